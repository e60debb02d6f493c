"""Decode attention over the quantized cache: one new token per sequence, dequantization fused.

    out = softmax(q K^T / sqrt(D)) V,   K, V = [sink slots | body | tail | new token],
    body = offset + scale * level[code],  K rotated by RoPE in-kernel when stored pre-RoPE

Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"): each program
takes one (sequence, KV head, split) — the G query heads of a KV group share every key it
dequantizes — keeps an online-softmax state (max, sum, acc) over its split of the positions,
and a combine kernel merges the splits. Lengths are runtime values, so no length recompiles.

Keys and values are read each as its own scheme says — "token", "channel" or "static"
groups, uniform or codebook levels, asymmetric or symmetric, 2/3/4/8 bits, or left exact — up
to its own body boundary (key and value flushes may differ); keys pre-RoPE (rotated here, at
their position) or post-RoPE (and Hadamard-rotated: the caller rotates q). Kept outliers are
not read: `supports` says no, and the cache takes its reference path.

The reference is the cache's own reference path (`QuantizedCache._gather` + `_attention`),
which is also the CPU fallback; the tests compare the two.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from kvcalib_runtime.kernels.layout import PackedBody, Sinks, Stored
from kvcalib_runtime.kernels.quant_pack import GRANULARITY, ROUNDING

# GRAN of a stream left in full precision: its "codes" are the values themselves
EXACT = tl.constexpr(3)
LOG2E = 1.4426950408889634
INV_TWO_PI = tl.constexpr(0.5 / math.pi)
TWO_PI_HI = tl.constexpr(float(torch.tensor(2 * math.pi, dtype=torch.float32)))  # + LO = 2 pi
TWO_PI_LO = tl.constexpr(float(torch.tensor(2 * math.pi - TWO_PI_HI.value, dtype=torch.float32)))


# fmt: off
@triton.jit
def _load(BODY, SCALE, OFFSET, LEVELS, TAIL, row, h, pos, ch, live, nb, N, meta_rows, ring,
          D: tl.constexpr, BITS: tl.constexpr, GRAN: tl.constexpr, GROUP: tl.constexpr,
          SYMMETRIC: tl.constexpr, CODEBOOK: tl.constexpr, MIXED: tl.constexpr):
    # fmt: on
    """Keys or values at positions pos [BN, 1], channels ch [1, BC] (where `live`): fp32.

    Positions below nb come from the body, x = offset + scale * level[code]; with MIXED, the
    others from the tail ring (slot pos % ring). Code j of a row sits at bits [j*b, (j+1)*b).
    BODY holds the codes, or the values themselves when GRAN == EXACT.
    """
    in_body = live & (pos < nb)
    if GRAN == EXACT:
        x = tl.load(BODY + row * N * D + (pos * D + ch), mask=in_body, other=0.0).to(tl.float32)
    else:
        PB: tl.constexpr = (D * BITS + 7) // 8
        codes = BODY + row * N * PB  # this (sequence, head)'s rows; int32 offsets below
        bit = ch * BITS
        byte = tl.load(codes + (pos * PB + bit // 8), mask=in_body, other=0).to(tl.int32)
        if 8 % BITS != 0:  # a 3-bit code may straddle two bytes
            after = bit // 8 + 1
            nxt = tl.load(codes + (pos * PB + after), mask=in_body & (after < PB), other=0)
            byte |= nxt.to(tl.int32) << 8
        code = (byte >> (bit % 8)) & (2**BITS - 1)
        if CODEBOOK:
            level = tl.load(LEVELS + h * 2**BITS + code, mask=in_body, other=0.0)
        elif SYMMETRIC:
            level = (code - (2 ** (BITS - 1) - 1)).to(tl.float32)
        else:
            level = code.to(tl.float32)
        if GRAN == 0:  # token: [.., N, D / GROUP]; one scale per row when GROUP == D
            meta = row * N * (D // GROUP) + (pos * (D // GROUP) + (ch // GROUP if GROUP < D else 0))
            meta_mask = in_body if GROUP < D else pos < nb
        elif GRAN == 1:  # channel: [.., ceil(N / GROUP), D]
            meta = row * meta_rows * D + ((pos // GROUP) * D + ch)
            meta_mask = in_body
        else:  # static: [Hkv, D], one per channel
            meta = h * D + ch
            meta_mask = ch < D
        x = level * tl.load(SCALE + meta, mask=meta_mask, other=0.0).to(tl.float32)
        if not SYMMETRIC:
            x += tl.load(OFFSET + meta, mask=meta_mask, other=0.0).to(tl.float32)
    if MIXED:
        in_tail = live & (pos >= nb)
        tail = tl.load(TAIL + row * ring * D + ((pos % ring) * D + ch), mask=in_tail, other=0.0)
        x = tl.where(pos < nb, x, tail.to(tl.float32))
    return x


# fmt: off
@triton.jit
def _scores(q_lo, q_hi, k_lo, k_hi, pos, valid, INV_FREQ, ch, sm_scale, D: tl.constexpr,
            PRE_ROPE: tl.constexpr, PRECISION: tl.constexpr):
    # fmt: on
    """Scores [BLOCK_G, BN] (log2 units, -inf where not valid) of the G query heads against keys
    given as channel halves k_lo, k_hi [BN, D/2] fp32 at positions pos [BN]."""
    if PRE_ROPE:  # rope(k) = k * cos + rotate_half(k) * sin, rotate_half([a, b]) = [-b, a]
        freq = tl.load(INV_FREQ + ch, mask=ch < D // 2, other=0.0)
        angle = pos[:, None].to(tl.float32) * freq[None, :]  # the fp32 angle Rope computes
        turns = (angle * INV_TWO_PI + ROUNDING) - ROUNDING  # reduced to [-pi, pi] (Cody-Waite)
        angle = tl.fma(-turns, TWO_PI_LO, tl.fma(-turns, TWO_PI_HI, angle))
        cos, sin = tl.cos(angle), tl.sin(angle)
        k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
    dt = q_lo.dtype
    s = tl.dot(q_lo, tl.trans(k_lo.to(dt)), input_precision=PRECISION)
    s += tl.dot(q_hi, tl.trans(k_hi.to(dt)), input_precision=PRECISION)
    return tl.where(valid[None, :], s * sm_scale, float("-inf"))


@triton.jit
def _softmax_update(s, v, m_i, l_i, acc, DT: tl.constexpr, PRECISION: tl.constexpr):
    """Fold scores s [BLOCK_G, BN] and values v [BN, D] into the running max m_i, sum l_i and
    unnormalized output acc [BLOCK_G, D] (online softmax, base 2; the dot in dtype DT)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: keep zeros
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    acc = acc * alpha[:, None] + tl.dot(p.to(DT), v.to(DT), input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


# fmt: off
@triton.jit
def _decode_split_kernel(
    Q, K_NEW, V_NEW,                       # [B, H, D], [B, Hkv, D], [B, Hkv, D]
    SINK_K, SINK_V, SINK_POS, IS_SINK,     # [B, Hkv, S, D] x 2, int32 [B, S], uint8 [B, N]
    LENGTHS, K_NB, V_NB, INV_FREQ,         # int32 [B] x 3, float32 [D/2]
    PART, STATS,                           # float32 [B, H, splits, D], [B, H, splits, 2]
    KC, KS, KO, KL, KT,                    # keys: body, scale, offset, levels, tail
    VC, VS, VO, VL, VT,                    # values: the same
    num_heads, N, k_meta_rows, v_meta_rows, ring, num_slots, chunk, num_splits, sm_scale,
    G: tl.constexpr, D: tl.constexpr, NUM_SINKS: tl.constexpr, PRE_ROPE: tl.constexpr,
    PRECISION: tl.constexpr,
    K_BITS: tl.constexpr, K_GRAN: tl.constexpr, K_GROUP: tl.constexpr, K_SYM: tl.constexpr,
    K_CB: tl.constexpr,
    V_BITS: tl.constexpr, V_GRAN: tl.constexpr, V_GROUP: tl.constexpr, V_SYM: tl.constexpr,
    V_CB: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    """Program (b, KV head hk, split): positions [split * chunk, (split + 1) * chunk) of sequence
    b (body, then the tail), plus the sink slots and the new token in split 0, for query heads
    hk * G .. hk * G + G - 1. Writes PART [B, H, splits, D] (unnormalized) and STATS
    [B, H, splits, 2] (running max in log2 units, sum)."""
    b, hk, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, nbk, nbv = tl.load(LENGTHS + b), tl.load(K_NB + b), tl.load(V_NB + b)
    row = b.to(tl.int64) * num_heads + hk
    g = tl.arange(0, BLOCK_G)
    ch = tl.arange(0, BLOCK_H)  # one half of the channels (RoPE pairs c with c + D/2)
    cv = tl.arange(0, BLOCK_D)
    half = (ch < D // 2)[None, :]
    q_ptr = Q + (row * G + g)[:, None] * D + ch[None, :]
    q_lo = tl.load(q_ptr, mask=(g < G)[:, None] & half, other=0.0)
    q_hi = tl.load(q_ptr + D // 2, mask=(g < G)[:, None] & half, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)
    both = tl.maximum(tl.minimum(hi, tl.minimum(nbk, nbv)), lo)  # [lo, both): body only
    for phase in tl.static_range(2):
        first = lo if phase == 0 else both
        last = both if phase == 0 else hi
        for start in range(first, last, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            sink = tl.load(IS_SINK + b * N + pos, mask=pos < last, other=1)
            valid = (pos < last) & (sink == 0)  # a sink is read from its slot, not the body
            k_lo = _load(KC, KS, KO, KL, KT, row, hk, pos[:, None], ch[None, :],
                         valid[:, None] & half, nbk, N, k_meta_rows, ring,
                         D, K_BITS, K_GRAN, K_GROUP, K_SYM, K_CB, phase == 1)
            k_hi = _load(KC, KS, KO, KL, KT, row, hk, pos[:, None], ch[None, :] + D // 2,
                         valid[:, None] & half, nbk, N, k_meta_rows, ring,
                         D, K_BITS, K_GRAN, K_GROUP, K_SYM, K_CB, phase == 1)
            s = _scores(q_lo, q_hi, k_lo, k_hi, pos, valid, INV_FREQ, ch, sm_scale, D, PRE_ROPE,
                        PRECISION)
            v = _load(VC, VS, VO, VL, VT, row, hk, pos[:, None], cv[None, :],
                      valid[:, None] & (cv < D)[None, :], nbv, N, v_meta_rows, ring,
                      D, V_BITS, V_GRAN, V_GROUP, V_SYM, V_CB, phase == 1)
            m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, Q.dtype.element_ty, PRECISION)
    if split == 0:  # exact extras: x < NUM_SINKS are the sink slots, x == NUM_SINKS the new token
        x = tl.arange(0, BLOCK_X)
        is_new = x == NUM_SINKS
        slot_pos = tl.load(SINK_POS + b * num_slots + x, mask=x < NUM_SINKS, other=-1)
        pos = tl.where(is_new, n, slot_pos)
        valid = is_new | ((slot_pos >= 0) & (slot_pos < n))
        slot = (row * num_slots + x)[:, None] * D
        in_slot = (valid & ~is_new)[:, None]
        new = K_NEW + row * D + x[:, None] * 0  # every row points at the new token
        k_lo = tl.load(SINK_K + slot + ch[None, :], mask=in_slot & half, other=0.0)
        k_lo += tl.load(new + ch[None, :], mask=is_new[:, None] & half, other=0.0)
        k_hi = tl.load(SINK_K + slot + D // 2 + ch[None, :], mask=in_slot & half, other=0.0)
        k_hi += tl.load(new + D // 2 + ch[None, :], mask=is_new[:, None] & half, other=0.0)
        s = _scores(q_lo, q_hi, k_lo.to(tl.float32), k_hi.to(tl.float32), pos, valid, INV_FREQ,
                    ch, sm_scale, D, PRE_ROPE, PRECISION)
        v = tl.load(SINK_V + slot + cv[None, :], mask=in_slot & (cv < D)[None, :], other=0.0)
        new = V_NEW + row * D + x[:, None] * 0
        v += tl.load(new + cv[None, :], mask=is_new[:, None] & (cv < D)[None, :], other=0.0)
        m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, Q.dtype.element_ty, PRECISION)
    out = (row * G + g) * num_splits + split  # [BLOCK_G] rows of PART / STATS
    tl.store(PART + out[:, None] * D + cv[None, :], acc, mask=(g < G)[:, None] & (cv < D)[None, :])
    tl.store(STATS + out * 2, m_i, mask=g < G)
    tl.store(STATS + out * 2 + 1, l_i, mask=g < G)
# fmt: on


@triton.jit
def _combine_kernel(
    PART, STATS, OUT, num_splits, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s, one query head
    per program (split 0 always holds the new token, so M is finite)."""
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


def supports(spec) -> bool:
    """Whether `decode_attention` reads a tensor stored with spec (None: full precision)."""
    return spec is None or (spec.outliers == 0 and spec.granularity != "vector")


def _stream_args(stored: Stored, name: str) -> tuple[list, int, dict]:
    """One stream's pointers (body, scale, offset, levels, tail; unused ones repeat the body),
    metadata rows (channel groups) and constexprs, prefixed `name`."""
    body = stored.body
    if not isinstance(body, PackedBody):
        flags = dict(BITS=8, GRAN=EXACT.value, GROUP=1, SYM=True, CB=False)
        return [body] * 4 + [stored.tail], 0, {f"{name}_{k}": v for k, v in flags.items()}
    spec = body.spec
    group = spec.group_size if spec.granularity == "channel" else 1
    if spec.granularity == "token":
        group = spec.channel_group(body.head_dim)
    pointers = [body.codes, body.scale, body.offset, body.levels, stored.tail]
    pointers = [t if t is not None else body.codes for t in pointers]
    meta_rows = body.scale.shape[2] if spec.granularity == "channel" else 0
    flags = dict(
        BITS=spec.bits,
        GRAN=GRANULARITY[spec.granularity],
        GROUP=group,
        SYM=spec.symmetric,
        CB=spec.codebook,
    )
    return pointers, meta_rows, {f"{name}_{k}": v for k, v in flags.items()}


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(q: torch.Tensor, longest: int, programs: int, block_n: int) -> int:
    """Enough (sequence, head, split) programs to fill the GPU twice, each at least 4 blocks."""
    if q.device.type != "cuda":
        return 1
    wanted = max(1, 2 * _sm_count(q.device) // max(programs, 1))
    return max(1, min(wanted, triton.cdiv(longest, 4 * block_n)))


def decode_attention(
    q,
    k_new,
    v_new,
    keys: Stored,
    values: Stored,
    sinks: Sinks,
    lengths,
    longest: int,
    *,
    inv_freq=None,
):
    """Attention of one new token per sequence over the cache and itself.

    q [B, H, 1, D] post-RoPE (rotated, when keys are), in the cache dtype; k_new, v_new
    [B, Hkv, 1, D] the new token's key (in the key domain) and value; lengths int32 [B] on the
    device, tokens stored before the new one; longest = max(lengths) (host int, sizes the
    splits); inv_freq float32 [D/2] when keys are stored pre-RoPE (RoPE at the position).
    Returns out [B, H, 1, D] in q's dtype.
    """
    B, H, T, D = q.shape
    hkv = k_new.shape[1]
    if T != 1 or H % hkv or D % 2:
        raise ValueError(
            f"decode_attention takes one query per sequence and even head_dim: {q.shape}"
        )
    G = H // hkv
    # sm_90 register budget at 8 warps: no spills with 32 positions a step, 16 with RoPE
    block_n = 16 if inv_freq is not None or D > 128 else 32
    splits = _num_splits(q, longest, B * hkv, block_n)
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(longest, 1), splits), block_n) * block_n)
    q, k_new, v_new = (t.contiguous() for t in (q, k_new, v_new))
    part = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
    stats = torch.empty(B, H, splits, 2, device=q.device, dtype=torch.float32)
    k_ptrs, k_rows, k_flags = _stream_args(keys, "K")
    v_ptrs, v_rows, v_flags = _stream_args(values, "V")
    num_sinks = sinks.positions.shape[1]
    # fmt: off
    _decode_split_kernel[(B, hkv, splits)](
        q, k_new, v_new,
        sinks.keys, sinks.values, sinks.positions, sinks.is_sink.view(torch.uint8),
        lengths, keys.n_body, values.n_body, inv_freq if inv_freq is not None else part,
        part, stats,
        *k_ptrs,
        *v_ptrs,
        hkv, sinks.is_sink.shape[1], k_rows, v_rows, keys.tail.shape[2], num_sinks, chunk, splits,
        D**-0.5 * LOG2E,
        G=G, D=D, NUM_SINKS=num_sinks, PRE_ROPE=inv_freq is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **k_flags,
        **v_flags,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_H=max(16, triton.next_power_of_2(D // 2)),
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_N=block_n,
        BLOCK_X=max(16, triton.next_power_of_2(num_sinks + 1)), num_warps=8,
    )
    # fmt: on
    out = torch.empty_like(q)
    _combine_kernel[(B * H,)](
        part,
        stats,
        out,
        splits,
        D=D,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,
    )
    return out
