"""kvcalib's affine numerics, shared by the layouts that store them (token, vector, channel,
static; ggml changes only the levels and how codes are taken); a cache stores them in a
`PackedBody` (layouts.packed_body).

Every group is dequantized as  x_hat = offset + scale * level[code]  (layouts.quant's module
docstring gives the levels, the clip ratio and the exact slots); a layout says which
elements form a group: `group`, `ungroup`, `expand` and `group_range` below, and where a body
keeps the groups' metadata (`metadata_shape`, `metadata_index`, `read_metadata`).
"""

import torch

from kvcalib_runtime.layouts import fp8, metabyte
from kvcalib_runtime.layouts.base import CODEBOOK, Layout, QTensor, slot_index_dtype
from kvcalib_runtime.layouts.packed_body import PackedBody
from kvcalib_runtime.layouts.packing import packed_size


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
