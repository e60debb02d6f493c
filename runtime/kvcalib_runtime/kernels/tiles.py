"""How the decode kernel reads a tile of keys or values: [BN positions, one half of a head's
channels], in fp32 registers, from what the cache stores (kernels.operands).

    packed codes   read whole: 32-bit words (2/4/8 bits, when a half row is whole words) or
                   bytes, split into codes by shifts in registers; 3/5/6-bit codes as words of
                   8 codes (BITS bytes)
    level          code itself, or a calibrated codebook entry (L scalars, read once per tile);
                   2-bit words of whole tiles: 16 levels a word by a byte-permute table
                   (`table2`, kernels.packed), 16-bit; 3- and 4-bit codebooks' likewise, 8
                   levels a word from byte tables (`level_table`)
    x              level * scale + offset, the metadata read once per group: per channel
                   ("static", read once per program by the caller), per group of channels of a
                   row ("token", "vector"; one byte each for metadata_code "byte", decoded
                   from their bits), per group of tokens ("channel": one row per GROUP
                   positions, broadcast); whole tiles whose metadata is per channel or one
                   group a half row (`foldable`) stay levels: the caller applies it outside
                   the tile
    vector codes   "vq": each channel's level is a coordinate of its vector's codebook entry
                   (`coordinates`: the vector's index gathered from the packed row, then the
                   entry's coordinate from the head's codebook), scaled per channel as "static"
    exact slots    x_hat = base + delta at channel index: for values added into the tile, for
                   keys added to the scores (`slot_scores`), rotated with their RoPE pair;
                   an "fp8" delta is its E4M3 byte times the channel's static scale

A head is read as two halves (channels [0, D/2) and [D/2, D)) because RoPE pairs channel c
with c + D/2: keys stored before RoPE are rotated in registers. In whole tiles only by R(j),
built once per program, since q . R(p0 + j) k = (R(p0)^T q) . R(j) k: the caller rotates q
once per tile.

A row (one token of one head, or of every head for "vector") is found by its buffer's element
strides (block or sequence, head row, slot) — `at` — so the same reads serve a contiguous cache
(one block per sequence) and vLLM's pages (a block per `block_size` positions, the fields of a
token interleaved in one page row).
"""

import math

import torch
import triton
import triton.language as tl

from kvcalib_runtime.kernels import packed
from kvcalib_runtime.layouts import Kind, fp8, metabyte

# the kernels' switch
TOKEN, CHANNEL, STATIC, EXACT, VECTORS = (tl.constexpr(int(k)) for k in Kind)
INV_TWO_PI = tl.constexpr(0.5 / math.pi)
TWO_PI_HI = tl.constexpr(float(torch.tensor(2 * math.pi, dtype=torch.float32)))  # + LO = 2 pi
TWO_PI_LO = tl.constexpr(float(torch.tensor(2 * math.pi - TWO_PI_HI.value, dtype=torch.float32)))
TWO_OVER_PI = tl.constexpr(2 / math.pi)
HALF_PI_HI = tl.constexpr(float(torch.tensor(math.pi / 2, dtype=torch.float32)))  # + LO = pi/2
HALF_PI_LO = tl.constexpr(float(torch.tensor(math.pi / 2 - HALF_PI_HI.value, dtype=torch.float32)))
FP8_MAX = tl.constexpr(fp8.FP8_MAX)  # the largest finite E4M3FN value
ROUNDING = tl.constexpr(12582912.0)  # 1.5 * 2**23: fp32 (v + R) - R rounds v half to even
SCALE_BASE = tl.constexpr(metabyte.BASE)  # one-byte metadata (layouts.metabyte)
SCALE_CARRY = tl.constexpr(metabyte.CARRY)
ZERO_STEPS = tl.constexpr(metabyte.ZERO_STEPS)
SINCOS_ASM = tl.constexpr(
    "{ .reg .f32 a, c, s; mov.b32 a, $2; cos.approx.f32 c, a; "
    "sin.approx.f32 s, a; mov.b32 $0, c; mov.b32 $1, s; }"
)  # trig FAST


