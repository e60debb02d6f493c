"""Quantize a block of tokens and pack it into the body: the cache's flush.

Per group (channels of a row, tokens of a channel, or a calibrated channel range):

    scale, offset = range_metadata(lo, hi);  code = clamp(round((x - offset) / scale)),  packed

the asymmetric case being KIVI's float-offset formula (Liu et al. 2024, arXiv:2402.02750), the
metadata stored in the cache's dtype or, for per-token groups with metadata_code "byte", as a
one-byte scale and zero point (layouts.metabyte, by integer bit work in the kernel). With
outliers (KVQuant's dense-and-sparse split, Hooper et al. 2024), dynamic ranges leave out k
elements at each end and each row's K exact slots keep the elements of largest excess (quant's
module docstring). The kernel computes the reference's fp32 operations in the reference's order
(metadata rounded to the storage dtype first, IEEE division, round half to even, no FMA
contraction), so codes, metadata and slots are bit-identical to `quant_pack_reference`
(quant.quantize + packing.pack), which is also the CPU fallback.

Two sources, one kernel: `quant_pack` takes dense blocks (a prefill); `flush` reads the residual
ring and the new token in place (a decode step: no copy, no host synchronization, blocks whose
sequence has nothing to flush return at once). Position p goes to body slot p % slots (a ring
for sliding-window layers, slot p otherwise). Without the kernel, a decode step's flushes of one
spec across layers are quantized in one call (`flush_many`): one token a stream is all overhead.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvcalib_runtime.kernels.tiles import (
    CHANNEL,
    ROUNDING,
    TOKEN,
    fp8_encode,
    scale_decode,
    scale_encode,
    zero_decode,
    zero_encode,
)
from kvcalib_runtime.layouts import Kind
from kvcalib_runtime.layouts.packed_body import PackedBody
from kvcalib_runtime.layouts.packing import pack
from kvcalib_runtime.layouts.quant import QuantSpec, quantize


# fmt: off
@triton.jit
def _range_scale(lo, hi, BITS: tl.constexpr, SYMMETRIC: tl.constexpr, CODEBOOK: tl.constexpr):
    # fmt: on
    """The fp32 scale of clipped ranges [lo, hi], as AffineLayout.metadata divides it."""
    if SYMMETRIC:
        scale = tl.maximum(tl.abs(lo), tl.abs(hi))
        if not CODEBOOK:
            scale = tl.math.div_rn(scale, tl.full(scale.shape, 2 ** (BITS - 1) - 1, tl.float32))
    else:
        scale = hi - lo
        if not CODEBOOK:
            scale = tl.math.div_rn(scale, tl.full(scale.shape, 2**BITS - 1, tl.float32))
    return scale


# fmt: off
@triton.jit
def _range_metadata(lo, hi, clip, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                    CODEBOOK: tl.constexpr, DTYPE: tl.constexpr):
    # fmt: on
    """quant.range_metadata in fp32, rounded to DTYPE and back: (scale, offset); the offset is
    unused when symmetric."""
    lo, hi = lo * clip, hi * clip
    scale = _range_scale(lo, hi, BITS, SYMMETRIC, CODEBOOK)
    return scale.to(DTYPE).to(tl.float32), lo.to(DTYPE).to(tl.float32)


# fmt: off
@triton.jit
def _byte_metadata(lo, hi, clip, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                   CODEBOOK: tl.constexpr):
    # fmt: on
    """One-byte metadata (layouts.metabyte, as AffineLayout.metadata computes it): (scale,
    offset) decoded in fp32, and the scale and zero point bytes; the offset and zero point are
    unused when symmetric, an asymmetric range is widened to contain 0 first."""
    lo, hi = lo * clip, hi * clip
    if not SYMMETRIC:
        lo, hi = tl.minimum(lo, 0.0), tl.maximum(hi, 0.0)
    code = scale_encode(_range_scale(lo, hi, BITS, SYMMETRIC, CODEBOOK))
    scale = scale_decode(code)
    if SYMMETRIC:
        return scale, lo, code, code
    SPAN: tl.constexpr = 1.0 if CODEBOOK else 2.0**BITS - 1
    zero = zero_encode(lo, scale, SPAN)
    return scale, zero_decode(zero, scale, SPAN), code, zero


@triton.jit
def _trimmed(v, K: tl.constexpr, LARGEST: tl.constexpr, BLOCK_G: tl.constexpr):
    """The (K+1)-th smallest (largest) of v [BT, NG, BLOCK_G] along its last axis, as
    torch.kthvalue: K instances of the current extreme removed first."""
    j = tl.arange(0, BLOCK_G)[None, None, :]
    gone = float("-inf") if LARGEST else float("inf")
    for _ in tl.static_range(K):
        m = tl.max(v, axis=2) if LARGEST else tl.min(v, axis=2)
        first = tl.min(tl.where(v == m[:, :, None], j, BLOCK_G), axis=2)
        v = tl.where(j == first[:, :, None], gone, v)
    return tl.max(v, axis=2) if LARGEST else tl.min(v, axis=2)


@triton.jit
def _spread(g, BT: tl.constexpr, NG: tl.constexpr, BLOCK_G: tl.constexpr):
    """Per-group values g [BT, NG] repeated over their BLOCK_G channels: [BT, NG * BLOCK_G]."""
    return tl.reshape(tl.broadcast_to(g[:, :, None], [BT, NG, BLOCK_G]), [BT, NG * BLOCK_G])


# fmt: off
@triton.jit
def _quant_pack_kernel(
    X, NEW, LENGTHS,                # dense x [M, Hkv, n, D]; or (RING) tail [B, Hkv, R, D],
                                    # new [B, Hkv, D], lengths [B]
    SEQ, START, END,                # int [M]: sequence, first position, (RING) end position
    BODY,                           # BodyBuffers: the body it writes
    EXCLUDE,                        # uint8 [B, P] or None
    n, num_kv, num_slots, meta_rows, ring, exclude_stride, clip,
    L: tl.constexpr,                # PackLayout
    D: tl.constexpr, RING: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_G: tl.constexpr,
):
    # fmt: on
    """Block m (n tokens from position start[m] of sequence seq[m]) into body slots
    (start[m] + t) % num_slots: codes = pack(clamp(round((x - offset) / scale))), the metadata,
    and the K exact slots of each row.

    L (PackLayout) says how: its GRAN, GROUP, HEADS, ... below. TOKEN / STATIC: program (row
    block, -, m) takes BLOCK_T rows r = h * n + t of block m (h < HEADS; a VECTOR row joins the
    Hkv heads of token t, channel j = head j // D, channel j % D); TOKEN groups BLOCK_G channels
    (GROUP real ones), STATIC reads BODY.scale / BODY.offset [Hkv, D].
    CHANNEL: program (token group, h, m) takes the GROUP tokens of one group
    (start[m] % GROUP == 0); EXCLUDE slots and padding stay out of its ranges, as in
    quant.quantize. RING: x at position p is tail[seq, h, p % ring] below lengths[seq], else
    new[seq, h]; a block with start >= end has nothing to flush.
    """
    pid, m = tl.program_id(0), tl.program_id(2)
    seq, start = tl.load(SEQ + m).to(tl.int64), tl.load(START + m).to(tl.int64)
    if RING and start >= tl.load(END + m):
        return
    i = tl.arange(0, BLOCK_T)
    if L.GRAN == CHANNEL:
        h = tl.program_id(1) + i * 0
        t = pid * L.GROUP + i
        rows = (i < L.GROUP) & (t < n)
    else:
        r = pid * BLOCK_T + i
        h, t = r // n, r % n
        rows = r < L.HEADS * n
    c = tl.arange(0, BLOCK_W)
    cols = c < L.WIDTH
    mask = rows[:, None] & cols[None, :]
    if L.VECTOR:  # source head and channel of row channel c
        src_h, src_c = (c // D)[None, :], (c % D)[None, :]
    else:
        src_h, src_c = h[:, None], c[None, :]
    pos = start + t  # [BLOCK_T] absolute positions
    if RING:
        length = tl.load(LENGTHS + seq)
        old = (pos < length)[:, None]
        line = (seq * num_kv + src_h).to(tl.int64)
        x = tl.load(X + (line * ring + (pos % ring)[:, None]) * D + src_c, mask=mask & old,
                    other=0.0)
        x += tl.load(NEW + line * D + src_c, mask=mask & ~old, other=0.0)
        x = x.to(tl.float32)
    else:
        src = ((m * num_kv + src_h).to(tl.int64) * n + t[:, None]) * D + src_c
        x = tl.load(X + src, mask=mask, other=0.0).to(tl.float32)
    body_row = (seq * L.HEADS + h) * num_slots + pos % num_slots  # [BLOCK_T]
    DTYPE: tl.constexpr = BODY.scale.dtype.element_ty  # the cache's, or uint8 (L.BYTE)
    if L.GRAN == TOKEN:
        NG: tl.constexpr = BLOCK_W // BLOCK_G
        lo = tl.reshape(tl.where(mask, x, float("inf")), [BLOCK_T, NG, BLOCK_G])
        hi = tl.reshape(tl.where(mask, x, float("-inf")), [BLOCK_T, NG, BLOCK_G])
        lo, hi = _trimmed(lo, L.TRIM, False, BLOCK_G), _trimmed(hi, L.TRIM, True, BLOCK_G)
        gi = tl.arange(0, NG)
        meta_mask = rows[:, None] & (gi < L.WIDTH // L.GROUP)[None, :]
        lo = tl.where(meta_mask, lo, 0.0)  # padding rows and groups: finite, never stored
        hi = tl.where(meta_mask, hi, 0.0)
        meta = body_row[:, None] * (L.WIDTH // L.GROUP) + gi[None, :]
        if L.BYTE:
            scale, offset, scale_code, zero = _byte_metadata(
                lo, hi, clip, L.BITS, L.SYMMETRIC, L.CODEBOOK
            )
            tl.store(BODY.scale + meta, scale_code, mask=meta_mask)
            if not L.SYMMETRIC:
                tl.store(BODY.offset + meta, zero, mask=meta_mask)
        else:
            scale, offset = _range_metadata(lo, hi, clip, L.BITS, L.SYMMETRIC, L.CODEBOOK, DTYPE)
            tl.store(BODY.scale + meta, scale.to(DTYPE), mask=meta_mask)
            if not L.SYMMETRIC:
                tl.store(BODY.offset + meta, offset.to(DTYPE), mask=meta_mask)
        scale = _spread(scale, BLOCK_T, NG, BLOCK_G)
        if not L.SYMMETRIC:
            offset = _spread(offset, BLOCK_T, NG, BLOCK_G)
        lo, hi = _spread(lo, BLOCK_T, NG, BLOCK_G), _spread(hi, BLOCK_T, NG, BLOCK_G)
    elif L.GRAN == CHANNEL:
        keep = rows
        if EXCLUDE is not None:
            keep = keep & (tl.load(EXCLUDE + seq * exclude_stride + pos, mask=rows, other=1) == 0)
        kept = keep[:, None] & cols[None, :]  # ranges over kept tokens only
        any_kept = tl.sum(keep.to(tl.int32), axis=0) > 0
        lo = tl.where(any_kept, tl.min(tl.where(kept, x, float("inf")), axis=0), 0.0)
        hi = tl.where(any_kept, tl.max(tl.where(kept, x, float("-inf")), axis=0), 0.0)
        scale, offset = _range_metadata(lo, hi, clip, L.BITS, L.SYMMETRIC, L.CODEBOOK, DTYPE)
        group = (start // L.GROUP + pid) % meta_rows
        meta = ((seq * num_kv + tl.program_id(1)) * meta_rows + group) * D + c
        tl.store(BODY.scale + meta, scale.to(DTYPE), mask=cols)
        scale = scale[None, :]
        if not L.SYMMETRIC:
            tl.store(BODY.offset + meta, offset.to(DTYPE), mask=cols)
            offset = offset[None, :]
    else:
        meta = h[:, None] * D + c[None, :]
        scale = tl.load(BODY.scale + meta, mask=mask, other=1.0).to(tl.float32)
        if not L.SYMMETRIC:
            offset = tl.load(BODY.offset + meta, mask=mask, other=0.0).to(tl.float32)
        if L.K > 0 and not L.ERROR_RULE:
            lo = tl.load(BODY.lo + meta, mask=mask, other=0.0)
            hi = tl.load(BODY.hi + meta, mask=mask, other=0.0)
    v = x if L.SYMMETRIC else x - offset
    v = tl.math.div_rn(v, tl.where(scale > 0, scale, 1.0))
    LEVELS_N: tl.constexpr = 2**L.BITS
    head = h if not L.VECTOR else h * 0
    if L.CODEBOOK:
        code = tl.zeros(x.shape, tl.int32)
        for j in tl.static_range(LEVELS_N - 1):
            mid = tl.load(BODY.mids + head * (LEVELS_N - 1) + j, mask=rows, other=0.0)
            code += (v > mid[:, None]).to(tl.int32)
    else:  # clamp, then round half to even: fp32 (v + 1.5 * 2**23) - 1.5 * 2**23
        QMAX: tl.constexpr = 2 ** (L.BITS - 1) - 1 if L.SYMMETRIC else LEVELS_N - 1
        low: tl.constexpr = -QMAX if L.SYMMETRIC else 0
        v = tl.minimum(tl.maximum(v, low), QMAX)
        code = ((v + ROUNDING) - ROUNDING).to(tl.int32) + (QMAX if L.SYMMETRIC else 0)
    code = tl.where(mask, code, 0)
    if L.K > 0:  # quant._base, then the K largest excesses of each row, lower channel on ties
        if L.CODEBOOK:
            level = tl.load(BODY.levels + head[:, None] * LEVELS_N + code, mask=mask, other=0.0)
        elif L.SYMMETRIC:
            level = (code - (2 ** (L.BITS - 1) - 1)).to(tl.float32)
        else:
            level = code.to(tl.float32)
        base = level * scale
        if not L.SYMMETRIC:
            base = base + offset
        error = x - base
        excess = tl.abs(error) if L.ERROR_RULE else tl.abs(x - tl.minimum(tl.maximum(x, lo), hi))
        excess = tl.where(mask, excess, -1.0)
        K: tl.constexpr = L.K  # a constexpr local: Triton 3.6 reads L.K as a plain int
        slot = body_row * K
        for k in tl.static_range(K):
            top = tl.max(excess, axis=1)
            index = tl.min(tl.where(excess == top[:, None], c[None, :], BLOCK_W), axis=1)
            hit = c[None, :] == index[:, None]
            delta = tl.where(top > 0, tl.sum(tl.where(hit, error, 0.0), axis=1), 0.0)
            tl.store(BODY.slot_index + slot + k, tl.where(top > 0, index, 0), mask=rows)
            if L.FP8:  # layouts.fp8: steps of the channel's scale, one E4M3 byte
                step = tl.sum(tl.where(hit, scale, 0.0), axis=1)
                byte = fp8_encode(tl.math.div_rn(delta, tl.where(step > 0, step, 1.0)))
                tl.store(BODY.slot_delta + slot + k, byte, mask=rows)
            else:
                tl.store(BODY.slot_delta + slot + k, delta.to(BODY.slot_delta.dtype.element_ty),
                         mask=rows)  # fmt: skip
            excess = tl.where(hit, -1.0, excess)
    PB: tl.constexpr = (L.WIDTH * L.BITS + 7) // 8
    dst = BODY.codes + body_row[:, None] * PB
    if 8 % L.BITS == 0:  # whole codes per byte: one contiguous row of bytes
        PER_BYTE: tl.constexpr = 8 // L.BITS
        shift = tl.arange(0, PER_BYTE) * L.BITS
        grouped = tl.reshape(code, [BLOCK_T, BLOCK_W // PER_BYTE, PER_BYTE])
        packed = tl.sum(grouped << shift[None, None, :], axis=2)
        j = tl.arange(0, BLOCK_W // PER_BYTE)
        tl.store(dst + j[None, :], packed.to(tl.uint8), mask=rows[:, None] & (j < PB)[None, :])
    else:  # 3, 5, 6 or 7 bits: 8 codes make a word of L.BITS bytes
        shift = tl.arange(0, 8) * L.BITS
        wide = tl.reshape(code, [BLOCK_T, BLOCK_W // 8, 8])
        if L.BITS > 3:
            wide = wide.to(tl.int64)
        words = tl.sum(wide << shift[None, None, :], axis=2)
        w = tl.arange(0, BLOCK_W // 8)
        BITS: tl.constexpr = L.BITS
        for r in tl.static_range(BITS):
            byte = w * L.BITS + r
            out = ((words >> (8 * r)) & 0xFF).to(tl.uint8)
            tl.store(dst + byte[None, :], out, mask=rows[:, None] & (byte < PB)[None, :])


class BodyBuffers(NamedTuple):
    """A PackedBody's tensors as the kernel writes them; those a layout does not use repeat the
    scale. lo, hi: the static range float32 [Hkv, D]; the others as PackedBody documents."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    levels: torch.Tensor
    mids: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    slot_index: torch.Tensor
    slot_delta: torch.Tensor


class PackLayout(NamedTuple):
    """What the kernel compiles for one body (a constexpr argument).

    WIDTH       channels per stored row
    HEADS       rows per token: Hkv, or 1 for "vector"
    VECTOR      a row joins every KV head
    BITS        code width
    GRAN        tiles.TOKEN ("token", "vector"), CHANNEL or STATIC
    GROUP       channels per group of a row (TOKEN), tokens per group (CHANNEL), else 1
    SYMMETRIC   symmetric levels (no offset)
    CODEBOOK    codebook levels (thresholds `mids`)
    K           exact slots per row
    TRIM        elements left out at each end of a TOKEN group's range (outliers)
    ERROR_RULE  slot_rule "error" (else "outside")
    FP8         slot_code "fp8": a slot's delta as an E4M3 byte in steps of the static scale
    BYTE        TOKEN: one-byte scale and zero point (metadata_code "byte", layouts.metabyte)
    """

    WIDTH: int
    HEADS: int
    VECTOR: bool
    BITS: int
    GRAN: int
    GROUP: int
    SYMMETRIC: bool
    CODEBOOK: bool
    K: int
    TRIM: int
    ERROR_RULE: bool
    FP8: bool
    BYTE: bool


def supports(spec: QuantSpec, head_dim: int, kv_heads: int) -> bool:
    """Whether the kernel handles spec: row groups (Kind.TOKEN) of a power-of-two number of
    channels or the whole row; everything else (every layout, codebook, bit width and outlier
    rule) it does."""
    layout = spec.layout
    if layout.kind != Kind.TOKEN:
        return True
    width = layout.width(head_dim, kv_heads)
    g = layout.row_group(width)
    return g == width or g & (g - 1) == 0


def _launch(x, new, lengths, body: PackedBody, seq, start, end, n, exclude) -> None:
    spec, d, hkv = body.spec, body.head_dim, body.kv_heads
    if not supports(spec, d, hkv):
        raise ValueError(f"quant_pack does not handle {spec} at head_dim {d}: use the reference")
    layout, width = spec.layout, body.width
    heads = layout.row_heads(hkv)
    m, slots = len(seq), body.codes.shape[2]
    block_w = max(16, triton.next_power_of_2(width))
    group = layout.metadata_group(width)
    channel = layout.kind == Kind.CHANNEL
    if channel:
        block_t = triton.next_power_of_2(group)
        grid = (n // group, hkv, m)
    else:
        block_t = min(triton.next_power_of_2(heads * n), max(1, 4096 // block_w))
        grid = (triton.cdiv(heads * n, block_t), 1, m)
    ring = new is not None
    dummy = body.scale
    trim = layout.outliers_per_side(group)
    lo, hi = body.static_range or (dummy, dummy)
    buffers = BodyBuffers(
        body.codes, body.scale, body.offset if body.offset is not None else dummy,
        *(t if t is not None else dummy for t in (body.levels, body.mids)),
        lo, hi, *(t if t is not None else dummy for t in (body.slot_index, body.slot_delta)),
    )  # fmt: skip
    layout = PackLayout(
        WIDTH=width,
        HEADS=heads,
        VECTOR=body.vector,
        BITS=spec.bits,
        GRAN=layout.kind.value,
        GROUP=max(group, 1),
        SYMMETRIC=spec.symmetric,
        CODEBOOK=spec.codebook,
        K=layout.slots(width),
        TRIM=trim,
        ERROR_RULE=spec.slot_rule == "error",
        FP8=spec.slot_code == "fp8",
        BYTE=spec.metadata_code == "byte",
    )
    # fmt: off
    _quant_pack_kernel[grid](
        x, new if ring else dummy, lengths if ring else dummy,
        seq, start, end if ring else seq, buffers,
        exclude.view(torch.uint8) if channel and exclude is not None else None,
        n, hkv, slots, body.scale.shape[2] if channel else 1,
        x.shape[2] if ring else 1, exclude.shape[1] if exclude is not None else 0, spec.clip,
        layout, D=d, RING=ring, BLOCK_T=block_t, BLOCK_W=block_w,
        BLOCK_G=block_w if group in (0, width) else group,
        num_warps=4, enable_fp_fusion=False,  # no FMA contraction: the reference rounds twice
    )
    # fmt: on


def quant_pack(x, body: PackedBody, seq, start, exclude=None) -> None:
    """Quantize x [M, Hkv, n, D] and write block m to positions [start[m], start[m] + n) of
    sequence seq[m] of `body` (codes; scale and offset for "token"/"vector"/"channel"; slots).

    seq, start: integer tensors [M] on x's device, no two blocks writing the same slot; for
    "channel", start % group_size == 0 and n % group_size == 0 (the cache flushes whole groups).
    exclude: bool [B, P] on x's device (P >= every position), positions left out of "channel"
    ranges (kept sinks); they still get codes.
    """
    m, _, n, _ = x.shape
    _check_groups(body.spec, n)
    if m and n and body.codes.shape[2]:
        _launch(x.contiguous(), None, None, body, seq, start, None, n, exclude)


def flush(tail, new, lengths, body: PackedBody, start, end, n: int, exclude=None) -> None:
    """One decode step's flush, for every sequence b at once: positions [start[b], start[b] +
    n) into the body where start[b] < end[b] (nothing otherwise), read from the residual ring
    tail [B, Hkv, R, D] (slot p % R) below lengths[b] and from new [B, Hkv, D] (the token at
    position lengths[b]) otherwise. start, end, lengths: int64 [B] on the device."""
    _check_groups(body.spec, n)
    seq = torch.arange(len(start), device=start.device)
    if body.codes.shape[2]:
        _launch(tail, new.contiguous(), lengths, body, seq, start, end, n, exclude)


def _check_groups(spec: QuantSpec, n: int) -> None:
    g = spec.layout.token_group()
    if n % g:
        raise ValueError(f"a block of {n} tokens is not whole token groups of {g}")


def quant_pack_reference(x, body: PackedBody, seq, start, exclude=None, active=None) -> None:
    """`quant_pack` in plain torch (quant.quantize + packing.pack), every block at once and
    without host synchronization; `active` bool [M] (default all) says which blocks write."""
    spec, slots = body.spec, body.codes.shape[2]
    m, _, n, _ = x.shape
    _check_groups(spec, n)
    if not (m and n and slots):
        return
    kwargs = {"codebook": body.levels}
    if body.static_range is not None:
        kwargs["static_range"] = tuple(r[:, None, :] for r in body.static_range)
    if exclude is not None and spec.layout.kind == Kind.CHANNEL:
        pos = start[:, None] + torch.arange(n, device=x.device)
        kwargs["exclude"] = exclude[seq[:, None], pos.clamp(max=exclude.shape[1] - 1)][:, None]
    q = quantize(x, spec, **kwargs)
    _store(body, q, pack(q.codes, spec.bits), slice(None), seq, start, n, active)


def _store(body: PackedBody, q, packed, heads: slice, seq, start, n: int, active) -> None:
    """Write rows `heads` of q (quantized blocks [M, rows, n, width] of n tokens at positions
    start [M] of sequences seq [M]; `packed` its codes packed) into body: codes, metadata,
    exact slots; where `active` (bool [M], None: all) is False the body keeps what it holds."""
    rows, pos = seq[:, None], start[:, None] + torch.arange(n, device=start.device)

    def put(buffer, value, index):  # buffer[seq, :, index] = value [M, heads, k, ...]
        value = value[:, heads].transpose(1, 2)
        if active is not None:
            value = torch.where(active.view(-1, *[1] * (value.dim() - 1)), value,
                                buffer[rows, :, index])  # fmt: skip
        buffer[rows, :, index] = value

    slots = body.codes.shape[2]
    put(body.codes, packed, pos % slots)
    index = body.spec.layout.metadata_index(body, start, pos, n)
    if index is not None:
        put(body.scale, q.scale[..., 0], index)
        if body.offset is not None:
            put(body.offset, q.offset[..., 0], index)
    if body.slot_index is not None:
        put(body.slot_index, q.slot_index, pos % slots)
        put(body.slot_delta, q.slot_delta, pos % slots)


def _flushed(tail, new, lengths, start, n: int) -> torch.Tensor:
    """The n positions from start [B] on of every sequence, [B, Hkv, n, D]: from the residual
    ring `tail`, or `new` (the token at position lengths [B])."""
    seq = torch.arange(len(start), device=start.device)
    pos = start[:, None] + torch.arange(n, device=start.device)  # [B, n]
    old = tail[seq[:, None], :, pos % tail.shape[2]]  # [B, n, Hkv, D]
    return torch.where((pos < lengths[:, None])[..., None, None], old, new[:, None]).transpose(1, 2)


def flush_reference(tail, new, lengths, body: PackedBody, start, end, n: int, exclude=None):
    """`flush` in plain torch: the ring and the new token gathered, then quant_pack_reference."""
    if not body.codes.shape[2]:
        return
    seq = torch.arange(len(start), device=start.device)
    x = _flushed(tail, new, lengths, start, n)
    quant_pack_reference(x, body, seq, start, exclude, active=start < end)


def batch_key(body: PackedBody, n: int):
    """What bodies must share for `flush_many` to quantize their flushes as one (spec, block,
    buffer shapes and which buffers they keep), or None where it does not apply: a body without
    slots, groups that span tokens (Kind.CHANNEL: each body excludes its own kept sinks), rows
    that join the KV heads."""
    spec = body.spec
    if not body.codes.shape[2] or spec.layout.kind == Kind.CHANNEL or spec.layout.joins_heads:
        return None
    kept = tuple(t is not None for t in (body.static_range, body.levels, body.offset,
                                         body.slot_index))  # fmt: skip
    return spec, n, body.codes.shape[1:], kept


def flush_many(flushes, lengths, n: int) -> None:
    """`flush_reference` of several bodies with one `batch_key` (a decode step's flushes of one
    spec across layers), bit for bit: each body's block gathered as flush_reference gathers it,
    the blocks stacked along the heads axis (each head quantizes with its own range and levels)
    and quantized in one call, then each body's rows written. flushes: (tail, new, body, start,
    end) per body, as flush_reference takes them."""
    body = flushes[0][2]
    spec, heads = body.spec, body.codes.shape[1]
    _check_groups(spec, n)
    x = torch.cat([_flushed(tail, new, lengths, start, n) for tail, new, _, start, _ in flushes], 1)
    kwargs = {}
    if body.levels is not None:
        kwargs["codebook"] = torch.cat([f[2].levels for f in flushes])
    if body.static_range is not None:
        kwargs["static_range"] = tuple(
            torch.cat([f[2].static_range[i] for f in flushes])[:, None, :] for i in range(2)
        )
    q = quantize(x, spec, **kwargs)
    packed = pack(q.codes, spec.bits)
    for i, (_, _, body, start, end) in enumerate(flushes):
        seq = torch.arange(len(start), device=start.device)
        _store(body, q, packed, slice(i * heads, (i + 1) * heads), seq, start, n, start < end)
