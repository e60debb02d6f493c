"""What the kernels read and write: one layer's packed body, its residual ring and the sinks.

The quantized cache (kvcalib_runtime.kvcache) owns these buffers; the kernels and their
references take them through the three types below, whose docstrings give every shape.
"""

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcalib_runtime.packing import packed_size, unpack
from kvcalib_runtime.quant import (
    QTensor,
    QuantSpec,
    dequantize,
    range_metadata,
    slot_index_dtype,
)


def use_triton(device: torch.device | str) -> bool:
    """True where the Triton kernels can run: CUDA tensors, or any tensor with TRITON_INTERPRET=1
    (Triton's CPU interpreter, which the tests use)."""
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class PackedBody:
    """The quantized body of one layer's keys or values: B sequences of N slots (slot t % N holds
    position t: every position, or a ring for a sliding window), stored in `dtype` (the
    cache's dtype). A stored row is one token of one head
    (heads = Hkv, width = D), or for "vector" granularity one token of every head joined
    (heads = 1, width = Hkv * D, quant.to_vector's layout).

    spec          QuantSpec
    head_dim      D
    kv_heads      Hkv
    codes         uint8 [B, heads, N, ceil(width * bits / 8)]  codes of a row, packed along
                  channels (kvcalib_runtime.packing: code j at bits [j*b, (j+1)*b) of the row)
    scale         dtype [B, heads, N, width / g]       "token", "vector": one per group of g
                                                       channels of a row
                  dtype [B, heads, ceil(N / G), width] "channel": one per group of G tokens
                  dtype [Hkv, D]                       "static": range_metadata of the
                                                       calibrated range
    offset        like scale, or None when symmetric
    static_range  (lo, hi) float32 [Hkv, D], the calibrated range ("static" only), else None
    levels        float32 [heads, L] the codebook per head (L = 2**bits), or None for uniform
                  levels
    mids          float32 [heads, L - 1] decision thresholds between levels, as quant.quantize
                  computes them, or None
    slot_index    [B, heads, N, K] channel of each exact slot within its row (uint8, int16 past
                  256 channels: quant.slot_index_dtype), or None when the spec keeps no outliers
    slot_delta    dtype [B, heads, N, K] what each slot adds back (quant's module docstring)
    """

    spec: QuantSpec
    head_dim: int
    kv_heads: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    static_range: tuple[torch.Tensor, torch.Tensor] | None
    levels: torch.Tensor | None
    mids: torch.Tensor | None
    slot_index: torch.Tensor | None
    slot_delta: torch.Tensor | None

    @property
    def vector(self) -> bool:
        return self.spec.granularity == "vector"

    @property
    def width(self) -> int:
        return self.spec.vector_size(self.head_dim, self.kv_heads)

    @classmethod
    def allocate(cls, spec, shape, device, dtype, static_range=None, codebook=None):
        """Zeroed storage for `shape` = (B, Hkv, N, D), with the calibrated tensors it needs."""
        b, hkv, n, d = shape
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
        width = spec.vector_size(d, hkv)
        heads = 1 if spec.granularity == "vector" else hkv
        codes = torch.zeros(
            b, heads, n, packed_size(width, spec.bits), device=device, dtype=torch.uint8
        )
        if spec.granularity == "static":
            lo, hi = (r.to(device=device, dtype=torch.float32).contiguous() for r in static_range)
            static_range = (lo, hi)
            scale, offset = range_metadata(spec, lo, hi, dtype)
        else:
            rows = (b, heads, n, width // spec.channel_group(width))
            if spec.granularity == "channel":
                rows = (b, heads, -(-n // spec.group_size), width)
            scale = torch.zeros(rows, device=device, dtype=dtype)
            offset = None if spec.symmetric else torch.zeros_like(scale)
        levels = mids = None
        if spec.codebook:
            book = codebook.to(device=device, dtype=torch.float32)
            levels = book.expand(heads, -1).contiguous()
            mids = ((levels[:, 1:] + levels[:, :-1]) / 2).contiguous()
        slot_index = slot_delta = None
        k = spec.slots(width)
        if k:
            slot_index = torch.zeros(b, heads, n, k, device=device, dtype=slot_index_dtype(width))
            slot_delta = torch.zeros(b, heads, n, k, device=device, dtype=dtype)
        return cls(
            spec, d, hkv, codes, scale, offset, static_range, levels, mids, slot_index, slot_delta
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this body holds (what its memory is)."""
        found = [self.codes, self.scale, self.offset, self.levels, self.mids]
        found += [self.slot_index, self.slot_delta, *(self.static_range or ())]
        return [t for t in found if t is not None]

    def view(self, b: int) -> "PackedBody":
        """Sequence b alone (B = 1), sharing storage."""

        def one(t):
            return t[b : b + 1] if t is not None else None

        static = self.spec.granularity == "static"
        return PackedBody(
            self.spec,
            self.head_dim,
            self.kv_heads,
            one(self.codes),
            self.scale if static else one(self.scale),
            self.offset if static else one(self.offset),
            self.static_range,
            self.levels,
            self.mids,
            one(self.slot_index),
            one(self.slot_delta),
        )

    def dequantize(self, dtype: torch.dtype, b: int | None = None, n: int | None = None):
        """Slots [0, n) (default all) of sequence b (default every sequence, without host
        synchronization) in plain torch, the reference read: [B, Hkv, n, D] ([Hkv, n, D] for
        one sequence), exact slots added."""
        spec, rows = self.spec, slice(None) if b is None else slice(b, b + 1)
        n = self.codes.shape[2] if n is None else n
        codes = unpack(self.codes[rows, :, :n], spec.bits, self.width)
        if spec.granularity == "static":
            scale, offset = (
                t[None, :, None, :] if t is not None else None for t in (self.scale, self.offset)
            )
        else:
            groups = -(-n // spec.group_size) if spec.granularity == "channel" else n
            scale, offset = (
                t[rows, :, :groups, :, None] if t is not None else None
                for t in (self.scale, self.offset)
            )
        index = delta = None
        if self.slot_index is not None:
            index, delta = self.slot_index[rows, :, :n], self.slot_delta[rows, :, :n]
        q = QTensor(codes, scale, offset, index, delta, self.kv_heads if self.vector else None)
        out = dequantize(q, spec, codebook=self.levels, dtype=dtype)
        return out if b is None else out[0]


class Stored(NamedTuple):
    """One layer's keys or values as the decode kernel reads them.

    body     PackedBody, or dtype [B, Hkv, N, D] exact values (a tensor left in full precision);
             position t at slot t % N (N < every position: a sliding-window ring)
    tail     dtype [B, Hkv, R, D]  the residual ring: position t at slot t % R
    n_body   int64 [B] on the device: positions [0, n_body) are read from the body, the
             others (up to the sequence's length) from the tail
    """

    body: PackedBody | torch.Tensor
    tail: torch.Tensor
    n_body: torch.Tensor


class Sinks(NamedTuple):
    """One layer's sink slots: S = max(sinks_first + sink_budget, 1) per sequence.

    keys       dtype [B, Hkv, S, D]  exact keys, in the key domain (as the body stores them)
    values     dtype [B, Hkv, S, D]  exact values
    positions  int64 [B, S] on the device: the position each slot holds, -1 while empty
    is_sink    bool [B, P] (P: every position a sequence can reach): positions held in a sink
               slot (their body slots are not read)
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    is_sink: torch.Tensor
