"""Quantize a block of tokens and pack the codes into the body: the cache's flush.

Per group (channels of a token, tokens of a channel, or a calibrated channel range):

    scale, offset = range_metadata(lo, hi);  code = clamp(round((x - offset) / scale)),  packed

the asymmetric case being KIVI's float-offset formula (Liu et al. 2024, arXiv:2402.02750).
The kernel computes the reference's fp32 operations in the reference's order (metadata rounded
to the storage dtype first, IEEE division, round half to even), so its codes and metadata are
bit-identical to `quant_pack_reference` (quant.quantize + packing.pack), which is also the CPU
fallback and the path for outliers.
"""

import torch
import triton
import triton.language as tl

from kvcalib_runtime.kernels.layout import PackedBody
from kvcalib_runtime.packing import pack
from kvcalib_runtime.quant import QuantSpec, quantize

GRANULARITY = {"token": 0, "channel": 1, "static": 2}  # the kernels' GRAN switch
TOKEN, CHANNEL = tl.constexpr(0), tl.constexpr(1)
ROUNDING = tl.constexpr(12582912.0)  # 1.5 * 2**23: fp32 (v + R) - R rounds v half to even


# fmt: off
@triton.jit
def _range_metadata(lo, hi, clip, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                    CODEBOOK: tl.constexpr, DTYPE: tl.constexpr):
    # fmt: on
    """quant.range_metadata in fp32, rounded to DTYPE and back: (scale, offset); the offset is
    unused when symmetric."""
    lo, hi = lo * clip, hi * clip
    if SYMMETRIC:
        scale = tl.maximum(tl.abs(lo), tl.abs(hi))
        if not CODEBOOK:
            scale = tl.math.div_rn(scale, tl.full(scale.shape, 2 ** (BITS - 1) - 1, tl.float32))
    else:
        scale = hi - lo
        if not CODEBOOK:
            scale = tl.math.div_rn(scale, tl.full(scale.shape, 2**BITS - 1, tl.float32))
    return scale.to(DTYPE).to(tl.float32), lo.to(DTYPE).to(tl.float32)


