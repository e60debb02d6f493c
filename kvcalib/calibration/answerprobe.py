"""The answer-loss sensitivity measured: how much a retrieval answer's log-likelihood drops when one
layer's keys (or values) of its context are quantized, at every probed width.

The Fisher estimate of the answer loss (sensitivity.FisherSensitivity on the retrieval prompts)
is second order: it sees small, spread-out errors well and misjudges the few large ones that lose
a retrieval. On SmolLM2-135M, of the 8 tensors whose exact storage recovers most of what kvcalib-2
loses on the long-context suite, this measurement ranks 6 in its top 7 of 60 and the other two
12th and 13th; the Fisher estimate ranks the three value tensors among them 12th, 14th and 39th.
So this measures it, as a serving runtime would see it: the prompt is prefilled exact, the answer
is teacher-forced through a cache whose context (the retrieval prompt's haystack and records,
predicted sinks left out) is stored by the probe quantizers of sensitivity.py, and

    sensitivity.answer.{key,value}[layer, bits] = (NLL of the answer with only that tensor of
        that layer quantized - NLL with nothing quantized), summed over prompts, per answer token

(mean nats per answer token; the answer's first token is predicted by the exact prefill and
counts in the denominator only, as in kvcalib.evaluation.longcontext).

Cost: one forward over the prompts, plus the answer's rows alone through the layers from the
quantized one up — layer by layer, every probe a branch of the answer rows that continues exact
(what quantizing one layer changes is the answer's residual stream; the context's stays the
prefill's). A branch attends to the prompt's exact keys and values of its layer (those of its own
probe at its branching layer) and to its own answer rows, in two parts merged by their softmax
sums, so the prompt is never copied per branch: the branches reading one version of the prompt
as one block of query rows, a layer's new probes as one batch of their versions, through torch's
fused CPU attention (the scores never in memory: that was half the probe's time). The answer's
last token predicts nothing that counts and never runs. What is left is mostly the layers' and
the head's matrix products (`work`): on SmolLM2-135M (16 prompts of 1,024 tokens, 332 answer
tokens) 7.3x the parameter-rows of a forward over the calibration's 16 x 512 tokens, of which the
branches 3.8x and their heads 2.0x; measured, 9.5x that forward (bench_calibrate.py, was 25x).

The modes (Settings.answer_probe, MODES) measure less where it cannot move an allocation, and
`extrapolate` fills the rest from a tensor's widest measured width by the text's Fisher
sensitivity's ratio between the widths (the answer loss falls with the width as the error's
energy does). "cut" measures every tensor at 2 and 3 bits, where kvcalib-2's allocation cuts.
"screen", the default, measures every tensor at 2 bits, then the third with the largest 2-bit
loss at 3 bits too (a tensor whose 2-bit loss is small gains little from a third bit), branching
from each layer's _Prompt kept by the first round: no second forward of the prompts, for three
[Hkv, T, D] tensors a prompt and layer held until the end (a size planned, not yet measured:
3 x prompts x layers x Hkv x T x D values in the model's dtype).
Of SmolLM2-135M's 4.5x of arithmetic it runs 3.5x. On the long-context suite's committed profiles
(SmolLM2-135M, Qwen2.5-0.5B) kvcalib-2's plan digest is the same in all three modes; 2 bits alone
moves it on both (tests/toolkit/calibration/test_answer_cut.py).
"""

import contextlib
import functools
import math
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvcalib.calibration.layerwise import LayerSource
from kvcalib.calibration.sensitivity import BITS, TENSORS
from kvcalib.errors import ModelError
from kvcalib.sim.hooks import Hooks, capture_keys, decoder_layers, hidden_of, key_module
from kvcalib_runtime.cache.attention import capped
from kvcalib_runtime.layouts.quant import QuantSpec, fake_quantize
from kvcalib_runtime.model.rope import rotate

