"""The inline PTX of kernels.decode_gluon's layouts whose code rows are read by address, their
words at constant offsets from one shared address a thread (no linear layout splits a row among
a row's 4 lanes): 3-bit codebooks (12 words a position; a pair of codes, 6 bits, indexes a
table of level pairs) and kvcalib-1.5's vectors (6 words; a 6-bit index, one ld.shared.v2 of
its entry's four fp16). Constexpr functions as kernels.gluon_ptx's, on its fragments and
products. Imported by decode_gluon where its Gluon is available.
"""

from triton.experimental import gluon

from kvcalib_runtime.kernels.gluon_ptx import (
    block_products,
    chunked_scores,
    declared,
    fragments,
    pair_value_register,
    rotated_lines,
    transposed,
    unpacked,
)


@gluon.constexpr_function
def _field(dst: str, words, bit: int, width: int) -> list[str]:
    """PTX: dst the `width` bits at `bit` of the bit string `words` (registers, the first's
    bit 0 first): one shift, or one funnel shift where they cross a word, then a mask."""
    w, off = divmod(bit, 32)
    if off + width > 32:
        lines = [f"shf.r.clamp.b32 {dst}, {words[w]}, {words[w + 1]}, {off};"]
    elif off:
        lines = [f"shr.u32 {dst}, {words[w]}, {off};"]
    else:
        lines = [f"mov.b32 {dst}, {words[w]};"]
    return [*lines, f"and.b32 {dst}, {dst}, {2**width - 1};"]


@gluon.constexpr_function
def pair3_key_register(h: int, j: int) -> int:
    """A_OP register of pair j (codes 2j, 2j + 1) of a 3-bit key group of position r + 8h
    (words 3i .. 3i + 2: 32 codes): k-step j // 2, its half j % 2."""
    return h + 2 * (j & 1) + 4 * (j >> 1)


@gluon.constexpr_function
def _pair3_key_decode(a, words, table, chunks=(0, 1, 2, 3)) -> list[str]:
    """PTX: 3-bit key groups (registers e + 4h, e < 3: words 3i + e of position r + 8h, code
    n at bits 3n of the group) into A_OP registers a (`pair3_key_register`): pair j, the 6
    bits at 6j, indexes a table of level pairs (64 words at the shared address `table`:
    entry x the levels of codes x % 8 and x // 8). `chunks`: as `_pair_key_decode`'s.
    Temporary s."""
    lines = []
    for h in range(2):
        group = words[4 * h : 4 * h + 3]
        for j in range(16):
            if (j >> 1) % 4 in chunks:
                r = pair3_key_register(h, j)
                lines += [*_field("s", group, 6 * j, 6), f"mad.lo.u32 s, s, 4, {table};",
                          f"ld.shared.b32 {a[r]}, [s];"]  # fmt: skip
    return lines


@gluon.constexpr_function
def _shifted(words, shift: str, groups: int) -> list[str]:
    """PTX: 3-bit groups of 48 bits (16 codes), each the two words (2n, 2n + 1) that hold it
    less `shift` bits (16 where the group starts at a word's middle), into x_n (its first 32
    bits) and y_n (the 16 after them)."""
    lines = []
    for n in range(groups):
        first, second = words[2 * n], words[2 * n + 1]
        lines += [f"shf.r.clamp.b32 x{n}, {first}, {second}, {shift};",
                  f"shr.u32 y{n}, {second}, {shift};"]  # fmt: skip
    return lines