# fmt: off
@triton.jit
def _quant_pack_kernel(
    X, SEQ, START,                  # x [M, Hkv, n, D]; int [M] sequence and first slot per block
    CODES, SCALE, OFFSET,           # the body (PackedBody layout)
    MIDS, EXCLUDE,                  # float32 [Hkv, L - 1] thresholds; uint8 [B, N] or None
    n, num_heads, N, meta_rows, clip,
    D: tl.constexpr, BITS: tl.constexpr, GRAN: tl.constexpr, GROUP: tl.constexpr,
    SYMMETRIC: tl.constexpr, CODEBOOK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
):
    # fmt: on
    """Block m of x [M, Hkv, n, D] into slots start[m] + t of sequence seq[m]:
    codes[seq, h, slot] = pack(clamp(round((x - offset) / scale))), plus the metadata.

    TOKEN / STATIC: program (row block, -, m) takes BLOCK_T rows r = h * n + t of block m;
    TOKEN groups BLOCK_G channels (GROUP real ones), STATIC reads SCALE/OFFSET [Hkv, D].
    CHANNEL: program (token group, h, m) takes the GROUP tokens of one group
    (start[m] % GROUP == 0); EXCLUDE [B, N] slots and padding stay out of its ranges, as in
    quant.quantize.
    """
    pid, m = tl.program_id(0), tl.program_id(2)
    seq, start = tl.load(SEQ + m).to(tl.int64), tl.load(START + m).to(tl.int64)
    i = tl.arange(0, BLOCK_T)
    if GRAN == CHANNEL:
        h = tl.program_id(1) + i * 0
        t = pid * GROUP + i
        rows = (i < GROUP) & (t < n)
    else:
        r = pid * BLOCK_T + i
        h, t = r // n, r % n
        rows = r < num_heads * n
    c = tl.arange(0, BLOCK_D)
    cols = c < D
    mask = rows[:, None] & cols[None, :]
    src = X + ((m * num_heads + h).to(tl.int64) * n + t)[:, None] * D + c[None, :]
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    slot = start + t  # [BLOCK_T] absolute positions
    body_row = (seq * num_heads + h) * N + slot
    DTYPE: tl.constexpr = SCALE.dtype.element_ty
    if GRAN == TOKEN:
        NG: tl.constexpr = BLOCK_D // BLOCK_G
        lo = tl.min(tl.reshape(tl.where(mask, x, float("inf")), [BLOCK_T, NG, BLOCK_G]), axis=2)
        hi = tl.max(tl.reshape(tl.where(mask, x, float("-inf")), [BLOCK_T, NG, BLOCK_G]), axis=2)
        scale, offset = _range_metadata(lo, hi, clip, BITS, SYMMETRIC, CODEBOOK, DTYPE)
        gi = tl.arange(0, NG)
        meta = body_row[:, None] * (D // GROUP) + gi[None, :]
        meta_mask = rows[:, None] & (gi < D // GROUP)[None, :]
        tl.store(SCALE + meta, scale.to(DTYPE), mask=meta_mask)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_T, NG, BLOCK_G]), x.shape)
        if not SYMMETRIC:
            tl.store(OFFSET + meta, offset.to(DTYPE), mask=meta_mask)
            offset = tl.reshape(
                tl.broadcast_to(offset[:, :, None], [BLOCK_T, NG, BLOCK_G]), x.shape
            )
    elif GRAN == CHANNEL:
        keep = rows
        if EXCLUDE is not None:
            keep = keep & (tl.load(EXCLUDE + seq * N + slot, mask=rows, other=1) == 0)
        kept = keep[:, None] & cols[None, :]  # ranges over kept tokens only
        any_kept = tl.sum(keep.to(tl.int32), axis=0) > 0
        lo = tl.where(any_kept, tl.min(tl.where(kept, x, float("inf")), axis=0), 0.0)
        hi = tl.where(any_kept, tl.max(tl.where(kept, x, float("-inf")), axis=0), 0.0)
        scale, offset = _range_metadata(lo, hi, clip, BITS, SYMMETRIC, CODEBOOK, DTYPE)
        meta = ((seq * num_heads + tl.program_id(1)) * meta_rows + start // GROUP + pid) * D + c
        tl.store(SCALE + meta, scale.to(DTYPE), mask=cols)
        scale = scale[None, :]
        if not SYMMETRIC:
            tl.store(OFFSET + meta, offset.to(DTYPE), mask=cols)
            offset = offset[None, :]
    else:
        meta = h[:, None] * D + c[None, :]
        scale = tl.load(SCALE + meta, mask=mask, other=1.0).to(tl.float32)
        if not SYMMETRIC:
            offset = tl.load(OFFSET + meta, mask=mask, other=0.0).to(tl.float32)
    v = x if SYMMETRIC else x - offset
    v = tl.math.div_rn(v, tl.where(scale > 0, scale, 1.0))
    LEVELS: tl.constexpr = 2**BITS
    if CODEBOOK:
        code = tl.zeros(x.shape, tl.int32)
        for j in tl.static_range(LEVELS - 1):
            mid = tl.load(MIDS + h * (LEVELS - 1) + j, mask=rows, other=0.0)
            code += (v > mid[:, None]).to(tl.int32)
    else:  # clamp, then round half to even: fp32 (v + 1.5 * 2**23) - 1.5 * 2**23
        QMAX: tl.constexpr = 2 ** (BITS - 1) - 1 if SYMMETRIC else LEVELS - 1
        low: tl.constexpr = -QMAX if SYMMETRIC else 0
        v = tl.minimum(tl.maximum(v, low), QMAX)
        code = ((v + ROUNDING) - ROUNDING).to(tl.int32) + (QMAX if SYMMETRIC else 0)
    code = tl.where(mask, code, 0)
    PB: tl.constexpr = (D * BITS + 7) // 8
    dst = CODES + body_row[:, None] * PB
    if 8 % BITS == 0:  # whole codes per byte: one contiguous row of bytes
        PER_BYTE: tl.constexpr = 8 // BITS
        shift = tl.arange(0, PER_BYTE) * BITS
        grouped = tl.reshape(code, [BLOCK_T, BLOCK_D // PER_BYTE, PER_BYTE])
        packed = tl.sum(grouped << shift[None, None, :], axis=2)
        j = tl.arange(0, BLOCK_D // PER_BYTE)
        tl.store(dst + j[None, :], packed.to(tl.uint8), mask=rows[:, None] & (j < PB)[None, :])
    else:  # 3 bits: 8 codes make a 24-bit word, stored as 3 bytes
        shift = tl.arange(0, 8) * BITS
        words = tl.sum(tl.reshape(code, [BLOCK_T, BLOCK_D // 8, 8]) << shift[None, None, :], axis=2)
        w = tl.arange(0, BLOCK_D // 8)
        for r in tl.static_range(BITS):
            byte = w * BITS + r
            out = ((words >> (8 * r)) & 0xFF).to(tl.uint8)
            tl.store(dst + byte[None, :], out, mask=rows[:, None] & (byte < PB)[None, :])


def supports(spec: QuantSpec, head_dim: int) -> bool:
    """Whether `quant_pack` handles spec at this head dim: no outliers, rows of one head, and
    token groups of a power-of-two number of channels or the whole head."""
    if spec.outliers > 0 or spec.granularity == "vector":
        return False
    g = spec.channel_group(head_dim) if spec.granularity == "token" else 1
    return g == head_dim or g & (g - 1) == 0


def quant_pack(x, body: PackedBody, seq, start, exclude=None) -> None:
    """Quantize x [M, Hkv, n, D] and write block m to slots [start[m], start[m] + n) of sequence
    seq[m] of `body` (codes and, for "token"/"channel", scale and offset).

    seq, start: integer tensors [M] on x's device; for "channel", start % group_size == 0 and
    n % group_size == 0 (the cache flushes whole groups). exclude: bool [B, N] on x's device,
    slots left out of "channel" ranges (kept sinks); they still get codes.
    """
    spec = body.spec
    m, hkv, n, d = x.shape
    _, _, slots, _ = body.codes.shape
    if not supports(spec, d):
        raise ValueError(f"quant_pack does not handle {spec} at head_dim {d}: use the reference")
    if spec.granularity == "channel" and n % spec.group_size:
        raise ValueError(
            f"a 'channel' block of {n} tokens is not whole groups of {spec.group_size}"
        )
    if m == 0 or n == 0:
        return
    x = x.contiguous()
    block_d = triton.next_power_of_2(d)
    group = spec.channel_group(d) if spec.granularity == "token" else spec.group_size
    if spec.granularity == "channel":
        block_t = triton.next_power_of_2(group)
        grid = (n // group, hkv, m)
    else:
        block_t = min(triton.next_power_of_2(hkv * n), max(1, 4096 // block_d))
        grid = (triton.cdiv(hkv * n, block_t), 1, m)
    offset = body.offset if body.offset is not None else body.scale
    mids = body.mids if body.mids is not None else body.scale
    if exclude is not None:
        exclude = exclude.view(torch.uint8)
    # fmt: off
    _quant_pack_kernel[grid](
        x, seq, start,
        body.codes, body.scale, offset,
        mids, exclude if spec.granularity == "channel" else None,
        n, hkv, slots, body.scale.shape[2] if spec.granularity == "channel" else 0, spec.clip,
        D=d, BITS=spec.bits, GRAN=GRANULARITY[spec.granularity], GROUP=group,
        SYMMETRIC=spec.symmetric, CODEBOOK=spec.codebook,
        BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_G=block_d if group == d else group,
        num_warps=4, enable_fp_fusion=False,  # no FMA contraction: the reference rounds twice
    )
    # fmt: on


def quant_pack_reference(x, body: PackedBody, seq, start, exclude=None) -> None:
    """`quant_pack` in plain torch (quant.quantize + packing.pack), block by block; also the
    layouts the kernel does not take ("vector" rows, outlier slots)."""
    spec = body.spec
    n = x.shape[2]
    kwargs = {"codebook": body.levels}
    if body.static_range is not None:
        kwargs["static_range"] = tuple(r[:, None, :] for r in body.static_range)
    for xm, b, s in zip(x, seq.tolist(), start.tolist(), strict=True):
        if exclude is not None:
            kwargs["exclude"] = exclude[b, s : s + n][None]
        q = quantize(xm, spec, **kwargs)  # xm [Hkv, n, D]; rows [heads, n, width]
        body.codes[b, :, s : s + n] = pack(q.codes, spec.bits)
        if spec.granularity in ("token", "vector"):
            body.scale[b, :, s : s + n] = q.scale[..., 0]
            if body.offset is not None:
                body.offset[b, :, s : s + n] = q.offset[..., 0]
        elif spec.granularity == "channel":
            g0, g1 = s // spec.group_size, (s + n) // spec.group_size
            body.scale[b, :, g0:g1] = q.scale[..., 0]
            if body.offset is not None:
                body.offset[b, :, g0:g1] = q.offset[..., 0]
        if body.slot_index is not None:
            body.slot_index[b, :, s : s + n] = q.slot_index
            body.slot_delta[b, :, s : s + n] = q.slot_delta
