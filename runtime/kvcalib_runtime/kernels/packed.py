"""2-, 3- and 4-bit codes to 16-bit levels in ~1.5-2.8 instructions an element: byte-permute
lookups.

A 2-bit layout has 4 levels (a codebook's, or the codes themselves); as 16-bit values they are
8 bytes, two int32 registers (tiles.table2). PTX's `prmt.b32 d, a, b, sel` builds d from the 8
bytes of (a, b), byte i of d the one that nibble i of sel names. For one int32 word of 16 codes
(code n in bits 2n, 2n + 1):

    s = (word >> 2k) & 0x03030303        codes k, k + 4, k + 8, k + 12, one a byte
    s = s * 0x22 + 0x10101010            each code c a byte of nibbles (2c, 2c + 1)
    prmt(lo, hi, s), prmt(lo, hi, s >> 16)   levels of codes k, k + 4 and k + 8, k + 12

so 16 levels cost 4 x 6 instructions (one shift fewer for k = 0), not the shift, mask,
int-to-float, codebook arithmetic and float-to-half of each element. On a GPU (PACKED) that
is inline PTX (`LUT16_ASM`); the interpreter, which does not run PTX, selects the same table
entries in plain Triton. The 16 levels come out as 16 tensors shaped like the words, joined
back into channel order by `in_order` (a thread keeps a word's 16 channels together, so the
tile reaches the dot's operand layout with vector stores).

A 3- or 4-bit codebook's 8 or 16 levels are 16 or 32 bytes: more than one prmt reads. They are
kept as byte tables (tiles.level_table): the levels' low bytes in words L (2 or 4 int32, byte
c % 4 of L[c // 4] level c's), their high bytes in words H. For 8 codes w (3 bits: a group of 3
bytes, code n in bits 3n .. 3n + 2; 4 bits: an int32 word, code n in bits 4n .. 4n + 3) a
selector s holds code i in nibble i:

    3 bits  y = (w & 0xFFF) | (w << 4) & 0x0FFF0000     codes 0-3 and 4-7 in the two halves
            s = OR over k < 4 of (y << k) & (0x00070007 << 4k)    code n moved by n bits
    4 bits  s = w & 0x77777777                           its low 3 bits: prmt's nibble bit 3
                                                         is its sign-replicate mode, not an index
            m = (w >> 1) & 0x44444444 | 0x32103210       nibble i: i, + 4 where code i's bit 3

then per 4 codes (selector s, then s >> 16; m, then m >> 16):

    lo = prmt(L0, L1, s), hi = prmt(H0, H1, s)          3 bits: levels 0-7, one prmt each
    lo = prmt(prmt(L0, L1, s), prmt(L2, L3, s), m)       4 bits: levels 0-7 and 8-15, a byte
    hi = prmt(prmt(H0, H1, s), prmt(H2, H3, s), m)       from either by bit 3
    prmt(lo, hi, 0x5140), prmt(lo, hi, 0x7362)           the 16-bit levels of codes 0, 1 and 2, 3

so 8 levels cost 8 prmt and ~11 selector instructions (3 bits), 16 prmt and ~6 (4 bits),
against a tree of 2^b - 1 selects in fp32 and two conversions an element (tiles.level).
`LUT3_ASM`, `LUT4_ASM` (`levels8`); 8 tensors joined back in channel order by `in_order8`.

The tests execute the PTX on the CPU against the plain decode, every code in every position;
the interpreter's plain-Triton picks read the same tables.
"""

import triton
import triton.language as tl


def _lut16_asm() -> str:
    """LUT16_ASM: $0..$15 the 16-bit levels of codes 0..15 of the word $16, table $17, $18."""
    lines = ["{ .reg .b32 s, t, u, p, q;"]
    for k in range(4):
        word = "$16"
        if k:
            lines.append(f"shr.u32 u, $16, {2 * k};")
            word = "u"
        lines += [f"and.b32 s, {word}, 0x03030303;", "mad.lo.u32 s, s, 34, 0x10101010;",
                  "prmt.b32 p, $17, $18, s;", "shr.u32 t, s, 16;", "prmt.b32 q, $17, $18, t;",
                  f"mov.b32 {{${k}, ${k + 4}}}, p;",
                  f"mov.b32 {{${k + 8}, ${k + 12}}}, q;"]  # fmt: skip
    return "\n".join(lines) + " }"


LUT16_ASM = tl.constexpr(_lut16_asm())


@triton.jit
def _pick(word, n: tl.constexpr, lo, hi):
    """int16 bits of the level of code n of each word (plain Triton)."""
    c = (word >> 2 * n) & 3
    return ((tl.where(c < 2, lo, hi) >> (c % 2) * 16) & 0xFFFF).to(tl.int16)


