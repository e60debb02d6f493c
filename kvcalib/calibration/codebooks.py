"""Non-uniform codebooks: sensitivity-weighted k-means in each normalized domain (KVQuant,
Hooper et al. 2024, "nuqX": per-layer levels from Fisher-weighted k-means).

Each element's weight is its Fisher information, the squared gradient of the window's LM loss
(summed next-token cross-entropy) with respect to that key or value activation, from the
gradient pass (gradients.py), one window and layer at a time. Elements are mapped to the
normalized domain u in [0, 1] a quantizer of the variant codes them in, then accumulated into a
weighted histogram of `bins` bins per layer (streaming); a weighted 1-D Lloyd k-means on the
histogram (initialized uniform, levels sorted) gives [L, 2**bits] levels. A variant is named as
kvcalib.core.plan.codebook_variant names a recipe's tensor — "tensor:granularity[group]:position
[:hadamard][:symmetric][:outliers<f>]" — and its elements are normalized exactly as
kvcalib_runtime.layouts.quant normalizes them (the same group ranges, its layouts'):

    static        u = (x - lo) / (hi - lo), [lo, hi] the calibrated non-sink range with the
                  fraction f left out (none without :outliers)
    token[g]      per token and group of g channels (the whole head without g), the range
                  leaving out ceil(f * g / 2) elements at each end
    vector        per token over every KV head joined (quant.to_vector), likewise
    channel[G]    per channel and group of G tokens from position 0, sinks left out of ranges
    hadamard      after hadamard_transform(seed=None) of the tensor (and of its gradients: the
                  rotation is orthonormal)
    symmetric     u = (x / absmax + 1) / 2; the levels are returned in [-1, 1]

Elements outside their range (the outliers, which the cache keeps exactly) and sink tokens (the
ground-truth flags: recipes keep them exact) are left out. The variants calibrated by default
are those the shipped presets use (`preset_variants`; codebooks of vectors: vectorbooks.py).

A variant ending in ":answer" (a recipe's codebook_weight "fisher+answer") adds to its text
histogram the retrieval prompts' (retrieval.py): their context tokens (predicted sinks left
out) weighted by the gradients of the answer tokens' loss alone, each histogram scaled to sum to
1 per layer so that the two weigh alike.
"""

import re

import torch

from kvcalib.core.plan import codebook_variant
from kvcalib.core.profile import select_range
from kvcalib.core.recipe import load_recipe, presets
from kvcalib_runtime.layouts import registered
from kvcalib_runtime.layouts.quant import QuantSpec, uniform_codebook
from kvcalib_runtime.layouts.vector import to_vector
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.hadamard import hadamard_transform, is_supported

BITS = (2, 3, 4)
LLOYD_ITERATIONS = 200
_GRANULARITY = re.compile(r"(token|channel|static|vector)(\d*)$")


def preset_variants() -> tuple[str, ...]:
    """The codebook variants the shipped preset recipes ask for."""

    out = set()
    for name in presets():
        recipe = load_recipe(name)
        for tensor in ("key", "value"):
            t = recipe.tensor(tensor, 0)
            if t.quantized and t.codebook == "calibrated" and not t.layout.vectors:
                out.add(codebook_variant(tensor, t))
    return tuple(sorted(out))


def variants(model, wanted: tuple[str, ...] | None = None, answer: bool = False):
    """The variants this model gets (default: the presets', with `answer` each one's ":answer"
    twin too); the Hadamard ones need a Hadamard order of head_dim."""
    rotatable = is_supported(Geometry.from_config(model.config).head_dim)
    names = wanted or preset_variants()
    names = tuple(names) + tuple(f"{v}{ANSWER}" for v in names if answer and text_twin(v) is None)
    return tuple(v for v in names if rotatable or ":hadamard" not in v)


ANSWER = ":answer"


def text_twin(variant: str) -> str | None:
    """The text variant whose histogram an ":answer" variant adds the retrieval prompts' to, or
    None for a text variant."""
    return variant.removesuffix(ANSWER) if variant.endswith(ANSWER) else None