@gluon.constexpr_function
def _pair3_rope_key_decode(a, table, chunks=(0, 1, 2, 3)) -> list[str]:
    """PTX: pre-RoPE 3-bit key groups, shifted into x_(2h + g), y_(2h + g) (`_shifted`: the 16
    channels 16i .. 16i + 15 of position r + 8h, g = 0, and their RoPE partners 64 on, g = 1),
    into A_OP registers a: pair j (6 bits at 6j) indexes the table of level pairs
    (`_pair3_key_decode`'s) into `pair3_key_register`(h, j), k-step j // 2, 4 k-steps on for
    the partners (K index k ^ 64). `chunks`: k-steps j // 2 (and 4 on) to decode. Temporary
    s."""
    lines = []
    for h in range(2):
        for g in range(2):
            for j in range(8):
                if j >> 1 in chunks:
                    group = [f"x{2 * h + g}", f"y{2 * h + g}"]
                    lines += [
                        *_field("s", group, 6 * j, 6),
                        f"mad.lo.u32 s, s, 4, {table};",
                        f"ld.shared.b32 {a[pair3_key_register(h, j) + 16 * g]}, [s];",
                    ]
    return lines


@gluon.constexpr_function
def _pair3_value_blocks(a, words, shift: str, table) -> list[list[str]]:
    """PTX: 3-bit value groups into the transposed values' A_OP registers a (row r + 8q holding
    channel 16r + q, as at 4 bits: `pair_value_register`'s order), as the lines of each
    16-row block j (channels 16r + 2j, + 1). Registers 2b + 4c, + 1 (the words holding bits
    48r .. 48r + 47 of position 2i + b + 8c: channels 16r .. 16r + 15) are first shifted by
    `shift` (16 where r is odd) into x_(b + 2c) and y_(b + 2c); pair j (6 bits at 6j) of each
    position indexes the table of level pairs (`_pair3_key_decode`'s) and two permutes put
    each channel's two positions in one register. Temporaries s, t, u, x0 .. x3, y0 .. y3,
    p0 .. p3."""
    lines = _shifted(words, shift, 4)
    blocks = []
    for j in range(8):
        for n in range(4):
            lines += [*_field("s", [f"x{n}", f"y{n}"], 6 * j, 6),
                      f"mad.lo.u32 s, s, 4, {table};", f"ld.shared.b32 p{n}, [s];"]  # fmt: skip
        for c in range(2):
            even, odd = pair_value_register(2 * j, 0, c), pair_value_register(2 * j + 1, 0, c)
            lines += [f"prmt.b32 {a[even]}, p{2 * c}, p{2 * c + 1}, 0x5410;",
                      f"prmt.b32 {a[odd]}, p{2 * c}, p{2 * c + 1}, 0x7632;"]  # fmt: skip
        blocks.append(lines)
        lines = []
    return blocks


@gluon.constexpr_function
def _vq_key_decode(a, table, chunks=(0, 1, 2, 3)) -> list[str]:
    """PTX: kvcalib-1.5's key vector indices (6 bits; vector V holds channels 2V, 2V + 1 and
    their RoPE partners 64 on), shifted into x_h, y_h (`_shifted`: vectors 8i .. 8i + 7 of
    position r + 8h, the 48 bits of channels 16i .. 16i + 15 and their partners), into A_OP
    registers a: vector v's codebook entry (two words at table + 8 index: its channels' two
    fp16, its partners') into `pair3_key_register`(h, v) and the register 16 on (k-step v // 2
    and its partner's, 4 on), one ld.shared.v2. `chunks`: k-steps v // 2 (and 4 on) to
    decode. Temporary s."""
    lines = []
    for h in range(2):
        for v in range(8):
            if v >> 1 in chunks:
                r = pair3_key_register(h, v)
                lines += [*_field("s", [f"x{h}", f"y{h}"], 6 * v, 6),
                          f"mad.lo.u32 s, s, 8, {table};",
                          f"ld.shared.v2.b32 {{{a[r]}, {a[r + 16]}}}, [s];"]  # fmt: skip
    return lines