ATTENTION = "kvcalib-answer"
# the probe's modes: the widths every tensor is measured at, and whether the screened(L) tensors
# with the largest loss at the widest of them are measured one width up too (the others, and the
# wider widths, by `extrapolate`)
MODES = {"screen": ((2,), True), "cut": ((2, 3), False), "all": (BITS, False)}
SCREEN = 1 / 3  # the share of the tensors the screen measures again
ROWS = 2048  # query rows per attention block over the prompt (bounds the scores' memory)
_STATE: ContextVar["_Layer | None"] = ContextVar("kvcalib_answer_layer", default=None)


@dataclass
class _Group:
    """Branches rows[0]:rows[1] of a batch attending to versions of the prompt's keys and values
    [V, Hkv, P, D]: V 1, one version that every branch of the group reads, or V = the group's
    branches, one each."""

    rows: tuple[int, int]
    key: torch.Tensor
    value: torch.Tensor


@dataclass
class _Layer:
    """What the attention of the layer running now does: `groups` None: a full forward of the
    prompt (recorded into `key`, `value`); else the branches, each group over its prompt."""

    groups: list[_Group] | None = None
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None


def screened(num_layers: int) -> int:
    """How many tensors the screen measures again one width up: a third of them, rounded up."""
    return math.ceil(len(TENSORS) * num_layers * SCREEN)


def work(lm: LayerSource, prompts: int, length: int, answer: int, mode="all") -> float:
    """What `answer_pass` costs in `mode` (of MODES), in the units its `advance` counts:
    parameters run per token (`answer`: the prompts' answer tokens in all; each prompt's last one
    never runs). With L layers, p = len(TENSORS) x the mode's widths probes a layer, R prompts of
    T tokens and A answer tokens: R T L layer-rows for the prompts, (A - R)(L + p L (L + 1) / 2)
    for the branches (the reference, and a probe of layer i through layers i ... L - 1) and
    (A - R)(1 + p L) rows through the head; the screen's second round, s = screened(L) probes
    through (L + 1) / 2 layers each (their depths are known only once the first round has
    ranked them), (A - R) s ((L + 1) / 2 layers + the head). The branches' attention over the
    prompt is not counted."""
    widths, screen = MODES[mode]
    layer, head = lm.work()
    n = lm.config.num_hidden_layers
    probes = len(TENSORS) * len(widths)
    branch_layers = sum(1 + probes * (1 + i) for i in range(n))  # the reference, the probes
    heads = 1 + probes * n
    if screen:
        branch_layers += screened(n) * (n + 1) / 2
        heads += screened(n)
    rows = answer - prompts
    return layer * (prompts * length * n + rows * branch_layers) + head * rows * heads


def extrapolate(answer: dict, text: dict, measured: dict) -> dict:
    """`answer` (answer_pass's) with every width of BITS a tensor's row was not measured at
    filled from its widest measured one w by the text sensitivity's ratio: answer[b] = answer[w]
    x text[b] / text[w] (0 where text[w] is 0); measured bool [L, len(BITS)] per tensor name (as
    answer_pass returns it), text {"sensitivity.key", "sensitivity.value"} [L, len(BITS)]. The
    answer loss falls with the width as the quantization error's energy does, which the text's
    Fisher estimate measures at every width for free."""
    out = {}
    for tensor in TENSORS:
        a, t = answer[f"sensitivity.answer.{tensor}"].clone(), text[f"sensitivity.{tensor}"]
        m = measured[tensor]
        for i in range(len(a)):
            w = int(m[i].nonzero().max())
            base = t[i, w]
            for j in range(len(BITS)):
                if not m[i, j]:
                    a[i, j] = a[i, w] * (t[i, j] / base) if base > 0 else 0.0
        out[f"sensitivity.answer.{tensor}"] = a
    return out


