"""The decode kernel's whole tiles in Gluon, for kvcalib-2's, -3's, -4's and -1.5's layouts at
128 channels a head: the body's 64-position tiles that both bodies hold (`_body_kernel`), beside
the Triton kernel (kernels.decode_kernel), which then reads only what follows them (the last
partial tile, the residual ring, the sink slots and the new token); the combine merges both
kernels' splits.

Why Gluon: Triton moves each decoded tile to the tensor cores' operand layout through shared
memory and repacks the 16-bit table outputs every tile, ~29 warp-instructions a position before
any of kvcalib-2's features (benchmarks/kernel_floor.py). Here the layouts are written out
(the skeleton's, measured there): each of the 4 warps an independent split of 16 positions of a
64-position tile (its own softmax state, merged once after the loop); mma.sync with positions as
the scores' rows (K q^T) and channels as the output's rows (V^T p); every thread decodes exactly
the code words its A-operand fragments hold: keys by the byte-permute lookup of kernels.packed,
words i and i + 4 of positions r and r + 8 (lane = 4r + i: a channel and its RoPE partner in one
thread), the K index relabeled to the codes' order (`key_channel`, q read in that order);
values, uniform, by the magic-number conversion (two instructions a register), word r of
positions 2i, 2i + 1, 2i + 8, 2i + 9, a permute putting two positions' bytes in one register
(`value_channel` the output rows, undone by the store, `value_unit` their scale); the
probabilities reach the B operand by one movmatrix transpose a half. Each tile's decode and its
tensor-core products are one inline-PTX block (kernels.gluon_ptx: `scores_asm`,
`rotated_scores_asm`, `values_asm`): the codes decoded straight into the mma.sync fragments,
pre-RoPE keys scaled, offset and rotated there, four half2 fma a channel pair; the keys' table
words are ordinary registers of every thread (kernels.gluon_streams' `in_registers`). Before
RoPE, the six tables that scale, offset and rotate the keys are in shared memory
(`rope_tables`, built once a program, 96 words a thread), read by address in the fused block,
each k-step's 24 just before its products (fewer instructions than scaling, then rotating, from
four tables held in registers across the loop, and those 64 registers free); q is rotated once
a tile.

The pipeline: every per-position stream reaches shared memory by cp.async while the tile before
is computed, the codes 16 bytes a thread of each stream, the five one-byte streams (slot index
and delta, value scale and zero point, sink flag) 4 bytes a thread (`meta_copy`), then read
from there (the codes in their operands' layouts, the bytes by address: `shared_at`). The
codes' buffers are a ring of two after RoPE (one barrier a tile); before it one buffer (the
tables leave room for no more at 4 programs an SM), read at the tile's start, a second barrier
before the next copy. Offsets that stay per position reach their pointers zero-extended
(`_unsigned`), so that ptxas need not hold 64-bit addresses across the loop; the launch is
bounded to 128 registers before RoPE, 96 after (`MAX_REGISTERS`; at 3 and 4 bits, and
kvcalib-1.5's, 168 and 128).

What it reads (`applies`, `READS`): kvcalib-2's layout, keys "static" (per-channel scale and
offset) with a 2-bit codebook and one exact slot per row whose delta is an E4M3 byte in steps of
the channel's scale, before or after RoPE; values "token" (one group a row), 2-bit uniform,
asymmetric, with a one-byte scale and zero point (layouts.metabyte). Or kvcalib-4's (BITS 4) and
kvcalib-3's (BITS 3): keys the same with a 4- or 3-bit codebook and an fp16 delta; values a
symmetric codebook of the same width with an fp16 scale a row. Or kvcalib-1.5's (BITS 6, its
vectors' indices): keys and values "vq", a 6-bit index a vector of 4 channels into a codebook of
64 entries (a KV head's or the layer's), "static" scales and offsets, no slot, no per-position
metadata; the keys' vectors RoPE pairs (channels 2V, 2V + 1 and their partners 64 on), the
values' adjacent channels. All fp16, G <= 8 query heads a KV head, contiguous bodies
(`copied_strides`), no sliding window. The slot's score is q . R(p) (delta s_c e_c) from a
per-program table of q_c s_c (q_c: fp16 deltas are not in steps) and its RoPE partner's (global
scratch, written at the program's start: the loop's one load from global memory that is not a
copy, a gather by the slot's index), its angle by the SFU.

At 4 bits a byte of codes (two channels) indexes a table of level pairs in shared memory (256
words a codebook, built once a program: `pair_tables`; gluon_ptx's `_pair_key_decode`), three
instructions a register; a value register pairs two positions' codes of a channel, put in one
byte first. Each position's codes are 16 words (KEY_WORDS4, KEY_PAIRS4, VALUE_WORDS4, two
16-byte copies a thread a stream), the slot deltas and value scales two-byte streams of 33 words
(`meta_copy`). The table's loads fall at random among shared memory's 32 banks: the instruction
count does not see their conflicts.

At 3 bits the same, with tables of 64 words (a pair of codes is 6 bits: a shift, or a funnel
shift where it crosses a word, and a mask; gluon_rows' `_pair3_key_decode`,
`_pair3_rope_key_decode`, `_pair3_value_blocks`). A position's codes are 12 words, which no
linear layout splits among a row's 4 lanes: a tile's rows are copied flat (768 words of a
1,024-word buffer, 16 bytes a piece) and each thread reads its words by address at constant
offsets from one address of its own (gluon_streams' `slot_bases`, `code_words`; conflict-free:
the 32 lanes of a key read fall in 32 banks). Keys after RoPE, lane i reads channels 32i .. 32i
+ 31 (KEY_SLOTS3); before it, channels 16i .. 16i + 15 and their RoPE partners 64 on (the two
words holding each, shifted: `key_channel3`'s PAIRS).

kvcalib-1.5's rows are 6 words, read likewise (384 words of a 512-word buffer): lane i's key
vectors 8i .. 8i + 7 hold channels 16i .. 16i + 15 and their partners (KEY_SLOTS6,
`key_channel3`'s PAIRS order before and after RoPE); an index is one ld.shared.v2 of its entry's
two words from the codebook's table (128 words), straight into a channel pair's register and its
partner's (gluon_rows' `_vq_key_decode`). A value entry's words pair channels of one position:
two permutes a word pair two positions' (`_vq_value_blocks`). The static value scale and offset
are applied to the output rows once (o l + s sum_p p e).

Gluon's API moves between Triton releases: `available()` holds it to the one it is written
for, and the decode launcher uses the Triton kernel alone elsewhere. No interpreter runs Gluon:
tests/runtime/kernels/test_ptx_cta.py executes this kernel's PTX on the CPU.
"""

