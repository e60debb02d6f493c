"""`PackedBody`, the body a cache stores kvcalib's affine numerics in (layouts.affine: the
token, vector, channel and static layouts, and ggml's blocks): codes packed along a row, the
groups' metadata where the layout's `Kind` keeps it, exact slots. The kernels read it through the
body protocol (layouts.body): its tensors, per-token rows and stream arguments.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvcalib_runtime.layouts.base import Kind, Layout, QTensor
from kvcalib_runtime.layouts.body import NONE, StreamArgs, Unit, replace_rows, rows
from kvcalib_runtime.layouts.packing import unpack

if TYPE_CHECKING:
    from kvcalib_runtime.layouts.spec import QuantSpec


@dataclass
class PackedBody:
    """The quantized body of one layer's keys or values under an affine (or ggml) layout: B
    sequences of N slots (slot t % N holds position t: every position, or a ring for a sliding
    window), stored in `dtype` (the cache's dtype). A stored row is one token of one head
    (heads = Hkv, width = D), or for a layout that joins heads ("vector") one token of every
    head (heads = 1, width = Hkv * D, layouts.vector's row).

    spec          QuantSpec (its `layout` decides the metadata's shapes)
    head_dim      D
    kv_heads      Hkv
    codes         uint8 [B, heads, N, ceil(width * bits / 8)]  codes of a row, packed along
                  channels (layouts.packing: code j at bits [j*b, (j+1)*b) of the row)
    scale         dtype [B, heads, N, width / g]       Kind.TOKEN: one per group of g channels
                                                       of a row
                  dtype [B, heads, ceil(N / G), width] Kind.CHANNEL: one per group of G tokens
                  dtype [Hkv, D]                       Kind.STATIC: the metadata of the
                                                       calibrated range
    offset        like scale, or None when symmetric
                  (metadata_code "byte": uint8 scale and zero point codes, layouts.metabyte)
    static_range  (lo, hi) float32 [Hkv, D], the calibrated range (Kind.STATIC only), else None
    levels        float32 [heads, L] the codebook per head (L = 2**bits), or None for uniform
                  levels
    mids          float32 [heads, L - 1] decision thresholds between levels, as quantize
                  computes them, or None
    slot_index    [B, heads, N, K] channel of each exact slot within its row (uint8, int16 past
                  256 channels: slot_index_dtype), or None when the spec keeps no outliers
    slot_delta    dtype [B, heads, N, K] what each slot adds back (uint8 E4M3 bytes in steps
                  of its channel's scale for slot_code "fp8": layouts.fp8)

    A layouts.body.Body: `packed`, written by kernels.quant_pack.
    """

    packed: ClassVar[bool] = True

    spec: "QuantSpec"
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
    def layout(self) -> Layout:
        """The spec's layout: an affine one (layouts.affine.AffineLayout) or ggml's."""
        return self.spec.layout

    @property
    def kind(self) -> Kind:
        return self.layout.kind

    @property
    def slots(self) -> int:
        return self.codes.shape[2]

    @property
    def vector(self) -> bool:
        return self.layout.joins_heads

    @property
    def width(self) -> int:
        return self.layout.width(self.head_dim, self.kv_heads)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this body holds (what its memory is)."""
        found = [self.codes, self.scale, self.offset, self.levels, self.mids]
        found += [self.slot_index, self.slot_delta, *(self.static_range or ())]
        return [t for t in found if t is not None]

    def view(self, b: int) -> "PackedBody":
        """Sequence b alone (B = 1), sharing storage."""

        def one(t):
            return t[b : b + 1] if t is not None else None

        def meta(t):  # static metadata is per layer, not per sequence
            return t if self.layout.kind == Kind.STATIC or t is None else t[b : b + 1]

        return PackedBody(
            self.spec,
            self.head_dim,
            self.kv_heads,
            one(self.codes),
            meta(self.scale),
            meta(self.offset),
            self.static_range,
            self.levels,
            self.mids,
            one(self.slot_index),
            one(self.slot_delta),
        )

    def dequantize(
        self, dtype: torch.dtype, b: int | None = None, n: int | None = None, start: int = 0
    ):
        """Slots [start, n) (default all) of sequence b (default every sequence, without host
        synchronization) in plain torch, the reference read: [B, Hkv, n - start, D]
        ([Hkv, n - start, D] for one sequence), exact slots added. Every slot's value is the
        same whatever the span it is read in (start: a multiple of the layout's
        `token_group`)."""
        layout, rows = self.layout, slice(None) if b is None else slice(b, b + 1)
        n = self.codes.shape[2] if n is None else n
        if start % layout.token_group():
            raise ValueError(f"start {start} is not a multiple of {layout.token_group()} tokens")
        codes = unpack(self.codes[rows, :, start:n], self.spec.bits, self.width)
        scale, offset = (
            layout.read_metadata(t, rows, n, start) if t is not None else None
            for t in (self.scale, self.offset)
        )
        index = delta = None
        if self.slot_index is not None:
            index, delta = self.slot_index[rows, :, start:n], self.slot_delta[rows, :, start:n]
        q = QTensor(codes, scale, offset, index, delta, self.kv_heads if self.vector else None)
        out = layout.dequantize(q, codebook=self.levels).to(dtype)
        return out if b is None else out[0]

    def per_token(self) -> dict[str, torch.Tensor]:
        """codes and exact slots, and the scale and offset of per-token groups ("static" keeps
        them per layer); a "channel" body's metadata is per group of tokens: not paged."""
        if self.kind == Kind.CHANNEL:
            raise ValueError("a 'channel' body keeps metadata per group of tokens: it is not paged")
        static = self.kind == Kind.STATIC
        return {
            name: getattr(self, name)
            for name in ("codes", "scale", "offset", "slot_index", "slot_delta")
            if getattr(self, name) is not None and not (static and name in ("scale", "offset"))
        }

    with_rows = replace_rows

    def stream_args(self, head_dim: int, unit: Unit) -> StreamArgs:
        """codes as int32 words where the kernel loads a word at once and a row starts on one
        (a page field at a byte offset that is not a multiple of 4 does not), else bytes."""
        spec, layout = self.spec, self.layout
        words = None
        if unit(spec.bits, head_dim // 2) == 32 and not (
            self.codes.storage_offset() % 4 or any(s % 4 for s in self.codes.stride()[:-1])
        ):
            words = self.codes.view(torch.int32)
        codes = words if words is not None else self.codes
        pointers = [self.scale, self.offset, self.levels, self.slot_index, self.slot_delta]
        pointers = [t if t is not None else codes for t in pointers]
        meta_rows = self.scale.shape[2] if self.kind == Kind.CHANNEL else 1
        assert self.offset is None or self.offset.stride() == self.scale.stride()
        meta = NONE if self.kind == Kind.STATIC else rows(self.scale)
        strides = (rows(codes), meta, rows(self.slot_index), rows(self.slot_delta))
        fields = dict(
            BITS=spec.bits,
            GRAN=self.kind.value,
            GROUP=max(layout.metadata_group(self.width), 1),
            SYM=spec.symmetric,
            CB=spec.codebook,
            K=layout.slots(self.width),
            FP8=spec.slot_code == "fp8",
            VEC=self.vector,
            UNIT=32 if words is not None else 8,
            BOOK=spec.levels if spec.codebook and not self.vector else 0,
            PAIRS=False,
            BYTE=spec.metadata_code == "byte",
        )
        return StreamArgs((codes, *pointers), strides, meta_rows, fields)