@gluon.constexpr_function
def _vq_value_blocks(a, words, shift: str, table) -> list[list[str]]:
    """PTX: kvcalib-1.5's value vector indices (6 bits; vector u holds channels 4u .. 4u + 3)
    into the transposed values' A_OP registers a (row r + 8 nu holding channel 16r + nu), as
    the lines of each 16-row block m (channels 16r + 2m, + 1). Registers 2n, 2n + 1 (n = b +
    2c: the words holding vectors 4r .. 4r + 3 of position 2i + b + 8c) are first shifted by
    `shift` (24r mod 32) into x_n; vector 4r + u's entry of each position (two words:
    channels 4u, 4u + 1 and 4u + 2, 4u + 3) is loaded by one ld.shared.v2 (table + 8 index)
    and two permutes a word put each channel's two positions in one register (blocks 2u,
    2u + 1). Temporaries s, x0 .. x3, p0 .. p3."""
    lines = [f"shf.r.clamp.b32 x{n}, {words[2 * n]}, {words[2 * n + 1]}, {shift};"
             for n in range(4)]  # fmt: skip
    blocks = []
    for u in range(4):
        for c in range(2):
            for b in range(2):
                lines += [*_field("s", [f"x{b + 2 * c}"], 6 * u, 6),
                          f"mad.lo.u32 s, s, 8, {table};",
                          f"ld.shared.v2.b32 {{p{2 * b}, p{2 * b + 1}}}, [s];"]  # fmt: skip
            for word in range(2):
                for parity in range(2):
                    nu = 4 * u + 2 * word + parity
                    select = 0x7632 if parity else 0x5410
                    lines.append(f"prmt.b32 {a[(nu & 1) + 2 * c + 4 * (nu >> 1)]}, p{word}, "
                                 f"p{2 + word}, {select:#06x};")  # fmt: skip
        blocks += [lines, []]  # block 2u + 1's registers written with block 2u's
        lines = []
    return blocks