@triton.jit
def fp8_encode(steps):
    """uint8 E4M3FN bytes of fp32 `steps` saturated at +-FP8_MAX, bit for bit torch's rounding
    (layouts.fp8.encode): below 2**-6 by adding 2**-5 * 2**9 in fp32, else by rounding the
    mantissa's 20 dropped bits half to even."""
    x = tl.minimum(tl.maximum(steps, -FP8_MAX), FP8_MAX)
    f = tl.abs(x)
    a = f.to(tl.int32, bitcast=True)
    subnormal = (f + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    normal = (a + ((-120 << 23) + 0x7FFFF) + ((a >> 20) & 1)) >> 20
    code = tl.where(a < (121 << 23), subnormal, normal)
    return (code | tl.where(x.to(tl.int32, bitcast=True) < 0, 0x80, 0)).to(tl.uint8)


@triton.jit
def fp8_decode(code):
    """fp32 values of uint8 E4M3FN bytes (layouts.fp8.decode), built from their bits: exponent
    and mantissa moved into an fp16's (bias 15, not 7: times 2^8 after), the sign to bit 15;
    E4M3's subnormals land on fp16's, so every byte is exact (shifts and masks, no select)."""
    b = code.to(tl.int32)
    half = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.int16)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def scale_encode(scale):
    """uint8 one-byte scales of fp32 scales >= 0, rounded up (layouts.metabyte.encode_scale)."""
    bits = scale.to(tl.int32, bitcast=True)
    code = ((bits + SCALE_CARRY) >> 20) - SCALE_BASE
    return tl.minimum(tl.maximum(code, 0), 255).to(tl.uint8)


@triton.jit
def scale_decode(code):
    """fp32 scales of one-byte scales (layouts.metabyte.decode_scale), built from their bits."""
    return ((code.to(tl.int32) + SCALE_BASE) << 20).to(tl.float32, bitcast=True)


@triton.jit
def zero_encode(lo, scale, SPAN: tl.constexpr):
    """uint8 zero points of ranges from lo <= 0 and their decoded scale
    (layouts.metabyte.encode_zero): IEEE division, round half to even."""
    reach = scale * SPAN
    z = tl.math.div_rn(-lo * ZERO_STEPS, tl.where(reach > 0, reach, 1.0))
    z = tl.minimum(tl.maximum(z, 0.0), 255.0)
    return ((z + ROUNDING) - ROUNDING).to(tl.int32).to(tl.uint8)


@triton.jit
def zero_decode(zero, scale, SPAN: tl.constexpr):
    """fp32 offsets of one-byte zero points and their decoded scale
    (layouts.metabyte.decode_offset: SPAN / 255 is the step, rounded to fp32 as it is there)."""
    STEP: tl.constexpr = SPAN / ZERO_STEPS
    return -(zero.to(tl.float32) * STEP) * scale


