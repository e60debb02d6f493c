"""Dense bit packing of b-bit codes (b in 1..8) into uint8 buffers, and back.

Layout (the one the cache and the kernels share): each row of N codes is a little-endian
bitstream — code j occupies bits [j*b, (j+1)*b) of the row, and stream bit i is bit (i % 8) of
byte i // 8. A row of N codes takes ceil(N*b/8) bytes. For b = 2 this is four codes per byte
with code 0 in the low bits; for b = 3, eight codes fill three bytes and codes may straddle a
byte boundary.
"""

import torch

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def packed_size(n: int, bits: int) -> int:
    """Bytes that one row of `n` codes of `bits` bits takes."""
    return (n * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes along the last dimension.

    codes: uint8 [..., N], every value < 2**bits.  Returns uint8 [..., packed_size(N, bits)].
    """
    assert bits in SUPPORTED_BITS, bits
    n = codes.shape[-1]
    pad = (-n) % 8
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, pad))
    c = c.view(*codes.shape[:-1], (n + pad) // 8, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1, keepdim=True)  # [..., N/8, 1]: 8 codes = `bits` bytes
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    out = ((words >> byte_shifts) & 0xFF).to(torch.uint8)
    out = out.reshape(*codes.shape[:-1], (n + pad) // 8 * bits)
    return out[..., : packed_size(n, bits)].contiguous()


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., packed_size(n, bits)] -> uint8 codes [..., n]."""
    assert bits in SUPPORTED_BITS, bits
    assert packed.shape[-1] == packed_size(n, bits), (packed.shape, n, bits)
    n8 = n + (-n) % 8
    p = torch.nn.functional.pad(packed.to(torch.int64), (0, n8 // 8 * bits - packed.shape[-1]))
    p = p.view(*packed.shape[:-1], n8 // 8, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (p << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = ((words >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    return codes.reshape(*packed.shape[:-1], n8)[..., :n].contiguous()
