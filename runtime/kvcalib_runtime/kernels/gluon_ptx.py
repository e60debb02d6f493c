from triton.experimental import gluon

# The decode and the tensor-core products in PTX (the constexpr functions below write it):
# an A_OP register is a pair of fp16 (K indices 2i, 2i + 1 of a row); registers 4t .. 4t + 3
# are the fragment of mma.sync k-step t (keys: 16 channels; transposed values: 16 rows).
# The fused blocks decode straight into the fragment registers: Gluon's own mma_v2 after an
# asm block splits each pair into two fp16 values and joins them again, and ptxas copies the
# joined pairs into each fragment (~40 moves a tile); written as one block, it copies none.


@gluon.constexpr_function
def mma(d, a, b, c) -> str:
    """PTX: d = a b + c, one m16n8k16 tensor-core product (register lists)."""
    return (
        f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{', '.join(d)}}}, "
        f"{{{', '.join(a)}}}, {{{', '.join(b)}}}, {{{', '.join(c)}}};"
    )


@gluon.constexpr_function
def _scores(out, a, q) -> list[str]:
    """PTX: the scores out = A q^T from zero, one product a k-step (A_OP registers a, four a
    k-step; B_OP registers q, two)."""
    lines = [f"mov.b32 {x}, 0f00000000;" for x in out]
    for t in range(len(q) // 2):
        lines.append(mma(out, a[4 * t : 4 * t + 4], q[2 * t : 2 * t + 2], out))
    return lines


@gluon.constexpr_function
def key_register(e: int, h: int, k: int) -> int:
    """A_OP register of codes k (b = 0) and k + 4 (b = 1) of key word e + 2h (codes k + 8,
    k + 12 two registers on: c = 1)."""
    return h + 4 * (k & 1) + 8 * (k >> 1) + 16 * e


@gluon.constexpr_function
def value_register(code: int, c: int) -> int:
    """A_OP register of code `code` of the value words of positions 2i + 8c and 2i + 8c + 1
    (its two fp16: the two positions')."""
    return (code & 1) + 2 * c + 4 * ((code >> 1) & 1) + 8 * ((code >> 2) & 1) + 16 * (code >> 3)


@gluon.constexpr_function
def fragments(name: str, count: int) -> list[str]:
    return [f"{name}{j}" for j in range(count)]


@gluon.constexpr_function
def _key_decode(a, words, lo, hi, shifts=(0, 1, 2, 3)) -> list[str]:
    """PTX: each key word into A_OP registers a (`key_register`): packed.LUT16_ASM's
    permutes, written in place; `shifts`: which codes k of each byte (k-steps k and k + 4).
    Temporaries s, t, u."""
    lines = []
    for reg, word in enumerate(words):
        for k in shifts:
            src = word
            if k:
                lines.append(f"shr.u32 u, {word}, {2 * k};")
                src = "u"
            r = key_register(reg & 1, reg >> 1, k)
            lines += [f"and.b32 s, {src}, 0x03030303;", "mad.lo.u32 s, s, 34, 0x10101010;",
                      f"prmt.b32 {a[r]}, {lo[0]}, {hi[0]}, s;", "shr.u32 t, s, 16;",
                      f"prmt.b32 {a[r + 2]}, {lo[0]}, {hi[0]}, t;"]  # fmt: skip
    return lines


@gluon.constexpr_function
def _value_decode(a, words) -> list[str]:
    """PTX: value words of positions (2i + 8c, 2i + 8c + 1) (registers 2c, 2c + 1) into A_OP
    registers a (`value_register`) by the magic-number conversion of uniform codes: a
    permute puts byte j of both words in the two halves of one register, under fp16 1024's
    exponent bits (an or); code 4j + q of each, masked in place (bits 2q of its half, the
    exponent kept: one immediate a mask), is 1024 + 4^q code, and 1024 off leaves 4^q code,
    exact (decode_gluon.`value_unit` undoes 4^q on the output rows). Temporaries s, t, u."""
    magic = 0x64006400  # fp16 1024 in both halves
    lines = [f"mov.b32 u, {magic:#010x};"]
    for c in range(2):
        for j in range(4):
            select = 0x4400 + 0x1111 * j  # bytes j, j, 4 + j, 4 + j of (word, next word)
            lines += [f"prmt.b32 t, {words[2 * c]}, {words[2 * c + 1]}, {select:#06x};",
                      f"or.b32 t, t, {magic:#010x};"]  # fmt: skip
            for q in range(4):
                r = value_register(4 * j + q, c)
                mask = magic | 0x00030003 << 2 * q
                lines += [f"and.b32 s, t, {mask:#010x};", f"sub.rn.f16x2 {a[r]}, s, u;"]
    return lines


@gluon.constexpr_function
def pair_key_register(e: int, h: int, j: int) -> int:
    """A_OP register of byte j (codes 2j, 2j + 1) of the 4-bit key word e + 4h (words 4i + e of
    positions r, r + 8h): k-step 2e + j // 2, its half j % 2."""
    return h + 2 * (j & 1) + 4 * (j >> 1) + 8 * e


@gluon.constexpr_function
def pair_value_register(q: int, w: int, c: int) -> int:
    """A_OP register of channel 8w + q of the 4-bit value words w of positions 2i + 8c and
    2i + 8c + 1 (its two fp16: the two positions'): row r + 8 (8w + q) of the transposed
    values."""
    return (q & 1) + 2 * c + 4 * (4 * w + (q >> 1))


@gluon.constexpr_function
def _pair_lookup(a, r: int, source: str, byte: int, table: str) -> list[str]:
    """PTX: register a[r] the table word that byte `byte` of `source` indexes (a shared
    address: table + 4 byte). Temporary s."""
    select = 0x4440 + byte  # byte `byte`, then three bytes of the zero operand
    return [f"prmt.b32 s, {source}, 0, {select:#06x};", f"mad.lo.u32 s, s, 4, {table};",
            f"ld.shared.b32 {a[r]}, [s];"]  # fmt: skip


@gluon.constexpr_function
def _pair_key_decode(a, words, table, chunks=(0, 1, 2, 3)) -> list[str]:
    """PTX: 4-bit key words (code n in bits 4n .. 4n + 3) into A_OP registers a
    (`pair_key_register`): byte j, codes 2j and 2j + 1, indexes the table of level pairs (256
    words at the shared address `table`: entry x the levels of codes x % 16 and x // 16 as
    two fp16), which holds that register. `chunks`: which k-steps kappa (mod 4: a chunk is
    k-steps k and k + 4, as `_key_decode`'s shifts) to decode. Temporary s."""
    lines = []
    for reg, word in enumerate(words):
        for j in range(4):
            if (2 * (reg % 4) + j // 2) % 4 in chunks:
                lines += _pair_lookup(a, pair_key_register(reg % 4, reg // 4, j), word, j, table)
    return lines


@gluon.constexpr_function
def _pair_value_blocks(a, words, table) -> list[list[str]]:
    """PTX: 4-bit value words w of positions (2i + 8c, 2i + 8c + 1) (registers 2w + 4c and
    + 1) into A_OP registers a (`pair_value_register`), as the lines of each 16-row block m
    (registers 4m .. 4m + 3: channels 8w + 2q', + 1 of both position pairs, m = 4w + q'): a
    channel's codes of both positions put in one byte (the first position's in its low
    nibble: the even channels' by a shift and a select, the odd ones' likewise; before block
    4w, into x0 .. x3), which indexes the table of level pairs (`_pair_key_decode`'s).
    Temporaries s, u, x0 .. x3."""
    blocks = []
    for w in range(2):
        lines = []
        for c in range(2):
            first, second = words[2 * w + 4 * c], words[2 * w + 4 * c + 1]
            even, odd = f"x{2 * c}", f"x{2 * c + 1}"
            lines += [f"shl.b32 u, {second}, 4;", "and.b32 u, u, 0xF0F0F0F0;",
                      f"and.b32 {even}, {first}, 0x0F0F0F0F;", f"or.b32 {even}, {even}, u;",
                      f"shr.u32 u, {first}, 4;", "and.b32 u, u, 0x0F0F0F0F;",
                      f"and.b32 {odd}, {second}, 0xF0F0F0F0;",
                      f"or.b32 {odd}, {odd}, u;"]  # fmt: skip
        for q in range(4):  # block 4w + q: channels 8w + 2q (byte q of x0, x2), + 1 (x1, x3)
            for c in range(2):
                for parity in range(2):
                    r = pair_value_register(2 * q + parity, w, c)
                    lines += _pair_lookup(a, r, f"x{2 * c + parity}", q, table)
            blocks.append(lines)
            lines = []
    return blocks


@gluon.constexpr_function
def _keys(a, words, tables, chunks=(0, 1, 2, 3)) -> list[str]:
    """PTX: key words into A_OP registers a, k-steps k and k + D/32 for k in `chunks`: tables
    (lo, hi), the 2-bit table words (`_key_decode`), or (table,), a 4-bit codebook's table of
    level pairs (`_pair_key_decode`)."""
    if len(tables) == 2:
        return _key_decode(a, words, tables[0], tables[1], chunks)
    return _pair_key_decode(a, words, tables[0][0], chunks)


@gluon.constexpr_function
def _values(a, words, table) -> list[str]:
    """PTX: value words into the transposed values' A_OP registers a: 2-bit uniform codes
    (`_value_decode`), or with (table,) a 4-bit codebook's (`_pair_value_blocks`)."""
    if table:
        return [line for block in _pair_value_blocks(a, words, table[0][0]) for line in block]
    return _value_decode(a, words)


@gluon.constexpr_function
def unpacked(out, a) -> list[str]:
    """PTX: registers a split into the fp16 outputs out (two an A_OP register)."""
    return [f"mov.b32 {{{out[2 * j]}, {out[2 * j + 1]}}}, {x};" for j, x in enumerate(a)]


@gluon.constexpr_function
def transposed(b, p) -> list[str]:
    """PTX: the probabilities p from the scores' accumulator layout (positions r, r + 8;
    heads 2i, 2i + 1) to the B_OP registers b (positions 2i, 2i + 1 and + 8; head r): an
    8 x 8 transpose a half. Temporary t."""
    lines = []
    for h in range(2):
        lines += [f"mov.b32 t, {{{p[2 * h]}, {p[2 * h + 1]}}};",
                  f"movmatrix.sync.aligned.m8n8.trans.b16 {b[h]}, t;"]  # fmt: skip
    return lines


@gluon.constexpr_function
def declared(*names) -> str:
    temporaries = "s, t, u, x0, x1, x2, x3, y0, y1, y2, y3, p0, p1, p2, p3"
    return "{ .reg .b32 " + temporaries + ", " + ", ".join(names) + ";"


@gluon.constexpr_function
def key_asm(outputs, inputs):
    """Key words to fp16 A_OP values (`_keys` alone: what the register tests of
    tests/runtime/kernels/test_kernel_floor.py read), after the words the 2-bit table words
    or a 4-bit codebook's table of level pairs."""
    (out,), (words, *tables) = outputs, inputs
    a = fragments("a", len(out) // 2)
    return "\n".join([declared(*a), *_keys(a, words, tables), *unpacked(out, a)]) + " }"


@gluon.constexpr_function
def value_asm(outputs, inputs):
    """Value words to fp16 A_OP values of the transposed values (`_values` alone, as
    `key_asm`)."""
    (out,), (words, *table) = outputs, inputs
    a = fragments("a", len(out) // 2)
    return "\n".join([declared(*a), *_values(a, words, table), *unpacked(out, a)]) + " }"


@gluon.constexpr_function
def scores_asm(outputs, inputs):
    """A post-RoPE tile's scores K q^T [4, 16, 8] (MMA, fp32) from its key words, the tables
    (`_keys`) and q^T's B_OP registers (gluon_layouts.`packed_pairs`): the decode into the
    fragments, then the D / 16 k-steps."""
    (out,), (words, *tables, q) = outputs, inputs
    a = fragments("a", 2 * len(q))
    if len(tables) == 2:
        lines = [declared(*a), *_keys(a, words, tables), *_scores(out, a, q)]
    else:
        lines = [declared(*a), *chunked_scores(out, a, q, lambda ks: _keys(a, words, tables, ks))]
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def chunked_scores(out, a, q, decode) -> list[str]:
    """PTX: the scores out = A q^T from zero, each chunk's two k-steps (k, k + D/32) right
    after `decode((k,))` writes their fragments: fewer fragments live at once."""
    steps = len(q) // 4  # k-steps to a chunk's second
    lines = [f"mov.b32 {x}, 0f00000000;" for x in out]
    for k in range(steps):
        lines += decode((k,))
        for s in (k, k + steps):
            lines.append(mma(out, a[4 * s : 4 * s + 4], q[2 * s : 2 * s + 2], out))
    return lines


@gluon.constexpr_function
def rotated_scores_asm(outputs, inputs):
    """A pre-RoPE tile's scores (R(j) (x s + o)) q_a^T [4, 16, 8] (MMA, fp32), q_a being q
    rotated by the tile's start, from its key words, the table words, this thread's row of
    each of decode_gluon.`rope_tables`' six tables (a shared address) and q_a^T (B_OP, fp16:
    two a register). The key tables (`_keys`): the 2-bit table words, or a 4-bit codebook's
    table of level pairs (`rotated_lines` says the rest)."""
    (out,), (words, *tables, r1, r2, r3, r4, r5, r6, qh) = outputs, inputs
    return rotated_lines(out, (r1, r2, r3, r4, r5, r6), qh, [],
                         lambda a, ks: _keys(a, words, tables, ks))  # fmt: skip


@gluon.constexpr_function
def rotated_lines(out, rows, qh, prologue, decode) -> str:
    """The PTX of `rotated_scores_asm`: `prologue`'s lines, then one chunk a k-step k < D/32:
    the chunk's words of the six tables (one ld.shared.v4 each), `decode`(a, (k,)) into
    k-steps k and k + D/32 (a lower K index's RoPE partner, K index k ^ D/2, is D/32 k-steps
    on), each pair of registers scaled, offset and rotated at once (low = x_l c1 + x_h c2 +
    c3, high = x_h c4 + x_l c5 + c6: four fma), then the chunk's two k-steps: a chunk's
    fragments and table words are dead after its products."""
    a, q = fragments("a", len(qh)), fragments("q", len(qh) // 2)
    half, steps = len(a) // 2, len(a) // 8  # lower registers; k-steps to the partner
    c = [fragments(f"c{t}_", half) for t in range(len(rows))]
    lines = [declared(*a, *q, *(x for table in c for x in table), "x", "y"), *prologue]
    lines += [f"mov.b32 {x}, {{{qh[2 * j]}, {qh[2 * j + 1]}}};" for j, x in enumerate(q)]
    lines += [f"mov.b32 {x}, 0f00000000;" for x in out]
    c1, c2, c3, c4, c5, c6 = c
    for k in range(steps):
        for table, (row,) in zip(c, rows, strict=True):
            words_k = ", ".join(table[4 * k : 4 * k + 4])
            lines.append(f"ld.shared.v4.b32 {{{words_k}}}, [{row} + {16 * k}];")
        lines += decode(a, (k,))
        for j in range(4 * k, 4 * k + 4):
            low, high = a[j], a[j + half]
            lines += [f"fma.rn.f16x2 x, {high}, {c2[j]}, {c3[j]};",
                      f"fma.rn.f16x2 y, {low}, {c5[j]}, {c6[j]};",
                      f"fma.rn.f16x2 {low}, {low}, {c1[j]}, x;",
                      f"fma.rn.f16x2 {high}, {high}, {c4[j]}, y;"]  # fmt: skip
        for t in (k, k + steps):
            lines.append(mma(out, a[4 * t : 4 * t + 4], q[2 * t : 2 * t + 2], out))
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def values_asm(outputs, inputs):
    """acc + V^T p [4, D, 8] (MMA, fp32), row m times 1 / value_unit(m), from a tile's
    value words (after them a 4-bit codebook's table of level pairs: `_values`), its
    probabilities (the scores' layout, fp16) and acc: `transposed`, the decode into the
    fragments (as many as the accumulator's registers: four a 16-row block), then one
    product a block."""
    (out,), (words, *table, p, acc) = outputs, inputs
    a, b = fragments("a", len(out)), fragments("b", 2)
    lines = [declared(*a, *b), *transposed(b, p)]
    if table:
        lines += block_products(out, a, b, acc, _pair_value_blocks(a, words, table[0][0]))
    else:
        lines += _value_decode(a, words)
        for m in range(0, len(out), 4):
            lines.append(mma(out[m : m + 4], a[m : m + 4], b, acc[m : m + 4]))
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def block_products(out, a, b, acc, blocks) -> list[str]:
    """PTX: each 16-row block m's decode lines (`blocks`), then its product out[4m ..] = a[4m ..]
    b + acc[4m ..]: each block's product right after its decode, fewer fragments live at
    once."""
    lines = []
    for m, block in enumerate(blocks):
        lines += [*block, mma(out[4 * m : 4 * m + 4], a[4 * m : 4 * m + 4], b,
                              acc[4 * m : 4 * m + 4])]  # fmt: skip
    return lines


@gluon.constexpr_function
def rows_asm(outputs, inputs):
    """PTX: shared addresses, output t's registers buffer t's address plus offset t's (the
    inputs: the buffers, then the offsets)."""
    half = len(inputs) // 2
    buffers, offsets = inputs[:half], inputs[half:]
    return "\n".join(
        f"add.u32 {r}, {b[0]}, {x};"
        for out, b, off in zip(outputs, buffers, offsets, strict=True)
        for r, x in zip(out, off, strict=True)
    )


@gluon.constexpr_function
def shared_asm(offset, bits) -> str:
    """PTX: $0 the `bits`-bit unsigned integer (8, 16 or 32) at shared address $1 + offset."""
    return f"ld.shared.u{bits} $0, [$1 + {offset}];"


@gluon.constexpr_function
def stored_asm(outputs, inputs):
    """PTX: each table's four words of a chunk at its row's address (+ 16 kappa)."""
    half = len(inputs) // 2
    rows, words = inputs[:half], inputs[half:]
    return "\n".join(f"st.shared.v4.b32 [{r[0]}], {{{', '.join(w)}}};"
                      for r, w in zip(rows, words, strict=True))  # fmt: skip