@triton.jit
def trig(angle, FAST: tl.constexpr = False):
    """(cos, sin) of fp32 angles without libdevice (whose slow path for large arguments puts a
    local-memory array in the loop): reduced to [-pi, pi] (Cody-Waite), then by quadrant to
    [-pi/4, pi/4], where Cephes' sinf / cosf polynomials are within 2 ulp. FAST (a GPU): the
    reduced angle by the SFU's cos.approx / sin.approx (SINCOS_ASM: absolute error 2^-21.41
    on [-pi, pi], CUDA's __sinf bound; in the pre-RoPE slot loop ~14 instructions where the
    polynomials took ~30)."""
    turns = (angle * INV_TWO_PI + ROUNDING) - ROUNDING
    angle = tl.fma(-turns, TWO_PI_LO, tl.fma(-turns, TWO_PI_HI, angle))
    if FAST:
        cos, sin = tl.inline_asm_elementwise(SINCOS_ASM, "=r,=r,r",
                                             [angle.to(tl.int32, bitcast=True)],
                                             dtype=(tl.int32, tl.int32), is_pure=True,
                                             pack=1)  # fmt: skip
        return cos.to(tl.float32, bitcast=True), sin.to(tl.float32, bitcast=True)
    quad = (angle * TWO_OVER_PI + ROUNDING) - ROUNDING  # -2 .. 2
    r = tl.fma(-quad, HALF_PI_LO, tl.fma(-quad, HALF_PI_HI, angle))
    z = r * r
    s = tl.fma(r * z, tl.fma(z, tl.fma(z, -1.9515295891e-4, 8.3321608736e-3), -1.6666654611e-1),
               r)  # fmt: skip
    c = tl.fma(z * z, tl.fma(z, tl.fma(z, 2.443315711809948e-5, -1.388731625493765e-3),
                             4.166664568298827e-2), 1.0 - 0.5 * z)  # fmt: skip
    k = quad.to(tl.int32) & 3  # angle = k pi/2 + r
    odd = (k & 1) != 0
    cos = tl.where(odd, s, c)
    sin = tl.where(odd, c, s)
    return tl.where(((k + 1) & 2) != 0, -cos, cos), tl.where((k & 2) != 0, -sin, sin)


@triton.jit
def rotate(lo, hi, cos, sin):
    """RoPE of channel pairs (lo, hi): rope(x) = x cos + rotate_half(x) sin."""
    return lo * cos - hi * sin, hi * cos + lo * sin


@triton.jit
def at(STRIDE, blk, head, slot):
    """Element offsets (int64) of rows (blk, head, slot) — scalars or [BN] — of a buffer whose
    strides are STRIDE = (block or sequence, head row, slot)."""
    line = blk.to(tl.int64) * STRIDE[0] + head.to(tl.int64) * STRIDE[1]
    return line + slot.to(tl.int64) * STRIDE[2]


