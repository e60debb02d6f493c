"""8-bit exact slots (QuantSpec.slot_code "fp8"): a slot stores its delta in steps of its
channel's scale as a float8 E4M3 byte (OCP's E4M3FN: 4 exponent bits, bias 7, 3 mantissa bits,
no infinities; torch.float8_e4m3fn), clamped to +-FP8_MAX steps. Rounding to nearest keeps it
within 1/16 of the delta (2**-10 steps near zero): a 2-bit code's worst element comes back with
a sixteenth of its error, for 8 bits a slot instead of the cache dtype's 16. The byte is what
the body stores, the kernels write and read it bit for bit as torch converts it
(kernels.tiles.fp8_encode / fp8_decode)."""

import torch

FP8_MAX = 448.0  # the largest finite E4M3FN value


def encode(steps: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3FN bytes of fp32 `steps`, saturated at +-FP8_MAX."""
    return steps.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 E4M3FN bytes."""
    return code.view(torch.float8_e4m3fn).float()


def step(scale: torch.Tensor) -> torch.Tensor:
    """The step a slot's delta is counted in: the channel's scale in fp32, 1 where it is 0 (the
    codes' own guard)."""
    s = scale.float()
    return torch.where(s > 0, s, torch.ones_like(s))
