"""Bit packing is index math: round trips and layouts must be exact (torch.equal)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcalib_runtime.layouts.packing import SUPPORTED_BITS, pack, packed_size, unpack


@settings(max_examples=150, deadline=None)
@given(
    bits=st.sampled_from(SUPPORTED_BITS),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    n=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_exact(bits, lead, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, n), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    # Dense: exactly ceil(n * bits / 8) bytes per row, no padding beyond that.
    assert packed.shape == (*lead, packed_size(n, bits))
    assert packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits, n), codes)


def test_two_bit_layout_low_bits_first():
    # Codes 0..3 in one byte: code j at bits [2j, 2j+2) -> 0b11_10_01_00.
    assert pack(torch.tensor([0, 1, 2, 3], dtype=torch.uint8), 2).tolist() == [0b11100100]


def test_three_bit_layout_straddles_bytes():
    # Eight 3-bit codes fill three bytes; code 2 (value 7) straddles bytes 0 and 1.
    codes = torch.tensor([1, 0, 7, 0, 0, 0, 0, 5], dtype=torch.uint8)
    stream = sum(int(c) << (3 * j) for j, c in enumerate(codes))
    expected = [(stream >> (8 * b)) & 0xFF for b in range(3)]
    assert pack(codes, 3).tolist() == expected
    assert expected == [0b11000001, 0b00000001, 0b10100000]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_power_of_two_widths_match_shift_or_packing(bits):
    # For widths dividing 8, the stream layout equals the usual "code j << bits*(j % per_byte)".
    per = 8 // bits
    codes = torch.randint(0, 2**bits, (5, 8 * per), dtype=torch.uint8)
    c = codes.view(5, -1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    expected = (c << shifts).sum(-1).to(torch.uint8)
    assert torch.equal(pack(codes, bits), expected)