@dataclass
class _Prompt:
    """What a branch of one prompt needs at one layer: the prompt's exact key and value and its
    keys before RoPE [1, Hkv, P, D] (P: the positions before the answer), the layer's RoPE (or
    None) and its input at the answer's rows [1, a - 1, E]."""

    key: torch.Tensor
    value: torch.Tensor
    key_pre: torch.Tensor
    rope: tuple | None
    rows: torch.Tensor


def answer_pass(
    lm: LayerSource, prompts, quantized: torch.Tensor, key_range, advance, mode="all"
) -> tuple[dict, dict]:
    """({"sensitivity.answer.key", "sensitivity.answer.value"}: float32 [L, len(BITS)],
    {"key", "value"}: bool [L, len(BITS)], which entries were measured: the others are 0 and
    `extrapolate` fills them) for `prompts` (retrieval.Prompts, each answer its last tokens) in
    `mode` (of MODES); quantized bool [R, T]: the positions a probe quantizes (the context,
    sinks left out); key_range (lo, hi), each [L, Hkv, D]: the pre-RoPE probe ranges.

    A screen runs in two rounds: the first measures every tensor at the mode's width and keeps
    each layer's _Prompt; the second measures the screened(L) tensors with the largest loss
    there one width up, from the kept prompts (no second forward of the prompts)."""
    widths, screen = MODES[mode]
    num_layers = lm.config.num_hidden_layers
    dev = lm.device
    layer_work, head_work = lm.work()
    ids = prompts.ids.to(dev)
    count, t = ids.shape
    starts = [int(a.nonzero()[0]) for a in prompts.answer]
    probes = [(tensor, bits) for tensor in TENSORS for bits in sorted(widths)]
    names = [None]  # branch b of every prompt: None (nothing quantized) or (tensor, layer, bits)
    kept = [] if screen else None  # per layer, per prompt: its _Prompt
    with torch.no_grad(), Hooks(lm.model) as hooks:
        hooks.attention(ATTENTION)
        kwargs = lm.layer_kwargs(1, t)
        with lm.embedding():
            hidden = [lm.inputs(ids[w : w + 1])[0] for w in range(count)]
        branches = [h[:, p:-1] for h, p in zip(hidden, starts, strict=True)]
        for i in range(num_layers):
            with lm.layer(i) as layer, Hooks(lm.model) as inner:
                pre, rope = {}, {}
                inner.forward(key_module(lm.model, i), capture_keys(lm.model, pre, i))
                inner.pre_forward(decoder_layers(lm.model)[i].self_attn, _keep_rope(rope))
                here = []
                for w, p in enumerate(starts):
                    x = hidden[w].to(dev)
                    state = _Layer()
                    with _running(state):
                        hidden[w] = hidden_of(layer(x, **kwargs[i]))
                    k, v = state.key[:, :, :p], state.value[:, :, :p]
                    prompt = _Prompt(k, v, pre[i][:, :, :p], rope.get(i), x[:, p:-1].clone())
                    if kept is not None:
                        here.append(prompt)
                    args = (layer, kwargs[i], p, t, quantized[w, :p], key_range, i)
                    branches[w] = _branch(branches[w], prompt, probes, *args)
                    advance(layer_work * (t + branches[w].shape[0] * branches[w].shape[1]))
                if kept is not None:
                    kept.append(here)
            names += [(tensor, i, bits) for tensor, bits in probes]
        with lm.head():
            nll = _nlls(lm, branches, ids, starts)
            advance(head_work * sum(b.shape[0] * b.shape[1] for b in branches))
        if screen:
            top = max(widths)
            loss = {(n, i): float(nll[j] - nll[0]) for j, (n, i, b) in enumerate(names[1:], 1)
                    if b == top}  # fmt: skip
            chosen = set(sorted(loss, key=loss.get, reverse=True)[: screened(num_layers)])
            more, again = _again(lm, kept, chosen, BITS[BITS.index(top) + 1], kwargs, ids, starts,
                                 quantized, key_range, advance)  # fmt: skip
            names += again
            nll = torch.cat([nll, more])
    answers = int(prompts.answer.sum())
    out = {tensor: torch.zeros(num_layers, len(BITS)) for tensor in TENSORS}
    measured = {tensor: torch.zeros(num_layers, len(BITS), dtype=torch.bool) for tensor in TENSORS}
    for b, (tensor, i, bits) in enumerate(names[1:], 1):
        out[tensor][i, BITS.index(bits)] = float(nll[b] - nll[0]) / answers
        measured[tensor][i, BITS.index(bits)] = True
    return {f"sensitivity.answer.{tensor}": v for tensor, v in out.items()}, measured


