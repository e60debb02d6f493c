"""Reference quantizers for KV tensors — the single source of truth for kvcalib's numerics.

Every tensor here is laid out [..., T, D]: T tokens, D channels of one head (typically
[B, H, T, D]). One `QuantSpec` (defined in kvcalib_runtime.spec with `QTensor`, both exported
here; the groups' shapes live in kvcalib_runtime.groups) says how such a tensor is cut into
groups, each group getting its own range:

    granularity "token"    groups of `group_size` consecutive channels inside one token
                           (group_size 0 = the whole head: per-token quantization)
    granularity "channel"  groups of `group_size` consecutive tokens inside one channel
                           (KIVI's keys), aligned to absolute token index
    granularity "static"   one range per channel, calibrated offline (KVQuant's keys)
    granularity "vector"   one group per token over every KV head (KVQuant's values): the heads
                           at dim -3 are joined into one vector of H * D channels first

Every group is dequantized as  x_hat = offset + scale * level[code]:

    uniform, asymmetric  (KIVI)   scale = (max - min) / (2^b - 1), code = round((x - min) / scale),
                                  level[c] = c, offset = min (a float, not an integer zero point)
    uniform, symmetric            scale = absmax / (2^(b-1) - 1), level[c] = c - (2^(b-1) - 1),
                                  no offset
    codebook, asymmetric          scale = max - min, offset = min, level = sorted table in [0, 1]
    codebook, symmetric           scale = absmax, level = sorted table in [-1, 1]

`clip` shrinks min/max (or absmax) towards zero before the scale is taken (QuaRot's clip
ratio).

Outliers (dense-and-sparse, KVQuant). With `outliers = f > 0` the range of a dynamic group of n
elements leaves out k = ceil(f * n / 2) elements at each end; a "static" range is calibrated
with the fraction f left out. Elements outside their group's range are clamped by the codes,
and a fixed number K of slots per vector (one token of one head, or of every head for
"vector") keeps K elements exactly:

    slot_index  [..., T, K]  channel within the vector (uint8, int16 past 256 channels)
    slot_delta  [..., T, K]  x - x_hat at that channel, in x's dtype; x_hat += delta restores it

Which elements (`slot_rule`; ties go to the lower channel):
    "outside"  the K farthest outside their range (KVQuant's outliers); a vector with fewer
               leaves the other slots at index 0 with delta 0, one with more has them clamped
    "error"    the K with the largest |x - x_hat| (kvcalib's): the clamped outliers first,
               then the worst-rounded elements inside the range, so every slot is used
K is (D / g) * 2k for dynamic groups (under "outside" none is ever clamped); for "static" it
is `outlier_slots`. That one rule is what the cache stores, what kvcalib's simulation computes
and what the bit count charges (the slots whether used or not).

Scale and offset are rounded to the input's dtype before codes are computed (fp16 metadata in
an fp16 cache, as KIVI does); codes are computed in fp32 from the rounded metadata.

Methods (`method`): everything above is "affine". Two peers' own numerics are methods too:

    "ggml"        llama.cpp's KV cache types (ggml-quants.c, quantize_row_q4_0_ref /
                  quantize_row_q8_0_ref): "token" groups of 32 channels, symmetric, one scale d
                  per group computed in fp32 from m, the group's element of largest |x| (the
                  first on ties), and stored in fp16 whatever the cache dtype:
                    bits 4 (q4_0)  d = m / -8, code = min(15, trunc(x * (1/d) + 8.5)),
                                   level[c] = c - 8
                    bits 8 (q8_0)  d = |m| / 127, code = roundf(x * (1/d)) + 127 (ties away
                                   from zero), level[c] = c - 127
                  1/d is taken in fp32 before d is rounded (d = 0 gives the zero level).
    "turboquant"  TurboQuant_mse (kvcalib_runtime.turboquant): per vector, the L2 norm as
                  scale, a random rotation and fixed Lloyd-Max levels (1-5 bits), with an
                  outlier set of `split_channels` channels at `split_bits` bits (its channels
                  per KV head are a calibrated `split`); "token" granularity over the whole
                  head, symmetric. The cache stores it in a turboquant.TurboBody.
Both store no outliers and no offset.
"""

import torch

