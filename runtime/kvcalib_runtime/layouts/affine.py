"""kvcalib's affine numerics, shared by the layouts that store them (token, vector, channel,
static; ggml changes only the levels and how codes are taken), and `PackedBody`, the body a cache
stores them in.

Every group is dequantized as  x_hat = offset + scale * level[code]  (layouts.quant's module
docstring gives the levels, the clip ratio and the exact slots); a layout says which
elements form a group: `group`, `ungroup`, `expand` and `group_range` below, and where a body
keeps the groups' metadata (`metadata_shape`, `metadata_index`, `read_metadata`).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvcalib_runtime.layouts import fp8, metabyte
from kvcalib_runtime.layouts.base import CODEBOOK, Kind, Layout, QTensor, slot_index_dtype
from kvcalib_runtime.layouts.body import NONE, StreamArgs, Unit, replace_rows, rows
from kvcalib_runtime.layouts.packing import packed_size, unpack

if TYPE_CHECKING:
    from kvcalib_runtime.layouts.spec import QuantSpec


def _lookup(codebook: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Levels of per-layer [L] or per-head [H, L] codebooks; codes [..., H, T, D]."""
    codes = codes.long()
    if codebook.dim() == 1:
        return codebook[codes]
    heads, n = codebook.shape
    base = torch.arange(heads, device=codes.device).view(heads, 1, 1) * n
    return codebook.reshape(-1)[codes + base]


def select_slots(xf: torch.Tensor, base: torch.Tensor, excess: torch.Tensor, k: int):
    """The k elements of each vector (last dim) with the largest excess > 0, lower channel first
    on ties -> (slot_index, slot_delta = x - base in fp32)."""
    if k == 1:  # argmax takes the first of equal maxima: the stable sort's pick, without it
        order = excess.argmax(-1, keepdim=True)
    else:
        order = excess.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    used = excess.gather(-1, order) > 0
    index = torch.where(used, order, 0)
    delta = torch.where(used, (xf - base).gather(-1, order), 0.0)
    return index.to(slot_index_dtype(xf.shape[-1])), delta