@triton.jit
def _join4(a, b, c, d):
    return tl.join(tl.join(a, b), tl.join(c, d))


@triton.jit
def in_order(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, o12, o13, o14, o15):
    """The 16 tensors [..., W] of codes 0..15 of each word as [..., W, 2, 2, 2, 2] whose
    flattened last dims are the code's index: a join puts its pair on a new last dim, so the
    first join level picks bit 3 of the index, the last bit 0."""
    return tl.join(tl.join(_join4(o0, o8, o4, o12), _join4(o2, o10, o6, o14)),
                   tl.join(_join4(o1, o9, o5, o13), _join4(o3, o11, o7, o15)))  # fmt: skip


@triton.jit
def levels(CODES, row, c0, live, lo, hi, BN: tl.constexpr, BLOCK_C: tl.constexpr,
           C: tl.constexpr, DT: tl.constexpr, PACKED: tl.constexpr):  # fmt: skip
    """Levels (dtype DT) [BN, BLOCK_C] of the 2-bit codes of channels c0 + [0, C) of the body
    rows at element offsets `row` [BN] (int64; where `live`) of CODES (int32 words, 16 codes
    each), from the table (lo, hi) of tiles.table2. PACKED: by LUT16_ASM (a GPU)."""
    u = tl.arange(0, BLOCK_C // 16)
    ptr = CODES + row[:, None] + (c0 // 16 + u)[None, :]
    word = tl.load(ptr, mask=live[:, None] & (u < C // 16)[None, :], other=0).to(tl.int32)
    if PACKED:
        o = tl.inline_asm_elementwise(LUT16_ASM, "=h," * 16 + "r,r,r", [word, lo, hi],
                                      dtype=(tl.int16,) * 16, is_pure=True, pack=1)  # fmt: skip
        tile = in_order(*o)
    else:
        tile = in_order(_pick(word, 0, lo, hi), _pick(word, 1, lo, hi), _pick(word, 2, lo, hi),
                        _pick(word, 3, lo, hi), _pick(word, 4, lo, hi), _pick(word, 5, lo, hi),
                        _pick(word, 6, lo, hi), _pick(word, 7, lo, hi), _pick(word, 8, lo, hi),
                        _pick(word, 9, lo, hi), _pick(word, 10, lo, hi), _pick(word, 11, lo, hi),
                        _pick(word, 12, lo, hi), _pick(word, 13, lo, hi),
                        _pick(word, 14, lo, hi), _pick(word, 15, lo, hi))  # fmt: skip
    return tl.reshape(tile, [BN, BLOCK_C]).to(DT, bitcast=True)


# -- 3- and 4-bit codebooks: byte tables ---------------------------------------------------------


def _lut8_asm(bits: int) -> str:
    """LUT3_ASM (bits 3), LUT4_ASM (bits 4): $0..$7 the 16-bit levels of codes 0..7 of the
    word $8 (3 bits: a 24-bit group of tiles.codes; 4 bits: an int32 word), from the byte
    tables of tiles.level_table from $9 on: the low-byte words L (2 or 4), then the high-byte
    ones H."""
    words = 2 ** (bits - 2)
    lo = [f"${9 + i}" for i in range(words)]
    hi = [f"${9 + words + i}" for i in range(words)]
    lines = ["{ .reg .b32 y, a, s, t, m, n, p, q, r, e;"]
    if bits == 3:  # y: codes 0-3 in bits 0-11, codes 4-7 in bits 16-27; s: code i in nibble i
        lines += ["shl.b32 a, $8, 4;", "and.b32 a, a, 0x0FFF0000;", "and.b32 y, $8, 0xFFF;",
                  "or.b32 y, y, a;", "and.b32 s, y, 0x00070007;"]  # fmt: skip
        for k, mask in ((1, "0x00700070"), (2, "0x07000700"), (3, "0x70007000")):
            lines += [f"shl.b32 a, y, {k};", f"and.b32 a, a, {mask};", "or.b32 s, s, a;"]
    else:  # s: the low 3 bits of code i in nibble i; m: nibble i = i + 4 * (bit 3 of code i)
        lines += ["and.b32 s, $8, 0x77777777;", "shr.u32 m, $8, 1;",
                  "and.b32 m, m, 0x44444444;", "or.b32 m, m, 0x32103210;",
                  "shr.u32 n, m, 16;"]  # fmt: skip
    lines.append("shr.u32 t, s, 16;")
    for k, sel in ((0, "s"), (4, "t")):
        if bits == 3:  # 8 levels: one prmt per 4 bytes
            lines += [f"prmt.b32 p, {lo[0]}, {lo[1]}, {sel};",
                      f"prmt.b32 q, {hi[0]}, {hi[1]}, {sel};"]  # fmt: skip
        else:  # 16 levels: levels 0-7 and 8-15, then each byte from one by bit 3
            pick = "m" if k == 0 else "n"
            lines += [f"prmt.b32 p, {lo[0]}, {lo[1]}, {sel};",
                      f"prmt.b32 e, {lo[2]}, {lo[3]}, {sel};", f"prmt.b32 p, p, e, {pick};",
                      f"prmt.b32 q, {hi[0]}, {hi[1]}, {sel};",
                      f"prmt.b32 e, {hi[2]}, {hi[3]}, {sel};",
                      f"prmt.b32 q, q, e, {pick};"]  # fmt: skip
        lines += ["prmt.b32 r, p, q, 0x5140;", f"mov.b32 {{${k}, ${k + 1}}}, r;",
                  "prmt.b32 r, p, q, 0x7362;", f"mov.b32 {{${k + 2}, ${k + 3}}}, r;"]  # fmt: skip
    return "\n".join(lines) + " }"


LUT3_ASM = tl.constexpr(_lut8_asm(3))
LUT4_ASM = tl.constexpr(_lut8_asm(4))


@triton.jit
def _pick8(word, n: tl.constexpr, BITS: tl.constexpr, table):
    """int16 bits of the level of code n of each word (plain Triton): byte c % 4 of the table's
    low-byte word c // 4 and of its high-byte word 4 + c // 4, c the code."""
    c = (word >> BITS * n) & (2**BITS - 1)
    lo = tl.where(c < 4, table[0], table[1])
    hi = tl.where(c < 4, table[4], table[5])
    if BITS == 4:
        lo = tl.where(c < 8, lo, tl.where(c < 12, table[2], table[3]))
        hi = tl.where(c < 8, hi, tl.where(c < 12, table[6], table[7]))
    shift = (c % 4) * 8
    return (((lo >> shift) & 0xFF) | (((hi >> shift) & 0xFF) << 8)).to(tl.int16)


@triton.jit
def in_order8(o0, o1, o2, o3, o4, o5, o6, o7):
    """`in_order` for 8 codes a word: [..., W, 2, 2, 2], the first join level bit 2 of the
    index, the last bit 0."""
    return tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)),
                   tl.join(tl.join(o1, o5), tl.join(o3, o7)))  # fmt: skip


@triton.jit
def levels8(CODES, row, c0, live, table, BN: tl.constexpr, BLOCK_C: tl.constexpr,
            C: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr,
            PACKED: tl.constexpr):  # fmt: skip
    """`levels` for 3- and 4-bit codebook codes, 8 a word: 4 bits as int32 words (tiles.unit
    32), 3 bits as groups of 3 bytes (little-endian, as tiles.codes reads them); table: the
    byte tables of tiles.level_table. PACKED: by LUT3_ASM / LUT4_ASM (a GPU)."""
    u = tl.arange(0, BLOCK_C // 8)
    mask = live[:, None] & (u < C // 8)[None, :]
    if BITS == 4:
        ptr = CODES + row[:, None] + (c0 // 8 + u)[None, :]
        word = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    else:
        ptr = CODES + row[:, None] + (c0 * 3 // 8 + u * 3)[None, :]
        word = tl.zeros([BN, BLOCK_C // 8], tl.int32)
        for r in tl.static_range(3):
            word |= tl.load(ptr + r, mask=mask, other=0).to(tl.int32) << (8 * r)
    if PACKED and BITS == 3:
        o = tl.inline_asm_elementwise(LUT3_ASM, "=h," * 8 + "r,r,r,r,r",
                                      [word, table[0], table[1], table[4], table[5]],
                                      dtype=(tl.int16,) * 8, is_pure=True, pack=1)  # fmt: skip
        tile = in_order8(*o)
    elif PACKED:
        o = tl.inline_asm_elementwise(LUT4_ASM, "=h," * 8 + "r," * 8 + "r",
                                      [word, table[0], table[1], table[2], table[3], table[4],
                                       table[5], table[6], table[7]],
                                      dtype=(tl.int16,) * 8, is_pure=True, pack=1)  # fmt: skip
        tile = in_order8(*o)
    else:
        tile = in_order8(_pick8(word, 0, BITS, table), _pick8(word, 1, BITS, table),
                         _pick8(word, 2, BITS, table), _pick8(word, 3, BITS, table),
                         _pick8(word, 4, BITS, table), _pick8(word, 5, BITS, table),
                         _pick8(word, 6, BITS, table), _pick8(word, 7, BITS, table))  # fmt: skip
    return tl.reshape(tile, [BN, BLOCK_C]).to(DT, bitcast=True)
