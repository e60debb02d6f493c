"""2-bit codes to 16-bit levels at ~1.5 instructions an element: a byte-permute lookup.

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
tile reaches the dot's operand layout with vector stores). The tests execute LUT16_ASM's PTX
on the CPU against the plain decode, every code in every position.
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
