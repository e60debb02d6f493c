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

By default (Settings(answer_probe="cut"), WIDTHS) only 2 and 3 bits are measured, half the
branches and heads (4.5x of arithmetic on SmolLM2-135M): the allocation's cut lies there (the
presets allocate few bits above 2), and `extrapolate` fills 4 and 8 bits from the 3-bit loss by
the text's Fisher sensitivity's ratio between the widths. On the long-context suite's committed
profiles (SmolLM2-135M, Qwen2.5-0.5B) every preset's plan digest is the same either way; 2 bits
alone moves kvcalib-2's allocation on both (tests/toolkit/calibration/test_answer_cut.py).
"""

import contextlib
import functools
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
# the widths measured: "cut" those that decide an allocation (the wider ones by `extrapolate`)
WIDTHS = {"cut": (2, 3), "all": BITS}
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


def work(lm: LayerSource, prompts: int, length: int, answer: int, widths=BITS) -> float:
    """What `answer_pass` costs, in the units its `advance` counts: parameters run per token
    (`answer`: the prompts' answer tokens in all; each prompt's last one never runs). With L
    layers, p = len(TENSORS) x len(widths) probes a layer, R prompts of T tokens and A answer
    tokens: R T L layer-rows for the prompts, (A - R)(L + p L (L + 1) / 2) for the branches
    (the reference, and a probe of layer i through layers i ... L - 1) and (A - R)(1 + p L)
    rows through the head; the branches' attention over the prompt is not counted."""
    layer, head = lm.work()
    n = lm.config.num_hidden_layers
    probes = len(TENSORS) * len(widths)
    branch_layers = sum(1 + probes * (1 + i) for i in range(n))  # the reference, the probes
    heads = 1 + probes * n
    rows = answer - prompts
    return layer * (prompts * length * n + rows * branch_layers) + head * rows * heads


def extrapolate(answer: dict, text: dict, widths) -> dict:
    """`answer` (answer_pass's, measured at `widths` only) with every other width of BITS filled
    from the widest measured one w by the text sensitivity's ratio: answer[b] = answer[w] x
    text[b] / text[w] (0 where text[w] is 0), text {"sensitivity.key", "sensitivity.value"}
    [L, len(BITS)]. The answer loss falls with the width as the quantization error's energy
    does, which the text's Fisher estimate measures at every width for free."""
    w = BITS.index(max(widths))
    out = {}
    for tensor in TENSORS:
        a, t = answer[f"sensitivity.answer.{tensor}"].clone(), text[f"sensitivity.{tensor}"]
        base = t[:, w : w + 1]
        ratio = torch.where(base > 0, t / torch.where(base > 0, base, 1), 0.0)
        for j, bits in enumerate(BITS):
            if bits not in widths:
                a[:, j] = a[:, w] * ratio[:, j]
        out[f"sensitivity.answer.{tensor}"] = a
    return out


def answer_pass(
    lm: LayerSource, prompts, quantized: torch.Tensor, key_range, advance, widths=BITS
) -> dict:
    """{"sensitivity.answer.key", "sensitivity.answer.value"}: float32 [L, len(BITS)] for
    `prompts` (retrieval.Prompts, each answer its last tokens), measured at `widths` (of BITS;
    the other columns 0: `extrapolate` fills them); quantized bool [R, T]: the positions a
    probe quantizes (the context, sinks left out); key_range (lo, hi), each [L, Hkv, D]: the
    pre-RoPE probe ranges."""
    num_layers = lm.config.num_hidden_layers
    dev = lm.device
    layer_work, head_work = lm.work()
    ids = prompts.ids.to(dev)
    count, t = ids.shape
    starts = [int(a.nonzero()[0]) for a in prompts.answer]
    columns = [BITS.index(b) for b in sorted(widths)]
    names = [None]  # branch b of every prompt: None (nothing quantized) or (tensor, layer, column)
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
                for w, p in enumerate(starts):
                    x = hidden[w].to(dev)
                    state = _Layer()
                    with _running(state):
                        hidden[w] = hidden_of(layer(x, **kwargs[i]))
                    versions = _versions(
                        state, pre[i], rope.get(i), quantized[w, :p], key_range, i, widths
                    )
                    old = len(branches[w])
                    new = len(versions) - 1
                    state.groups = [
                        _Group((0, old), *versions[0]),
                        _Group(
                            (old, old + new),
                            *(torch.cat(t) for t in zip(*versions[1:], strict=True)),
                        ),
                    ]
                    rows = torch.cat([branches[w], x[:, p:-1].expand(new, -1, -1)])
                    with _running(state):
                        branches[w] = hidden_of(layer(rows, **_rows(kwargs[i], p, t - 1)))
                    advance(layer_work * (t + rows.shape[0] * rows.shape[1]))
            names += [(tensor, i, j) for tensor in TENSORS for j in columns]
        with lm.head():
            nll = sum(
                _nll(lm, b, ids[w, p:])
                for w, (b, p) in enumerate(zip(branches, starts, strict=True))
            )
            advance(head_work * sum(b.shape[0] * b.shape[1] for b in branches))
    answers = int(prompts.answer.sum())
    out = {tensor: torch.zeros(num_layers, len(BITS)) for tensor in TENSORS}
    for b, (tensor, i, j) in enumerate(names[1:], 1):
        out[tensor][i, j] = float(nll[b] - nll[0]) / answers
    return {f"sensitivity.answer.{tensor}": v for tensor, v in out.items()}


def _versions(state: _Layer, key_pre, rope, quantized, key_range, layer: int, widths) -> list:
    """[(key, value) of the prompt's first P positions, [1, Hkv, P, D], as branches read them]:
    exact (every branch so far), then one per probe of this layer (keys at every width of
    `widths` in order, then values at every width), quantized where `quantized` bool [P]
    says."""
    p = len(quantized)
    key, value = state.key[:, :, :p], state.value[:, :, :p]
    where = quantized.to(key.device)[None, None, :, None]
    lo, hi = (r[layer].to(key.device)[None, :, None, :] for r in key_range)
    out = [(key, value)]
    for bits in sorted(widths):
        k = fake_quantize(key_pre[:, :, :p], QuantSpec(bits, "static"), static_range=(lo, hi))
        if rope is not None:
            k = rotate(k, *(c[:, None, :p] for c in rope))
        out.append((torch.where(where, k.to(key.dtype), key), value))
    for bits in sorted(widths):
        out.append((key, torch.where(where, fake_quantize(value, QuantSpec(bits)), value)))
    return out


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
