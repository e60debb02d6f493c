"""Vector codebooks ("vq", kvcalib_runtime.layouts.vq): Fisher-weighted k-means of vectors of a
few channels in each channel's calibrated range (KVQuant's sensitivity-weighted k-means,
Hooper et al. 2024, over vectors instead of scalars).

A variant is named as kvcalib.core.plan.codebook_variant names a "vq" tensor recipe —
"tensor:vq<w>[:pre_rope|:post_rope][:rope]:<scope>:<weight>", e.g.
"key:vq2:pre_rope:rope:head:fisher" — and gives the profile tensor `vqbook.{variant}.{bits}`,
float32 [L, Hc, 2**bits, w] (Hc = 1 for scope "layer", Hkv for "head").

Samples: every non-sink token of the first `windows` windows (the gradient pass's, one window
and layer at a time), its activation x and loss gradient g ("pre" keys before RoPE, "key" after,
"value"), cut into the layout's vectors (channel_order) and normalized by the calibrated range
the runtime normalizes by (the non-sink min and max, profile.range with outliers 0): u = (x - lo)
/ s, s = hi - lo. At most MAX_SAMPLES vectors per codebook (a seeded random subset) enter a
weighted Lloyd k-means in the normalized domain whose objective is the error in x's units:

    assign   e(n) = argmin_e sum_i s_ni^2 (u_ni - c_ei)^2     the runtime's nearest entry
    update   c_ei = sum_{n: e(n) = e} F_ni s_ni^2 u_ni / sum F_ni s_ni^2

F = g^2 (weight "fisher": the diagonal Fisher information of each element) or 1 ("plain"),
started from distinct random samples, ITERATIONS steps; an entry that loses every sample keeps
its place. Computed on the activations' device, in float32.

Weight "fisher+answer" adds the retrieval prompts of the answer-loss sensitivity (retrieval.py):
their context tokens (predicted sinks left out) with F = g^2 of the answer tokens' loss alone,
the entries a copied number needs, next to the text's. A prompt's answer gradients sit on a few
tokens (the records, what attention reads them through), so its vectors are drawn with
probability in proportion to their weight, ANSWER_SAMPLES per codebook over all prompts, each
draw weighted so that a sum over the draws estimates the sum over every vector. The two sets
enter the k-means alike: each one's weights sum to 1 per codebook.
"""

import dataclasses
import re

import torch

from kvcalib.core.plan import codebook_variant
from kvcalib.core.profile import select_range
from kvcalib.core.recipe import load_recipe, presets
from kvcalib_runtime.layouts.vq import channel_order

ITERATIONS = 25
MAX_SAMPLES = 1 << 14  # vectors per codebook: the k-means' cost, and a sample of 2**14 is ample
ANSWER_SAMPLES = MAX_SAMPLES  # draws per codebook from the retrieval prompts ("fisher+answer")
ANSWER = "fisher+answer"
SEED = 0
_VARIANT = re.compile(r"(key|value):vq(\d+)(?::(pre_rope|post_rope))?(:rope)?:(layer|head):"
                      r"(fisher\+answer|fisher|plain)")  # fmt: skip


def parse(variant: str) -> tuple[str, int, str, str, str]:
    """(source of the activations: "pre" / "key" / "value", w, pairing, scope, weight)."""
    m = _VARIANT.fullmatch(variant)
    if m is None:
        raise ValueError(f"{variant!r} is not a vector codebook variant")
    tensor, w, position, rope, scope, weight = m.groups()
    source = "value" if tensor == "value" else ("pre" if position == "pre_rope" else "key")
    return source, int(w), "rope" if rope else "adjacent", scope, weight


CURVE_BITS = range(4, 9)  # the bits curve's index widths at the presets' own vector widths
SPLIT_WIDTH, SPLIT_BITS = 8, 8  # the keys-first split's values: 8-bit indices of 8 channels