import functools

import torch
import triton

from kvcalib_runtime.layouts import Kind, metabyte

TRITON = "3.9.0"  # the Gluon this module is written for
BLOCK_N = 64  # positions a tile: 4 warps of 16
WARPS = 4
# Registers a thread (CUDA's __launch_bounds__(128, n)), by (keys pre-RoPE?, code bits). At 2
# bits, bounded so that an SM holds 4 programs (16 warps) with keys before RoPE and 5 (20)
# after: unbounded, ptxas takes 130 and 112, which leave 3 and 4; bounded, neither spills and
# each issues about as many instructions. At 4 bits, as many as the programs an SM holds
# allow without a spill: before RoPE its shared memory holds 3 (63.5 KB each on an H100),
# whose 168 registers spill nothing (128 spilled 40 bytes, read in the loop); after RoPE 128
# (4 programs; 96 spilled 40 bytes) (benchmarks/kernel_budget). At 3 bits and kvcalib-1.5's
# the same as at 4: before RoPE 3 programs an SM (62 and 58 KB), 168 registers, no spill (at 128
# kvcalib-1.5's spilled 24 bytes); after it ptxas takes 121 and 124 (at 96 it spilled 104).
MAX_REGISTERS = {(True, 2): 128, (False, 2): 96, (True, 3): 168, (False, 3): 128,
                 (True, 4): 168, (False, 4): 128, (True, 6): 168, (False, 6): 128}  # fmt: skip


def available() -> bool:
    """Whether this Triton's Gluon is the one written for."""
    return triton.__version__ == TRITON


