"""Peers' own numerics, counted by hand: llama.cpp's q4_0 / q8_0 rounding (method "ggml") and
KVQuant's per-token-vector values ("vector" groups with outliers). Quantizer math against a
hand-derived oracle: exact equality (atol = 0), on values chosen so that another rounding rule
(round half to even, dividing by the fp16 scale, symmetric 4-bit levels) gives other codes."""

import pytest
import torch

from kvcalib_runtime.layouts.quant import QuantSpec, dequantize, fake_quantize, quantize

Q4_0 = QuantSpec(4, group_size=32, symmetric=True, method="ggml")
Q8_0 = QuantSpec(8, group_size=32, symmetric=True, method="ggml")


def _block(*values: float) -> torch.Tensor:
    """One group of 32 channels [1, 1, 32] starting with `values`, zeros after."""
    x = torch.zeros(1, 1, 32)
    x[0, 0, : len(values)] = torch.tensor(values)
    return x


def test_q4_0_rounds_as_llama_cpp():
    # max |x| is -3 (negative): d = -3 / -8 = 0.375, 1/d = 2.6666667 in fp32.
    # 1.0 * 2.6666667 + 8.5 = 11.17 -> 11 -> level 3 -> 1.125; -3 -> 0.4999999 -> 0 -> -8 -> -3;
    # +-0.1875 = d / 2 are ties, both rounded up: 9.0000001 -> 9 -> level 1 (round-half-even
    # gives 0), and -0.5000001 + 8.5 = 8.0 in fp32 -> level 0 (round-half-away gives -1).
    q = quantize(_block(-3.0, 1.0, 0.1875, -0.1875), Q4_0)
    assert q.scale.item() == 0.375 and q.offset is None
    assert q.codes[0, 0, :4].tolist() == [0, 11, 9, 8]
    x_hat = dequantize(q, Q4_0)[0, 0, :4]
    assert x_hat.tolist() == [-3.0, 1.125, 0.375, 0.0]
    assert (q.codes[0, 0, 4:] == 8).all()  # zeros: 0 + 8.5 -> 8, level 0


def test_q4_0_cannot_reach_minus_a_positive_max():
    # max |x| is +4: d = -0.5. +4 -> 4 * -2 + 8.5 = 0.5 -> code 0 -> -8 * -0.5 = 4 (exact);
    # -4 -> 16.5 -> 16, capped at 15 -> level 7 -> -3.5: q4_0's 16 levels are not symmetric.
    x_hat = fake_quantize(_block(4.0, -4.0), Q4_0)[0, 0, :2]
    assert x_hat.tolist() == [4.0, -3.5]


def test_q8_0_rounds_ties_away_from_zero_with_the_fp32_inverse():
    # amax 1.984375 = 127 / 64: d = 1/64, 1/d = 64 exactly; ties 0.5, 2.5, -2.5 go away from 0.
    q = quantize(_block(1.984375, 0.5 / 64, 2.5 / 64, -2.5 / 64), Q8_0)
    assert (q.codes[0, 0, :4].int() - 127).tolist() == [127, 1, 3, -3]
    # amax 1: d = 1/127, not an fp16 number: stored rounded to fp16, but the codes use the fp32
    # inverse (0.5 * 127 = 63.5 -> 64); dequantization multiplies by the fp16 scale.
    q = quantize(_block(1.0, 0.5), Q8_0)
    d16 = torch.tensor(1 / 127, dtype=torch.float32).half().float()
    assert q.scale.item() == d16.item() != torch.tensor(1 / 127).item()
    assert (q.codes[0, 0, :2].int() - 127).tolist() == [127, 64]
    assert dequantize(q, Q8_0)[0, 0, 1].item() == (64 * d16).item()


def test_ggml_blocks_are_32_channels_each_with_its_own_scale():
    x = torch.cat([_block(8.0), _block(-1.0)], -1)  # a head of 64: two blocks
    q = quantize(x, Q4_0)
    assert q.scale.shape == (1, 1, 2, 1) and q.scale.flatten().tolist() == [-1.0, 0.125]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(bits=4, group_size=32, method="ggml"), "set symmetric = true"),
        (dict(bits=4, group_size=64, symmetric=True, method="ggml"), "group_size 32"),
        (dict(bits=2, group_size=32, symmetric=True, method="ggml"), "bits 4 or 8"),
        (dict(bits=4, group_size=32, symmetric=True, method="ggml", clip=0.9), "leave clip"),
        (dict(bits=2, symmetric=True, method="turboquant", group_size=32), "whole heads"),
        (dict(bits=2, split_channels=4, split_bits=3), "TurboQuant's"),
        (dict(bits=3, symmetric=True, method="turboquant", split_channels=4, split_bits=2), "more"),
        (dict(bits=2, symmetric=True, method="turboquant", split_channels=4), "both"),
        (dict(bits=2, method="lloyd"), "method = 'lloyd' is unknown"),
    ],
)
def test_methods_are_closed(fields, message):
    with pytest.raises(ValueError, match=message):
        QuantSpec(**fields)


def test_vector_groups_are_one_range_per_token_over_every_head():
    """KVQuant's values: the two heads of a token joined into one vector of 8 channels, 1 outlier
    per side (outliers 0.2: ceil(0.2 * 8 / 2) = 1). The range is the 2nd smallest to the 2nd
    largest, [1, 6]: 2-bit steps of 5/3; the outliers 10 and -20 come back exactly."""
    spec = QuantSpec(2, "vector", outliers=0.2)
    x = torch.tensor([[[10.0, 1.0, 2.0, 3.0]], [[4.0, 5.0, 6.0, -20.0]]])  # [H=2, T=1, D=4]
    q = quantize(x, spec)
    assert q.scale.shape == (1, 1, 1, 1) and q.scale.item() == pytest.approx(5 / 3)
    assert q.offset.item() == 1.0
    assert sorted(q.slot_index.flatten().tolist()) == [0, 7]  # channel 0 of head 0, 3 of head 1
    step = 5 / 3
    expected = torch.tensor(
        [[[10.0, 1.0, 1 + step, 1 + step]], [[1 + 2 * step, 1 + 2 * step, 6.0, -20.0]]]
    )
    torch.testing.assert_close(dequantize(q, spec), expected, atol=1e-6, rtol=0)


def test_vector_groups_store_a_third_of_the_per_head_metadata():
    """Three KV heads of 64: one scale and offset per token (per 192 channels) and 2 slots,
    against per-head groups' three of each and 6 slots (KVQuant's 1% is per vector)."""
    joined = QuantSpec(3, "vector", outliers=0.01)
    per_head = QuantSpec(3, "token", outliers=0.01)
    assert joined.layout.slots(192) == 2 and per_head.layout.slots(64) == 2
    # codes 3 + scale/offset 32 / 192 + 2 slots x (8-bit index + 16-bit value) / 192
    joined_bits = joined.layout.bits_per_element(64, 1, kv_heads=3)
    assert joined_bits == pytest.approx(3 + 32 / 192 + 48 / 192)
    assert per_head.layout.bits_per_element(64, 1) == pytest.approx(3 + 32 / 64 + 48 / 64)