from kvcalib_runtime import turboquant
from kvcalib_runtime.groups import expand, from_vector, group, group_range, to_vector, ungroup
from kvcalib_runtime.spec import (
    BITS,
    GRANULARITIES,
    MAX_SLOTS,
    METADATA_BITS,
    METHODS,
    QTensor,
    QuantSpec,
    slot_index_dtype,
)

__all__ = [
    "BITS",
    "GRANULARITIES",
    "MAX_SLOTS",
    "METADATA_BITS",
    "METHODS",
    "QTensor",
    "QuantSpec",
    "dequantize",
    "fake_quantize",
    "from_vector",
    "quantize",
    "range_metadata",
    "select_slots",
    "slot_index_dtype",
    "to_vector",
    "uniform_codebook",
]


def _lookup(codebook: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Levels of per-layer [L] or per-head [H, L] codebooks; codes [..., H, T, D]."""
    codes = codes.long()
    if codebook.dim() == 1:
        return codebook[codes]
    heads, n = codebook.shape
    base = torch.arange(heads, device=codes.device).view(heads, 1, 1) * n
    return codebook.reshape(-1)[codes + base]


def range_metadata(spec: QuantSpec, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype):
    """(scale, offset or None) of groups whose data range is [lo, hi], rounded to `dtype`:
    the clip ratio shrinks the range towards zero first."""
    lo, hi = lo.float() * spec.clip, hi.float() * spec.clip
    if spec.symmetric:
        absmax = torch.maximum(lo.abs(), hi.abs())
        qmax = 2 ** (spec.bits - 1) - 1
        return (absmax if spec.codebook else absmax / qmax).to(dtype), None
    scale = (hi - lo) / (1 if spec.codebook else spec.levels - 1)
    return scale.to(dtype), lo.to(dtype)


def _levels(spec: QuantSpec, codes: torch.Tensor, codebook) -> torch.Tensor:
    """level[code] in fp32."""
    if spec.codebook:
        return _lookup(codebook.float(), codes)
    if spec.method == "ggml" and spec.bits == 4:
        return codes.float() - 8
    if spec.symmetric:
        return codes.float() - (2 ** (spec.bits - 1) - 1)
    return codes.float()


def _base(spec: QuantSpec, codes, scale, offset, codebook) -> torch.Tensor:
    """offset + scale * level[code] in fp32, element-shaped like codes."""
    shape = codes.shape
    x = _levels(spec, codes, codebook) * expand(scale.float(), spec, shape)
    if offset is not None:
        x = x + expand(offset.float(), spec, shape)
    return x


def select_slots(xf: torch.Tensor, base: torch.Tensor, excess: torch.Tensor, k: int, dtype):
    """The k elements of each vector (last dim) with the largest excess > 0, lower channel first
    on ties -> (slot_index, slot_delta = x - base in dtype)."""
    if k == 1:  # argmax takes the first of equal maxima: the stable sort's pick, without it
        order = excess.argmax(-1, keepdim=True)
    else:
        order = excess.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    used = excess.gather(-1, order) > 0
    index = torch.where(used, order, 0)
    delta = torch.where(used, (xf - base).gather(-1, order), 0.0)
    return index.to(slot_index_dtype(xf.shape[-1])), delta.to(dtype)


def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    static_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    codebook: torch.Tensor | None = None,
    exclude: torch.Tensor | None = None,
    split: torch.Tensor | None = None,
) -> QTensor:
    """Quantize x [..., T, D] (float; "vector": [..., H, T, D]) as `spec` says.

    static_range: (lo, hi), each broadcastable to [..., 1, D] — required for "static".
    codebook:     float [L] or [H, L] sorted levels (heads at dim -3 of x) — required when
                  spec.codebook; levels in [0, 1] (asymmetric) or [-1, 1] (symmetric).
    exclude:      bool [..., T], tokens left out of "channel" ranges (kept sinks); they still get
                  codes, which the caller ignores.
    split:        int64 [H, n_o], the outlier set's channels of each head (heads at dim -3) —
                  required by a "turboquant" spec with split_channels.
    """
    if spec.method == "turboquant":
        return turboquant.quantize(x, spec, split)
    if spec.method == "ggml":
        return _quantize_ggml(x, spec)
    heads = x.shape[-3] if spec.granularity == "vector" else None
    xf = to_vector(x.float()) if heads else x.float()
    if spec.granularity == "static":
        if static_range is None:
            raise ValueError("granularity 'static' needs calibrated ranges: pass static_range")
        lo, hi = (r.float() for r in static_range)
        lo_e, hi_e = lo, hi
    else:
        lo, hi = group_range(xf, spec, exclude)
        lo_e, hi_e = (expand(r, spec, xf.shape) for r in (lo, hi))
    if spec.codebook and codebook is None:
        raise ValueError("spec.codebook is set: pass the calibrated codebook")
    scale, offset = range_metadata(spec, lo, hi, x.dtype)
    qmax = 2 ** (spec.bits - 1) - 1
    s = expand(scale.float(), spec, xf.shape)
    s = torch.where(s > 0, s, torch.ones_like(s))
    t = xf - expand(offset.float(), spec, xf.shape) if offset is not None else xf
    t = t / s
    if spec.codebook:
        mids = (codebook[..., 1:] + codebook[..., :-1]).float() / 2
        if mids.dim() == 2:
            mids = mids.view(mids.shape[0], 1, 1, -1)
        codes = (t.unsqueeze(-1) > mids).sum(-1)
    elif spec.symmetric:
        codes = t.round().clamp(-qmax, qmax) + qmax
    else:
        codes = t.round().clamp(0, spec.levels - 1)
    codes = codes.to(torch.uint8)
    q = QTensor(codes, scale, offset, heads=heads)
    k = spec.slots(xf.shape[-1])
    if k:
        base = _base(spec, codes, scale, offset, codebook)
        if spec.slot_rule == "error":
            excess = (xf - base).abs()
        else:
            excess = (xf - torch.minimum(torch.maximum(xf, lo_e), hi_e)).abs()
        q.slot_index, q.slot_delta = select_slots(xf, base, excess, k, x.dtype)
    return q


def _quantize_ggml(x: torch.Tensor, spec: QuantSpec) -> QTensor:
    """llama.cpp's q4_0 / q8_0 block quantization (the module docstring), in fp32."""
    g = group(x.float(), spec)  # [..., T, D/32, 32]
    m = g.gather(-1, g.abs().argmax(-1, keepdim=True))  # argmax: the first on ties, as ggml
    d = m / -8 if spec.bits == 4 else m.abs() / 127
    t = g * torch.where(d != 0, 1 / d, 0.0)
    if spec.bits == 4:
        codes = (t + 8.5).trunc().clamp(max=15)
    else:
        whole = t.trunc()
        codes = whole + torch.sign(t) * ((t - whole).abs() >= 0.5) + 127  # roundf
    codes = ungroup(codes, spec, x.shape).to(torch.uint8)
    return QTensor(codes, d.to(torch.float16).to(x.dtype), None)


def dequantize(
    q: QTensor,
    spec: QuantSpec,
    *,
    codebook: torch.Tensor | None = None,
    split: torch.Tensor | None = None,
    dtype=None,
) -> torch.Tensor:
    """x_hat = offset + scale * level[code], plus the exact slots' deltas. Returns `dtype`
    (default: the metadata's dtype), in x's layout ([..., H, T, D] again for "vector");
    `split` as `quantize` takes it."""
    dtype = dtype or q.scale.dtype
    if spec.method == "turboquant":
        return turboquant.dequantize(q, spec, split).to(dtype)
    x = _base(spec, q.codes, q.scale, q.offset, codebook)
    if q.slot_index is not None:
        x = x.scatter_add(-1, q.slot_index.long(), q.slot_delta.float())
    if q.heads:
        x = from_vector(x, q.heads)
    return x.to(dtype)


def fake_quantize(x: torch.Tensor, spec: QuantSpec, **kwargs) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype; keyword arguments as for `quantize`."""
    codebook, split = kwargs.get("codebook"), kwargs.get("split")
    q = quantize(x, spec, **kwargs)
    return dequantize(q, spec, codebook=codebook, split=split, dtype=x.dtype)


def uniform_codebook(bits: int, symmetric: bool = False) -> torch.Tensor:
    """The levels a uniform grid puts in the normalized domain (a codebook's starting point)."""
    n = 2**bits
    levels = torch.linspace(0.0, 1.0, n)
    return levels * 2 - 1 if symmetric else levels
