"""Decode attention over the quantized cache: one new token per sequence, dequantization fused.

    out = softmax(q K^T / sqrt(D)) V,   K, V = [sink slots | body | tail | new token],
    body = offset + scale * level[code] (+ exact slots),  K rotated by RoPE when stored pre-RoPE,
    keys at positions p - W < j <= p only, for a sliding window W

Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"): each program
takes one (sequence, KV head, split) — the G query heads of a KV group share every key it
dequantizes, and only those G rows enter the softmax — keeps an online-softmax state (max, sum,
acc) over its split of the positions, and a combine kernel merges the splits. The split count is
fixed by the cache's capacity and every length is read on the device, so a step launches the
same grid whatever the lengths: no host synchronization, capturable in a CUDA graph.

Keys and values are each read as their own scheme says (kernels.tiles): "token", "vector",
"channel" or "static" groups, uniform or codebook levels, asymmetric or symmetric, 2-8 bits, exact
slots (keys: a score correction q . rope(delta e_c); values: added into the tile), vector codes
("vq": a codebook entry per vector of channels, looked up in the tile), or left exact; each up
to its own body boundary (key and value flushes may differ), then from the residual ring. Keys
pre-RoPE (rotated in registers) or post-RoPE (and maybe Hadamard-rotated: the caller rotates q).

Its spec in plain torch is kernels.decode_reference (the fallback off the CPU where the kernel does
not run; on the CPU the cache decodes through kernels.decode_torch, held to it); the tests hold
the kernel to it.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvcalib_runtime.kernels import tiles
from kvcalib_runtime.kernels.layout import Sinks, Stored
from kvcalib_runtime.layouts import Kind
from kvcalib_runtime.layouts.body import as_body

MIXED_N = tl.constexpr(16)  # rows of a tile that mixes body and ring (a few per sequence)
LOG2E = 1.4426950408889634
# (BLOCK_N, num_warps, num_stages): what `tune` times on a GPU, per (D, G, schemes, dtype)
CONFIGS = ((32, 4, 2), (64, 4, 2), (64, 8, 2), (64, 8, 3), (128, 8, 2))
INTERPRETED = (32, 4, 1)


# fmt: off
@triton.jit
def _stream(S, L: tl.constexpr, LEVELS, blk, head, kv, slot, pos, pos0, live, in_body, base,
            s_lo, o_lo, s_hi, o_hi, ring_size, BN: tl.constexpr, BLOCK_C: tl.constexpr,
            D: tl.constexpr, MIXED: tl.constexpr, FOLD: tl.constexpr = False, table=None,
            LDT: tl.constexpr = tl.float16, PACKED: tl.constexpr = False,
            LUT: tl.constexpr = False):
    # fmt: on
    """Keys or values (buffers S, layout L; LEVELS: this head's codebook row) at positions pos
    [BN], as two halves fp32 [BN, BLOCK_C]: the body where in_body, with MIXED the residual ring
    elsewhere (where live). (blk, head, slot): the body's rows (tiles.at; head 0 for "vector"),
    base: where the head's channels start in them; kv: the ring's (sequence, head); s_*, o_*:
    each half's "static" metadata; FOLD: the body's levels, its metadata left to the caller
    (tiles.foldable, never with MIXED); table, LDT, PACKED: 2-bit codes' levels, by
    kernels.packed in whole tiles with LUT (not MIXED; tiles.half)."""
    C: tl.constexpr = D // 2
    lo = tiles.half(S, L, LEVELS, blk, head, slot, pos0, in_body, base, s_lo, o_lo, BN, BLOCK_C,
                    C, FOLD, table, LDT, PACKED, LUT and not MIXED)  # fmt: skip
    hi = tiles.half(S, L, LEVELS, blk, head, slot, pos0, in_body, base + C, s_hi, o_hi, BN,
                    BLOCK_C, C, FOLD, table, LDT, PACKED, LUT and not MIXED)  # fmt: skip
    if MIXED:
        ring = live & ~in_body
        lo = tl.where(in_body[:, None], lo, tiles.ring(S.tail, kv, pos, ring, ring_size, 0, D,
                                                       BLOCK_C))  # fmt: skip
        hi = tl.where(in_body[:, None], hi, tiles.ring(S.tail, kv, pos, ring, ring_size, C, D,
                                                       BLOCK_C))  # fmt: skip
    return lo, hi


# fmt: off
@triton.jit
def _update(s, v_lo, v_hi, m_i, l_i, acc_lo, acc_hi, DT: tl.constexpr, PRECISION: tl.constexpr,
            w_lo=None, b_lo=None, w_hi=None, b_hi=None, META: tl.constexpr = 0,
            OFFSET: tl.constexpr = False):
    # fmt: on
    """Fold scores s [BLOCK_G, BN] (log2 units, -inf where invalid) and value halves [BN,
    BLOCK_C] into the running max m_i, sum l_i and unnormalized halves acc (online softmax).
    The halves are levels whose metadata (w, b per half) is applied outside the [BN, BLOCK_C]
    tiles: META 1, per row (w, b [BN]): the probabilities scaled by w, b a rank-1 term p . b;
    META 2, per channel (w, b [BLOCK_C]): the product scaled by w, b times the probabilities'
    sum; OFFSET: b is not zero."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: keep zeros
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    p_sum = tl.sum(p, axis=1)
    if META == 1:
        lo = tl.dot((p * w_lo[None, :]).to(DT), v_lo.to(DT), input_precision=PRECISION)
        hi = tl.dot((p * w_hi[None, :]).to(DT), v_hi.to(DT), input_precision=PRECISION)
        if OFFSET:
            lo += tl.sum(p * b_lo[None, :], axis=1)[:, None]
            hi += tl.sum(p * b_hi[None, :], axis=1)[:, None]
    else:
        pd = p.to(DT)
        lo = tl.dot(pd, v_lo.to(DT), input_precision=PRECISION)
        hi = tl.dot(pd, v_hi.to(DT), input_precision=PRECISION)
        if META == 2:
            lo *= w_lo[None, :]
            hi *= w_hi[None, :]
            if OFFSET:
                lo += p_sum[:, None] * b_lo[None, :]
                hi += p_sum[:, None] * b_hi[None, :]
    acc_lo = acc_lo * alpha[:, None] + lo
    acc_hi = acc_hi * alpha[:, None] + hi
    return m_new, l_i * alpha + p_sum, acc_lo, acc_hi


# fmt: off
@triton.jit
def _decode_split_kernel(
    Q, K_NEW, V_NEW,                       # [B, H, D], [B, Hkv, D], [B, Hkv, D]
    SINKS,                                 # SinkBuffers
    LENGTHS, INV_FREQ,                     # int64 [B], float32 [D/2]
    PART, STATS,                           # float32 [B, H, splits, D], [B, H, splits, 2]
    KS, VS,                                # keys', values' StreamBuffers
    BLOCK_TABLE, table_stride,             # int32 [B, blocks per sequence] when PAGED
    num_kv, positions, num_sinks, num_splits, window, sm_scale, ring_size,
    KL: tl.constexpr, VL: tl.constexpr,    # keys', values' StreamLayout
    G: tl.constexpr, D: tl.constexpr, PRE_ROPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_X: tl.constexpr,
    STAGES: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    FOLD_K: tl.constexpr, FOLD_V: tl.constexpr,  # metadata folded out of whole tiles
    PACKED: tl.constexpr,                  # 2-bit levels by inline PTX (kernels.packed): a GPU
):
    """Program (b, KV head hk, split): the split-th chunk of the positions sequence b attends to
    (body, then the ring), plus the sink slots and the new token in split 0, for query heads
    hk * G .. hk * G + G - 1. Writes PART (unnormalized) and STATS (running max in log2 units,
    sum). PAGED: position p of the bodies is slot p % PAGE of block BLOCK_TABLE[b, p // PAGE]
    (vLLM's pages); else slot p (p % slots for a ring) of sequence b.

    Whole tiles (phase 0) keep metadata out of the [BN, BLOCK_C] tiles where the layout allows
    (FOLD_K, FOLD_V): per-channel key metadata folded into q once per program (q s . level +
    q . o), value metadata applied to the probabilities or the product. Pre-RoPE keys are
    rotated by R(j), j < BLOCK_N, built once, and q by R(p0)^T once per tile."""
    b, hk, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(LENGTHS + b).to(tl.int32)
    nbk, nbv = tl.load(KS.n_body + b).to(tl.int32), tl.load(VS.n_body + b).to(tl.int32)
    first = tl.where(window > 0, tl.maximum(n - window + 1, 0), 0)  # oldest visible position
    lo = first // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(n - lo, num_splits), BLOCK_N) * BLOCK_N
    lo += split * chunk
    hi = tl.minimum(lo + chunk, n)
    # [lo, both): whole tiles inside both bodies, read without masks; [both, hi): the rest
    both = lo + tl.maximum(tl.minimum(hi, tl.minimum(nbk, nbv)) - lo, 0) // BLOCK_N * BLOCK_N
    kv = b.to(tl.int64) * num_kv + hk  # this (sequence, KV head)
    k_head, v_head = hk, hk  # the body's head row: every head's channels in one for "vector",
    k_base, v_base = hk * 0, hk * 0  # where this head's channels start in its row
    if KL.VEC:
        k_head, k_base = hk * 0, hk * D
    if VL.VEC:
        v_head, v_base = hk * 0, hk * D
    C: tl.constexpr = D // 2
    g = tl.arange(0, BLOCK_G)
    ch = tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_N)
    q_rows = Q + (kv * G + g) * D
    q_mask = (g < G)[:, None] & (ch < C)[None, :]
    q_lo = tl.load(q_rows[:, None] + ch[None, :], mask=q_mask, other=0.0)
    q_hi = tl.load(q_rows[:, None] + C + ch[None, :], mask=q_mask, other=0.0)
    DT: tl.constexpr = Q.dtype.element_ty
    qf_lo, qf_hi = q_lo.to(tl.float32), q_hi.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_lo = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
    # hoisted out of the loop: static metadata, codebook rows, R(j) for j < BLOCK_N
    zero = tl.zeros([BLOCK_C], tl.float32)
    ks_lo, ko_lo, ks_hi, ko_hi, vs_lo, vo_lo, vs_hi, vo_hi = (zero,) * 8
    if KL.GRAN == tiles.STATIC or KL.GRAN == tiles.VECTORS:
        ks_lo, ko_lo = tiles.static_meta(KS, KL, hk, 0, BLOCK_C, C, D)
        ks_hi, ko_hi = tiles.static_meta(KS, KL, hk, C, BLOCK_C, C, D)
    if VL.GRAN == tiles.STATIC or VL.GRAN == tiles.VECTORS:
        vs_lo, vo_lo = tiles.static_meta(VS, VL, hk, 0, BLOCK_C, C, D)
        vs_hi, vo_hi = tiles.static_meta(VS, VL, hk, C, BLOCK_C, C, D)
    qs_lo, qs_hi, q_off = q_lo, q_hi, tl.zeros([BLOCK_G], tl.float32)
    if FOLD_K:  # scores = (q s) . level + q . o
        qs_lo = (qf_lo * ks_lo[None, :]).to(DT)
        qs_hi = (qf_hi * ks_hi[None, :]).to(DT)
        q_off = tl.sum(qf_lo * ko_lo[None, :], axis=1) + tl.sum(qf_hi * ko_hi[None, :], axis=1)
    V_OFFSET: tl.constexpr = not (VL.SYM and (VL.CB or VL.BITS == 1))  # level 0 is not 0
    V_META: tl.constexpr = (1 if VL.GRAN == tiles.TOKEN else 2) if FOLD_V else 0
    k_levels = KS.levels + hk * KL.BOOK  # this head's codebook row
    v_levels = VS.levels + hk * VL.BOOK
    # 2-bit levels as 16-bit tables (a 16-bit cache: LUT): in the dot's dtype for folded whole
    # tiles, else fp16
    LUT: tl.constexpr = DT.primitive_bitwidth == 16
    k_table0 = tiles.table2(k_levels, KL.CB, DT if FOLD_K and LUT else tl.float16)
    k_table1 = tiles.table2(k_levels, KL.CB, tl.float16)
    v_table0 = tiles.table2(v_levels, VL.CB, DT if FOLD_V and LUT else tl.float16)
    v_table1 = tiles.table2(v_levels, VL.CB, tl.float16)
    freq = zero
    cos_j = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    sin_j = cos_j
    if PRE_ROPE:
        freq = tl.load(INV_FREQ + ch, mask=ch < C, other=0.0)
        cos_j, sin_j = tiles.trig(j[:, None].to(tl.float32) * freq[None, :])
    for phase in tl.static_range(2):  # 0: body only; 1: body and ring, in smaller tiles
        start_at = lo if phase == 0 else both
        stop_at = both if phase == 0 else hi
        for start in tl.range(start_at, stop_at, BLOCK_N if phase == 0 else MIXED_N,
                              num_stages=STAGES):  # fmt: skip
            pos = start + tl.arange(0, BLOCK_N if phase == 0 else MIXED_N)
            if phase == 0:  # every position in both bodies and in bounds: no load masks
                sink = tl.load(SINKS.is_sink + b * positions + pos)
                valid = (pos >= first) & (sink == 0)
                k_in = tl.full(pos.shape, 1, tl.int1)
                v_in = k_in
            else:
                sink = tl.load(SINKS.is_sink + b * positions + pos, mask=pos < stop_at, other=1)
                valid = (pos < stop_at) & (pos >= first) & (sink == 0)
                k_in, v_in = valid & (pos < nbk), valid & (pos < nbv)
            if PAGED:  # the sequence's blocks up to its length (all of phase 0's tile)
                page = BLOCK_TABLE + b * table_stride + pos // PAGE
                blk = tl.load(page, mask=pos < stop_at, other=0)
                k_blk, v_blk, k_slot, v_slot = blk, blk, pos % PAGE, pos % PAGE
            else:
                k_blk, v_blk, k_slot, v_slot = b, b, pos, pos
                if KL.RING:  # a ring body (sliding window): position % slots
                    k_slot = pos % KS.slots
                if VL.RING:
                    v_slot = pos % VS.slots
            FK: tl.constexpr = FOLD_K and phase == 0
            FV: tl.constexpr = FOLD_V and phase == 0
            k_lo, k_hi = _stream(KS, KL, k_levels, k_blk, k_head, kv, k_slot, pos, start, valid,
                                 k_in, k_base, ks_lo, ko_lo, ks_hi, ko_hi, ring_size,
                                 pos.shape[0], BLOCK_C, D, phase == 1, FK,
                                 k_table0 if FK else k_table1, DT if FK else tl.float16,
                                 PACKED, LUT)  # fmt: skip
            q1_lo, q1_hi, q2_lo, q2_hi = qs_lo, qs_hi, qf_lo, qf_hi
            in_tile = pos
            if PRE_ROPE:
                if phase == 0:  # q . R(start + j) k = (R(start)^T q) . R(j) k
                    cos_a, sin_a = tiles.trig((start * 1.0) * freq)
                    q2_lo = qf_lo * cos_a[None, :] + qf_hi * sin_a[None, :]
                    q2_hi = qf_hi * cos_a[None, :] - qf_lo * sin_a[None, :]
                    q1_lo, q1_hi = q2_lo.to(DT), q2_hi.to(DT)
                    in_tile = j
                    k_lo, k_hi = tiles.rotate(k_lo, k_hi, cos_j, sin_j)
                else:
                    cos, sin = tiles.trig(pos[:, None].to(tl.float32) * freq[None, :])
                    k_lo, k_hi = tiles.rotate(k_lo, k_hi, cos, sin)
            elif not FK:
                q1_lo, q1_hi = q_lo, q_hi
            s = tl.dot(q1_lo, tl.trans(k_lo.to(DT)), input_precision=PRECISION)
            s += tl.dot(q1_hi, tl.trans(k_hi.to(DT)), input_precision=PRECISION)
            if FK:
                s += q_off[:, None]
            if KL.K > 0:
                s += tiles.slot_scores(KS.slot_index, KS.slot_delta, KS.scale + hk * D, q2_lo,
                                       q2_hi, tiles.at(KS.strides.index, k_blk, k_head, k_slot),
                                       tiles.at(KS.strides.delta, k_blk, k_head, k_slot), k_in,
                                       k_base, in_tile, freq, KL.K, D, PRE_ROPE,
                                       KL.FP8)  # fmt: skip
            s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
            v_lo, v_hi = _stream(VS, VL, v_levels, v_blk, v_head, kv, v_slot, pos, start, valid,
                                 v_in, v_base, vs_lo, vo_lo, vs_hi, vo_hi, ring_size,
                                 pos.shape[0], BLOCK_C, D, phase == 1, FV,
                                 v_table0 if FV else v_table1, DT if FV else tl.float16,
                                 PACKED, LUT)  # fmt: skip
            if VL.K > 0:
                v_lo, v_hi = tiles.slot_values(v_lo, v_hi, VS.slot_index, VS.slot_delta,
                                               VS.scale + hk * D,
                                               tiles.at(VS.strides.index, v_blk, v_head, v_slot),
                                               tiles.at(VS.strides.delta, v_blk, v_head, v_slot),
                                               v_in, v_base, VL.K, D, BLOCK_C,
                                               VL.FP8)  # fmt: skip
            if FV and V_META == 1:  # one metadata group per half row
                w_lo, b_lo = tiles.row_meta(VS, VL, v_blk, v_head, v_slot, v_in, v_base, C)
                w_hi, b_hi = tiles.row_meta(VS, VL, v_blk, v_head, v_slot, v_in, v_base + C, C)
                m_i, l_i, acc_lo, acc_hi = _update(s, v_lo, v_hi, m_i, l_i, acc_lo, acc_hi, DT,
                                                   PRECISION, w_lo, b_lo, w_hi, b_hi, 1,
                                                   V_OFFSET)  # fmt: skip
            elif FV:
                m_i, l_i, acc_lo, acc_hi = _update(s, v_lo, v_hi, m_i, l_i, acc_lo, acc_hi, DT,
                                                   PRECISION, vs_lo, vo_lo, vs_hi, vo_hi, 2,
                                                   V_OFFSET)  # fmt: skip
            else:
                m_i, l_i, acc_lo, acc_hi = _update(s, v_lo, v_hi, m_i, l_i, acc_lo, acc_hi, DT,
                                                   PRECISION)  # fmt: skip
    if split == 0:  # exact extras: x < num_sinks the sink slots, x == num_sinks the new token
        x = tl.arange(0, BLOCK_X)
        is_new = x == num_sinks
        SINK_K = SINKS.k
        SINK_V = SINKS.v
        slot_pos = tl.load(SINKS.positions + b * num_sinks + x, mask=x < num_sinks, other=-1)
        pos = tl.where(is_new, n, slot_pos.to(tl.int32))
        valid = is_new | ((slot_pos >= 0) & (slot_pos < n) & (slot_pos >= first))
        rows = (kv * num_sinks + x)[:, None] * D
        in_slot = (valid & ~is_new)[:, None] & (ch < C)[None, :]
        new = is_new[:, None] & (ch < C)[None, :]
        k_lo = tl.load(SINK_K + rows + ch[None, :], mask=in_slot, other=0.0).to(tl.float32)
        k_lo += tl.load(K_NEW + kv * D + ch[None, :] + x[:, None] * 0, mask=new, other=0.0)
        k_hi = tl.load(SINK_K + rows + C + ch[None, :], mask=in_slot, other=0.0).to(tl.float32)
        k_hi += tl.load(K_NEW + kv * D + C + ch[None, :] + x[:, None] * 0, mask=new, other=0.0)
        if PRE_ROPE:
            cos, sin = tiles.trig(pos[:, None].to(tl.float32) * freq[None, :])
            k_lo, k_hi = tiles.rotate(k_lo, k_hi, cos, sin)
        s = tl.dot(q_lo, tl.trans(k_lo.to(DT)), input_precision=PRECISION)
        s += tl.dot(q_hi, tl.trans(k_hi.to(DT)), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
        v_lo = tl.load(SINK_V + rows + ch[None, :], mask=in_slot, other=0.0).to(tl.float32)
        v_lo += tl.load(V_NEW + kv * D + ch[None, :] + x[:, None] * 0, mask=new, other=0.0)
        v_hi = tl.load(SINK_V + rows + C + ch[None, :], mask=in_slot, other=0.0).to(tl.float32)
        v_hi += tl.load(V_NEW + kv * D + C + ch[None, :] + x[:, None] * 0, mask=new, other=0.0)
        m_i, l_i, acc_lo, acc_hi = _update(s, v_lo, v_hi, m_i, l_i, acc_lo, acc_hi, DT,
                                           PRECISION)  # fmt: skip
    out = (kv * G + g) * num_splits + split  # [BLOCK_G] rows of PART / STATS
    part = PART + out[:, None] * D + ch[None, :]
    tl.store(part, acc_lo, mask=q_mask)
    tl.store(part + C, acc_hi, mask=q_mask)
    tl.store(STATS + out * 2, m_i, mask=g < G)
    tl.store(STATS + out * 2 + 1, l_i, mask=g < G)
# fmt: on


@triton.jit
def _combine_kernel(
    PART, STATS, OUT, num_splits, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s, one query head
    per program (split 0 always holds the new token, so M is finite; empty splits weigh 0)."""
    bh = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    rows = bh * num_splits + s
    m = tl.load(STATS + rows * 2, mask=s < num_splits, other=float("-inf"))
    w = tl.exp2(m - tl.max(m, axis=0))
    l_sum = tl.sum(w * tl.load(STATS + rows * 2 + 1, mask=s < num_splits, other=0.0), axis=0)
    part = tl.load(
        PART + rows[:, None] * D + c[None, :],
        mask=(s < num_splits)[:, None] & (c < D)[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], axis=0) / l_sum
    tl.store(OUT + bh * D + c, out.to(OUT.dtype.element_ty), mask=c < D)


def supports(spec, head_dim: int, kv_heads: int = 1) -> bool:
    """Whether `decode_attention` reads a tensor stored with spec (None: full precision): every
    layout kvcalib's presets and its peers use, vector codes included; odd head widths (a half
    row of codes that does not start on a byte) and non-power-of-two "channel" groups go to the
    reference."""
    if spec is None or spec.layout.kind == Kind.VECTORS:
        return True
    return spec.layout.affine and tiles.readable(spec, head_dim, kv_heads)


class SinkBuffers(NamedTuple):
    """layout.Sinks as the decode kernel reads it (a field may not be named `values` there):
    k, v dtype [B, Hkv, S, D], positions int64 [B, S], is_sink uint8 [B, P]."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    is_sink: torch.Tensor


class Strides(NamedTuple):
    """Element strides (block or sequence, head row, slot) of a body's per-token buffers, as
    `tiles.at` reads them: a contiguous body's, or a page view's (its fields interleaved in
    one row per token). (0, 0, 0) where a buffer is absent or per layer."""

    codes: tuple[int, int, int]
    meta: tuple[int, int, int]
    index: tuple[int, int, int]
    delta: tuple[int, int, int]


class StreamBuffers(NamedTuple):
    """One stream's (keys' or values') tensors and sizes as the decode kernel reads them;
    pointers a layout does not use repeat the codes.

    codes, scale, offset, levels, slot_index, slot_delta  the PackedBody's (codes as int32
                  words when the layout's UNIT is 32), a CodeBody's (levels: its codebook
                  [Hc, E, w]), or the exact body dtype [B, Hkv, S, D];
                  B: sequences, or blocks of a paged body
    tail          dtype [B, Hkv, R, D] the residual ring (B: sequences)
    n_body        int64 [B] body sizes (B: sequences)
    slots         body slots per row (per block when paged), at least 1
    meta_rows     metadata rows of a "channel" body, else 1
    strides       Strides of codes, scale (and offset), slot_index, slot_delta
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    levels: torch.Tensor
    slot_index: torch.Tensor
    slot_delta: torch.Tensor
    tail: torch.Tensor
    n_body: torch.Tensor
    slots: int
    meta_rows: int
    strides: Strides


class StreamLayout(NamedTuple):
    """What the decode kernel compiles for one stream (a constexpr argument: one compiled kernel
    per layout pair).

    BITS    code width (16 for an exact body)
    GRAN    the layout's Kind: tiles.TOKEN, CHANNEL, STATIC, VECTORS or EXACT (left in full
            precision)
    GROUP   channels per group of a row (TOKEN), tokens per group (CHANNEL), channels per
            vector (VECTORS), else 1
    SYM     symmetric levels (no offset)
    CB      codebook levels
    K       exact slots per row
    FP8     the slots' deltas are E4M3 bytes in steps of the static scale (slot_code "fp8")
    VEC     a row joins every KV head ("vector")
    UNIT    bits of one code load (tiles.unit; 8 where a page's rows do not start on a word)
    RING    fewer body slots than positions: a sliding window's ring (never paged)
    BOOK    elements of one KV head's codebook row (0: every head reads the first row)
    PAIRS   VECTORS: a vector is GROUP / 2 RoPE pairs (c, c + D/2), not GROUP adjacent channels
    BYTE    TOKEN: one-byte scale and zero point (metadata_code "byte", layouts.metabyte)
    """

    BITS: int
    GRAN: int
    GROUP: int
    SYM: bool
    CB: bool
    K: int
    FP8: bool
    VEC: bool
    UNIT: int
    RING: bool
    BOOK: int
    PAIRS: bool
    BYTE: bool = False


def _stream_args(stored: Stored, head_dim: int, positions: int, paged: bool):
    """One stream's (StreamBuffers, StreamLayout), from what its body gives the kernel
    (layouts.body's `stream_args`); RING: fewer body slots than `positions` (a paged body holds
    every position in its blocks)."""
    body = as_body(stored.body)
    args, slots = body.stream_args(head_dim, tiles.unit), body.slots
    buffers = StreamBuffers(*args.buffers, stored.tail, stored.n_body, max(slots, 1),
                            args.meta_rows, Strides(*args.strides))  # fmt: skip
    return buffers, StreamLayout(**args.layout, RING=not paged and slots < positions)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(device: torch.device, programs: int, span: int, block_n: int,
               resident: int = 1) -> int:  # fmt: skip
    """Splits per (sequence, KV head): as many programs as the GPU runs at once, `resident` per
    SM (FlashInfer's scheduler: occupancy x SMs, no split when the programs fill it), each at
    least 4 blocks of the longest span a sequence can reach (fixed by capacity, not by
    lengths: a CUDA graph replays one grid)."""
    if device.type != "cuda":
        return 1
    wanted = max(1, resident * _sm_count(device) // max(programs, 1))
    return max(1, min(wanted, triton.cdiv(span, 4 * block_n)))


def resident(regs: int, warps: int, shared: int) -> int:
    """Programs an SM (sm_80/sm_90: 64K registers, 64 warps, 32 blocks, 227 KB of shared
    memory) holds at once, of a kernel using regs registers per thread (allocated 8 at a time,
    per warp), `warps` warps and `shared` bytes."""
    by_regs = 65536 // (triton.cdiv(max(regs, 1), 8) * 8 * 32 * warps)
    by_shared = 232448 // shared if shared else 32
    return max(1, min(by_regs, 64 // warps, 32, by_shared))


_RESIDENT: dict = {}  # (key, config): resident programs per SM, read off the compiled kernel


_TUNED: dict = {}


def _config(key, device: torch.device, launch) -> tuple[int, int, int]:
    """The (BLOCK_N, num_warps, num_stages) of `key`: timed once per key on a GPU (not while a
    CUDA graph is being captured: the first eager step tunes), a fixed one interpreted."""
    if device.type != "cuda":
        return INTERPRETED
    if key in _TUNED:
        return _TUNED[key]
    if torch.cuda.is_current_stream_capturing():
        return CONFIGS[2]
    best = None
    for config in CONFIGS if key[0] <= 128 else [c for c in CONFIGS if c[0] <= 64]:
        launch(config)  # compile and warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            launch(config)
        end.record()
        end.synchronize()
        if best is None or start.elapsed_time(end) < best[0]:
            best = (start.elapsed_time(end), config)
    _TUNED[key] = best[1]
    return best[1]


def _page_size(keys: Stored, values: Stored, block_table, batch: int, window) -> int:
    """The slots per block of paged bodies (vLLM's block_size), after the checks."""
    bodies = [as_body(s.body) for s in (keys, values)]
    sizes, kinds = {b.slots for b in bodies}, [b.kind for b in bodies]
    if block_table.dim() != 2 or block_table.shape[0] != batch or len(sizes) != 1:
        raise ValueError(
            f"decode_attention: block_table {tuple(block_table.shape)} must be [B={batch}, "
            f"blocks] over key and value bodies of one block size (theirs: {sorted(sizes)})"
        )
    if window is not None or Kind.CHANNEL in kinds:
        raise ValueError(
            "decode_attention: pages hold every position of per-token and static layouts: "
            "read a sliding window or a 'channel' body from a contiguous cache"
        )
    return sizes.pop()


def decode_attention(q, k_new, v_new, keys: Stored, values: Stored, sinks: Sinks, lengths, *,
                     inv_freq=None, window: int | None = None, block_table=None):  # fmt: skip
    """Attention of one new token per sequence over the cache and itself.

    q [B, H, 1, D] post-RoPE (rotated, when keys are), in the cache dtype; k_new, v_new
    [B, Hkv, 1, D] the new token's key (in the key domain) and value; lengths int64 [B] on the
    device, tokens stored before the new one; inv_freq float32 [D/2] when keys are stored
    pre-RoPE (RoPE at the position); window: the layer's sliding window, None for global.
    block_table int32 [B, blocks] on the device: the bodies are pages (their B = blocks, N =
    block_size, any strides: `kernels.paged`), position p of sequence b at slot p % N of block
    block_table[b, p // N], read in place; None: contiguous bodies, one sequence a row.
    Returns out [B, H, 1, D] in q's dtype. Launches a fixed grid: nothing read on the host.
    """
    B, H, T, D = q.shape
    hkv = k_new.shape[1]
    if T != 1 or H % hkv or D % 2:
        raise ValueError(
            f"decode_attention takes one query per sequence and even head_dim: {q.shape}"
        )
    G = H // hkv
    q, k_new, v_new = (t.contiguous() for t in (q, k_new, v_new))
    positions = sinks.is_sink.shape[1]
    paged = block_table is not None
    page = _page_size(keys, values, block_table, B, window) if paged else 1
    k_buffers, k_layout = _stream_args(keys, D, positions, paged)
    v_buffers, v_layout = _stream_args(values, D, positions, paged)
    sink_buffers = SinkBuffers(sinks.keys, sinks.values, sinks.positions,
                               sinks.is_sink.view(torch.uint8))  # fmt: skip
    span = min(window or positions, positions)
    num_sinks = sinks.positions.shape[1]
    out = torch.empty_like(q)
    # per-channel key metadata folds into q (post-RoPE); keys' exact slots are scores of their
    # own, values' are added into the tile
    fold_k = inv_freq is None and k_layout.GRAN in (tiles.STATIC.value, tiles.VECTORS.value)
    fold_v = tiles.foldable(v_layout, D // 2) and v_layout.K == 0
    key = (D, G, inv_freq is not None, q.dtype, k_layout, v_layout, page)

    def launch(config):
        block_n, warps, stages = config
        splits = num_splits(q.device, B * hkv, span, block_n, _RESIDENT.get((key, config), 1))
        part = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
        stats = torch.empty(B, H, splits, 2, device=q.device, dtype=torch.float32)
        # fmt: off
        kernel = _decode_split_kernel[(B, hkv, splits)](
            q, k_new, v_new, sink_buffers,
            lengths, inv_freq if inv_freq is not None else part,
            part, stats, k_buffers, v_buffers,
            block_table if paged else lengths, block_table.stride(0) if paged else 0,
            hkv, positions, num_sinks, splits, window or 0, D**-0.5 * LOG2E, keys.tail.shape[2],
            k_layout, v_layout,
            G=G, D=D, PRE_ROPE=inv_freq is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            BLOCK_G=tiles.next_pow2(G), BLOCK_C=max(16, tiles.next_pow2(D // 2)),
            BLOCK_N=block_n, BLOCK_X=max(16, tiles.next_pow2(num_sinks + 1)), STAGES=stages,
            PAGED=paged, PAGE=page, FOLD_K=fold_k, FOLD_V=fold_v,
            PACKED=q.device.type == "cuda", num_warps=warps,
        )
        # fmt: on
        # later launches split by it (Triton returns no kernel where a cache hook compiled it)
        if q.device.type == "cuda" and kernel is not None and (key, config) not in _RESIDENT:
            _RESIDENT[key, config] = resident(kernel.n_regs, warps, kernel.metadata.shared)
        _combine_kernel[(B * H,)](
            part,
            stats,
            out,
            splits,
            D=D,
            BLOCK_S=tiles.next_pow2(splits),
            BLOCK_D=tiles.next_pow2(D),
            num_warps=4,
        )  # fmt: skip

    launch(_config(key, q.device, launch))
    return out