if available():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from kvcalib_runtime.kernels.gluon_layouts import (
        A_OP,
        B_OP,
        COPY,
        COPY4,
        FLAT,
        FOUR_A_THREAD,
        KEY_PAIRS,
        KEY_PAIRS4,
        KEY_WORDS,
        KEY_WORDS4,
        KEYS,
        MMA,
        PROBS,
        Q_ROWS,
        QUERY,
        SCORES,
        TILE,
        VALUE_WORDS,
        VALUE_WORDS4,
        VALUES,
        channel_at,
        offsets,
        packed_pairs,
        rope_kept,
        rope_tables,
        rotated_scores,
        scores,
        trig,
        value_channel,
        value_products,
        value_unit,
    )
    from kvcalib_runtime.kernels.gluon_streams import (
        code_words,
        in_registers,
        meta_copy,
        meta_source,
        meta_starts,
        pair_tables,
        shared_at,
        slot_bases,
        table_word,
    )

    SCALE_BASE = gl.constexpr(metabyte.BASE)
    ZERO_STEP = gl.constexpr(3.0 / metabyte.ZERO_STEPS)  # 2-bit uniform: SPAN 3 (tiles.zero_decode)

    @gluon.jit
    def _unsigned(x):
        """A non-negative int32 offset widened to int64 without its sign. Added to a pointer
        as int32, Triton sign-extends it (one more instruction a load), and ptxas then keeps
        the loop's 64-bit addresses in registers; zero-extended, it computes each from its
        32-bit offset when needed."""
        return x.to(gl.uint32, bitcast=True).to(gl.int64)

    @gluon.jit
    def _slot_scores(
        tile_meta,
        tile_halves,
        table,
        slot_heads,
        INV_FREQ,
        p_at,
        D: gl.constexpr,
        PRE_ROPE: gl.constexpr,
        WIDE: gl.constexpr,
        STARTS: gl.constexpr,
    ):
        """The exact slots' scores [4, 16, 8] of a tile's positions p_at: delta times q_c s_c
        (the slot table's, gathered by the slot's index; before RoPE q . R(p) (delta s_c e_c),
        q_c cos + q_pair sin, the sign in the table), the index and delta read from the
        tile's metadata (WIDE: fp16 deltas; else E4M3 bytes in steps of the scale)."""
        index = shared_at(tile_meta, 0, 8)
        if WIDE:  # fp16, exact
            delta = shared_at(tile_halves, 4 * STARTS[1], 16).to(gl.int16)
            delta = delta.to(gl.float16, bitcast=True).to(gl.float32)
        else:  # tiles.fp8_decode
            code = shared_at(tile_meta, 4 * STARTS[1], 8)
            half = (((code & 0x7F) << 7) | ((code & 0x80) << 8)).to(gl.int16)
            delta = half.to(gl.float16, bitcast=True).to(gl.float32) * 256.0
        slot = gl.load(table + _unsigned(gl.expand_dims(index * 8, 2) + slot_heads))  # q_c s_c
        if PRE_ROPE:
            pair = gl.load(table + D * 8 + _unsigned(gl.expand_dims(index * 8, 2) + slot_heads))
            cos, sin = trig(p_at.to(gl.float32) * gl.load(INV_FREQ + _unsigned(index % (D // 2))))
            slot = slot * gl.expand_dims(cos, 2) + pair * gl.expand_dims(sin, 2)
        return slot * gl.expand_dims(delta, 2)

    # fmt: off
    @gluon.jit(do_not_specialize=["num_splits", "first_split", "split_rows"])  # `launch`'s warmup
    def _body_kernel(
        Q, INV_FREQ, SINK, TABLE, PART, STATS,
        KC, KSCALE, KOFF, KLEV, KIDX, KDEL, NBK,   # keys: words, static scale and offset,
        VC, VSCALE, VZERO, VLEV, NBV,              # codebook, slot index and delta, body sizes
        kc_b, kc_h, vc_b, vc_h,   # code rows (D BITS / 32 words) a sequence, a head
        m_b, m_h,                 # metadata elements a sequence, a head (one a slot)
        num_kv, positions, num_splits, first_split, split_rows, sm_scale,
        G: gl.constexpr, D: gl.constexpr, BITS: gl.constexpr, BOOK: gl.constexpr,
        VBOOK: gl.constexpr, PRE_ROPE: gl.constexpr, BLOCK_N: gl.constexpr,
    ):
        # fmt: on
        """Program (b, KV head hk, split): the split-th chunk of the 64-position tiles that
        both bodies of sequence b hold, for query heads hk * G .. hk * G + G - 1, written as
        split first_split + split of PART / STATS (split_rows a head), as the Triton kernel
        writes its own. Sinks are masked (their exact copies are the Triton kernel's). BITS:
        kvcalib-2's layout (2), -3's (3), -4's (4) or -1.5's (6: the module docstring)."""
        gl.static_assert(D == 128 and BLOCK_N == 64)  # the layouts' shapes
        gl.static_assert(BITS == 2 or BITS == 3 or BITS == 4 or BITS == 6)
        gl.static_assert(gl.to_linear_layout(A_OP, [4, 16, D]) == KEYS)
        gl.static_assert(gl.to_linear_layout(A_OP, [4, D, 16]) == VALUES)
        gl.static_assert(gl.to_linear_layout(B_OP, [4, D, 8]) == QUERY)
        gl.static_assert(gl.to_linear_layout(MMA, [4, 16, 8]) == SCORES)
        gl.static_assert(gl.to_linear_layout(B_OP, [4, 16, 8]) == PROBS)
        BN: gl.constexpr = BLOCK_N
        WIDE: gl.constexpr = BITS != 2  # fp16 slot deltas and value scales, codebook values
        VQ: gl.constexpr = BITS == 6  # kvcalib-1.5: an index a 4-channel vector, no slot
        WORDS: gl.constexpr = D // (4 if VQ else 1) * BITS // 32  # a position's code words
        # code rows read by address (3 bits, kvcalib-1.5's), copied flat: a tile's in a
        # buffer of a power of two words
        ADDRESSED: gl.constexpr = BITS == 3 or VQ
        FLAT_TILE: gl.constexpr = 1024 if BITS == 3 else 512
        # the codes' ring: before RoPE one buffer (4 programs of the tables' 48 KB and it fill
        # an H100's 228 KB; the tile's codes are read before the next copy), after it two
        STAGES: gl.constexpr = 1 if PRE_ROPE else 2
        SLOT_TABLE: gl.constexpr = (2 * D + 1) * 8
        STARTS: gl.constexpr = meta_starts(WIDE)
        C: gl.constexpr = D // 2
        b, hk, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        kv = b.to(gl.int64) * num_kv + hk
        whole = gl.minimum(gl.load(NBK + b), gl.load(NBV + b)).to(gl.int32) // BN * BN
        chunk = gl.cdiv(gl.cdiv(whole, num_splits), BN) * BN
        lo = split * chunk
        hi = gl.minimum(lo + chunk, whole)
        # the slot table, [2 D + 1, 8] per program: q_c s_c (q_c where the slot's delta is
        # exact, 4 bits), the RoPE partner's +- q s_c, q . o
        gq = gl.arange(0, 8, layout=gl.SliceLayout(0, Q_ROWS))
        cq = gl.arange(0, D, layout=gl.SliceLayout(1, Q_ROWS))
        q_live = gl.expand_dims(cq >= 0, 1) & gl.expand_dims(gq < G, 0)
        q_at = Q + (kv * G) * D + gl.expand_dims(gq * D, 0)
        t_own = gl.load(q_at + gl.expand_dims(cq, 1), mask=q_live, other=0.0).to(gl.float32)
        t_pair = gl.load(q_at + gl.expand_dims((cq + C) % D, 1), mask=q_live,
                         other=0.0).to(gl.float32)  # fmt: skip
        t_pair = t_pair * gl.expand_dims(gl.where(cq < C, 1.0, -1.0), 1)
        o_q = gl.expand_dims(gl.load(KOFF + hk * D + cq).to(gl.float32), 1)
        table = TABLE + (kv * gl.num_programs(2) + split) * (SLOT_TABLE + 2 * 128)
        gl.store(table + 2 * D * 8 + gq, gl.sum(t_own * o_q, axis=0))
        if not WIDE:  # E4M3 deltas in steps of the channel's scale
            s_q = gl.expand_dims(gl.load(KSCALE + hk * D + cq).to(gl.float32), 1)
            t_own, t_pair = t_own * s_q, t_pair * s_q
        rows = gl.expand_dims(cq * 8, 1) + gl.expand_dims(gq, 0)
        gl.store(table + rows, t_own)
        gl.store(table + D * 8 + rows, t_pair)
        if WIDE:  # tables of level pairs (kvcalib-1.5: of its codebooks' entries)
            pairs, k_table, v_table = pair_tables(KLEV + hk * BOOK, VLEV + hk * VBOOK, BITS)
            keys = (k_table, k_table)
            gl.barrier()  # the tables and the slot table written
        else:
            levels = KLEV + hk * BOOK
            keys = in_registers(table + SLOT_TABLE, table_word(levels, 0),
                                 table_word(levels, 2))  # fmt: skip
            v_table = keys[0]  # unread: 2-bit values need no table
        # q^T [4, D, 8] as the B operand, K index k read from the channel key_asm puts there
        k = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_OP)))
        chan = channel_at(k, PRE_ROPE, BITS)
        heads = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, B_OP)))
        at_q = offsets(B_OP, 4, D, 8, 0, 0, D) + gl.expand_dims(gl.expand_dims(chan, 0), 2)
        head_live = gl.expand_dims(gl.expand_dims(heads < G, 0), 0) & (at_q >= 0)
        qt = gl.load(Q + (kv * G) * D + at_q, mask=head_live, other=0.0)
        if not PRE_ROPE:  # scores = (q s) . level + q . o
            s_k = gl.load(KSCALE + hk * D + chan)
            qt = (qt.to(gl.float32) * gl.expand_dims(gl.expand_dims(s_k.to(gl.float32), 0), 2)
                  ).to(gl.float16)  # fmt: skip
            q_pairs = packed_pairs(qt)
        warp = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        pos = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        at = gl.expand_dims(warp * 16, 1) + gl.expand_dims(pos, 0)  # [4, 16] in the tile
        # the pipeline: each tile's codes (a thread 16 bytes a piece of each stream) and
        # metadata copied while the tile before it is computed; the codes' buffers a ring of
        # STAGES, the metadata's a ring of 2 (read late in the tile)
        mbuf = gl.allocate_shared_memory(gl.int32, [2, 128], FLAT)
        if ADDRESSED:  # 12 (6) words a position: a tile's rows in a flat buffer
            kbuf = gl.allocate_shared_memory(gl.int32, [STAGES, FLAT_TILE], FLAT)
            vbuf = gl.allocate_shared_memory(gl.int32, [STAGES, FLAT_TILE], FLAT)
            piece = gl.arange(0, FLAT_TILE, layout=FOUR_A_THREAD)
            c_live = piece < BN * WORDS
            k_base, v_base, k_shift, v_shift = slot_bases(kbuf, vbuf, PRE_ROPE, BITS)
            keys = (k_table, k_shift)
        else:
            kbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 16, WORDS], TILE)
            vbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 16, WORDS], TILE)
            # a thread's 16-byte pieces of a tile's codes
            piece = offsets(COPY4 if WIDE else COPY, 4, 16, WORDS, 16 * WORDS, WORDS, 1)
            c_live = None
            v_shift = v_table  # unread: only words read by address are shifted
        k_at = KC + (b.to(gl.int64) * kc_b + hk * kc_h) * WORDS + piece
        v_at = VC + (b.to(gl.int64) * vc_b + hk * vc_h) * WORDS + piece
        m_at, m_live, m_width, meta, m_halves, sink_meta = meta_copy(
            KIDX, KDEL, VSCALE, VZERO, SINK, b.to(gl.int64) * m_b + hk * m_h,
            b.to(gl.int64) * positions, mbuf, at, WIDE, not VQ,
        )  # fmt: skip
        if lo < hi:
            async_copy.async_load(kbuf.index(0), k_at + lo * WORDS, mask=c_live)
            async_copy.async_load(vbuf.index(0), v_at + lo * WORDS, mask=c_live)
            async_copy.async_load(mbuf.index(0), meta_source(m_at, m_width, lo, WIDE),
                                  mask=m_live)  # fmt: skip
            async_copy.commit_group()
        ring = 0
        slot_heads = gl.expand_dims(
            gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, MMA))), 0),
            0)  # fmt: skip
        q_off = gl.load(table + 2 * D * 8 + slot_heads)
        if PRE_ROPE:  # keys x s + o, rotated by R(j) (j < 64 in the tile); q by R(start)^T
            tables = rope_tables(KSCALE + hk * D, KOFF + hk * D, INV_FREQ, D, BITS)
            q_chan = channel_at(cq, True, BITS)
            q_own = gl.load(Q + (kv * G) * D + gl.expand_dims(gq * D, 0)
                            + gl.expand_dims(q_chan, 1), mask=q_live,
                            other=0.0).to(gl.float32)  # fmt: skip
            q_pair = gl.load(Q + (kv * G) * D + gl.expand_dims(gq * D, 0)
                             + gl.expand_dims((q_chan + C) % D, 1),
                             mask=q_live, other=0.0).to(gl.float32)  # fmt: skip
            q_pair = q_pair * gl.expand_dims(gl.where(q_chan < C, 1.0, -1.0), 1)
            fq = gl.load(INV_FREQ + q_chan % C)
            cos_a, sin_a = trig(lo.to(gl.float32) * fq)
            cos_b, sin_b = trig(fq * BN)
        m_i = gl.full([4, 8], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
        l_w = gl.zeros([4, 16, 8], gl.float32, layout=MMA)
        o_w = gl.zeros([4, 16, 8], gl.float32, layout=MMA)
        acc = gl.zeros([4, D, 8], gl.float32, layout=MMA)  # transposed: channels x query heads
        for start in range(lo, hi, BN):
            async_copy.wait_group(0)  # this tile's copies landed, and (the barrier) every
            gl.barrier()  # warp's: the buffers of the tile before are free
            stage = ring * (STAGES - 1)
            k_tile, v_tile = kbuf.index(stage), vbuf.index(stage)
            if ADDRESSED:
                words = code_words(k_base, stage, 4 * FLAT_TILE, PRE_ROPE, False, BITS)
            elif WIDE:
                words = k_tile.load(KEY_PAIRS4 if PRE_ROPE else KEY_WORDS4)
            else:
                words = k_tile.load(KEY_PAIRS if PRE_ROPE else KEY_WORDS)
            if STAGES == 1:  # read before the next tile's copy overwrites them
                if ADDRESSED:
                    vw = code_words(v_base, stage, 4 * FLAT_TILE, False, True, BITS)
                else:
                    vw = v_tile.load(VALUE_WORDS4 if WIDE else VALUE_WORDS)
                gl.barrier()
            ahead = gl.minimum(start + BN, hi - BN)  # past the last tile: the last again
            next_k = kbuf.index((1 - ring) * (STAGES - 1))
            async_copy.async_load(next_k, k_at + ahead * WORDS, mask=c_live)  # budget: steady loop
            async_copy.async_load(vbuf.index((1 - ring) * (STAGES - 1)), v_at + ahead * WORDS,
                                  mask=c_live)  # fmt: skip
            async_copy.async_load(mbuf.index(1 - ring), meta_source(m_at, m_width, ahead, WIDE),
                                  mask=m_live)  # fmt: skip
            async_copy.commit_group()
            tile_meta, tile_sink = meta + ring * 512, sink_meta + ring * 512
            tile_halves = m_halves + ring * 512
            ring = 1 - ring
            if PRE_ROPE:
                q_rot = q_own * gl.expand_dims(cos_a, 1) + q_pair * gl.expand_dims(sin_a, 1)
                q_rot = gl.convert_layout(q_rot.to(gl.float16), gl.SliceLayout(0, B_OP))
                qt = gl.expand_dims(q_rot, 0).broadcast_to([4, D, 8])
                cos_a, sin_a = cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b
                s = rotated_scores(words, keys, tables, qt, BITS)
            else:
                s = scores(words, keys, q_pairs, BITS)
            if not PRE_ROPE:
                s += q_off
            if not VQ:  # the exact slot's score
                s += _slot_scores(tile_meta, tile_halves, table, slot_heads, INV_FREQ,
                                  start + at, D, PRE_ROPE, WIDE, STARTS)  # fmt: skip
            s = s * sm_scale
            s = gl.where(gl.expand_dims(shared_at(tile_sink, 0, 8) == 0, 2), s,
                         float("-inf"))  # fmt: skip
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: zeros
            p = gl.exp2(s - gl.expand_dims(m_use, 1))
            alpha = gl.expand_dims(gl.exp2(m_i - m_use), 1)
            l_w = l_w * alpha + p
            if VQ:  # static values: scale and offset a channel, applied to the output
                pw = p.to(gl.float16)
            elif WIDE:  # symmetric codebook values: scale x level
                w = shared_at(tile_halves, 4 * STARTS[2], 16).to(gl.int16)
                w = w.to(gl.float16, bitcast=True).to(gl.float32)
                pw = (p * gl.expand_dims(w, 2)).to(gl.float16)
            else:  # uniform: one-byte scale and zero point (layouts.metabyte)
                w = ((shared_at(tile_meta, 4 * STARTS[2], 8) + SCALE_BASE) << 20).to(
                    gl.float32, bitcast=True)  # fmt: skip
                v_off = -(shared_at(tile_meta, 4 * STARTS[3], 8).to(gl.float32) * ZERO_STEP) * w
                o_w = o_w * alpha + p * gl.expand_dims(v_off, 2)
                pw = (p * gl.expand_dims(w, 2)).to(gl.float16)
            if STAGES == 2:
                if ADDRESSED:
                    vw = code_words(v_base, stage, 4 * FLAT_TILE, False, True, BITS)
                else:
                    vw = v_tile.load(VALUE_WORDS4 if WIDE else VALUE_WORDS)
            acc = value_products(vw, v_table, v_shift, pw, acc * alpha, BITS)
            m_i = m_new
        async_copy.wait_group(0)  # the last tile's copy again: landed before the memory is reused
        if PRE_ROPE:
            rope_kept(tables)
        if WIDE:  # the tables of level pairs, read by address: kept allocated (`rope_kept`)
            gl.inline_asm("", ("r",), [pairs], [], is_pure=False)
        # the warps' splits merged at their largest max (-inf where nothing was read)
        m_all = gl.max(m_i, axis=0)
        scale = gl.exp2(m_i - gl.expand_dims(gl.where(m_all == float("-inf"), 0.0, m_all), 0))
        COLS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, MMA))
        total = gl.convert_layout(gl.sum(gl.sum(l_w, axis=1) * scale, axis=0), COLS)
        offset = gl.convert_layout(gl.sum(gl.sum(o_w, axis=1) * scale, axis=0), COLS)
        row = gl.arange(0, D, layout=gl.SliceLayout(1, gl.SliceLayout(0, MMA)))
        out = gl.sum(acc * gl.expand_dims(scale, 1), axis=0)
        if VQ:  # offset + scale x entry a channel: sum_p p (o + s e) = o l + s (sum_p p e)
            v_at = hk * D + value_channel(row)
            v_s = gl.expand_dims(gl.load(VSCALE + v_at).to(gl.float32), 1)
            v_o = gl.expand_dims(gl.load(VZERO + v_at).to(gl.float32), 1)
            out = out * v_s + v_o * gl.expand_dims(total, 0)
        elif not WIDE:  # the rows' powers of two (`value_unit`), the zero points' term
            out = out * gl.expand_dims(value_unit(row), 1) + gl.expand_dims(offset, 0)
        head = gl.arange(0, 8, layout=COLS)
        line = (kv * G + head) * split_rows + first_split + split  # [8] rows of PART / STATS
        gl.store(PART + gl.expand_dims(line * D, 0) + gl.expand_dims(value_channel(row), 1), out,
                 mask=gl.expand_dims(row >= 0, 1) & gl.expand_dims(head < G, 0))  # fmt: skip
        gl.store(STATS + line * 2, gl.convert_layout(m_all, COLS), mask=head < G)
        gl.store(STATS + line * 2 + 1, total, mask=head < G)