def wanted(ablation: bool = False) -> dict[str, tuple[int, ...]]:
    """{variant: bit widths}: the vector codebooks the shipped presets use (at their bits and
    their allocation's choices) and, with `ablation`, what the README's kvcalib-1.5 ablation and
    bits curve evaluate: each one's one-factor neighbours (the other vector width (2 <-> 4) at
    the same bits per element, the other pairing (keys), the other scope and the other
    weightings: fisher <-> plain, and ANSWER), its own vectors at every index width of CURVE_BITS
    (1 to 2 bits per element for quads), and values in vectors of SPLIT_WIDTH at SPLIT_BITS (1
    bit per element: what frees bits for the keys)."""
    out: dict[str, set[int]] = {}
    for name in presets():
        recipe = load_recipe(name)
        for tensor in ("key", "value"):
            t = recipe.tensor(tensor, 0)
            if not (t.quantized and t.layout.vectors):
                continue
            widths = {t.bits, *(recipe.allocation.choices if recipe.allocation else ())}
            other = 6 - t.group_size if t.group_size in (2, 4) else t.group_size
            flips = [
                dataclasses.replace(t, group_size=other),
                dataclasses.replace(
                    t, codebook_scope={"layer": "head"}.get(t.codebook_scope, "layer")
                ),
                dataclasses.replace(
                    t, codebook_weight={"fisher": "plain"}.get(t.codebook_weight, "fisher")
                ),
                dataclasses.replace(
                    t, codebook_weight={ANSWER: "fisher"}.get(t.codebook_weight, ANSWER)
                ),
            ]
            if tensor == "key":
                flips.append(
                    dataclasses.replace(t, pairing={"rope": "adjacent"}.get(t.pairing, "rope"))
                )
            for v in (t, *flips) if ablation else (t,):
                scaled = {b * v.group_size // t.group_size for b in widths}
                out.setdefault(codebook_variant(tensor, v), set()).update(scaled)
            if ablation:
                out[codebook_variant(tensor, t)].update(CURVE_BITS)
                if tensor == "value":
                    split = dataclasses.replace(t, group_size=SPLIT_WIDTH)
                    out.setdefault(codebook_variant(tensor, split), set()).add(SPLIT_BITS)
    return {v: tuple(sorted(b for b in bits if 1 <= b <= 8)) for v, bits in sorted(out.items())}


class VectorBooks:
    """The samples of every vector variant, window by window and layer by layer (a consumer of
    gradients.gradient_pass), and their k-means codebooks.

    wanted: {variant: (bits, ...)}; sinks bool [N, T], the windows' ground-truth sink flags (left
    out); ranges {"pre" / "key" / "value": (lo, hi) float32 [L, Hkv, D]}."""

    def __init__(self, wanted: dict, num_layers: int, sinks, ranges: dict, windows: int):
        self.wanted, self.sinks, self.ranges, self.windows = dict(wanted), sinks, ranges, windows
        self.sources = sorted({parse(v)[0] for v in self.wanted})
        self.x = {s: [[] for _ in range(num_layers)] for s in self.sources}
        self.g = {s: [[] for _ in range(num_layers)] for s in self.sources}
        self.drawn = {v: [[] for _ in range(num_layers)] for v in self.wanted if answer_weighted(v)}

    def answers_wanted(self) -> bool:
        """Whether a codebook needs the retrieval prompts' answer gradients (`answer_consumer`)."""
        return bool(self.drawn)

    def answer_consumer(self, counted) -> "AnswerDraws":
        """The consumer of the retrieval prompts' gradient pass (answer loss): counted bool
        [R, T], the context tokens whose vectors are drawn (predicted sinks left out)."""
        return AnswerDraws(self, counted)

    def add(self, window: int, layer: int, x: dict, g: dict) -> None:
        """One window and layer: x and g as gradients.fisher_layer gives them, [Hkv, T, D]."""
        if window >= self.windows:
            return
        keep = ~self.sinks[window]
        for s in self.sources:
            self.x[s][layer].append(x[s][:, keep])
            self.g[s][layer].append(g[s][:, keep])

    def result(self) -> dict[str, torch.Tensor]:
        """{f"vqbook.{variant}.{bits}": float32 [L, Hc, 2**bits, w]}."""
        out = {}
        for variant, widths in self.wanted.items():
            source, w, pairing, scope, weight = parse(variant)
            drawn = self.drawn.get(variant)
            if drawn is not None and not all(drawn):
                raise RuntimeError(f"{variant}: no retrieval prompt's answer gradients were added")
            for bits in widths:
                books = [
                    fit(
                        torch.cat(self.x[source][i], 1),
                        torch.cat(self.g[source][i], 1) if weight != "plain" else None,
                        tuple(r[i] for r in self.ranges[source]),
                        w,
                        pairing,
                        bits,
                        per_head=scope == "head",
                        extra=None if drawn is None else _joined(drawn[i]),
                    )
                    for i in range(len(self.x[source]))
                ]
                out[f"vqbook.{variant}.{bits}"] = torch.stack(books)
        return out


class AnswerDraws:
    """VectorBooks' consumer of the retrieval prompts' gradient pass: each prompt's context
    vectors drawn by their answer-loss weight (module docstring), kept per ANSWER variant and
    layer instead of the prompts' activations."""

    def __init__(self, books: VectorBooks, counted):
        self.books, self.counted = books, counted
        self.count = -(-ANSWER_SAMPLES // len(counted))  # draws per prompt and codebook
        self.generator = torch.Generator().manual_seed(SEED)

    def add(self, prompt: int, layer: int, x: dict, g: dict) -> None:
        """One prompt and layer: x and g as gradients.fisher_layer gives them, [Hkv, T, D]."""
        keep = self.counted[prompt]
        for variant, drawn in self.books.drawn.items():
            source, w, pairing, scope, _ = parse(variant)
            rng = tuple(r[layer] for r in self.books.ranges[source])
            one = samples(x[source][:, keep], g[source][:, keep], rng, w, pairing, scope == "head")
            drawn[layer].append(draw(*one, self.count, self.generator))


def answer_weighted(variant: str) -> bool:
    """Whether a variant's codebook is fitted on the retrieval prompts' answer gradients too."""
    return parse(variant)[4] == ANSWER


def draw(u, weight, s2, count: int, generator) -> tuple:
    """`count` vectors of each codebook of samples' (u, weight, s2) [C, M, w], drawn with
    replacement with probability in proportion to their weight (summed over the vector), each
    weighted so that a sum over the draws estimates the sum over all M: weight * total / (count
    * vector's weight). A codebook whose vectors all weigh 0 draws uniformly (they stay 0)."""
    vector = weight.sum(-1)  # [C, M]
    total = vector.sum(-1, keepdim=True)
    chance = torch.where(total > 0, vector, 1.0)
    pick = torch.multinomial(chance.cpu(), count, replacement=True, generator=generator)
    pick = pick.to(u.device)
    scale = total / (count * vector.gather(1, pick)).clamp_min(1e-30)
    take = pick[..., None].expand(-1, -1, u.shape[-1])
    u, weight, s2 = (t.gather(1, take) for t in (u, weight, s2))
    return u, weight * scale[..., None], s2


def ranges(tensors: dict) -> dict:
    """{"pre" / "key" / "value": (lo, hi) [L, Hkv, D]}: the non-sink min and max of a profile's
    tensors, the ranges a "vq" spec normalizes by (profile.range with outliers 0)."""
    kinds = {"pre": "key_pre_rope", "key": "key_post_rope", "value": "value"}
    return {s: select_range(tensors[f"{k}.nonsink.quantiles"], 0.0) for s, k in kinds.items()}


def samples(x, g, rng, w: int, pairing: str, per_head: bool):
    """(u, weight) [C, M, w] of x, g [Hkv, T, D] (g None: plain): the normalized vectors and
    F * s^2 per element, C = Hkv codebooks (per_head) or 1, M vectors each; and s^2 [C, M, w]."""
    lo, hi = (r.to(x.device, torch.float32) for r in rng)
    d = x.shape[-1]
    order = channel_order(d, w, pairing).to(x.device)
    s = hi - lo  # [Hkv, D]
    # A channel constant over the statistics' tokens (s = 0; Gemma 3 has some) is restored as lo
    # whatever the code: coordinate 0 and weight 0 (its s^2), whatever the codebook windows hold.
    spread = s > 0
    u = torch.where(spread[:, None], (x - lo[:, None]) / torch.where(spread, s, 1)[:, None], 0.0)
    u = u[..., order]  # [Hkv, T, D] in vector order
    s2 = s.square()[:, None, order].expand_as(u)
    f = torch.ones_like(u) if g is None else g.square()[..., order]
    heads = x.shape[0]
    cut = (heads if per_head else 1, -1, w)
    return u.reshape(cut), (f * s2).reshape(cut), s2.reshape(cut)


def fit(x, g, rng, w: int, pairing: str, bits: int, *, per_head: bool, extra=None):
    """float32 [Hc, 2**bits, w]: the codebooks of one layer (module docstring); x, g [Hkv, T, D]
    (g None: plain), rng (lo, hi) [Hkv, D]; extra: more samples (u, weight, s2) [Hc, M, w] (the
    retrieval prompts' draws), weighing as much as x's in all."""
    u, weight, s2 = samples(x.float(), None if g is None else g.float(), rng, w, pairing, per_head)
    generator = torch.Generator().manual_seed(SEED)
    m = u.shape[1]
    if m > MAX_SAMPLES:
        pick = torch.randperm(m, generator=generator)[:MAX_SAMPLES].to(u.device)
        u, weight, s2 = (t[:, pick] for t in (u, weight, s2))
    if extra is not None:
        pairs = zip((u, _unit(weight), s2), (extra[0], _unit(extra[1]), extra[2]), strict=True)
        u, weight, s2 = (torch.cat(p, 1) for p in pairs)
    return torch.stack(
        [_lloyd(*one, 2**bits, generator) for one in zip(u, weight, s2, strict=True)]
    )


def _joined(draws: list) -> tuple:
    """One layer's draws, (u, weight, s2) of each prompt, as one (u, weight, s2)."""
    return tuple(torch.cat(t, 1) for t in zip(*draws, strict=True))


def _unit(weight):
    """weight [C, M, w] scaled to sum to 1 per codebook (all 0 stays 0)."""
    return weight / weight.sum((1, 2), keepdim=True).clamp_min(1e-30)


def _lloyd(u, weight, s2, count: int, generator) -> torch.Tensor:
    """Weighted Lloyd k-means of u [M, w] (weights F s^2 and s^2 [M, w], module docstring)."""
    m = u.shape[0]
    start = torch.randperm(m, generator=generator)[: min(count, m)].to(u.device)
    book = u[start]
    if len(book) < count:  # fewer samples than entries: the rest repeat the first
        book = torch.cat([book, book[:1].expand(count - len(book), -1)])
    su2 = (s2 * u).contiguous()  # [M, w]: a transposed operand took the slow matmul
    base = (s2 * u.square()).sum(-1, keepdim=True)
    s2, wu = s2.contiguous(), weight * u
    order = torch.arange(count, dtype=u.dtype, device=u.device)
    for _ in range(ITERATIONS):
        # base - 2 su2 book^T + s2 book^2^T [M, E], bit for bit (-2 x is exact, + commutes),
        # in place: a fresh [M, E] per step and argmin's slow path were 70% of the k-means
        dist = torch.mm(su2, book.T).mul_(-2).add_(base).add_(torch.mm(s2, book.square().T))
        cell = _first_min(dist, order)
        mass = torch.zeros_like(book).index_add_(0, cell, weight)
        moment = torch.zeros_like(book).index_add_(0, cell, wu)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-30), book)
        if torch.equal(new, book):
            break
        book = new
    return book


def _first_min(dist, order):
    """The index of each row's first minimum of dist [M, E] (as argmin), order = 0 .. E - 1 in
    dist's dtype: the row's minimum subtracted is 0 exactly at its minima and > 0 elsewhere, so
    order + E * sign is smallest at the first one. Float passes only: a comparison's bool
    tensor, or min's indices, cost twice as much on a CPU."""
    low = dist.amin(-1, keepdim=True)
    return torch.add(order, dist.sub_(low).sign_(), alpha=len(order)).amin(-1).long()
