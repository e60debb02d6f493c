"""The decode kernels (Triton): attention of one new token per sequence over the quantized
cache, dequantization fused; launched by kernels.decode_attention.

    out = softmax(q K^T / sqrt(D)) V,   K, V = [sink slots | body | tail | new token],
    body = offset + scale * level[code] (+ exact slots),  K rotated by RoPE when stored pre-RoPE,
    keys at positions p - W < j <= p only, for a sliding window W

Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"): each program
takes one (sequence, KV head, split) — the G query heads of a KV group share every key it
dequantizes — keeps an online-softmax state (max, sum, acc) over its split of the positions, and
a combine kernel merges the splits. The products are transposed (K q^T, then V^T p): positions
are the MMAs' M rows and the G query heads their N columns (N pads to 8 where M pads to 16, so
G = 4 costs half the MMAs and repeats no operand registers; sm_90 then issues wgmma). The
split count is fixed by the cache's capacity and every length is read on the device, so a step
launches the same grid whatever the lengths: no host synchronization, capturable in a CUDA
graph.

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

import triton
import triton.language as tl

from kvcalib_runtime.kernels import tiles

MIXED_N = tl.constexpr(16)  # rows of a tile that mixes body and ring (a few per sequence)


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
    (tiles.foldable, never with MIXED); table, LDT, PACKED: 2-bit codes' and 3- and 4-bit
    codebooks' levels, by kernels.packed in whole tiles with LUT (not MIXED; tiles.half)."""
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
    """Fold scores s [BN, BLOCK_G] (log2 units, -inf where invalid) and value halves [BN,
    BLOCK_C] into the running max m_i, sum l_i [BLOCK_G] and the unnormalized halves acc
    [BLOCK_C, BLOCK_G] (online softmax; transposed, as the module docstring says). The
    halves are levels whose metadata (w, b per half) is applied outside the [BN, BLOCK_C] tiles:
    META 1, per row (w, b [BN]): the probabilities scaled by w, b a rank-1 term p . b; META 2,
    per channel (w, b [BLOCK_C]): the product scaled by w, b times the probabilities' sum;
    OFFSET: b is not zero."""
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: keep zeros
    p = tl.exp2(s - m_use[None, :])
    alpha = tl.exp2(m_i - m_use)
    p_sum = tl.sum(p, axis=0)
    if META == 1:
        lo = tl.dot(tl.trans(v_lo.to(DT)), (p * w_lo[:, None]).to(DT), input_precision=PRECISION)
        hi = tl.dot(tl.trans(v_hi.to(DT)), (p * w_hi[:, None]).to(DT), input_precision=PRECISION)
        if OFFSET:
            lo += tl.sum(p * b_lo[:, None], axis=0)[None, :]
            hi += tl.sum(p * b_hi[:, None], axis=0)[None, :]
    else:
        pd = p.to(DT)
        lo = tl.dot(tl.trans(v_lo.to(DT)), pd, input_precision=PRECISION)
        hi = tl.dot(tl.trans(v_hi.to(DT)), pd, input_precision=PRECISION)
        if META == 2:
            lo *= w_lo[:, None]
            hi *= w_hi[:, None]
            if OFFSET:
                lo += b_lo[:, None] * p_sum[None, :]
                hi += b_hi[:, None] * p_sum[None, :]
    acc_lo = acc_lo * alpha[None, :] + lo
    acc_hi = acc_hi * alpha[None, :] + hi
    return m_new, l_i * alpha + p_sum, acc_lo, acc_hi


# fmt: off
@triton.jit
def _update_wide(s, v_lo, v_hi, m_i, l_w, acc_lo, acc_hi, o_lo, o_hi, DT: tl.constexpr,
                 PRECISION: tl.constexpr, w_lo=None, b_lo=None, w_hi=None, b_hi=None,
                 META: tl.constexpr = 0, OFFSET: tl.constexpr = False):
    # fmt: on
    """`_update` for whole tiles, with every sum over the tile's positions but the max left
    unreduced: the probabilities' sum l_w and, META 1 with OFFSET, the rank-1 terms o_lo, o_hi
    (p . b) accumulate per (position in the tile, head) [BLOCK_N, BLOCK_G], rescaled with the
    rest, and are summed once after the last whole tile (`_fold_wide`): one reduction across
    the warps per tile (the max) instead of four. META 2's offset is b times the final sum,
    added there too."""
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: keep zeros
    p = tl.exp2(s - m_use[None, :])
    alpha = tl.exp2(m_i - m_use)
    l_w = l_w * alpha[None, :] + p
    if META == 1:
        lo = tl.dot(tl.trans(v_lo.to(DT)), (p * w_lo[:, None]).to(DT), input_precision=PRECISION)
        hi = tl.dot(tl.trans(v_hi.to(DT)), (p * w_hi[:, None]).to(DT), input_precision=PRECISION)
        if OFFSET:
            o_lo = o_lo * alpha[None, :] + p * b_lo[:, None]
            o_hi = o_hi * alpha[None, :] + p * b_hi[:, None]
    else:
        pd = p.to(DT)
        lo = tl.dot(tl.trans(v_lo.to(DT)), pd, input_precision=PRECISION)
        hi = tl.dot(tl.trans(v_hi.to(DT)), pd, input_precision=PRECISION)
        if META == 2:
            lo *= w_lo[:, None]
            hi *= w_hi[:, None]
    acc_lo = acc_lo * alpha[None, :] + lo
    acc_hi = acc_hi * alpha[None, :] + hi
    return m_new, l_w, acc_lo, acc_hi, o_lo, o_hi