def _again(lm, kept, chosen, bits, kwargs, ids, starts, quantized, key_range, advance) -> tuple:
    """The screen's second round: the `chosen` (tensor, layer) pairs measured at `bits`, each
    branch from its layer's kept _Prompt up; returns (summed NLL per branch float64 [n], the
    branches' names (tensor, layer, bits))."""
    layer_work, head_work = lm.work()
    t = ids.shape[1]
    branches = [None] * len(starts)
    names = []
    first = min(i for _, i in chosen)
    with Hooks(lm.model) as hooks:
        hooks.attention(ATTENTION)
        for i in range(first, lm.config.num_hidden_layers):
            probes = [(tensor, bits) for tensor in TENSORS if (tensor, i) in chosen]
            with lm.layer(i) as layer:
                for w, p in enumerate(starts):
                    args = (layer, kwargs[i], p, t, quantized[w, :p], key_range, i)
                    branches[w] = _branch(branches[w], kept[i][w], probes, *args)
                    advance(layer_work * branches[w].shape[0] * branches[w].shape[1])
            kept[i] = None
            names += [(tensor, i, bits) for tensor, bits in probes]
        with lm.head():
            nll = _nlls(lm, branches, ids, starts)
            advance(head_work * sum(b.shape[0] * b.shape[1] for b in branches))
    return nll, names


def _branch(branches, prompt: _Prompt, probes, layer, kwargs, p, t, quantized, key_range, i):
    """One layer of a prompt's branches: those running (`branches` [n, a - 1, E], or None) over
    the exact prompt, and one new branch per probe (tensor, bits) from the layer's input at the
    answer's rows over its quantized version; returns the branches' rows out of the layer."""
    versions = _versions(prompt, probes, quantized, key_range, i)
    old = 0 if branches is None else len(branches)
    groups = [_Group((0, old), *versions[0])] if old else []
    if probes:
        both = (torch.cat(x) for x in zip(*versions[1:], strict=True))
        groups.append(_Group((old, old + len(probes)), *both))
    parts = ([] if branches is None else [branches]) + [prompt.rows.expand(len(probes), -1, -1)]
    with _running(_Layer(groups=groups)):
        return hidden_of(layer(torch.cat(parts), **_rows(kwargs, p, t - 1)))


def _versions(prompt: _Prompt, probes, quantized, key_range, layer: int) -> list:
    """[(key, value) of the prompt's first P positions, [1, Hkv, P, D], as branches read them]:
    exact (every branch so far), then one per probe (tensor, bits) in order, quantized where
    `quantized` bool [P] says."""
    key, value, p = prompt.key, prompt.value, len(quantized)
    where = quantized.to(key.device)[None, None, :, None]
    lo, hi = (r[layer].to(key.device)[None, :, None, :] for r in key_range)
    out = [(key, value)]
    for tensor, bits in probes:
        if tensor == "key":
            spec = QuantSpec(bits, "static")
            k = fake_quantize(prompt.key_pre, spec, static_range=(lo, hi))
            if prompt.rope is not None:
                k = rotate(k, *(c[:, None, :p] for c in prompt.rope))
            out.append((torch.where(where, k.to(key.dtype), key), value))
        else:
            out.append((key, torch.where(where, fake_quantize(value, QuantSpec(bits)), value)))
    return out


