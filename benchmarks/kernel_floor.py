"""The decode loop's floor in each formulation, read on a CPU (issue 51): what a whole-tile loop
of kvcalib-2's key and value reads costs per (position x KV head) at 32/8/128 on sm_90, before
and with kvcalib-2's features, and at 4 and 3 bits.

    python benchmarks/kernel_floor.py --out benchmarks/kernel_budget/floor.json  # kernel-floor

Every row but the last two does the same work per tile of 64 positions (G = 4 query heads a KV
head, D = 128, fp16): 2-bit key words decoded to fp16 levels by the byte-permute table
(kernels.packed), 2-bit value words to their uniform levels 0 .. 3 (as kvcalib-2 stores
values), scores, an online softmax whose probabilities are scaled per position (a "token" value
scale) with a rank-1 offset term, and p . v. Keys after RoPE.

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
                  order once); values, word r of positions 2i, 2i + 1, 2i + 8, 2i + 9, by the
                  magic-number conversion (a permute puts two positions' bytes in one register,
                  each code masked under fp16 1024's exponent, 1024 subtracted), the output
                  rows relabeled and scaled (`value_channel`, `value_unit`, undone once after
                  the loop). The triton row reads values by the table (of levels 0 .. 3), as the
                  decode kernel does. The probabilities reach the B operand
                  by one movmatrix transpose per 8 x 8 half. Decode and products are one block
                  of inline PTX each (the codes decoded into the MMA fragments), the table
                  words in each thread's registers: kernels.decode_gluon's blocks. No shared
                  memory in the loop.
  gluon+features  with kvcalib-2's per-position work added as its cache stores it today: one
                  exact key slot (index and E4M3 delta bytes, q times the step gathered from a
                  per-program table in L1), the sink mask (one byte), the folded keys' constant
                  term, one-byte value scale and zero point decoded.
  gluon+features, pre-RoPE
                  keys stored before RoPE, as kvcalib-2 stores them: each thread holds a
                  channel and its RoPE partner (words i, i + 4: `key_channel(k, True)`), the
                  decoded keys scaled, offset per channel (by one and zero here: the
                  arithmetic, not the values) and rotated by R(j) (j < 64) in four half2 fma a
                  channel pair from six tables built once in shared memory (`rope_tables`,
                  24 ld.shared.v4 a thread and tile), q by R(start)^T each tile (angle
                  addition, then to every warp through shared memory), the slot's q rotated by
                  its absolute position (the SFU's cos, sin); bounded at 128 registers, as the
                  kernel's launch is.
  gluon 4-bit     the "gluon" row with 4-bit codes (kvcalib-4's: a codebook for keys and one for
                  values), each read through a table of level pairs in shared memory (256
                  words, entry x the fp16 levels of codes x % 16 and x // 16; gluon_ptx's
                  `_pair_key_decode`): a key register is one byte of a word, three instructions
                  (its byte, its address, the load); a value register pairs two positions'
                  codes of a channel, put in one byte by a shift and a select per four
                  registers first. Keys words 4i .. 4i + 3 (16 bytes a position), values words
                  2r, 2r + 1 of four positions. What the instruction count does not see: the
                  table's loads are random in its 32 banks, so a warp's load takes several of
                  shared memory's cycles.
  gluon 3-bit     the same at 3 bits (kvcalib-3's codebooks): a position's 128 codes are 12
                  words, which no linear layout splits among a row's 4 lanes, so each lane reads
                  its words by address (gluon_layouts' KEY_SLOTS3, VALUE_SLOTS3): keys, the 96
                  bits of channels 32i .. 32i + 31, each pair of codes 6 bits (a shift, or a
                  funnel shift across words, and a mask) indexing a 64-word table of level
                  pairs; values, the 48 bits of channels 16r .. 16r + 15 of each position
                  (two words, funnel-shifted into place), a pair of channels looked up at each
                  position, two permutes putting each channel's two positions in one register.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_read as read
import kernel_budget

from kvcalib_runtime.kernels import packed
from kvcalib_runtime.kernels.decode_gluon import MAX_REGISTERS
from kvcalib_runtime.kernels.gluon_layouts import (
    A_OP,
    B_OP,
    FLAT,
    FOUR_A_THREAD,
    KEY_PAIRS,
    KEY_SLOTS3,
    KEY_WORDS,
    KEY_WORDS4,
    KEYS,
    MMA,
    ONE_A_THREAD,
    PROBS,
    Q_ROWS,
    QUERY,
    SCORES,
    VALUE_SLOTS3,
    VALUE_WORDS,
    VALUE_WORDS4,
    VALUES,
    channel_at,
    offsets,
    packed_pairs,
    pair_addresses,
    rope_kept,
    rope_tables,
    rotated_scores,
    scores,
    trig,
    value_channel,
    value_products,
    value_unit,
)
from kvcalib_runtime.kernels.gluon_streams import in_registers
from kvcalib_runtime.layouts import metabyte

G, D, BN, WARPS = 4, 128, 64, 4
FORMULATIONS = (
    "triton",
    "gluon",
    "gluon+features",
    "gluon+features, pre-RoPE",
    "gluon 4-bit",
    "gluon 3-bit",
)
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
    v_lo, v_hi = tl.load(T + 2), tl.load(T + 3)  # the values' levels 0 .. 3
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
        vl = packed.levels(VC, row, 0, live, v_lo, v_hi, BN, C, C, tl.float16, True)
        vh = packed.levels(VC, row, C, live, v_lo, v_hi, BN, C, C, tl.float16, True)
        acc_lo = acc_lo * alpha[None, :] + tl.dot(tl.trans(vl), pw)
        acc_hi = acc_hi * alpha[None, :] + tl.dot(tl.trans(vh), pw)
        m_i = m_new
    total, offset = tl.sum(l_w, axis=0), tl.sum(o_w, axis=0)
    out = OUT + g[None, :] * D + ch[:, None]
    tl.store(out, (acc_lo + offset[None, :]) / total[None, :], mask=(g < G)[None, :])
    tl.store(out + C, (acc_hi + offset[None, :]) / total[None, :], mask=(g < G)[None, :])


# -- Gluon: [warp, position, query head] products, each warp its own split --------------------

# The layouts, the relabelings and the inline PTX (decode and products in one block, the table
# words in each thread's registers) are kernels.decode_gluon's (the launched kernel's whole
# tiles), imported: this skeleton is that loop without its cache's addressing.


@gluon.jit
def _slots(layout: gl.constexpr, d0: gl.constexpr, d1: gl.constexpr, d2: gl.constexpr,
           d3: gl.constexpr, s0, s1, s2, s3):  # fmt: skip
    """s0 i + s1 j + s2 k + s3 l over [d0, d1, d2, d3] in `layout` (`offsets` in four
    dimensions)."""
    i = gl.arange(0, d0, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
    j = gl.arange(0, d1, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
    k = gl.arange(0, d2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
    m = gl.arange(0, d3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
    out = gl.expand_dims(gl.expand_dims(gl.expand_dims(i * s0, 1), 2), 3)
    out = out + gl.expand_dims(gl.expand_dims(gl.expand_dims(j * s1, 0), 2), 3)
    out = out + gl.expand_dims(gl.expand_dims(gl.expand_dims(k * s2, 0), 1), 3)
    return out + gl.expand_dims(gl.expand_dims(gl.expand_dims(m * s3, 0), 1), 2)


@gluon.jit
def _gluon_loop(Q, KC, VC, W, B, OUT, n, T, SINK, INDEX, DELTA, VSCALE, VZERO, TABLE, INV_FREQ,
                KSCALE, KOFF,
                G: gl.constexpr, D: gl.constexpr, FEATURES: gl.constexpr,
                PRE_ROPE: gl.constexpr, BITS: gl.constexpr):  # fmt: skip
    BN: gl.constexpr = 64
    WORDS: gl.constexpr = D * BITS // 32  # a position's code words
    gl.static_assert(BITS == 2 or not (FEATURES or PRE_ROPE))
    gl.static_assert(gl.to_linear_layout(A_OP, [4, 16, D]) == KEYS)
    gl.static_assert(gl.to_linear_layout(A_OP, [4, D, 16]) == VALUES)
    gl.static_assert(gl.to_linear_layout(B_OP, [4, D, 8]) == QUERY)
    gl.static_assert(gl.to_linear_layout(MMA, [4, 16, 8]) == SCORES)
    gl.static_assert(gl.to_linear_layout(B_OP, [4, 16, 8]) == PROBS)
    if BITS != 2:  # the keys' and the values' tables of level pairs, in shared memory
        pairs = gl.allocate_shared_memory(gl.int32, [512], FLAT)
        pairs.store(gl.load(T + gl.arange(0, 512, layout=FOUR_A_THREAD)))
        gl.barrier()
        k_table, v_table = pair_addresses(pairs)
        keys = (k_table, k_table)
    else:
        keys = in_registers(T + 4, gl.load(T), gl.load(T + 1))
        v_table = keys[0]  # unread: 2-bit values need no table
    # q^T [4, D, 8] as the B operand, K index k read from the channel gluon_ptx.key_asm puts there
    k = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_OP)))
    chan = channel_at(k, PRE_ROPE, BITS)
    heads = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, B_OP)))
    at_q = offsets(B_OP, 4, D, 8, 0, 0, D) + gl.expand_dims(gl.expand_dims(chan, 0), 2)
    qt = gl.load(Q + at_q, mask=gl.expand_dims(gl.expand_dims(heads < G, 0), 0) & (at_q >= 0),
                 other=0.0)  # fmt: skip
    if not PRE_ROPE:
        q_pairs = packed_pairs(qt)
    k_live = True
    shift = gl.zeros([128], gl.int32, ONE_A_THREAD)  # of each thread's 3-bit value words
    if BITS == 3:  # words read by address (gluon_layouts' KEY_SLOTS3, VALUE_SLOTS3)
        k_at = _slots(KEY_SLOTS3, 4, 16, 4, 4, 16 * WORDS, WORDS, 3, 1)
        k_live = _slots(KEY_SLOTS3, 4, 16, 4, 4, 0, 0, 0, 1) < 3
        v_at = (_slots(VALUE_SLOTS3, 4, 16, 8, 2, 16 * WORDS, WORDS, 0, 1)
                + _slots(VALUE_SLOTS3, 4, 16, 8, 2, 0, 0, 1, 0) * 3 // 2)  # fmt: skip
        shift = 16 * ((gl.arange(0, 128, layout=ONE_A_THREAD) >> 2) & 1)
    elif BITS == 4:
        k_at = offsets(KEY_WORDS4, 4, 16, WORDS, 16 * WORDS, WORDS, 1)
        v_at = offsets(VALUE_WORDS4, 4, 16, WORDS, 16 * WORDS, WORDS, 1)
    else:
        k_at = offsets(KEY_PAIRS if PRE_ROPE else KEY_WORDS, 4, 16, WORDS, 16 * WORDS, WORDS, 1)
        v_at = offsets(VALUE_WORDS, 4, 16, WORDS, 16 * WORDS, WORDS, 1)
    warp = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    pos = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    at = gl.expand_dims(warp * 16, 1) + gl.expand_dims(pos, 0)  # [4, 16] positions in the tile
    # the slot table: q times the key's static step at each channel, [D, 8] (tiles.slot_table)
    slot_heads = gl.expand_dims(
        gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, MMA))), 0), 0
    )
    q_off = gl.load(TABLE + D * 8 + slot_heads)  # q . offset, the folded keys' constant term
    if PRE_ROPE:  # keys rotated by R(j), j < 64 in the tile; q by R(start)^T each tile
        # scales of one and offsets of zero: the kernel's arithmetic on kvcalib-2's keys, not
        # its values
        tables = rope_tables(KSCALE, KOFF, INV_FREQ, D, BITS)
        kq = gl.arange(0, D, layout=gl.SliceLayout(1, Q_ROWS))
        cq = channel_at(kq, True, BITS)
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
        words = gl.load(KC + start * WORDS + k_at, mask=k_live, other=0)
        if PRE_ROPE:
            q_rot = q_own * gl.expand_dims(cos_a, 1) + q_pair * gl.expand_dims(sin_a, 1)
            q_rot = gl.convert_layout(q_rot.to(gl.float16), gl.SliceLayout(0, B_OP))
            qt = gl.expand_dims(q_rot, 0).broadcast_to([4, D, 8])
            cos_a, sin_a = cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b
            s = rotated_scores(words, keys, tables, qt, BITS)
        else:
            s = scores(words, keys, q_pairs, BITS)
        if FEATURES:  # kvcalib-2's: one exact key slot, the sink mask, one-byte value metadata
            rows = start + at
            index = gl.load(INDEX + rows).to(gl.int32)
            code = gl.load(DELTA + rows).to(gl.int32)
            half = (((code & 0x7F) << 7) | ((code & 0x80) << 8)).to(gl.int16)
            delta = half.to(gl.float16, bitcast=True).to(gl.float32) * 256.0  # tiles.fp8_decode
            slot = gl.load(TABLE + gl.expand_dims(index * 8, 2) + slot_heads)  # q c step
            if PRE_ROPE:  # q . R(p) (delta e_c): q_c cos + sign q_pair sin at p f_c, by the SFU
                pair = gl.load(TABLE + (D + 1) * 8 + gl.expand_dims(index * 8, 2) + slot_heads)
                cos, sin = trig(rows.to(gl.float32) * gl.load(INV_FREQ + index % (D // 2)))
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
        words = gl.load(VC + start * WORDS + v_at)
        acc = value_products(words, v_table, shift, pw, acc * alpha, BITS)
        m_i = m_new
    if PRE_ROPE:
        rope_kept(tables)
    if BITS == 4:  # the tables read by address: kept allocated through the loop (`rope_kept`)
        gl.inline_asm("", ("r",), [pairs], [], is_pure=False)
    scale = gl.exp2(m_i - gl.expand_dims(gl.max(m_i, axis=0), 0))  # each warp's split to one max
    COLS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, MMA))
    total = gl.convert_layout(gl.sum(gl.sum(l_w, axis=1) * scale, axis=0), COLS)
    offset = gl.convert_layout(gl.sum(gl.sum(o_w, axis=1) * scale, axis=0), COLS)
    row = gl.arange(0, D, layout=gl.SliceLayout(1, gl.SliceLayout(0, MMA)))
    out = gl.sum(acc * gl.expand_dims(scale, 1), axis=0)
    if BITS == 2:
        out = out * gl.expand_dims(value_unit(row), 1)
    out = (out + gl.expand_dims(offset, 0)) / gl.expand_dims(total, 0)
    head = gl.arange(0, 8, layout=COLS)
    channel = value_channel(row)
    gl.store(OUT + gl.expand_dims(channel, 1) + gl.expand_dims(head * D, 0), out,
             mask=gl.expand_dims(channel >= 0, 1) & gl.expand_dims(head < G, 0))  # fmt: skip


SIGNATURE = {"Q": "*fp16", "KC": "*i32", "VC": "*i32", "W": "*fp32", "B": "*fp32", "OUT": "*fp32",
             "n": "i32", "T": "*i32", "G": "constexpr", "D": "constexpr"}  # fmt: skip
FEATURE_ARGS = {"SINK": "*u8", "INDEX": "*u8", "DELTA": "*u8", "VSCALE": "*u8", "VZERO": "*u8",
                "TABLE": "*fp32", "INV_FREQ": "*fp32", "KSCALE": "*fp32",
                "KOFF": "*fp32"}  # fmt: skip
ALIGNED = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7)}
CONSTANTS = ("G", "D", "FEATURES", "PRE_ROPE", "BITS")


def constants(name: str) -> dict:
    """The Gluon skeleton's constexpr arguments for formulation `name`."""
    return {"G": G, "D": D, "FEATURES": "features" in name, "PRE_ROPE": "pre-RoPE" in name,
            "BITS": 4 if "4-bit" in name else 3 if "3-bit" in name else 2}  # fmt: skip


def measure(name: str) -> dict:
    """One skeleton compiled for sm_90: registers, stack and its loop's SASS."""
    if name == "triton":
        src = ASTSource(_triton_loop, {**SIGNATURE, "BN": "constexpr"},
                        {"G": G, "D": D, "BN": BN}, ALIGNED)  # fmt: skip
        options = {"num_warps": WARPS, "num_stages": 2}
    else:
        signature = {k: v for k, v in SIGNATURE.items() if v != "constexpr"}
        signature.update(FEATURE_ARGS, **dict.fromkeys(CONSTANTS, "constexpr"))
        src = gluon.GluonASTSource(_gluon_loop, signature, constants(name),
                                   {**ALIGNED, (13,): [["tt.divisibility", 16]]})  # fmt: skip
        options = {"num_warps": WARPS}
        if "pre-RoPE" in name:  # the kernel's launch bound
            options["maxnreg"] = MAX_REGISTERS[True, 2]
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