class AffineLayout(Layout):
    """A layout of kvcalib's affine numerics; subclasses say how elements form groups."""

    calibrates = (CODEBOOK,)

    # -- groups (per layout) ---------------------------------------------------------------------

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """View x [..., T, D] as its groups, elements last."""
        raise NotImplementedError

    def ungroup(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Inverse of `group` for a full group-shaped tensor."""
        raise NotImplementedError

    def expand(self, param: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Broadcast a group-shaped parameter back to the element shape [..., T, D]."""
        raise NotImplementedError

    def group_range(self, x: torch.Tensor, exclude: torch.Tensor | None):
        """Per-group (lo, hi) in group shape."""
        raise NotImplementedError

    def to_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """x in fp32 as stored rows, and the heads joined into a row (None: one head a row)."""
        return x.float(), None

    def ranges(self, xf, static_range, exclude):
        """(lo, hi) in group shape and (lo, hi) element-shaped: the groups' data ranges."""
        lo, hi = self.group_range(xf, exclude)
        return lo, hi, *(self.expand(r, xf.shape) for r in (lo, hi))

    # -- levels and metadata ---------------------------------------------------------------------

    def metadata(self, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype):
        """(scale, offset or None) of groups whose data range is [lo, hi] as stored: rounded to
        `dtype`, or one byte each (metadata_code "byte", layouts.metabyte: an asymmetric range
        widened to contain 0 first). The clip ratio shrinks the range towards zero first."""
        spec = self.spec
        lo, hi = lo.float() * spec.clip, hi.float() * spec.clip
        byte = spec.metadata_code == "byte"
        if spec.symmetric:
            absmax = torch.maximum(lo.abs(), hi.abs())
            qmax = 2 ** (spec.bits - 1) - 1
            scale = absmax if spec.codebook else absmax / qmax
            return (metabyte.encode_scale(scale) if byte else scale.to(dtype)), None
        if byte:
            lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        scale = (hi - lo) / self.span
        if not byte:
            return scale.to(dtype), lo.to(dtype)
        code = metabyte.encode_scale(scale)
        return code, metabyte.encode_zero(lo, metabyte.decode_scale(code), self.span)

    @property
    def span(self) -> float:
        """The asymmetric levels' reach in scales: 2**bits - 1 uniform, 1 for a codebook."""
        return 1.0 if self.spec.codebook else float(self.spec.levels - 1)

    def metadata_values(self, scale: torch.Tensor, offset: torch.Tensor | None):
        """(scale, offset or None) in fp32 from what a group stores."""
        if self.spec.metadata_code != "byte":
            return scale.float(), None if offset is None else offset.float()
        scale = metabyte.decode_scale(scale)
        if offset is None:
            return scale, None
        return scale, metabyte.decode_offset(offset, scale, self.span)

    def levels(self, codes: torch.Tensor, codebook) -> torch.Tensor:
        """level[code] in fp32."""
        spec = self.spec
        if spec.codebook:
            return _lookup(codebook.float(), codes)
        if spec.symmetric:
            return codes.float() - (2 ** (spec.bits - 1) - 1)
        return codes.float()

    def base(self, codes, scale, offset, codebook) -> torch.Tensor:
        """offset + scale * level[code] in fp32, element-shaped like codes."""
        shape = codes.shape
        scale, offset = self.metadata_values(scale, offset)
        x = self.levels(codes, codebook) * self.expand(scale, shape)
        if offset is not None:
            x = x + self.expand(offset, shape)
        return x

    # -- reference numerics ----------------------------------------------------------------------

    def quantize(self, x, *, static_range=None, codebook=None, exclude=None, split=None):
        spec = self.spec
        xf, heads = self.to_rows(x)
        lo, hi, lo_e, hi_e = self.ranges(xf, static_range, exclude)
        if spec.codebook and codebook is None:
            raise ValueError("spec.codebook is set: pass the calibrated codebook")
        scale, offset = self.metadata(lo, hi, x.dtype)
        qmax = 2 ** (spec.bits - 1) - 1
        s, o = self.metadata_values(scale, offset)
        s = self.expand(s, xf.shape)
        s = torch.where(s > 0, s, torch.ones_like(s))
        t = xf - self.expand(o, xf.shape) if o is not None else xf
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
        k = self.slots(xf.shape[-1])
        if k:
            base = self.base(codes, scale, offset, codebook)
            if spec.slot_rule == "error":
                excess = (xf - base).abs()
            else:
                excess = (xf - torch.minimum(torch.maximum(xf, lo_e), hi_e)).abs()
            index, delta = select_slots(xf, base, excess, k)
            if spec.slot_code == "fp8":
                delta = fp8.encode(delta / s.gather(-1, index.long()))
            q.slot_index, q.slot_delta = index, delta.to(self.slot_dtype(x.dtype))
        return q

    def dequantize(self, q: QTensor, *, codebook=None, split=None) -> torch.Tensor:
        x = self.base(q.codes, q.scale, q.offset, codebook)
        if q.slot_index is not None:
            x = self.add_slots(x, q.slot_index, q.slot_delta, q.scale)
        return x

    def slot_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What a slot's delta is stored as in a `dtype` cache: its E4M3 byte ("fp8"), else
        dtype."""
        return torch.uint8 if self.spec.slot_code == "fp8" else dtype

    def add_slots(self, x, index, delta, scale) -> torch.Tensor:
        """x [..., T, D] with each slot's delta added at its channel, in place (x is returned);
        `scale` is the group-shaped metadata the "fp8" deltas count steps of. Only the T * K
        slots are touched: a slot's step is read at its own channel."""
        index = index.long()
        if self.spec.slot_code == "fp8":
            steps = fp8.step(self.expand(scale, x.shape).gather(-1, index))
            return x.scatter_add_(-1, index, fp8.decode(delta) * steps)
        return x.scatter_add_(-1, index, delta.float())

    # -- storage ---------------------------------------------------------------------------------

    def metadata_group(self, width: int) -> int:
        """Elements that share one scale: channels of a row (Kind.TOKEN), tokens of a channel
        (Kind.CHANNEL), or 0 (Kind.STATIC: one per channel over every token)."""
        return self.row_group(width)

    def metadata_shape(self, b: int, heads: int, n: int, width: int) -> tuple[int, ...]:
        """The shape of a body's scale (and offset) for B sequences of N slots."""
        return (b, heads, n, width // self.row_group(width))

    def metadata_index(self, body, start: torch.Tensor, pos: torch.Tensor, n: int):
        """Where blocks of n tokens at positions pos [M, n] (starting at start [M]) put their
        metadata along dim 2 of `body`'s scale, or None (metadata per layer)."""
        return pos % body.scale.shape[2]

    def read_metadata(self, t: torch.Tensor, rows: slice, n: int, start: int = 0) -> torch.Tensor:
        """A body's scale or offset for slots [start, n) of sequences `rows`, group-shaped for
        `expand`; start a multiple of `token_group`."""
        return t[rows, :, start:n, :, None]

    def allocate(self, shape, device, dtype, *, static_range=None, codebook=None, split=None):
        spec = self.spec
        b, hkv, n, d = shape
        if spec.codebook and codebook is None:
            raise ValueError(
                "spec.codebook is set: put this layer's levels in KVParams.key_codebook / "
                "value_codebook"
            )
        width, heads = self.width(d, hkv), self.row_heads(hkv)
        codes = torch.zeros(
            b, heads, n, packed_size(width, spec.bits), device=device, dtype=torch.uint8
        )
        scale, offset, static_range = self.metadata_buffers(
            (b, heads, n, width), device, dtype, static_range
        )
        levels = mids = None
        if spec.codebook:
            book = codebook.to(torch.float32).expand(heads, -1)  # where it lies: see static.py
            levels = book.to(device).contiguous()
            mids = ((book[:, 1:] + book[:, :-1]) / 2).to(device).contiguous()
        slot_index = slot_delta = None
        k = self.slots(width)
        if k:
            slot_index = torch.zeros(b, heads, n, k, device=device, dtype=slot_index_dtype(width))
            slot_delta = torch.zeros(b, heads, n, k, device=device, dtype=self.slot_dtype(dtype))
        return PackedBody(
            spec, d, hkv, codes, scale, offset, static_range, levels, mids, slot_index, slot_delta
        )

    def metadata_buffers(self, rows, device, dtype, static_range):
        """(scale, offset or None, static_range) of a body of `rows` = (B, heads, N, width)."""
        stored = torch.uint8 if self.spec.metadata_code == "byte" else dtype
        shape = self.metadata_shape(*rows)
        scale = torch.zeros(shape, device=device, dtype=stored)
        offset = None if self.spec.symmetric else torch.zeros(shape, device=device, dtype=stored)
        return scale, offset, None


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
    def layout(self) -> AffineLayout:
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
