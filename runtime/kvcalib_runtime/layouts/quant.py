"""Reference quantizers for KV tensors — the single source of truth for kvcalib's numerics.

Every tensor here is laid out [..., T, D]: T tokens, D channels of one head (typically
[B, H, T, D]). One `QuantSpec` (layouts.spec; `QTensor` is layouts.base's, both exported here;
each granularity is a layout of kvcalib_runtime.layouts) says how such a tensor is cut into
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
                             (`slot_code` "fp8", static ranges only: delta / scale of its
                             channel as one float8 E4M3 byte, restored within 1/16; layouts.fp8)

Which elements (`slot_rule`; ties go to the lower channel):
    "outside"  the K farthest outside their range (KVQuant's outliers); a vector with fewer
               leaves the other slots at index 0 with delta 0, one with more has them clamped
    "error"    the K with the largest |x - x_hat| (kvcalib's): the clamped outliers first,
               then the worst-rounded elements inside the range, so every slot is used
K is (D / g) * 2k for dynamic groups (under "outside" none is ever clamped); for "static" it
is `outlier_slots`. That one rule is what the cache stores, what kvcalib's simulation computes
and what the bit count charges (the slots whether used or not).

Scale and offset are rounded to the input's dtype before codes are computed (fp16 metadata in
an fp16 cache, as KIVI does), or with `metadata_code` "byte" ("token" and "vector") to one byte
each (layouts.metabyte: the scale rounded up to 5 exponent and 3 mantissa bits, the offset a
zero point in 1/255 of the range, which is widened to contain 0); codes are computed in fp32
from the rounded metadata.

Methods (`method`): everything above is "affine". Two peers' own numerics are methods too:
"ggml" (llama.cpp's q4_0 / q8_0 blocks, kvcalib_runtime.layouts.ggml) and "turboquant"
(TurboQuant_mse: per vector the L2 norm, a random rotation and fixed Lloyd-Max levels, with an
outlier set of `split_channels` channels at `split_bits` bits; kvcalib_runtime.layouts.
turboquant). Both store no outliers and no offset. "vq" (kvcalib-1.5's vector codes,
kvcalib_runtime.layouts.vq) gives each vector of `group_size` channels, normalized by its
calibrated "static" range, one index into a calibrated codebook of 2**bits vectors.

Each granularity and method is a stored layout (kvcalib_runtime.layouts, one module each), which
the spec's `layout` binds: this module is their common entry point.
"""

import torch

from kvcalib_runtime.layouts.base import QTensor
from kvcalib_runtime.layouts.spec import QuantSpec

__all__ = ["QTensor", "QuantSpec", "dequantize", "fake_quantize", "quantize", "uniform_codebook"]


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
                  spec.codebook; levels in [0, 1] (asymmetric) or [-1, 1] (symmetric); for
                  "vq" float [1 or H, 2**bits, group_size] entries.
    exclude:      bool [..., T], tokens left out of "channel" ranges (kept sinks); they still get
                  codes, which the caller ignores.
    split:        int64 [H, n_o], the outlier set's channels of each head (heads at dim -3) —
                  required by a "turboquant" spec with split_channels.
    """
    return spec.layout.quantize(
        x, static_range=static_range, codebook=codebook, exclude=exclude, split=split
    )


def dequantize(
    q: QTensor,
    spec: QuantSpec,
    *,
    codebook: torch.Tensor | None = None,
    split: torch.Tensor | None = None,
    dtype=None,
) -> torch.Tensor:
    """x_hat = offset + scale * level[code], plus the exact slots' deltas. Returns `dtype`
    (default: the metadata's dtype, float32 for one-byte metadata), in x's layout
    ([..., H, T, D] again for "vector"); `split` as `quantize` takes it."""
    if dtype is None:
        dtype = q.scale.dtype if q.scale.is_floating_point() else torch.float32
    return spec.layout.dequantize(q, codebook=codebook, split=split).to(dtype)


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