def _nlls(lm: LayerSource, branches, ids: torch.Tensor, starts) -> torch.Tensor:
    """Per branch, the answer NLL summed over the prompts, float64 [n] (`_nll` of each prompt's
    branches [n, a - 1, E] out of the last layer)."""
    return sum(
        _nll(lm, b, ids[w, p:]) for w, (b, p) in enumerate(zip(branches, starts, strict=True))
    )


def _nll(lm: LayerSource, rows: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Per branch, the summed NLL of the answer's tokens after its first, float64 [branches]:
    rows [branches, a - 1, E] out of the last layer (the answer's last token predicts nothing
    that counts, so it never runs), answer int64 [a]."""
    out = []
    for chunk in rows.split(max(1, ROWS // rows.shape[1])):
        logits = lm.logits(chunk).float()
        target = logits.gather(-1, answer[1:].expand(len(chunk), -1)[..., None])[..., 0]
        out.append((logits.logsumexp(-1) - target).double().sum(1))
    return torch.cat(out)


def _keep_rope(store: dict):
    def hook(module, args, kwargs):
        store[module.layer_idx] = kwargs.get("position_embeddings")  # None: no RoPE

    return hook


def _rows(kwargs: dict, start: int, end: int) -> dict:
    """A layer's keyword arguments for the prompt [1, T] cut to its rows start:end (the
    attention mask keeps every column before `end`: the branch attention reads the prompt's
    part)."""
    out = {}
    for name, v in kwargs.items():
        if name == "attention_mask":
            out[name] = v[..., start:end, :end]
        elif name == "position_embeddings" and v is not None:
            out[name] = tuple(c[:, start:end] for c in v)
        elif name == "position_ids":
            out[name] = v[:, start:end]
        elif isinstance(v, torch.Tensor):
            raise ModelError(f"layer argument {name!r}: the answer probe cannot cut it to rows")
        else:
            out[name] = v
    return out


@contextlib.contextmanager
def _running(state: _Layer):
    token = _STATE.set(state)
    try:
        yield
    finally:
        _STATE.reset(token)


def _attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs
):
    """transformers' attention interface: query [B, H, a, D], key and value [B, Hkv, a, D] of
    the rows running, attention_mask additive [1, 1, a, T] (T: the whole prompt, whose first
    T - a positions a branch reads from its group's versions)."""
    state = _STATE.get()
    assert state is not None, "the answer probe's attention runs only inside answer_pass"
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    b, h, a, d = query.shape
    hkv = key.shape[1]
    q = query.view(b, hkv, h // hkv, a, d).float()
    k, v = key.float(), value.float()
    mask = attention_mask.float()
    if state.groups is None:  # the prompt's own forward
        state.key, state.value = key, value
        m, z, o = _over(q, k, v, mask, scaling, softcap)
        return _out(o / z, query), None
    m2, z2, o2 = _over(q, k, v, mask[..., -a:], scaling, softcap)
    prompt = mask[..., :-a] if mask[..., :-a].any() else None  # None: every column is read
    out = torch.empty_like(q)
    for g in state.groups:
        r0, r1 = g.rows
        n = r1 - r0
        if len(g.key) == 1:  # one version for all: the branches' rows as one query block
            folded = q[r0:r1].permute(1, 2, 0, 3, 4).reshape(1, hkv, h // hkv, n * a, d)
            part = _over(
                folded,
                g.key.float(),
                g.value.float(),
                None if prompt is None else prompt.repeat(1, 1, n, 1),
                scaling,
                softcap,
            )
            m, z, o = (x.view(hkv, h // hkv, n, a, -1).permute(2, 0, 1, 3, 4) for x in part)
        else:  # a version each: a batch
            m, z, o = _over(q[r0:r1], g.key.float(), g.value.float(), prompt, scaling, softcap)
        top = torch.maximum(m, m2[r0:r1])
        e, e2 = (m - top).exp(), (m2[r0:r1] - top).exp()
        out[r0:r1] = (o * e + o2[r0:r1] * e2) / (z * e + z2[r0:r1] * e2)
    return _out(out, query), None


def _over(q, k, v, mask, scaling: float, softcap) -> tuple:
    """Softmax attention of q [B, Hkv, G, R, D] over k, v [B or 1, Hkv, K, D] with an additive
    mask [B' or 1, 1, R, K] (None: none), in parts that merge: (m, z, o), the row's largest
    score (or its log-sum-exp), its exp(score - m) summed and its exp(score - m)-weighted
    values, [B, Hkv, G, R, 1 / 1 / D]. Without a soft-cap, by torch's fused CPU kernel (no
    scores in memory); with one, in blocks of ROWS rows. A specialisation of
    kvcalib_runtime.cache.attention kept here: parts that merge across the branches' key
    versions, not one normalised output (the soft-cap is that module's `capped`)."""
    b, hkv, g, r, d = q.shape
    if softcap is not None or q.device.type != "cpu":
        mask = None if mask is None else mask[:, :, None]
        return _part(q, k[:, :, None], v[:, :, None], mask, scaling, softcap)
    causal = mask is not None and _causal(mask)
    if mask is None:  # a head group's queries as one block over their shared keys
        k, v, q = (x.expand(b, -1, -1, -1) for x in (k, v, q.reshape(b, hkv, g * r, d)))
    else:  # the keys copied per query head (the mask's rows are one head's)
        k, v = (x.repeat_interleave(g, 1).expand(b, -1, -1, -1) for x in (k, v))
        q = q.reshape(b, hkv * g, r, d)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=None if causal else mask, scale=scaling
    )
    lse = lse.view(b, hkv, g, r, 1)
    return lse, torch.ones_like(lse), o.view(b, hkv, g, r, d)


def _causal(mask: torch.Tensor) -> bool:
    """Whether an additive mask [1, 1, R, R] is the causal one (0 on and below the diagonal,
    above it float32's or bfloat16's lowest or -inf: whose exp is 0). The fused kernel then
    skips the blocks above the diagonal instead of adding the mask: the same bits (exp of the
    masked scores is 0 either way; tests/toolkit/test_calibration_speed.py), the prompt's
    attention in half the time."""
    r = mask.shape[-1]
    if mask.shape[0] != 1 or mask.shape[-2] != r:
        return False
    low = float(mask[0, 0, 0, -1]) if r > 1 else float("-inf")
    if low > torch.finfo(torch.bfloat16).min:
        return False
    return torch.equal(mask[0, 0], _template(r, low, mask.dtype, mask.device))


@functools.lru_cache(maxsize=4)
def _template(r: int, low: float, dtype, device) -> torch.Tensor:
    """The causal additive mask [R, R] with `low` above the diagonal (one per layer shape)."""
    return torch.full((r, r), low, dtype=dtype, device=device).triu(1)


def _part(q, k, v, mask, scaling: float, softcap) -> tuple:
    """_over in blocks of ROWS query rows, the scores in memory: k, v [B, Hkv, 1, K, D], mask
    [B', 1, 1, R, K] or None."""
    parts = []
    for r in range(0, q.shape[3], ROWS):
        s = capped(q[..., r : r + ROWS, :] @ k.transpose(-1, -2) * scaling, softcap)
        if mask is not None:
            s = s + mask[..., r : r + ROWS, :]
        m = s.amax(-1, keepdim=True)
        p = (s - m).exp()
        parts.append((m, p.sum(-1, keepdim=True), p @ v))
    return tuple(torch.cat(x, 3) for x in zip(*parts, strict=True))


def _out(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, a, D] -> [B, a, H, D], as transformers' attention functions return it."""
    b, h, a, d = query.shape
    return out.reshape(b, h, a, d).transpose(1, 2).contiguous().to(query.dtype)


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, eager_mask)