class Codebooks:
    """The weighted histograms of every variant, window by window and layer by layer (a consumer
    of gradients.gradient_pass), and their k-means levels.

    sinks bool [N, T]: the windows' ground-truth sink flags, left out; quantiles[position] = the
    non-sink key quantiles [L, Hkv, D, Q] at kvcalib.core.profile.QUANTILE_LEVELS for
    "pre_rope" / "post_rope" (the static variants' ranges)."""

    def __init__(self, names, num_layers: int, bins: int, sinks, quantiles: dict, windows: int):
        self.names, self.bins, self.windows = tuple(names), bins, windows
        self.num_layers = num_layers
        self.sinks, self.quantiles = sinks, quantiles
        self.texts = tuple(dict.fromkeys(text_twin(v) or v for v in self.names))
        self.hist = {v: torch.zeros(num_layers, bins, dtype=torch.float64) for v in self.texts}
        self.answer = None  # the retrieval prompts' Codebooks (`answer_consumer`)

    def answers_wanted(self) -> bool:
        """Whether a variant needs the retrieval prompts' answer gradients (`answer_consumer`)."""
        return any(text_twin(v) for v in self.names)

    def answer_consumer(self, counted) -> "Codebooks":
        """The consumer of the retrieval prompts' gradient pass (answer loss): the text variants
        of the ":answer" ones over the prompts' tokens where counted bool [R, T] holds."""
        texts = tuple(dict.fromkeys(a for v in self.names if (a := text_twin(v))))
        self.answer = Codebooks(
            texts, self.num_layers, self.bins, ~counted, self.quantiles, len(counted)
        )
        return self.answer

    def add(self, window: int, layer: int, x: dict, g: dict) -> None:
        """One window and layer: x and g as gradients.fisher_layer gives them, [Hkv, T, D]."""
        if window >= self.windows:
            return
        keep = ~self.sinks[window]
        x1, g1 = ({k: v[None] for k, v in d.items()} for d in (x, g))
        quantiles = {p: q[layer : layer + 1] for p, q in self.quantiles.items()}
        for v in self.texts:
            t, weight = _normalized(v, x1, g1, keep, quantiles)
            self.hist[v][layer] += _histogram(t, weight, self.bins)[0]

    def result(self) -> dict[str, torch.Tensor]:
        """{f"codebook.{variant}.{bits}": float32 [L, 2**bits]}."""
        out = {}
        for v in self.names:
            text = text_twin(v)
            if text is None:
                hist = self.hist[v]
            elif self.answer is None:
                raise RuntimeError(f"{v}: no retrieval prompt's answer gradients were added")
            else:
                hist = _unit(self.hist[text]) + _unit(self.answer.hist[text])
            for bits in BITS:
                levels = lloyd(hist, bits)
                symmetric = "symmetric" in v.split(":")
                out[f"codebook.{v}.{bits}"] = levels * 2 - 1 if symmetric else levels
        return out


def _unit(hist: torch.Tensor) -> torch.Tensor:
    """hist [L, B] scaled to sum to 1 per layer (a layer with no weight stays 0)."""
    return hist / hist.sum(-1, keepdim=True).clamp_min(1e-300)


def _normalized(variant: str, x: dict, g: dict, keep: torch.Tensor, quantiles: dict):
    """(u, weight), both [L, Hkv, T, D] ([L, 1, T, Hkv * D] for "vector"), u in [0, 1] where
    the element is inside its range; weight 0 where it is left out."""
    tensor, granularity, *rest = variant.split(":")
    kind, group = _GRANULARITY.match(granularity).groups()
    position = "pre_rope" if "pre_rope" in rest else "post_rope"
    outliers = next((float(p[len("outliers") :]) for p in rest if p.startswith("outliers")), 0.0)
    source = "value" if tensor == "value" else ("pre" if position == "pre_rope" else "key")
    v, grad = x[source], g[source]
    if "hadamard" in rest:
        v, grad = hadamard_transform(v), hadamard_transform(grad)
    keep = keep.expand(v.shape[:-1])  # [T] -> [L, Hkv, T]
    weight = grad.square() * keep[..., None].to(grad.dtype)
    if registered()[kind].calibrated_range:
        found = select_range(quantiles[position], outliers)
        if found is None:
            raise ValueError(f"variant {variant}: no calibrated range leaves {outliers} out")
        lo, hi = (r[:, :, None, :] for r in found)
    else:
        layout = QuantSpec(2, kind, int(group or 0), outliers=outliers).layout
        if layout.joins_heads:
            v, weight = to_vector(v), to_vector(weight)
        lo, hi = (layout.expand(r, v.shape) for r in layout.group_range(v, ~keep))
    if "symmetric" in rest:
        a = torch.maximum(lo.abs(), hi.abs())
        lo, hi = -a, a
    u = (v - lo) / (hi - lo).clamp_min(torch.finfo(v.dtype).tiny)
    inside = (u >= 0) & (u <= 1) & (hi > lo)  # outliers (kept exactly) are left out
    return u, weight * inside


def _histogram(t: torch.Tensor, weight: torch.Tensor, bins: int) -> torch.Tensor:
    """Weighted histogram of t in [0, 1] per layer: t, weight [L, ...] -> float64 [L, bins]."""
    num_layers = t.shape[0]
    idx = (t.reshape(num_layers, -1) * bins).floor().clamp(0, bins - 1).long()
    idx += torch.arange(num_layers)[:, None] * bins
    w = weight.reshape(num_layers, -1).double()
    counts = torch.bincount(idx.flatten(), w.flatten(), minlength=num_layers * bins)
    return counts.view(num_layers, bins)


def lloyd(hist: torch.Tensor, bits: int) -> torch.Tensor:
    """Weighted 1-D k-means of bin centres: hist [L, B] -> sorted levels float32 [L, 2**bits];
    starts from the uniform grid, an empty cluster keeps its level, layers with no weight stay
    uniform."""
    num_layers, bins = hist.shape
    centres = ((torch.arange(bins, dtype=torch.float64) + 0.5) / bins).expand(num_layers, bins)
    levels = uniform_codebook(bits).double().expand(num_layers, -1).clone()
    for _ in range(LLOYD_ITERATIONS):
        mids = (levels[:, 1:] + levels[:, :-1]) / 2
        cluster = torch.searchsorted(mids, centres.contiguous())  # t == mid goes low, as quant
        mass = torch.zeros_like(levels).scatter_add_(1, cluster, hist)
        moment = torch.zeros_like(levels).scatter_add_(1, cluster, hist * centres)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), levels).sort(-1).values
        if torch.equal(new, levels):
            break
        levels = new
    return levels.float()