def runs_on(device) -> bool:
    """Whether the kernel is launched for tensors on `device`: a GPU's (the tests execute it on
    the CPU by saying yes here)."""
    return torch.device(device).type == "cuda"


# What `_body_kernel` reads, by code width: the fields of the keys' and the values'
# StreamLayout (kvcalib-2's layout at 2 bits, kvcalib-3's at 3, kvcalib-4's at 4, kvcalib-1.5's
# at 6, its vectors' index width; no ring; code rows of words, or of bytes: `copied_strides`
# checks them whole words)
STATIC, TOKEN, VECTORS = int(Kind.STATIC), int(Kind.TOKEN), int(Kind.VECTORS)
READS = {
    2: (dict(GRAN=STATIC, CB=True, SYM=False, K=1, FP8=True),
        dict(GRAN=TOKEN, CB=False, SYM=False, K=0, BYTE=True, GROUP=128)),
    3: (dict(GRAN=STATIC, CB=True, SYM=False, K=1, FP8=False),
        dict(GRAN=TOKEN, CB=True, SYM=True, K=0, BYTE=False, GROUP=128)),
    4: (dict(GRAN=STATIC, CB=True, SYM=False, K=1, FP8=False),
        dict(GRAN=TOKEN, CB=True, SYM=True, K=0, BYTE=False, GROUP=128)),
    6: (dict(GRAN=VECTORS, CB=True, K=0, GROUP=4, PAIRS=True),
        dict(GRAN=VECTORS, CB=True, K=0, GROUP=4, PAIRS=False)),
}  # fmt: skip


