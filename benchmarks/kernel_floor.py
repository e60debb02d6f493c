"""The decode loop's floor in each formulation, read on a CPU (issue 51): what a whole-tile loop
of kvcalib-2's key and value reads costs per (position x KV head) at 32/8/128 on sm_90, before
and with kvcalib-2's features.

    python benchmarks/kernel_floor.py --out benchmarks/kernel_budget/floor.json  # kernel-floor

Every row does the same work per tile of 64 positions (G = 4 query heads a KV head, D = 128,
fp16): 2-bit key and value words decoded to fp16 levels by the byte-permute table
(kernels.packed), scores, an online softmax whose probabilities are scaled per position (a
"token" value scale) with a rank-1 offset term, and p . v. Keys after RoPE.

  triton          the decode kernel's formulation in Triton: `packed.levels` tiles [BN, D/2] (a
                  thread holds a word's 16 channels), K q^T and V^T p with positions as the
                  products' M rows, 4 warps sharing one softmax state. Triton converts each
                  decoded tile to the dot's operand layout through shared memory (STS, LDSM),
                  repacks the table's 16-bit outputs (PRMT) and re-stores q for wgmma each tile.
  gluon           the same work in Gluon with the layouts written out: each warp an independent
                  split of 16 positions (its own softmax state, merged once after the loop),
                  mma.sync with positions as the scores' M rows (K q^T) and channels as the
                  output's (V^T p). Every thread decodes exactly the words its A-operand
                  fragments hold: keys, words 2i, 2i + 1 of positions r, r + 8 (lane = 4r + i),
                  the K index relabeled to the codes' order (`key_channel`: q is read in that
                  order once); values, word r of positions 2i, 2i + 1, 2i + 8, 2i + 9, two
                  positions' codes interleaved into one selector so that each permute gives the
                  (position, position + 1) pair a register holds, the output rows relabeled
                  (`value_channel`, undone by the store). The probabilities reach the B operand
                  by one movmatrix transpose per 8 x 8 half. No shared memory in the loop.
  gluon+features  with kvcalib-2's per-position work added as its cache stores it today: one
                  exact key slot (index and E4M3 delta bytes, q times the step gathered from a
                  per-program table in L1), the sink mask (one byte), the folded keys' constant
                  term, one-byte value scale and zero point decoded.
  gluon+features, pre-RoPE
                  keys stored before RoPE, as kvcalib-2 stores them: each thread holds a
                  channel and its RoPE partner (words i, i + 4: `key_channel(k, True)`), the
                  decoded keys rotated by R(j) (j < 64, a table built once, half2 arithmetic),
                  q by R(start)^T each tile (angle addition, then to every warp through shared
                  memory), the slot's q rotated by its absolute position (the SFU's cos, sin).

Not in any row: the cp.async pipeline of the code words (plain loads here), the per-program
setup, the tiles where body meets ring. tests/runtime/kernels/test_kernel_floor.py executes the
Gluon rows' inline PTX on the CPU, every register of every lane against the plain decode of
the channel the other operand reads there. Per position = the SASS loop's instructions x warps
/ 64 (kernel_budget's rule). Triton internals are read, so its version is pinned as
kernel_budget pins it.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_read as read
import kernel_budget

from kvcalib_runtime.kernels import packed, tiles
from kvcalib_runtime.layouts import metabyte

G, D, BN, WARPS = 4, 128, 64, 4
FORMULATIONS = ("triton", "gluon", "gluon+features", "gluon+features, pre-RoPE")
SCALE_BASE = gl.constexpr(metabyte.BASE)  # one-byte value scales (layouts.metabyte)


@triton.jit
def _triton_loop(Q, KC, VC, W, B, OUT, n, T, G: tl.constexpr, D: tl.constexpr,
                 BN: tl.constexpr):  # fmt: skip
    C: tl.constexpr = D // 2
    BG: tl.constexpr = 8
    ch = tl.arange(0, C)
    j = tl.arange(0, BN)
    g = tl.arange(0, BG)
    lo, hi = tl.load(T), tl.load(T + 1)
    live = j >= 0
    q_lo = tl.load(Q + g[:, None] * D + ch[None, :], mask=(g < G)[:, None], other=0.0)
    q_hi = tl.load(Q + g[:, None] * D + C + ch[None, :], mask=(g < G)[:, None], other=0.0)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_w = tl.zeros([BN, BG], tl.float32)
    o_w = tl.zeros([BN, BG], tl.float32)
    acc_lo = tl.zeros([C, BG], tl.float32)
    acc_hi = tl.zeros([C, BG], tl.float32)
    for start in tl.range(0, n, BN, num_stages=2):
        row = (start + j).to(tl.int64) * (D // 16)
        k_lo = packed.levels(KC, row, 0, live, lo, hi, BN, C, C, tl.float16, True)
        k_hi = packed.levels(KC, row, C, live, lo, hi, BN, C, C, tl.float16, True)
        s = tl.dot(k_lo, tl.trans(q_lo)) + tl.dot(k_hi, tl.trans(q_hi))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp2(s - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        w = tl.load(W + start + j)
        b = tl.load(B + start + j)
        l_w = l_w * alpha[None, :] + p
        o_w = o_w * alpha[None, :] + p * b[:, None]
        pw = (p * w[:, None]).to(tl.float16)
        v_lo = packed.levels(VC, row, 0, live, lo, hi, BN, C, C, tl.float16, True)
        v_hi = packed.levels(VC, row, C, live, lo, hi, BN, C, C, tl.float16, True)
        acc_lo = acc_lo * alpha[None, :] + tl.dot(tl.trans(v_lo), pw)
        acc_hi = acc_hi * alpha[None, :] + tl.dot(tl.trans(v_hi), pw)
        m_i = m_new
    total, offset = tl.sum(l_w, axis=0), tl.sum(o_w, axis=0)
    out = OUT + g[None, :] * D + ch[:, None]
    tl.store(out, (acc_lo + offset[None, :]) / total[None, :], mask=(g < G)[None, :])
    tl.store(out + C, (acc_hi + offset[None, :]) / total[None, :], mask=(g < G)[None, :])


# -- Gluon: [warp, position, query head] products, each warp its own split --------------------

MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
A_OP = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
B_OP = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
Q_ROWS = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])  # q [D, 8]: a channel a thread
# Thread (i, r) = (lane % 4, lane // 4) of each warp. Keys as A_OP [4, 16, D]: register bits
# (k + 1, position + 8, k + 8, k + 16, k + 32, k + 64), lanes (k + 2, k + 4, position + 1, + 2,
# + 4): positions r, r + 8, K index 2i + b + 8c + 16 kappa; its words [warp, position, word]
# (KEY_WORDS): 2i + e of positions r, r + 8, kappa = 4e + k' and K index -> code k' + 4b + 8c
KEY_WORDS = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 8, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, 8])  # fmt: skip
# keys before RoPE: words i + 4e, so that a channel and its RoPE partner (+ D/2, K index k ^ 64)
# are in one thread (two loads a position, not one of 8 bytes)
KEY_PAIRS = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 4], [0, 8, 0]],
    lane_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, 8])  # fmt: skip
# Values transposed as A_OP [4, D, 16]: register bits (position + 1, m + 8, position + 8, m + 16,
# m + 32, m + 64), lanes (position + 2, + 4, m + 1, + 2, + 4): positions 2i + b + 8c of rows
# m = r + 8 nu: word r of those four positions (VALUE_WORDS), row m holding channel
# 16 (m % 8) + m // 8
VALUE_WORDS = gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 8, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, 8])  # fmt: skip


def _linear(reg_bases, lane_bases, shape):
    return gl.DistributedLinearLayout(reg_bases=reg_bases, lane_bases=lane_bases,
                                      warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[],
                                      shape=shape)  # fmt: skip


# The operands and accumulators as Gluon lays them out at D = 128 (the skeleton asserts each when
# it compiles; the tests read registers through them): lanes (k + 2, k + 4, m + 1, + 2, + 4) of
# A_OP and the accumulator, (k + 2, k + 4, n + 1, + 2, + 4) of B_OP
LANES_A = [[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
LANES_B = [[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]]
KEYS = _linear([[0, 0, 1], [0, 8, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64]], LANES_A,
               [4, 16, 128])  # fmt: skip
VALUES = _linear([[0, 0, 1], [0, 8, 0], [0, 0, 8], [0, 16, 0], [0, 32, 0], [0, 64, 0]], LANES_A,
                 [4, 128, 16])  # fmt: skip
QUERY = _linear([[0, 1, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0], [0, 64, 0]], LANES_B, [4, 128, 8])
SCORES = _linear([[0, 0, 1], [0, 8, 0]], LANES_A, [4, 16, 8])
PROBS = _linear([[0, 1, 0], [0, 8, 0]], LANES_B, [4, 16, 8])


@gluon.jit
def key_channel(k, PAIRS: gl.constexpr):
    """The channel whose code `_key_asm` puts at K index k = 16 kappa + 8c + 2i + b (kappa =
    4e + k'): code k' + 4b + 8c of word 2i + e; with PAIRS (KEY_PAIRS) of word i + 4e, so that
    K index k ^ 64 holds its RoPE partner."""
    word = ((k >> 1) & 3) + 4 * ((k >> 6) & 1) if PAIRS else 2 * ((k >> 1) & 3) + ((k >> 6) & 1)
    return 16 * word + ((k >> 4) & 3) + 4 * (k & 1) + 8 * ((k >> 3) & 1)


@gluon.jit
def value_channel(m):
    """The channel of row m of the transposed values (`_value_asm`): code m // 8 of word m % 8."""
    return 16 * (m % 8) + m // 8


@gluon.constexpr_function
def key_register(e: int, h: int, k: int) -> int:
    """A_OP register of codes k (b = 0) and k + 4 (b = 1) of key word e + 2h (codes k + 8, k + 12
    four registers on: c = 1)."""
    return 2 * h + 8 * (k & 1) + 16 * (k >> 1) + 32 * e


@gluon.constexpr_function
def value_register(code: int, c: int) -> int:
    """A_OP register of code `code` of the value words of positions 2i + 8c and 2i + 8c + 1 (the
    next register: the second position's)."""
    return (
        2 * (code & 1) + 4 * c + 8 * ((code >> 1) & 1) + 16 * ((code >> 2) & 1) + 32 * (code >> 3)
    )


@gluon.constexpr_function
def _key_asm(outputs, inputs):
    """Each key word to its A_OP registers (`key_register`): packed.LUT16_ASM's permutes, written
    in place."""
    (out,), (words, lo, hi) = outputs, inputs
    lines = ["{ .reg .b32 s, t, u, p, q;"]
    for reg, word in enumerate(words):
        for k in range(4):
            src = word
            if k:
                lines.append(f"shr.u32 u, {word}, {2 * k};")
                src = "u"
            r = key_register(reg & 1, reg >> 1, k)
            lines += [f"and.b32 s, {src}, 0x03030303;", "mad.lo.u32 s, s, 34, 0x10101010;",
                      f"prmt.b32 p, {lo[0]}, {hi[0]}, s;", "shr.u32 t, s, 16;",
                      f"prmt.b32 q, {lo[0]}, {hi[0]}, t;",
                      f"mov.b32 {{{out[r]}, {out[r + 1]}}}, p;",
                      f"mov.b32 {{{out[r + 4]}, {out[r + 5]}}}, q;"]  # fmt: skip
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def _value_asm(outputs, inputs):
    """Value words of positions (2i + 8c, 2i + 8c + 1) (registers 2c, 2c + 1) to A_OP registers
    (`value_register`): both positions' codes interleaved into one selector by a permute, so
    that each table permute gives the (position, position + 1) pair a register holds."""
    (out,), (words, lo, hi) = outputs, inputs
    lines = ["{ .reg .b32 a, b, s, t;"]
    for c in range(2):
        for k in range(4):
            lines += [
                f"shr.u32 a, {words[2 * c]}, {2 * k};",
                "and.b32 a, a, 0x03030303;",
                f"shr.u32 b, {words[2 * c + 1]}, {2 * k};",
                "and.b32 b, b, 0x03030303;",
            ]
            for sel, code in (("0x5140", k), ("0x7362", k + 8)):
                r, r4 = value_register(code, c), value_register(code + 4, c)
                lines += [f"prmt.b32 s, a, b, {sel};", "mad.lo.u32 s, s, 34, 0x10101010;",
                          f"prmt.b32 t, {lo[0]}, {hi[0]}, s;",
                          f"mov.b32 {{{out[r]}, {out[r + 1]}}}, t;", "shr.u32 s, s, 16;",
                          f"prmt.b32 t, {lo[0]}, {hi[0]}, s;",
                          f"mov.b32 {{{out[r4]}, {out[r4 + 1]}}}, t;"]  # fmt: skip
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def _transpose_asm(outputs, inputs):
    """The probabilities from the scores' accumulator layout (positions r, r + 8; heads 2i,
    2i + 1) to B_OP (positions 2i, 2i + 1 and + 8; head r): an 8 x 8 transpose of each half."""
    (out,), (p,) = outputs, inputs
    lines = ["{ .reg .b32 a;"]
    for h in range(2):
        lines += [f"mov.b32 a, {{{p[2 * h]}, {p[2 * h + 1]}}};",
                  "movmatrix.sync.aligned.m8n8.trans.b16 a, a;",
                  f"mov.b32 {{{out[2 * h]}, {out[2 * h + 1]}}}, a;"]  # fmt: skip
    return "\n".join(lines) + " }"


@gluon.jit
def _trig(angle):
    """(cos, sin) of fp32 angles as tiles.trig(FAST=True) takes them: Cody-Waite to [-pi, pi],
    then the SFU's cos.approx and sin.approx."""
    turns = (angle * tiles.INV_TWO_PI + tiles.ROUNDING) - tiles.ROUNDING
    angle = gl.fma(-turns, tiles.TWO_PI_LO, gl.fma(-turns, tiles.TWO_PI_HI, angle))
    bits = angle.to(gl.int32, bitcast=True)
    cos, sin = gl.inline_asm_elementwise(tiles.SINCOS_ASM, "=r,=r,r", [bits],
                                         dtype=(gl.int32, gl.int32), is_pure=True,
                                         pack=1)  # fmt: skip
    return cos.to(gl.float32, bitcast=True), sin.to(gl.float32, bitcast=True)


@gluon.jit
def _halves(x):
    """x [4, 16, D] in A_OP: its channels below D/2 and their RoPE partners (K index k ^ 64 with
    KEY_PAIRS), each [4, 16, D/2]."""
    D: gl.constexpr = x.shape[2]
    return gl.split(gl.permute(gl.reshape(x, [4, 16, 2, D // 2]), (0, 1, 3, 2)))


@gluon.jit
def _pairs(lo, hi):
    """`_halves` undone, back in A_OP."""
    D: gl.constexpr = 2 * lo.shape[2]
    x = gl.reshape(gl.permute(gl.join(lo, hi), (0, 1, 3, 2)), [4, 16, D])
    return gl.convert_layout(x, A_OP, assert_trivial=True)


@gluon.jit
def _offsets(layout: gl.constexpr, d0: gl.constexpr, d1: gl.constexpr, d2: gl.constexpr,
             s0, s1, s2):  # fmt: skip
    """s0 i + s1 j + s2 k over [d0, d1, d2] in `layout`."""
    i = gl.arange(0, d0, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    j = gl.arange(0, d1, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    k = gl.arange(0, d2, layout=gl.SliceLayout(0, gl.SliceLayout(0, layout)))
    along_i = gl.expand_dims(gl.expand_dims(i * s0, 1), 2)
    along_j = gl.expand_dims(gl.expand_dims(j * s1, 0), 2)
    return along_i + along_j + gl.expand_dims(gl.expand_dims(k * s2, 0), 0)


@gluon.jit
def _gluon_loop(Q, KC, VC, W, B, OUT, n, T, SINK, INDEX, DELTA, VSCALE, VZERO, TABLE, INV_FREQ,
                G: gl.constexpr, D: gl.constexpr, FEATURES: gl.constexpr,
                PRE_ROPE: gl.constexpr):  # fmt: skip
    BN: gl.constexpr = 64
    gl.static_assert(gl.to_linear_layout(A_OP, [4, 16, D]) == KEYS)
    gl.static_assert(gl.to_linear_layout(A_OP, [4, D, 16]) == VALUES)
    gl.static_assert(gl.to_linear_layout(B_OP, [4, D, 8]) == QUERY)
    gl.static_assert(gl.to_linear_layout(MMA, [4, 16, 8]) == SCORES)
    gl.static_assert(gl.to_linear_layout(B_OP, [4, 16, 8]) == PROBS)
    lo, hi = gl.load(T), gl.load(T + 1)
    # q^T [4, D, 8] as the B operand, K index k read from the channel _key_asm puts there
    k = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_OP)))
    chan = key_channel(k, PRE_ROPE)
    heads = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, B_OP)))
    at_q = _offsets(B_OP, 4, D, 8, 0, 0, D) + gl.expand_dims(gl.expand_dims(chan, 0), 2)
    qt = gl.load(Q + at_q, mask=gl.expand_dims(gl.expand_dims(heads < G, 0), 0) & (at_q >= 0),
                 other=0.0)  # fmt: skip
    if PRE_ROPE:
        k_at = _offsets(KEY_PAIRS, 4, 16, 8, 16 * (D // 16), D // 16, 1)
    else:
        k_at = _offsets(KEY_WORDS, 4, 16, 8, 16 * (D // 16), D // 16, 1)
    v_at = _offsets(VALUE_WORDS, 4, 16, 8, 16 * (D // 16), D // 16, 1)
    warp = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    pos = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    at = gl.expand_dims(warp * 16, 1) + gl.expand_dims(pos, 0)  # [4, 16] positions in the tile
    # the slot table: q times the key's static step at each channel, [D, 8] (tiles.slot_table)
    slot_heads = gl.expand_dims(
        gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, MMA))), 0), 0
    )
    q_off = gl.load(TABLE + D * 8 + slot_heads)  # q . offset, the folded keys' constant term
    if PRE_ROPE:  # keys rotated by R(j), j < 64 in the tile; q by R(start)^T each tile
        kk = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(0, A_OP)))
        f = gl.load(INV_FREQ + key_channel(kk, True) % (D // 2))
        j = _offsets(A_OP, 4, 16, D, 16, 1, 0).to(gl.float32)
        cos_j, _ = _halves((gl.cos(j * gl.expand_dims(gl.expand_dims(f, 0), 0))).to(gl.float16))
        sin_j, _ = _halves((gl.sin(j * gl.expand_dims(gl.expand_dims(f, 0), 0))).to(gl.float16))
        kq = gl.arange(0, D, layout=gl.SliceLayout(1, Q_ROWS))
        cq = key_channel(kq, True)
        gq = gl.arange(0, 8, layout=gl.SliceLayout(0, Q_ROWS))
        q_live = gl.expand_dims(kq >= 0, 1) & gl.expand_dims(gq < G, 0)
        q_own = gl.load(Q + gl.expand_dims(cq, 1) + gl.expand_dims(gq * D, 0), mask=q_live,
                        other=0.0).to(gl.float32)  # fmt: skip
        q_pair = gl.load(Q + gl.expand_dims((cq + D // 2) % D, 1) + gl.expand_dims(gq * D, 0),
                         mask=q_live, other=0.0).to(gl.float32)  # fmt: skip
        q_pair = q_pair * gl.expand_dims(gl.where(cq < D // 2, 1.0, -1.0), 1)
        fq = gl.load(INV_FREQ + cq % (D // 2))
        cos_a, sin_a = gl.cos(fq * 0.0), gl.sin(fq * 0.0)
        cos_b, sin_b = gl.cos(fq * BN), gl.sin(fq * BN)
    m_i = gl.full([4, 8], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_w = gl.zeros([4, 16, 8], gl.float32, layout=MMA)
    o_w = gl.zeros([4, 16, 8], gl.float32, layout=MMA)
    acc = gl.zeros([4, D, 8], gl.float32, layout=MMA)  # transposed: channels x query heads
    for start in range(0, n, BN):
        words = gl.load(KC + start * (D // 16) + k_at)
        keys = gl.inline_asm(_key_asm, ("=h", "r", "r", "r"), [words, lo, hi],
                             gl.distributed_type(gl.float16, [4, 16, D], A_OP),
                             is_pure=True)  # fmt: skip
        if PRE_ROPE:
            k_lo, k_hi = _halves(keys)
            keys = _pairs(k_lo * cos_j - k_hi * sin_j, k_hi * cos_j + k_lo * sin_j)
            q_rot = q_own * gl.expand_dims(cos_a, 1) + q_pair * gl.expand_dims(sin_a, 1)
            q_rot = gl.convert_layout(q_rot.to(gl.float16), gl.SliceLayout(0, B_OP))
            qt = gl.expand_dims(q_rot, 0).broadcast_to([4, D, 8])
            cos_a, sin_a = cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b
        s = mma_v2(keys, qt, gl.zeros([4, 16, 8], gl.float32, layout=MMA))
        if FEATURES:  # kvcalib-2's: one exact key slot, the sink mask, one-byte value metadata
            rows = start + at
            index = gl.load(INDEX + rows).to(gl.int32)
            code = gl.load(DELTA + rows).to(gl.int32)
            half = (((code & 0x7F) << 7) | ((code & 0x80) << 8)).to(gl.int16)
            delta = half.to(gl.float16, bitcast=True).to(gl.float32) * 256.0  # tiles.fp8_decode
            slot = gl.load(TABLE + gl.expand_dims(index * 8, 2) + slot_heads)  # q c step
            if PRE_ROPE:  # q . R(p) (delta e_c): q_c cos + sign q_pair sin at p f_c, by the SFU
                pair = gl.load(TABLE + (D + 1) * 8 + gl.expand_dims(index * 8, 2) + slot_heads)
                cos, sin = _trig(rows.to(gl.float32) * gl.load(INV_FREQ + index % (D // 2)))
                slot = slot * gl.expand_dims(cos, 2) + pair * gl.expand_dims(sin, 2)
            s += slot * gl.expand_dims(delta, 2)
            s = gl.where(gl.expand_dims(gl.load(SINK + rows) == 0, 2), s + q_off, float("-inf"))
            w = ((gl.load(VSCALE + rows).to(gl.int32) + SCALE_BASE) << 20).to(
                gl.float32, bitcast=True
            )
            b = -(gl.load(VZERO + rows).to(gl.float32) * (3.0 / 255.0)) * w  # tiles.zero_decode
        else:
            w, b = gl.load(W + start + at), gl.load(B + start + at)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        alpha = gl.expand_dims(gl.exp2(m_i - m_new), 1)
        l_w = l_w * alpha + p
        o_w = o_w * alpha + p * gl.expand_dims(b, 2)
        pw = (p * gl.expand_dims(w, 2)).to(gl.float16)
        pt = gl.inline_asm(_transpose_asm, ("=h", "h"), [pw],
                           gl.distributed_type(gl.float16, [4, 16, 8], B_OP),
                           is_pure=True)  # fmt: skip
        words = gl.load(VC + start * (D // 16) + v_at)
        vt = gl.inline_asm(_value_asm, ("=h", "r", "r", "r"), [words, lo, hi],
                           gl.distributed_type(gl.float16, [4, D, 16], A_OP),
                           is_pure=True)  # fmt: skip
        acc = mma_v2(vt, pt, acc * alpha)
        m_i = m_new
    scale = gl.exp2(m_i - gl.expand_dims(gl.max(m_i, axis=0), 0))  # each warp's split to one max
    COLS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, MMA))
    total = gl.convert_layout(gl.sum(gl.sum(l_w, axis=1) * scale, axis=0), COLS)
    offset = gl.convert_layout(gl.sum(gl.sum(o_w, axis=1) * scale, axis=0), COLS)
    out = gl.sum(acc * gl.expand_dims(scale, 1), axis=0)
    out = (out + gl.expand_dims(offset, 0)) / gl.expand_dims(total, 0)
    row = gl.arange(0, D, layout=gl.SliceLayout(1, gl.SliceLayout(0, MMA)))
    head = gl.arange(0, 8, layout=COLS)
    channel = value_channel(row)
    gl.store(OUT + gl.expand_dims(channel, 1) + gl.expand_dims(head * D, 0), out,
             mask=gl.expand_dims(channel >= 0, 1) & gl.expand_dims(head < G, 0))  # fmt: skip


SIGNATURE = {"Q": "*fp16", "KC": "*i32", "VC": "*i32", "W": "*fp32", "B": "*fp32", "OUT": "*fp32",
             "n": "i32", "T": "*i32", "G": "constexpr", "D": "constexpr"}  # fmt: skip
FEATURE_ARGS = {"SINK": "*u8", "INDEX": "*u8", "DELTA": "*u8", "VSCALE": "*u8", "VZERO": "*u8",
                "TABLE": "*fp32", "INV_FREQ": "*fp32"}  # fmt: skip
ALIGNED = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7)}


def measure(name: str) -> dict:
    """One skeleton compiled for sm_90: registers, stack and its loop's SASS."""
    if name == "triton":
        src = ASTSource(_triton_loop, {**SIGNATURE, "BN": "constexpr"},
                        {"G": G, "D": D, "BN": BN}, ALIGNED)  # fmt: skip
        options = {"num_warps": WARPS, "num_stages": 2}
    else:
        signature = {k: v for k, v in SIGNATURE.items() if v != "constexpr"}
        signature.update(FEATURE_ARGS, G="constexpr", D="constexpr", FEATURES="constexpr",
                         PRE_ROPE="constexpr")  # fmt: skip
        src = gluon.GluonASTSource(_gluon_loop, signature,
                                   {"G": G, "D": D, "FEATURES": "features" in name,
                                    "PRE_ROPE": "pre-RoPE" in name},
                                   {**ALIGNED, (13,): [["tt.divisibility", 16]]})  # fmt: skip
        options = {"num_warps": WARPS}
    with knobs.compilation.scope():
        knobs.compilation.always_compile = True  # Triton's cache keys miss the layouts' globals
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    loop = read.sass_loops(read._cubin_text(kernel.asm["cubin"], "nvdisasm", "-c"))[0]
    opcodes = Counter(x.split()[0].split(".")[0] for x in loop.instructions)
    usage = read.resources(kernel.asm["cubin"])
    return dict(formulation=name, shape="32/8/128", block_n=BN, num_warps=WARPS,
                registers=usage["REG"], stack=usage["STACK"],
                loop_instructions=len(loop.instructions),
                per_position=round(len(loop.instructions) * WARPS / BN, 1),
                loop_opcodes=dict(opcodes.most_common()))  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    try:
        kernel_budget.check_triton()
    except kernel_budget.BudgetError as e:
        print(f"kernel_floor: {e}", file=sys.stderr)
        return 2
    rows = [measure(name) for name in FORMULATIONS]
    print("| formulation | registers | loop instr. | per position | top opcodes |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["loop_opcodes"].items())[:8])
        print(f"| {r['formulation']} | {r['registers']} | {r['loop_instructions']} | "
              f"{r['per_position']} | {top} |")  # fmt: skip
    if args.out:
        record = dict(triton=triton.__version__, arch="sm_90", rows=rows)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