# fmt: off
@triton.jit
def codes(CODES, row, c0, live, BN: tl.constexpr, BLOCK_C: tl.constexpr, C: tl.constexpr,
          BITS: tl.constexpr, UNIT: tl.constexpr):
    # fmt: on
    """int32 codes [BN, BLOCK_C] of channels c0 + [0, C) of the body rows starting at element
    offsets `row` [BN] (int64; where `live`) of CODES: int32 words (UNIT 32) or bytes (UNIT 8)."""
    if 8 % BITS == 0:
        PER: tl.constexpr = UNIT // BITS
        u = tl.arange(0, BLOCK_C // PER)
        ptr = CODES + row[:, None] + (c0 * BITS // UNIT + u)[None, :]
        word = tl.load(ptr, mask=live[:, None] & (u < C // PER)[None, :], other=0).to(tl.int32)
    else:  # 8 codes in BITS bytes, little-endian
        PER: tl.constexpr = 8
        u = tl.arange(0, BLOCK_C // 8)
        ptr = CODES + row[:, None] + (c0 * BITS // 8 + u * BITS)[None, :]
        mask = live[:, None] & (u < C // 8)[None, :]
        WIDE: tl.constexpr = tl.int64 if BITS > 3 else tl.int32
        word = tl.zeros([BN, BLOCK_C // 8], WIDE)
        for r in tl.static_range(BITS):
            word |= tl.load(ptr + r, mask=mask, other=0).to(WIDE) << (8 * r)
    shift = tl.arange(0, PER) * BITS
    split = (word[:, :, None] >> shift[None, None, :]) & (2**BITS - 1)
    return tl.reshape(split, [BN, BLOCK_C]).to(tl.int32)


@triton.jit
def _entry(code, LEVELS, FIRST: tl.constexpr, BITS: tl.constexpr):
    """Entry FIRST + (code mod 2^BITS) of LEVELS, fp32: a select on each bit of the code,
    2^BITS - 1 selects (a chain comparing the code with each entry takes twice as many)."""
    if BITS == 0:
        out = tl.load(LEVELS + FIRST).to(tl.float32)
    else:
        HALF: tl.constexpr = 2 ** (BITS - 1)
        low = _entry(code, LEVELS, FIRST, BITS - 1)
        high = _entry(code, LEVELS, FIRST + HALF, BITS - 1)
        out = tl.where((code & HALF) != 0, high, low)
    return out


@triton.jit
def level(code, LEVELS, BITS: tl.constexpr, CODEBOOK: tl.constexpr):
    """fp32 level of each code: the codebook row at LEVELS (L scalars), or the code itself
    (a symmetric grid's -(2^(b-1) - 1) is folded into the offset by the caller). A 2-bit
    codebook is the cubic through its 4 levels (Horner: 3 FMAs, exact to fp32 rounding); wider
    ones a tree of selects (`_entry`)."""
    if CODEBOOK and BITS == 2:
        l0, l1 = tl.load(LEVELS), tl.load(LEVELS + 1)
        l2, l3 = tl.load(LEVELS + 2), tl.load(LEVELS + 3)
        d1, d2, d3 = l1 - l0, l2 - 2 * l1 + l0, l3 - 3 * l2 + 3 * l1 - l0  # Newton differences
        c = code.to(tl.float32)
        out = l0 + c * ((d1 - d2 / 2 + d3 / 3) + c * ((d2 - d3) / 2 + c * (d3 / 6)))
    elif CODEBOOK:
        out = _entry(code, LEVELS, 0, BITS)
    else:
        out = code.to(tl.float32)
    return out


@triton.jit
def table2(LEVELS, CODEBOOK: tl.constexpr, DT: tl.constexpr):
    """A 2-bit layout's 4 levels (`level` of codes 0..3) in dtype DT (16 bits) as packed.levels
    reads them: int32 scalars, lo levels 0, 1, hi levels 2, 3, the first of each in the low
    half."""
    c = tl.arange(0, 4)
    bits = level(c, LEVELS, 2, CODEBOOK).to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    bits = bits << (c % 2) * 16
    return tl.sum(tl.where(c < 2, bits, 0)), tl.sum(tl.where(c >= 2, bits, 0))


@triton.jit
def _word(part, c, k: tl.constexpr):
    """Bytes of codes 4k .. 4k + 3 of `part` [16] (byte c % 4 of the code's) as one int32."""
    return tl.sum(tl.where(c // 4 == k, part << (c % 4) * 8, 0))


@triton.jit
def level_table(LEVELS, BITS: tl.constexpr, CODEBOOK: tl.constexpr, DT: tl.constexpr):
    """The levels packed reads whole tiles from, in dtype DT (16 bits): a 3- or 4-bit
    codebook's as byte tables, int32 scalars (L0, L1, L2, L3, H0, H1, H2, H3), byte c % 4 of
    L[c // 4] the low byte of level c and of H[c // 4] its high byte (3 bits: L2, L3, H2, H3
    unread); any other layout's `table2`."""
    if CODEBOOK and (BITS == 3 or BITS == 4):
        c = tl.arange(0, 16)
        bits = level(c, LEVELS, BITS, True).to(DT).to(tl.int16, bitcast=True).to(tl.int32)
        lo, hi = bits & 0xFF, (bits >> 8) & 0xFF
        out = (_word(lo, c, 0), _word(lo, c, 1), _word(lo, c, 2), _word(lo, c, 3),
               _word(hi, c, 0), _word(hi, c, 1), _word(hi, c, 2), _word(hi, c, 3))  # fmt: skip
    else:
        out = table2(LEVELS, CODEBOOK, DT)
    return out


# fmt: off
@triton.jit
def coordinates(CODES, BOOK, row, c0, live, BN: tl.constexpr, BLOCK_C: tl.constexpr,
                C: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, PAIRS: tl.constexpr):
    # fmt: on
    """fp32 [BN, BLOCK_C]: for channels c0 + [0, C) (c0 0 or C) of the "vq" rows at element
    offsets `row` [BN] of CODES (where `live`), each channel's coordinate of its vector's entry
    in BOOK [E, W], the head's codebook (layouts.vq). Vector j's index is bits [j*BITS,
    (j+1)*BITS) of the row, little-endian across bytes (layouts.packing). PAIRS: vector j holds
    channels j*W/2 + [0, W/2) of each half, coordinates [0, W/2) from the low half and [W/2, W)
    from the high one (RoPE's pairs); else the W adjacent channels j*W + [0, W)."""
    ch = tl.arange(0, BLOCK_C)
    if PAIRS:
        HALF: tl.constexpr = W // 2
        vec = ch // HALF
        coord = ch % HALF + (c0 // C) * HALF
    else:
        vec = (c0 + ch) // W
        coord = (c0 + ch) % W
    bit = vec * BITS
    shift = (bit % 8)[None, :]
    mask = live[:, None] & (ch < C)[None, :]
    ptr = CODES + row[:, None] + (bit // 8)[None, :]
    code = tl.load(ptr, mask=mask, other=0).to(tl.int32) >> shift
    if 8 % BITS != 0:  # an index may end in the next byte
        spill = mask & (shift + BITS > 8)
        code |= tl.load(ptr + 1, mask=spill, other=0).to(tl.int32) << (8 - shift)
    code &= 2**BITS - 1
    return tl.load(BOOK + code * W + coord[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def spread(meta, ROWS: tl.constexpr, REPEAT: tl.constexpr, COLS: tl.constexpr):
    """Each entry of meta [ROWS, COLS] repeated REPEAT times along the columns:
    [ROWS, COLS * REPEAT]."""
    return tl.reshape(tl.broadcast_to(meta[:, :, None], [ROWS, COLS, REPEAT]),
                      [ROWS, COLS * REPEAT])  # fmt: skip


# fmt: off
@triton.jit
def half(S, L: tl.constexpr, LEVELS, blk, head, slot, pos0, live, c0, s_static, o_static,
         BN: tl.constexpr, BLOCK_C: tl.constexpr, C: tl.constexpr, FOLD: tl.constexpr = False,
         table=None, LDT: tl.constexpr = tl.float16, PACKED: tl.constexpr = False,
         WIDE: tl.constexpr = False):
    # fmt: on
    """One half of a head from the body (buffers S, layout L: decode_attention's StreamBuffers
    and StreamLayout; LEVELS: the codebook row), fp32 [BN, BLOCK_C]: channels c0 + [0, C) of the
    rows (blk, head, slot) (`at`; blk and slot [BN] or scalars), where `live`.

    STATIC and VECTORS: s_static, o_static [BLOCK_C] (offset with the symmetric shift folded
    in) from the caller; VECTORS reads LEVELS as the head's codebook [E, GROUP]. CHANNEL
    (contiguous only: blk a scalar): the tile's positions are pos0 + [0, BN), pos0 a multiple
    of BN, the metadata rows groups of GROUP positions. EXACT: S.codes holds the values.
    FOLD (`foldable`): the levels alone, the caller applies the metadata outside the tile.
    WIDE (whole tiles) 2-bit codes in words, 3-bit codebook codes, 4-bit ones in words: levels
    looked up in `table` (`level_table`, dtype LDT: the dot's with FOLD, else fp16 then fp32)
    by packed.levels / packed.levels8 (PACKED: inline PTX, a GPU).
    """
    CODES = S.codes
    SCALE = S.scale
    OFFSET = S.offset
    BITS: tl.constexpr = L.BITS
    GRAN: tl.constexpr = L.GRAN
    GROUP: tl.constexpr = L.GROUP
    SYMMETRIC: tl.constexpr = L.SYM
    CODEBOOK: tl.constexpr = L.CB
    ch = tl.arange(0, BLOCK_C)
    row = at(S.strides.codes, blk, head, slot)
    SHIFT: tl.constexpr = 2 ** (BITS - 1) - 1 if SYMMETRIC and not CODEBOOK else 0
    if GRAN == EXACT:
        x = tl.load(CODES + row[:, None] + (c0 + ch)[None, :],
                    mask=live[:, None] & (ch < C)[None, :], other=0.0).to(tl.float32)  # fmt: skip
    elif GRAN == VECTORS:
        x = coordinates(CODES, LEVELS, row, c0, live, BN, BLOCK_C, C, BITS, GROUP,
                        L.PAIRS)  # fmt: skip
        if not FOLD:
            x = x * s_static[None, :] + o_static[None, :]
    else:
        UNIT: tl.constexpr = L.UNIT
        if WIDE and BITS == 2 and UNIT == 32:
            lv = packed.levels(CODES, row, c0, live, table[0], table[1], BN, BLOCK_C, C, LDT,
                               PACKED)  # fmt: skip
            if not FOLD:
                lv = lv.to(tl.float32)
        elif WIDE and CODEBOOK and (BITS == 3 or (BITS == 4 and UNIT == 32)):
            lv = packed.levels8(CODES, row, c0, live, table, BN, BLOCK_C, C, BITS, LDT, PACKED)
            if not FOLD:
                lv = lv.to(tl.float32)
        else:
            lv = level(codes(CODES, row, c0, live, BN, BLOCK_C, C, BITS, L.UNIT), LEVELS, BITS,
                       CODEBOOK)  # fmt: skip
        if FOLD:
            x = lv
        elif GRAN == STATIC:
            x = lv * s_static[None, :] + o_static[None, :]
        elif GRAN == TOKEN:  # per row: the half in one group, C / GROUP whole groups, or any
            ONE: tl.constexpr = GROUP % C == 0
            WHOLE: tl.constexpr = C % GROUP == 0 and GROUP & (GROUP - 1) == 0
            NG: tl.constexpr = 1 if ONE else (BLOCK_C // GROUP if WHOLE else BLOCK_C)
            gi = tl.arange(0, NG)
            if ONE or WHOLE:
                index = (c0 // GROUP + gi)[None, :]
                mask = live[:, None] & (gi < (C + GROUP - 1) // GROUP)[None, :]
            else:  # groups straddle the halves: one metadata load per element (L1 hits)
                index = ((c0 + gi) // GROUP)[None, :]
                mask = live[:, None] & (gi < C)[None, :]
            meta = at(S.strides.meta, blk, head, slot)[:, None] + index
            if L.BYTE:  # one-byte scale and zero point (layouts.metabyte)
                scale = scale_decode(tl.load(SCALE + meta, mask=mask, other=0))
                offset = -SHIFT * scale
                if not SYMMETRIC:
                    zero = tl.load(OFFSET + meta, mask=mask, other=0)
                    offset = zero_decode(zero, scale, 1.0 if CODEBOOK else 2.0**BITS - 1)
            else:
                scale = tl.load(SCALE + meta, mask=mask, other=0.0).to(tl.float32)
                offset = -SHIFT * scale
                if not SYMMETRIC:
                    offset += tl.load(OFFSET + meta, mask=mask, other=0.0).to(tl.float32)
            if WHOLE and NG > 1:
                scale = spread(scale, BN, GROUP, NG)
                offset = spread(offset, BN, GROUP, NG)
            x = lv * scale + offset
        else:  # CHANNEL: one metadata row per GROUP positions (broadcast when GROUP >= BN)
            NGB: tl.constexpr = BN // GROUP if GROUP < BN else 1
            group = (pos0 // GROUP + tl.arange(0, NGB)) % S.meta_rows
            meta = at(S.strides.meta, blk, head, group)[:, None] + (c0 + ch)[None, :]
            scale = tl.load(SCALE + meta, mask=(ch < C)[None, :], other=0.0).to(tl.float32)
            offset = -SHIFT * scale
            if not SYMMETRIC:
                offset += tl.load(OFFSET + meta, mask=(ch < C)[None, :], other=0.0).to(tl.float32)
            if NGB > 1:
                scale = tl.trans(spread(tl.trans(scale), BLOCK_C, GROUP, NGB))
                offset = tl.trans(spread(tl.trans(offset), BLOCK_C, GROUP, NGB))
            x = lv * scale + offset
    return x


def foldable(layout, C: int) -> bool:
    """Whether `half(FOLD=True)` reads a StreamLayout (C channels a half): metadata per channel
    ("static", "vq") or one group per half row ("token")."""
    one_group = int(Kind.TOKEN) == layout.GRAN and layout.GROUP % C == 0
    return layout.GRAN in (int(Kind.STATIC), int(Kind.VECTORS)) or one_group


@triton.jit
def row_meta(S, L: tl.constexpr, blk, head, slot, live, c0, C: tl.constexpr):
    """fp32 (scale, offset) [BN] of the "token" rows (blk, head, slot) for channels c0 + [0, C),
    which one metadata group holds (`foldable`): what `half` applies to each element."""
    SHIFT: tl.constexpr = 2 ** (L.BITS - 1) - 1 if L.SYM and not L.CB else 0
    meta = at(S.strides.meta, blk, head, slot) + c0 // L.GROUP
    if L.BYTE:  # one-byte scale and zero point (layouts.metabyte)
        scale = scale_decode(tl.load(S.scale + meta, mask=live, other=0))
        offset = -SHIFT * scale
        if not L.SYM:
            zero = tl.load(S.offset + meta, mask=live, other=0)
            offset = zero_decode(zero, scale, 1.0 if L.CB else 2.0**L.BITS - 1)
    else:
        scale = tl.load(S.scale + meta, mask=live, other=0.0).to(tl.float32)
        offset = -SHIFT * scale
        if not L.SYM:
            offset += tl.load(S.offset + meta, mask=live, other=0.0).to(tl.float32)
    return scale, offset


@triton.jit
def static_meta(S, L: tl.constexpr, h, c0, BLOCK_C: tl.constexpr, C: tl.constexpr, D: tl.constexpr):
    """A "static" half's scale and offset [BLOCK_C] (fp32, symmetric shift folded in), read
    once per program: S.scale / S.offset [Hkv, D] (buffers S, layout L as `half` takes them)."""
    ch = tl.arange(0, BLOCK_C)
    scale = tl.load(S.scale + h * D + c0 + ch, mask=ch < C, other=0.0).to(tl.float32)
    SHIFT: tl.constexpr = 2 ** (L.BITS - 1) - 1 if L.SYM and not L.CB else 0
    offset = -SHIFT * scale
    if not L.SYM:
        offset += tl.load(S.offset + h * D + c0 + ch, mask=ch < C, other=0.0).to(tl.float32)
    return scale, offset


# fmt: off
@triton.jit
def slot(INDEX, DELTA, SCALE, i_row, d_row, live, base, k, FP8: tl.constexpr, D: tl.constexpr):
    # fmt: on
    """Exact slot k of the rows at element offsets i_row of INDEX and d_row of DELTA [BN]:
    (channel within this head, fp32 delta), delta 0 where
    not live or where the slot belongs to another head (base: this head's first channel). An
    FP8 delta is an E4M3 byte in steps of SCALE [D] (this head's static scale) at its channel."""
    index = tl.load(INDEX + i_row + k, mask=live, other=0).to(tl.int32) - base
    mine = live & (index >= 0) & (index < D)
    index = tl.where(mine, index, 0)
    if FP8:
        delta = fp8_decode(tl.load(DELTA + d_row + k, mask=mine, other=0))
        step = tl.load(SCALE + index, mask=mine, other=1.0).to(tl.float32)
        delta = delta * tl.where(step > 0, step, 1.0)
    else:
        delta = tl.load(DELTA + d_row + k, mask=live, other=0.0).to(tl.float32)
    return index, tl.where(mine, delta, 0.0)


# fmt: off
@triton.jit
def slot_scores(INDEX, DELTA, SCALE, q_lo, q_hi, i_row, d_row, live, base, j, freq,
                K: tl.constexpr, D: tl.constexpr, PRE_ROPE: tl.constexpr, FP8: tl.constexpr,
                FAST: tl.constexpr = False):
    # fmt: on
    """What the keys' exact slots add to the scores, fp32 [BN, BLOCK_G] (positions x query
    heads, as the decode kernel's scores): q . R(j) (delta e_c) for each slot (channel c), q's
    halves q_lo, q_hi fp32 [BLOCK_G, BLOCK_C] gathered in registers. Before RoPE, q is the
    query rotated back by the tile's first position (R(p0)^T q, so that q . R(p0 + j) k =
    q' . R(j) k), j [BN] the positions within the tile, freq [BLOCK_C] RoPE's; delta at
    channel c lands on c and its pair c +- D/2:
    delta (q_c cos + q_pair sin) for c < D/2, delta (q_c cos - q_pair sin) otherwise.
    FAST: `trig` by the SFU (a GPU)."""
    C: tl.constexpr = D // 2
    out = tl.zeros([j.shape[0], q_lo.shape[0]], tl.float32)
    qt_lo, qt_hi = tl.trans(q_lo), tl.trans(q_hi)
    for k in tl.static_range(K):
        index, delta = slot(INDEX, DELTA, SCALE, i_row, d_row, live, base, k, FP8, D)
        upper = index >= C
        c = tl.where(upper, index - C, index)
        at_c = tl.broadcast_to(c[:, None], out.shape)
        lo = tl.gather(qt_lo, at_c, axis=0)
        hi = tl.gather(qt_hi, at_c, axis=0)
        if PRE_ROPE:
            cos, sin = trig(j.to(tl.float32) * tl.gather(freq, c, axis=0), FAST)
            q = tl.where(upper[:, None], hi * cos[:, None] - lo * sin[:, None],
                         lo * cos[:, None] + hi * sin[:, None])  # fmt: skip
        else:
            q = tl.where(upper[:, None], hi, lo)
        out += q * delta[:, None]
    return out


# fmt: off
@triton.jit
def slot_values(lo, hi, INDEX, DELTA, SCALE, i_row, d_row, live, base, K: tl.constexpr,
                D: tl.constexpr, BLOCK_C: tl.constexpr, FP8: tl.constexpr):
    # fmt: on
    """Values' exact slots added into the halves lo, hi [BN, BLOCK_C] at their channels (rows
    at element offsets i_row of INDEX, d_row of DELTA)."""
    ch = tl.arange(0, BLOCK_C)[None, :]
    for k in tl.static_range(K):
        index, delta = slot(INDEX, DELTA, SCALE, i_row, d_row, live, base, k, FP8, D)
        lo = tl.where(ch == index[:, None], lo + delta[:, None], lo)
        hi = tl.where(ch == index[:, None] - D // 2, hi + delta[:, None], hi)
    return lo, hi


@triton.jit
def ring(TAIL, line, pos, live, ring_size, c0, D: tl.constexpr, BLOCK_C: tl.constexpr):
    """One half from the residual ring TAIL [B, Hkv, R, D] (slot pos % R), fp32 [BN, BLOCK_C]."""
    ch = tl.arange(0, BLOCK_C)
    ptr = TAIL + (line * ring_size + pos % ring_size)[:, None] * D + (c0 + ch)[None, :]
    x = tl.load(ptr, mask=live[:, None] & (ch < D // 2)[None, :], other=0.0)
    return x.to(tl.float32)


def unit(bits: int, half: int) -> int:
    """Bits a code load reads at once: 32 (an int32 word) when a half row of codes is whole
    words, else 8."""
    return 32 if 8 % bits == 0 and half * bits % 32 == 0 else 8


def readable(spec, head_dim: int, kv_heads: int) -> bool:
    """Whether `half` reads a body stored with spec: halves that start on a byte (whole 8-code
    words for 3/5/6 bits) and power-of-two token groups."""
    c = head_dim // 2
    if head_dim % 2 or c * spec.bits % 8 or (8 % spec.bits and c % 8):
        return False
    g = spec.layout.token_group()
    return g & (g - 1) == 0


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)