@triton.jit
def _fold_wide(l_i, acc_lo, acc_hi, l_w, o_lo, o_hi, b_lo, b_hi, m_was, m_i, META: tl.constexpr,
               OFFSET: tl.constexpr):
    """The whole tiles' unreduced sums (`_update_wide`) into l_i and acc, at their max m_i:
    l_i, the sum before them at max m_was, rescaled by what the loop scaled acc by (its alphas'
    product, 2^(m_was - m_i) with -inf read as 0 as `_update` reads it)."""
    l_i *= tl.exp2(tl.where(m_was == float("-inf"), 0.0, m_was) -
                   tl.where(m_i == float("-inf"), 0.0, m_i))  # fmt: skip
    l_sum = tl.sum(l_w, axis=0)
    if META == 1 and OFFSET:
        acc_lo += tl.sum(o_lo, axis=0)[None, :]
        acc_hi += tl.sum(o_hi, axis=0)[None, :]
    if META == 2 and OFFSET:
        acc_lo += b_lo[:, None] * l_sum[None, :]
        acc_hi += b_hi[:, None] * l_sum[None, :]
    return l_i + l_sum, acc_lo, acc_hi


# fmt: off
@triton.jit
def _decode_split_kernel(
    Q, K_NEW, V_NEW,                       # [B, H, D], [B, Hkv, D], [B, Hkv, D]
    SINKS,                                 # SinkBuffers
    LENGTHS, INV_FREQ,                     # int64 [B], float32 [D/2]
    PART, STATS,                           # float32 [B, H, splits, D], [B, H, splits, 2]
    KS, VS,                                # keys', values' StreamBuffers
    BLOCK_TABLE, table_stride,             # int32 [B, blocks per sequence] when PAGED
    num_kv, positions, num_sinks, num_splits, split_rows, window, sm_scale, ring_size,
    KL: tl.constexpr, VL: tl.constexpr,    # keys', values' StreamLayout
    G: tl.constexpr, D: tl.constexpr, PRE_ROPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_X: tl.constexpr,
    STAGES: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    FOLD_K: tl.constexpr, FOLD_V: tl.constexpr,  # metadata folded out of whole tiles
    PACKED: tl.constexpr,                  # 2-4-bit levels by inline PTX (kernels.packed): a GPU
    WHOLE: tl.constexpr = 0,               # > 0: both bodies' WHOLE-position tiles are read by
):                                         # kernels.decode_gluon, this kernel what follows
    """Program (b, KV head hk, split): the split-th chunk of the positions sequence b attends to
    (body, then the ring), plus the sink slots and the new token in split 0, for query heads
    hk * G .. hk * G + G - 1. Writes PART (unnormalized) and STATS (running max in log2 units,
    sum), split_rows splits a head (the Gluon kernel's after num_splits). PAGED: position p of
    the bodies is slot p % PAGE of block BLOCK_TABLE[b, p // PAGE] (vLLM's pages); else slot p
    (p % slots for a ring) of sequence b.

    Whole tiles (phase 0) keep metadata out of the [BN, BLOCK_C] tiles where the layout allows
    (FOLD_K, FOLD_V): per-channel key metadata folded into q once per program (q s . level +
    q . o), value metadata applied to the probabilities or the product; sums over a tile's
    positions left unreduced until the last tile (`_update_wide`). Pre-RoPE keys are rotated
    by R(j), j < BLOCK_N, built once (static keys in the dot's 16-bit dtype: packed half2
    arithmetic), and q by R(p0)^T once per tile, R(p0) by angle addition (no trig in the
    loop)."""
    b, hk, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(LENGTHS + b).to(tl.int32)
    nbk, nbv = tl.load(KS.n_body + b).to(tl.int32), tl.load(VS.n_body + b).to(tl.int32)
    first = tl.where(window > 0, tl.maximum(n - window + 1, 0), 0)  # oldest visible position
    lo = first // BLOCK_N * BLOCK_N
    if WHOLE:  # no window: the whole tiles of both bodies were read by kernels.decode_gluon
        lo = tl.minimum(nbk, nbv) // WHOLE * WHOLE
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
    acc_lo = tl.zeros([BLOCK_C, BLOCK_G], tl.float32)  # transposed: channels x query heads
    acc_hi = tl.zeros([BLOCK_C, BLOCK_G], tl.float32)
    # whole tiles' sums over their positions, left unreduced until the last (_update_wide)
    l_w = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    o_lo, o_hi = l_w, l_w
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
    # 2-bit levels, and 3- and 4-bit codebooks', as 16-bit tables (a 16-bit cache: LUT;
    # tiles.level_table): in the dot's dtype for folded whole tiles, else fp16
    LUT: tl.constexpr = DT.primitive_bitwidth == 16
    # pre-RoPE static keys in whole tiles: levels, metadata and rotation in the dot's 16-bit
    # dtype (packed half2 arithmetic), not fp32
    HALF_ROPE: tl.constexpr = PRE_ROPE and LUT and KL.GRAN == tiles.STATIC
    k_table0 = tiles.level_table(k_levels, KL.BITS, KL.CB,
                           DT if (FOLD_K or HALF_ROPE) and LUT else tl.float16)  # fmt: skip
    k_table1 = tiles.level_table(k_levels, KL.BITS, KL.CB, tl.float16)
    v_table0 = tiles.level_table(v_levels, VL.BITS, VL.CB, DT if FOLD_V and LUT else tl.float16)
    v_table1 = tiles.level_table(v_levels, VL.BITS, VL.CB, tl.float16)
    freq = zero
    RT: tl.constexpr = DT if HALF_ROPE else tl.float32  # R(j)'s dtype
    cos_j = tl.zeros([BLOCK_N, BLOCK_C], RT)
    sin_j = cos_j
    if PRE_ROPE:
        freq = tl.load(INV_FREQ + ch, mask=ch < C, other=0.0)
        cos_j, sin_j = tiles.trig(j[:, None].to(tl.float32) * freq[None, :])
        cos_j, sin_j = cos_j.to(RT), sin_j.to(RT)
    # R(start) of each whole tile by angle addition from R(lo), R(BLOCK_N) a step: no trig in
    # the loop
    cos_a, sin_a, cos_b, sin_b = zero, zero, zero, zero
    if PRE_ROPE:
        cos_a, sin_a = tiles.trig((lo * 1.0) * freq)
        cos_b, sin_b = tiles.trig((BLOCK_N * 1.0) * freq)
    hks_lo, hko_lo, hks_hi, hko_hi = ks_lo.to(DT), ko_lo.to(DT), ks_hi.to(DT), ko_hi.to(DT)
    # 1: body and ring, in smaller tiles (a few per sequence); 0: whole tiles of both bodies.
    # The mixed tiles first: the whole tiles' loop then hands its state to no other loop, whose
    # layouts Triton would carry into it (in the other order it computes each tile's max twice,
    # once in the mixed loop's layout; kernel_budget reads the difference)
    for phase in tl.static_range(1, -1, -1):
        m_mixed = m_i  # phase 0: the mixed tiles' max, l_i's scale until _fold_wide
        start_at = lo if phase == 0 else both
        stop_at = both if phase == 0 else hi
        for start in tl.range(start_at, stop_at, BLOCK_N if phase == 0 else MIXED_N,
                              num_stages=STAGES):  # fmt: skip
            pos = start + tl.arange(0, BLOCK_N if phase == 0 else MIXED_N)
            if phase == 0:  # every position in both bodies and in bounds: no load masks
                sink = tl.load(SINKS.is_sink + b * positions + pos)  # budget: steady loop
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
            HR: tl.constexpr = HALF_ROPE and phase == 0
            FV: tl.constexpr = FOLD_V and phase == 0
            k_lo, k_hi = _stream(KS, KL, k_levels, k_blk, k_head, kv, k_slot, pos, start, valid,
                                 k_in, k_base, ks_lo, ko_lo, ks_hi, ko_hi, ring_size,
                                 pos.shape[0], BLOCK_C, D, phase == 1, FK or HR,
                                 k_table0 if FK or HR else k_table1,
                                 DT if FK or HR else tl.float16, PACKED, LUT)  # fmt: skip
            if HR:  # levels (in DT from either code read), then x s + o in DT
                k_lo = k_lo.to(DT) * hks_lo[None, :] + hko_lo[None, :]
                k_hi = k_hi.to(DT) * hks_hi[None, :] + hko_hi[None, :]
            q1_lo, q1_hi, q2_lo, q2_hi = qs_lo, qs_hi, qf_lo, qf_hi
            in_tile = pos
            if PRE_ROPE:
                if phase == 0:  # q . R(start + j) k = (R(start)^T q) . R(j) k
                    q2_lo = qf_lo * cos_a[None, :] + qf_hi * sin_a[None, :]
                    q2_hi = qf_hi * cos_a[None, :] - qf_lo * sin_a[None, :]
                    q1_lo, q1_hi = q2_lo.to(DT), q2_hi.to(DT)
                    in_tile = j
                    k_lo, k_hi = tiles.rotate(k_lo, k_hi, cos_j, sin_j)
                    cos_a, sin_a = (cos_a * cos_b - sin_a * sin_b,
                                    sin_a * cos_b + cos_a * sin_b)  # fmt: skip
                else:
                    cos, sin = tiles.trig(pos[:, None].to(tl.float32) * freq[None, :])
                    k_lo, k_hi = tiles.rotate(k_lo, k_hi, cos, sin)
            elif not FK:
                q1_lo, q1_hi = q_lo, q_hi
            s = tl.dot(k_lo.to(DT), tl.trans(q1_lo), input_precision=PRECISION)
            s += tl.dot(k_hi.to(DT), tl.trans(q1_hi), input_precision=PRECISION)
            if FK:
                s += q_off[None, :]
            if KL.K > 0:
                s += tiles.slot_scores(KS.slot_index, KS.slot_delta, KS.scale + hk * D, q2_lo,
                                       q2_hi, tiles.at(KS.strides.index, k_blk, k_head, k_slot),
                                       tiles.at(KS.strides.delta, k_blk, k_head, k_slot), k_in,
                                       k_base, in_tile, freq, KL.K, D, PRE_ROPE,
                                       KL.FP8, PACKED)  # fmt: skip
            s = tl.where(valid[:, None], s * sm_scale, float("-inf"))
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
                m_i, l_w, acc_lo, acc_hi, o_lo, o_hi = _update_wide(
                    s, v_lo, v_hi, m_i, l_w, acc_lo, acc_hi, o_lo, o_hi, DT, PRECISION, w_lo,
                    b_lo, w_hi, b_hi, 1, V_OFFSET)  # fmt: skip
            elif phase == 0:
                m_i, l_w, acc_lo, acc_hi, o_lo, o_hi = _update_wide(
                    s, v_lo, v_hi, m_i, l_w, acc_lo, acc_hi, o_lo, o_hi, DT, PRECISION, vs_lo,
                    vo_lo, vs_hi, vo_hi, V_META, V_OFFSET)  # fmt: skip
            else:
                m_i, l_i, acc_lo, acc_hi = _update(s, v_lo, v_hi, m_i, l_i, acc_lo, acc_hi, DT,
                                                   PRECISION)  # fmt: skip
        if phase == 0:
            l_i, acc_lo, acc_hi = _fold_wide(l_i, acc_lo, acc_hi, l_w, o_lo, o_hi, vo_lo, vo_hi,
                                             m_mixed, m_i, V_META, V_OFFSET)  # fmt: skip
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
        s = tl.dot(k_lo.to(DT), tl.trans(q_lo), input_precision=PRECISION)
        s += tl.dot(k_hi.to(DT), tl.trans(q_hi), input_precision=PRECISION)
        s = tl.where(valid[:, None], s * sm_scale, float("-inf"))
        v_lo = tl.load(SINK_V + rows + ch[None, :], mask=in_slot, other=0.0).to(tl.float32)
        v_lo += tl.load(V_NEW + kv * D + ch[None, :] + x[:, None] * 0, mask=new, other=0.0)
        v_hi = tl.load(SINK_V + rows + C + ch[None, :], mask=in_slot, other=0.0).to(tl.float32)
        v_hi += tl.load(V_NEW + kv * D + C + ch[None, :] + x[:, None] * 0, mask=new, other=0.0)
        m_i, l_i, acc_lo, acc_hi = _update(s, v_lo, v_hi, m_i, l_i, acc_lo, acc_hi, DT,
                                           PRECISION)  # fmt: skip
    out = (kv * G + g) * split_rows + split  # [BLOCK_G] rows of PART / STATS
    part = PART + out[None, :] * D + ch[:, None]
    tl.store(part, acc_lo, mask=tl.trans(q_mask))
    tl.store(part + C, acc_hi, mask=tl.trans(q_mask))
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
