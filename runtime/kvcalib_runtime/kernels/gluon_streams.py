"""What kernels.decode_gluon's tiles read besides their codes in their operands' layouts: the
codebooks' tables (2 bits: two table words in every thread's ordinary registers,
`in_registers`; 3 and 4 bits and kvcalib-1.5's vectors: tables in shared memory,
`pair_tables`), code words read by address (3 bits, kvcalib-1.5's: `slot_bases`,
`code_words`) and the per-position metadata, copied a tile ahead by cp.async (`meta_copy`,
`meta_source`) and read by address (`shared_at`). Imported by decode_gluon (and
benchmarks/kernel_floor's skeleton) where its Gluon is available.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kvcalib_runtime.kernels.gluon_layouts import (
    FLAT,
    FOUR_A_THREAD,
    KEY_SLOTS3,
    KEY_SLOTS6,
    ONE_A_THREAD,
    VALUE_SLOTS3,
    pair_addresses,
)
from kvcalib_runtime.kernels.gluon_ptx import rows_asm, shared_asm
from kvcalib_runtime.kernels.gluon_rows import (
    ROW3,
    ROW6,
    key3_pairs_slots_asm,
    key3_slots_asm,
    value3_slots_asm,
    vq_key_slots_asm,
    vq_value_slots_asm,
)

ROW = gl.constexpr(ROW3)  # bytes a position of 3-bit code rows
ROW_VQ = gl.constexpr(ROW6)  # and of kvcalib-1.5's


@gluon.jit
def in_registers(at, lo, hi):
    """The two table words (every thread's the same) in ordinary registers of each thread,
    and a barrier (which also publishes what the program wrote before it). ptxas keeps a
    value every thread shares in a uniform register, and a permute's table operands must
    be ordinary ones: it copied them in before each permute, ~40 copies a tile. Each thread
    stores them at at[2t ..] and reads its neighbour's copy (t ^ 1) after the barrier: a
    value ptxas cannot know is shared, held in registers across the loop."""
    tid = gl.arange(0, 128, layout=ONE_A_THREAD)
    at = at.to(gl.pointer_type(gl.int32), bitcast=True)
    mine, theirs = at + 2 * tid, at + 2 * (tid ^ 1)
    gl.store(mine, gl.full([128], lo, gl.int32, ONE_A_THREAD))
    gl.store(mine + 1, gl.full([128], hi, gl.int32, ONE_A_THREAD))
    gl.barrier()
    return gl.load(theirs), gl.load(theirs + 1)


@gluon.jit
def table_word(LEVELS, first: gl.constexpr):
    """Levels first, first + 1 of a codebook row (fp32) as one int32 of two fp16."""
    a = gl.load(LEVELS + first).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32)
    b = gl.load(LEVELS + first + 1).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32)
    return (a & 0xFFFF) | (b << 16)


@gluon.jit
def pair_tables(KLEV, VLEV, BITS: gl.constexpr):
    """The keys' and the values' tables of level pairs (BITS 4 or 3, gluon_ptx's
    `_pair_key_decode`, gluon_rows' `_pair3_key_decode`) in shared memory, from their codebook
    rows KLEV, VLEV (2^BITS levels): entry x of each the fp16 levels of codes x % 2^BITS and
    x >> BITS (256 words apart; at 3 bits the first 64 read). BITS 6: kvcalib-1.5's codebooks
    (64 entries of 4 coordinates), word x of each the fp16 coordinates 2x and 2x + 1 (an
    entry's two words at 8 index bytes: gluon_rows' `_vq_key_decode`; the first 128 read).
    Returns the buffer (to keep it allocated: the loop reads it by address) and each table's
    shared address."""
    x = gl.arange(0, 512, layout=FOUR_A_THREAD)
    row = gl.where(x < 256, KLEV, VLEV)
    LEVELS: gl.constexpr = 1 << BITS
    if BITS == 6:
        lo_at, hi_at = 2 * (x % 128), 2 * (x % 128) + 1
    else:
        lo_at, hi_at = x % LEVELS, ((x % 256) >> BITS) % LEVELS
    lo = gl.load(row + lo_at).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32)
    hi = gl.load(row + hi_at).to(gl.float16).to(gl.int16, bitcast=True)
    pairs = gl.allocate_shared_memory(gl.int32, [512], FLAT)
    pairs.store((lo & 0xFFFF) | (hi.to(gl.int32) << 16))
    k_table, v_table = pair_addresses(pairs)
    return pairs, k_table, v_table


@gluon.constexpr_function
def meta_starts(WIDE):
    """The words of `meta_copy`'s buffer where its five streams start (and where they
    end): 17 words a one-byte stream, 33 a two-byte one (none for the zero points at 4
    bits)."""
    words = (17, 33, 33, 0, 17) if WIDE else (17, 17, 17, 17, 17)
    return [sum(words[:s]) for s in range(6)]


@gluon.jit
def meta_copy(KIDX, KDEL, VSCALE, VZERO, SINK, head_at, sink_at, mbuf, tile,
               WIDE: gl.constexpr, SLOTS: gl.constexpr):  # fmt: skip
    """The copy of a tile's per-position streams: its slot indices, slot deltas, value scales and
    zero points (elements head_at + p of each: one offset, `copied_strides`) and sink flags
    (sink_at + p), 64 a stream; one byte each, or WIDE (3, 4 bits: deltas and scales fp16, no
    zero points); without SLOTS (kvcalib-1.5: no per-position metadata) the sink flags alone.
    cp.async copies 4 bytes at least, and a row of one byte a slot starts anywhere in a word (of
    two bytes, at either half): each stream is copied as the 17 (33) words from the one holding
    its first byte, one word a thread (the last only where that byte is not a word's first, so
    that every word read holds a byte of its tensor), stream s from word `meta_starts(WIDE)[s]`
    of a buffer of `mbuf`'s ring, its first byte `lead` bytes in. Returns (each thread's source
    word at position 0, whether it copies, as async_load takes them, and its stream's bytes a
    position; the shared addresses, in buffer 0, of tile positions `tile` [4, 16] of the
    one-byte per-head streams, of the two-byte ones (less their start) and of the sink flags:
    `shared_at` reads them)."""
    STARTS: gl.constexpr = meta_starts(WIDE)
    e = gl.arange(0, 128, layout=ONE_A_THREAD)
    stream = ((e >= STARTS[1]).to(gl.int32) + (e >= STARTS[2]).to(gl.int32)
              + (e >= STARTS[3]).to(gl.int32) + (e >= STARTS[4]).to(gl.int32))  # fmt: skip
    word = e - gl.where(stream == 0, 0, gl.where(stream == 1, STARTS[1], gl.where(
        stream == 2, STARTS[2], gl.where(stream == 3, STARTS[3], STARTS[4]))))  # fmt: skip
    WIDTH: gl.constexpr = 2 if WIDE else 1  # of the slot deltas and value scales
    width = gl.where((stream == 1) | (stream == 2), WIDTH, 1)
    shift = (head_at & 3).to(gl.int32)
    half_shift = ((2 * head_at) & 3).to(gl.int32)
    sink_shift = (sink_at & 3).to(gl.int32)
    lead = gl.where(stream == 4, sink_shift, gl.where(width == 2, half_shift, shift))
    i8: gl.constexpr = gl.pointer_type(gl.int8)
    per_head = gl.where(stream == 0, KIDX.to(i8, bitcast=True),
                        gl.where(stream == 1, KDEL.to(i8, bitcast=True),
                                 gl.where(stream == 2, VSCALE.to(i8, bitcast=True),
                                          VZERO.to(i8, bitcast=True))))  # fmt: skip
    at = gl.where(stream == 4, SINK.to(i8, bitcast=True) + sink_at,
                  per_head + head_at * width)  # fmt: skip
    at = (at + (4 * word - lead)).to(gl.pointer_type(gl.int32), bitcast=True)
    live = (stream < 5) & ((word < 16 * width) | (lead > 0))
    if not SLOTS:
        live = live & (stream == 4)
    heads, halves, sinks = gl.inline_asm(
        rows_asm, ("=r", "=r", "=r", "r", "r", "r", "r", "r", "r"),
        [mbuf, mbuf, mbuf, tile + shift, 2 * tile + half_shift,
         tile + 4 * STARTS[4] + sink_shift], [tile.type] * 3, is_pure=False,
    )  # fmt: skip
    return at, live, width, heads, halves, sinks


@gluon.jit
def meta_source(at, width, start, WIDE: gl.constexpr):
    """`meta_copy`'s source words for the tile at `start` (a multiple of 64)."""
    return at + (start // 4) * width if WIDE else at + start // 4


@gluon.jit
def shared_at(at, OFFSET: gl.constexpr, BITS: gl.constexpr):
    """The BITS-bit unsigned integer (8 or 16) at shared address at + OFFSET, zero-extended
    (the address is one that Gluon's allocator does not see: `meta_copy`'s)."""
    return gl.inline_asm_elementwise(shared_asm(OFFSET, BITS), "=r,r", [at], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def slot_bases(kbuf, vbuf, PAIRS: gl.constexpr, BITS: gl.constexpr):
    """Where code rows are read by address (3 bits, 48 bytes a position; 6, kvcalib-1.5's
    vectors, 24), each thread's shared address in the first tile of `kbuf` and `vbuf` from
    which `code_words` reads its words, lane (i, r) of warp w: at 3 bits, keys word 3i
    (PAIRS: word 3i // 2) of position 16w + r, values word 3r // 2 of position 16w + 2i; at 6,
    keys word 3i // 2, values word 3r // 4; and the shift of its key and value words (the
    bit its first code starts at)."""
    tid = gl.arange(0, 128, layout=ONE_A_THREAD)
    i, r, w = tid & 3, (tid >> 2) & 7, tid >> 5
    if BITS == 6:
        k_at = (16 * w + r) * ROW_VQ + 4 * ((3 * i) >> 1)
        v_at = (16 * w + 2 * i) * ROW_VQ + 4 * ((3 * r) >> 2)
        k_shift, v_shift = 16 * (i & 1), 8 * ((3 * r) & 3)
    else:
        k_word = (3 * i) >> 1 if PAIRS else 3 * i
        k_at = (16 * w + r) * ROW + 4 * k_word
        v_at = (16 * w + 2 * i) * ROW + 4 * ((3 * r) >> 1)
        k_shift, v_shift = 16 * (i & 1), 16 * (r & 1)
    k_base, v_base = gl.inline_asm(rows_asm, ("=r", "=r", "r", "r", "r", "r"),
                                   [kbuf, vbuf, k_at, v_at], [tid.type] * 2,
                                   is_pure=False)  # fmt: skip
    return k_base, v_base, k_shift, v_shift


@gluon.jit
def code_words(base, ring, TILE_BYTES: gl.constexpr, PAIRS: gl.constexpr,
               VALUES: gl.constexpr, BITS: gl.constexpr):  # fmt: skip
    """A tile's code words read by address (BITS 3 or 6: `slot_bases`) in buffer `ring` of a
    ring of tiles TILE_BYTES apart: the keys' (KEY_SLOTS3, with PAIRS read as pairs; at 6
    KEY_SLOTS6) or the values' (VALUES: VALUE_SLOTS3)."""
    at = base + ring * TILE_BYTES
    if VALUES:
        out = gl.inline_asm(value3_slots_asm if BITS == 3 else vq_value_slots_asm, ("=r", "r"),
                            [at], gl.distributed_type(gl.int32, [4, 16, 8, 2], VALUE_SLOTS3),
                            is_pure=False)  # fmt: skip
    elif BITS == 6:
        out = gl.inline_asm(vq_key_slots_asm, ("=r", "r"), [at],
                            gl.distributed_type(gl.int32, [4, 16, 4, 2], KEY_SLOTS6),
                            is_pure=False)  # fmt: skip
    else:
        out = gl.inline_asm(key3_pairs_slots_asm if PAIRS else key3_slots_asm, ("=r", "r"),
                            [at], gl.distributed_type(gl.int32, [4, 16, 4, 4], KEY_SLOTS3),
                            is_pure=False)  # fmt: skip
    return out
