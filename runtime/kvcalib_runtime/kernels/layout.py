"""What the kernels read and write: one layer's packed body, its residual ring and the sinks.

The quantized cache (kvcalib_runtime.kvcache) owns these buffers; the kernels and their
references take them through the three types below, whose docstrings give every shape.
"""

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcalib_runtime.packing import packed_size, unpack
from kvcalib_runtime.quant import QTensor, QuantSpec, dequantize, range_metadata


def use_triton(device: torch.device | str) -> bool:
    """True where the Triton kernels can run: CUDA tensors, or any tensor with TRITON_INTERPRET=1
    (Triton's CPU interpreter, which the tests use)."""
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class PackedBody:
    """The quantized body of one layer's keys or values: B sequences, Hkv heads, N slots (slot t
    holds position t), D channels, stored in `dtype` (the cache's dtype).

    spec          QuantSpec
    head_dim      D
    codes         uint8 [B, Hkv, N, ceil(D * bits / 8)]  codes of a token, packed along channels
                  (kvcalib_runtime.packing: code j at bits [j*b, (j+1)*b) of the row)
    scale         dtype [B, Hkv, N, D / g]        "token": one per group of g channels of a token
                  dtype [B, Hkv, ceil(N / G), D]  "channel": one per group of G tokens of a channel
                  dtype [Hkv, D]                  "static": range_metadata of the calibrated range
    offset        like scale, or None when symmetric
    static_range  (lo, hi) float [Hkv, D], the calibrated range ("static" only), else None
    codebook      float [L] or [Hkv, L] as calibrated (L = 2**bits), or None for uniform levels
    levels        float32 [Hkv, L] the codebook per head (the kernels' lookup table), or None
    mids          float32 [Hkv, L - 1] decision thresholds between levels, as quant.quantize
                  computes them, or None
    outliers      (values dtype [B, Hkv, N, D], exact bool [B, Hkv, N, D]) kept exactly, stored
                  densely (reference path only), or None when spec.outliers == 0
    """

    spec: QuantSpec
    head_dim: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    static_range: tuple[torch.Tensor, torch.Tensor] | None
    codebook: torch.Tensor | None
    levels: torch.Tensor | None
    mids: torch.Tensor | None
    outliers: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def allocate(cls, spec, shape, device, dtype, static_range=None, codebook=None):
        """Zeroed storage for `shape` = (B, Hkv, N, D), with the calibrated tensors it needs."""
        b, h, n, d = shape
        if spec.granularity == "static" and static_range is None:
            raise ValueError(
                "granularity 'static' needs its calibrated range: put (lo, hi) for this layer in "
                "KVParams.key_range / value_range"
            )
        if spec.codebook and codebook is None:
            raise ValueError(
                "spec.codebook is set: put this layer's levels in KVParams.key_codebook / "
                "value_codebook"
            )
        codes = torch.zeros(b, h, n, packed_size(d, spec.bits), device=device, dtype=torch.uint8)
        if spec.granularity == "static":
            lo, hi = (r.to(device) for r in static_range)
            static_range = (lo, hi)
            scale, offset = range_metadata(spec, lo, hi, dtype)
        else:
            rows = (b, h, n, d // spec.channel_group(d))
            if spec.granularity == "channel":
                rows = (b, h, -(-n // spec.group_size), d)
            scale = torch.zeros(rows, device=device, dtype=dtype)
            offset = None if spec.symmetric else torch.zeros_like(scale)
        levels = mids = None
        if spec.codebook:
            codebook = codebook.to(device)
            levels = codebook.float().expand(h, -1).contiguous()
            mids = ((codebook[..., 1:] + codebook[..., :-1]).float() / 2).expand(h, -1).contiguous()
        outliers = None
        if spec.outliers > 0:
            outliers = (
                torch.zeros(shape, device=device, dtype=dtype),
                torch.zeros(shape, device=device, dtype=torch.bool),
            )
        return cls(spec, d, codes, scale, offset, static_range, codebook, levels, mids, outliers)

    def view(self, b: int) -> "PackedBody":
        """Sequence b alone (B = 1), sharing storage."""

        def one(t):
            return t[b : b + 1] if t is not None else None

        static = self.spec.granularity == "static"
        return PackedBody(
            self.spec,
            self.head_dim,
            one(self.codes),
            self.scale if static else one(self.scale),
            self.offset if static else one(self.offset),
            self.static_range,
            self.codebook,
            self.levels,
            self.mids,
            tuple(one(t) for t in self.outliers) if self.outliers is not None else None,
        )

    def dequantize(self, b: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots [0, n) of sequence b in plain torch (the reference read): [Hkv, n, D]."""
        spec = self.spec
        codes = unpack(self.codes[b, :, :n], spec.bits, self.head_dim)[None]
        if spec.granularity == "static":
            scale, offset = (
                t[None, :, None, :] if t is not None else None for t in (self.scale, self.offset)
            )
        else:
            rows = n if spec.granularity == "token" else -(-n // spec.group_size)
            scale, offset = (
                t[b, :, :rows, :, None][None] if t is not None else None
                for t in (self.scale, self.offset)
            )
        exact = values = None
        if self.outliers is not None:
            values, exact = (t[b, :, :n][None] for t in self.outliers)
        q = QTensor(codes, scale, offset, exact, values)
        return dequantize(q, spec, codebook=self.codebook, dtype=dtype)[0]


class Stored(NamedTuple):
    """One layer's keys or values as the decode kernel reads them.

    body     PackedBody, or dtype [B, Hkv, N, D] exact values (a tensor left in full precision)
    tail     dtype [B, Hkv, R, D]  the residual ring: position t at slot t % R
    n_body   int32 [B] on the device: positions [0, n_body) are read from the body, the
             others (up to the sequence's length) from the tail
    """

    body: PackedBody | torch.Tensor
    tail: torch.Tensor
    n_body: torch.Tensor


class Sinks(NamedTuple):
    """One layer's sink slots: S = max(sinks_first + sink_budget, 1) per sequence.

    keys       dtype [B, Hkv, S, D]  exact keys, in the key domain (as the body stores them)
    values     dtype [B, Hkv, S, D]  exact values
    positions  int32 [B, S] on the device: the position each slot holds, -1 while empty
    is_sink    bool [B, N]: positions held in a sink slot (their body slots are not read)
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    is_sink: torch.Tensor