def applies(k_layout, v_layout, head_dim: int, group: int, dtype, paged: bool, window) -> bool:
    """Whether `_body_kernel` reads these streams (`READS`; the module docstring's layouts)."""
    if k_layout.BITS not in READS or v_layout.BITS != k_layout.BITS:
        return False
    wanted = READS[k_layout.BITS]
    read = all(
        all(getattr(layout, name) == value for name, value in fields.items())
        and layout.UNIT in (8, 32) and not layout.RING
        for layout, fields in zip((k_layout, v_layout), wanted, strict=True)
    )  # fmt: skip
    return (available() and read and head_dim == 128 and group <= 8
            and dtype == torch.float16 and not paged and not window)  # fmt: skip


def copied_strides(ks, vs, sinks, words: int, slots: bool = True) -> tuple[int, ...]:
    """The strides the kernel's copies take: each code buffer's (sequence, head) in rows of
    `words` words (so that the compiler knows each row's 16-byte pieces aligned), then the
    one element stride pair of the slot index, slot delta and value metadata (`meta_copy`
    copies them with one offset; without `slots`, kvcalib-1.5's, none: zeros). Raises where
    the buffers are not as the copies read them: dense code rows, one element a slot alike in
    each per-head stream, every buffer word-aligned (its storage's start is: allocators align
    it)."""
    rows = []
    for codes, strides in ((ks.codes, ks.strides.codes), (vs.codes, vs.strides.codes)):
        b, h, p = (s * codes.element_size() for s in strides)  # bytes (rows of UNIT 8: bytes)
        if p != 4 * words or b % (4 * words) or h % (4 * words):
            raise ValueError(f"the whole-tile kernel copies dense {words}-word code rows: "
                             f"{strides}")  # fmt: skip
        rows += [b // (4 * words), h // (4 * words)]
    meta = {ks.strides.index, ks.strides.delta, vs.strides.meta} if slots else {(0, 0, 1)}
    buffers = (ks.codes, vs.codes, ks.slot_index, ks.slot_delta, vs.scale, vs.offset,
               sinks.is_sink)  # fmt: skip
    shifted = any(t.storage_offset() * t.element_size() % 4 for t in buffers)
    if len(meta) != 1 or next(iter(meta))[2] != 1 or shifted:
        raise ValueError(f"the whole-tile kernel copies word-aligned metadata rows alike: {meta}")
    ((b, h, _),) = meta
    return (*rows, b, h)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """A code buffer as the kernel reads it, int32 words (rows of bytes, UNIT 8, viewed so:
    `copied_strides` has checked them whole words)."""
    return codes if codes.dtype == torch.int32 else codes.view(torch.int32)


def launch(q, ks, vs, k_layout, v_layout, sinks, inv_freq, part, stats, splits: int,
           first_split: int, sm_scale: float, positions: int, warmup: bool = False):  # fmt: skip
    """`_body_kernel` over (sequences, KV heads, splits) for decode_attention: its splits are
    rows first_split .. first_split + splits - 1 of part / stats (the Triton kernel's before
    them). Returns the compiled kernel (its registers and shared memory size the splits);
    `warmup`: compiled, not launched (the split counts are not specialized on: the launch
    that follows runs this compile)."""
    B, H, _, D = q.shape
    hkv = ks.tail.shape[1]
    bits, slots = k_layout.BITS, k_layout.K > 0
    words = D // k_layout.GROUP * bits // 32 if bits == 6 else D * bits // 32  # a code row
    # per program: the slot table [2 D + 1, 8] and the table words of each thread (2 x 128)
    table = torch.empty(B * hkv * splits, (2 * D + 1) * 8 + 2 * 128, device=q.device,
                        dtype=torch.float32)  # fmt: skip
    grid = (B, hkv, splits)
    run = functools.partial(_body_kernel.warmup, grid=grid) if warmup else _body_kernel[grid]
    return run(
        q, inv_freq if inv_freq is not None else table, sinks.is_sink, table, part, stats,
        _words(ks.codes), ks.scale, ks.offset, ks.levels, ks.slot_index, ks.slot_delta,
        ks.n_body, _words(vs.codes), vs.scale, vs.offset, vs.levels, vs.n_body,
        *copied_strides(ks, vs, sinks, words, slots), hkv, positions, splits, first_split,
        first_split + splits, sm_scale,
        G=H // hkv, D=D, BITS=bits, BOOK=k_layout.BOOK, VBOOK=v_layout.BOOK,
        PRE_ROPE=inv_freq is not None, BLOCK_N=BLOCK_N,
        num_warps=WARPS, num_stages=1,  # its pipeline is its own (cp.async), not Triton's
        maxnreg=MAX_REGISTERS[inv_freq is not None, bits],
    )  # fmt: skip
