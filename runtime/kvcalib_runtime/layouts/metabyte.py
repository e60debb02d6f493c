"""One-byte metadata (QuantSpec.metadata_code "byte", per-token groups): a group's scale and
offset in one byte each instead of two each in an fp16 cache, so an asymmetric group costs what
a symmetric one did (16 bits a group).

Scale: an unsigned float of 5 exponent and 3 mantissa bits, the top bits of the fp32 scale
rounded up:

    scale(c) = (1 + (c & 7) / 8) * 2**((c >> 3) - 20),   c in 0..255: 2**-20 .. 3840

one step is 1/16 to 1/8 of the scale at every magnitude (a float8 E4M3 byte would lose precision
below 2**-6: an 8-bit group's scale of a head ranging over 2). Rounding up keeps the group's
whole range on the grid: a group's codes never clamp because of the byte, they are at most 1/8
coarser. A range wider than 3840 steps saturates (its extremes clamp).

Offset: the zero point as a fraction of the group's range, z in 0..255:

    offset = -(z * span / 255) * scale,   span = 2**bits - 1 (uniform levels) or 1 (codebook)

Asymmetric ranges are widened to contain 0 first (lo <= 0 <= hi, as integer zero points have
it), so z = round(255 * -lo / (span * scale)) always fits; the offset is then lo within 1/510 of
the range. Symmetric groups store the scale byte alone.

Every operation is exact in fp32 (integer bit arithmetic, IEEE division rounded to nearest,
round half to even), so the kernels write and read these bytes bit for bit as this module does
(kernels.tiles.scale_encode / scale_decode).
"""

import functools

import torch

BASE = 856  # (127 - 20) << 3: fp32 bits >> 20 of the smallest scale, 2**-20
CARRY = (1 << 20) - 1  # added to an fp32's bits before dropping 20: rounds the mantissa up
ZERO_STEPS = 255.0


def encode_scale(scale: torch.Tensor) -> torch.Tensor:
    """uint8 codes of fp32 scales >= 0, each the smallest code whose scale is >= it (saturated
    at 255)."""
    bits = scale.float().view(torch.int32)
    return (((bits + CARRY) >> 20) - BASE).clamp(0, 255).to(torch.uint8)


def decode_scale(code: torch.Tensor) -> torch.Tensor:
    """fp32 scales of uint8 codes, built from their bits."""
    return ((code.to(torch.int32) + BASE) << 20).view(torch.float32)


@functools.cache
def zero_step(span: float) -> float:
    """The offset's step in scales: span / 255 as an fp32 number."""
    return float(torch.tensor(span / ZERO_STEPS, dtype=torch.float32))


def encode_zero(lo: torch.Tensor, scale: torch.Tensor, span: float) -> torch.Tensor:
    """uint8 zero points of groups from lo <= 0 and their decoded fp32 scale:
    round(255 * -lo / (span * scale)), half to even, in 0..255 (0 where scale is 0)."""
    reach = scale * span
    z = (-lo.float() * ZERO_STEPS) / torch.where(reach > 0, reach, torch.ones_like(reach))
    return z.round().clamp(0, 255).to(torch.uint8)


def decode_offset(zero: torch.Tensor, scale: torch.Tensor, span: float) -> torch.Tensor:
    """fp32 offsets of uint8 zero points and their decoded fp32 scale."""
    return -(zero.float() * zero_step(span)) * scale