@gluon.constexpr_function
def key3_asm(outputs, inputs):
    """3-bit key groups to fp16 A_OP values (`_pair3_key_decode` alone, as `key_asm`): the
    words, then the table of level pairs' shared address."""
    (out,), (words, (table,)) = outputs, inputs
    a = fragments("a", len(out) // 2)
    lines = [declared(*a), *_pair3_key_decode(a, words, table), *unpacked(out, a)]
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def key3_pairs_asm(outputs, inputs):
    """Pre-RoPE 3-bit key groups to fp16 A_OP values (`_pair3_rope_key_decode` alone, as
    `key_asm`): the words (registers 4h + 2g, + 1: `_shifted`'s), each thread's shift, the
    table of level pairs' shared address."""
    (out,), (words, (shift,), (table,)) = outputs, inputs
    return _shifted_decode(out, words, shift, 4, lambda a: _pair3_rope_key_decode(a, table))


@gluon.constexpr_function
def _shifted_decode(out, words, shift: str, groups: int, decode) -> str:
    """PTX: `groups` of words shifted (`_shifted`), `decode`(a) into A_OP registers a, then
    split into the fp16 outputs out (the register tests' blocks)."""
    a = fragments("a", len(out) // 2)
    lines = [declared(*a), *_shifted(words, shift, groups), *decode(a), *unpacked(out, a)]
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def vq_key_asm(outputs, inputs):
    """kvcalib-1.5's key vector indices to fp16 A_OP values (`_vq_key_decode` alone, as
    `key_asm`): the words (registers 2h, 2h + 1), each thread's shift, the codebook table's
    shared address."""
    (out,), (words, (shift,), (table,)) = outputs, inputs
    return _shifted_decode(out, words, shift, 2, lambda a: _vq_key_decode(a, table))


@gluon.constexpr_function
def vq_value_asm(outputs, inputs):
    """kvcalib-1.5's value vector indices to fp16 A_OP values of the transposed values
    (`_vq_value_blocks` alone): the words, each thread's shift, the table's shared address."""
    (out,), (words, (shift,), (table,)) = outputs, inputs
    return _blocks_alone(out, lambda a: _vq_value_blocks(a, words, shift, table))


@gluon.constexpr_function
def _blocks_alone(out, blocks_of) -> str:
    """PTX: the lines of `blocks_of`(a), a value decode's blocks, into the transposed values'
    A_OP registers a, split into the fp16 outputs out (the register tests' blocks)."""
    a = fragments("a", len(out) // 2)
    lines = [declared(*a), *(line for block in blocks_of(a) for line in block), *unpacked(out, a)]
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def scores_vq_asm(outputs, inputs):
    """`scores_asm` for kvcalib-1.5's key vector indices (`_vq_key_decode`): the words, each
    thread's shift, the table's shared address, q^T's pairs."""
    (out,), (words, (shift,), (table,), q) = outputs, inputs
    a = fragments("a", 2 * len(q))
    decode = lambda ks: _vq_key_decode(a, table, ks)  # noqa: E731
    lines = [declared(*a), *_shifted(words, shift, 2), *chunked_scores(out, a, q, decode)]
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def values_vq_asm(outputs, inputs):
    """`values_asm` for kvcalib-1.5's value vector indices (`_vq_value_blocks`): the words,
    each thread's shift, the table's shared address, the probabilities, acc."""
    (out,), (words, (shift,), (table,), p, acc) = outputs, inputs
    return _products(out, p, acc, lambda a: _vq_value_blocks(a, words, shift, table))


@gluon.constexpr_function
def _products(out, p, acc, blocks_of) -> str:
    """PTX: `values_asm` from a value decode's blocks (`blocks_of`(a)): the probabilities
    transposed, then each block's product right after its decode."""
    a, b = fragments("a", len(out)), fragments("b", 2)
    lines = [declared(*a, *b), *transposed(b, p), *block_products(out, a, b, acc, blocks_of(a))]
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def value3_asm(outputs, inputs):
    """3-bit value groups to fp16 A_OP values of the transposed values (`_pair3_value_blocks`
    alone): the words, each thread's shift, the table's shared address."""
    (out,), (words, (shift,), (table,)) = outputs, inputs
    return _blocks_alone(out, lambda a: _pair3_value_blocks(a, words, shift, table))


@gluon.constexpr_function
def scores3_asm(outputs, inputs):
    """`scores_asm` for 3-bit key groups (`_pair3_key_decode`): the words, the table's shared
    address, q^T's pairs."""
    (out,), (words, (table,), q) = outputs, inputs
    a = fragments("a", 2 * len(q))
    decode = lambda ks: _pair3_key_decode(a, words, table, ks)  # noqa: E731
    return "\n".join([declared(*a), *chunked_scores(out, a, q, decode)]) + " }"


@gluon.constexpr_function
def values3_asm(outputs, inputs):
    """`values_asm` for 3-bit value groups (`_pair3_value_blocks`): the words, each thread's
    shift, the table's shared address, the probabilities, acc."""
    (out,), (words, (shift,), (table,), p, acc) = outputs, inputs
    return _products(out, p, acc, lambda a: _pair3_value_blocks(a, words, shift, table))


@gluon.constexpr_function
def rotated_scores3_asm(outputs, inputs):
    """`rotated_scores_asm` for pre-RoPE 3-bit key groups (`_pair3_rope_key_decode`): the
    words, each thread's shift, the table of level pairs' shared address, the six tables'
    rows, q_a^T."""
    (out,), (words, (shift,), (table,), r1, r2, r3, r4, r5, r6, qh) = outputs, inputs
    return rotated_lines(out, (r1, r2, r3, r4, r5, r6), qh, _shifted(words, shift, 4),
                         lambda a, ks: _pair3_rope_key_decode(a, table, ks))  # fmt: skip


@gluon.constexpr_function
def rotated_scores_vq_asm(outputs, inputs):
    """`rotated_scores_asm` for kvcalib-1.5's key vector indices (`_vq_key_decode`): the words,
    each thread's shift, the table's shared address, the six tables' rows, q_a^T."""
    (out,), (words, (shift,), (table,), r1, r2, r3, r4, r5, r6, qh) = outputs, inputs
    return rotated_lines(out, (r1, r2, r3, r4, r5, r6), qh, _shifted(words, shift, 2),
                         lambda a, ks: _vq_key_decode(a, table, ks))  # fmt: skip


@gluon.constexpr_function
def _loaded(out, base, offsets) -> str:
    """PTX: out[m] the word at shared address base + offsets[m] (None: zero, a register the
    decode does not read)."""
    return "\n".join(
        f"ld.shared.b32 {x}, [{base} + {at}];" if at is not None else f"mov.b32 {x}, 0;"
        for x, at in zip(out, offsets, strict=True)
    )


# A tile's 3-bit code rows in shared memory, 48 bytes a position (12 words): each thread's
# words at constant offsets from one address of its own (decode_gluon's `slot_bases`)
ROW3 = 48


@gluon.constexpr_function
def key3_slots_asm(outputs, inputs):
    """Post-RoPE 3-bit key words (gluon_layouts.KEY_SLOTS3: words 3i + e of positions r, r + 8
    in registers e + 4h, e < 3; e = 3 unread) from the address of word 3i of position r."""
    (out,), ((base,),) = outputs, inputs
    return _loaded(out, base, [4 * (m % 4) + 8 * ROW3 * (m // 4) if m % 4 < 3 else None
                               for m in range(len(out))])  # fmt: skip


@gluon.constexpr_function
def key3_pairs_slots_asm(outputs, inputs):
    """Pre-RoPE 3-bit key words (KEY_SLOTS3 read as pairs: the two words holding channels 16i
    .. 16i + 15 of positions r, r + 8, then the two holding their RoPE partners, 6 words on, in
    registers 4h + 2g, + 1) from the address of the first word of position r."""
    (out,), ((base,),) = outputs, inputs
    return _loaded(out, base, [4 * (m % 2) + 24 * ((m // 2) % 2) + 8 * ROW3 * (m // 4)
                               for m in range(len(out))])  # fmt: skip


@gluon.constexpr_function
def value3_slots_asm(outputs, inputs):
    """3-bit value words (gluon_layouts.VALUE_SLOTS3: the two words holding channels 16r ..
    16r + 15 of positions 2i + b + 8c in registers 2 (b + 2c), + 1) from the address of the
    first word of position 2i."""
    (out,), ((base,),) = outputs, inputs
    return _loaded(out, base, [4 * (m % 2) + ROW3 * ((m // 2) % 2) + 8 * ROW3 * (m // 4)
                               for m in range(len(out))])  # fmt: skip


ROW6 = 24  # bytes a position of kvcalib-1.5's code rows (32 6-bit vector indices)


@gluon.constexpr_function
def vq_key_slots_asm(outputs, inputs):
    """kvcalib-1.5's key words (gluon_layouts.KEY_SLOTS6: the two words holding vectors 8i ..
    8i + 7 of positions r, r + 8 in registers 2h, 2h + 1) from the address of the first word
    of position r."""
    (out,), ((base,),) = outputs, inputs
    return _loaded(out, base, [4 * (m % 2) + 8 * ROW6 * (m // 2) for m in range(len(out))])


@gluon.constexpr_function
def vq_value_slots_asm(outputs, inputs):
    """kvcalib-1.5's value words (gluon_layouts.VALUE_SLOTS3's registers: the two words
    holding vectors 4r .. 4r + 3 of positions 2i + b + 8c in registers 2 (b + 2c), + 1) from
    the address of the first word of position 2i."""
    (out,), ((base,),) = outputs, inputs
    return _loaded(out, base, [4 * (m % 2) + ROW6 * ((m // 2) % 2) + 8 * ROW6 * (m // 4)
                               for m in range(len(out))])  # fmt: skip
