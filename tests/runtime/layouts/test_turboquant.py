"""TurboQuant (Zandieh et al., arXiv:2504.19874) against its paper: Theorem 1 reports the MSE of
quantizing a unit vector as D_mse ~ 0.36, 0.117, 0.03, 0.009 at 1-4 bits (the large-d limit, the
Lloyd-Max distortions of a Gaussian truncated to the printed digits), within the bounds
4^-b <= D_mse <= (sqrt(3) pi / 2) 4^-b at any dimension. A wrong density, a wrong k-means, a
rotation that is not orthogonal or a norm left out would miss these."""

import math

import pytest
import torch

from kvcalib_runtime.layouts.codebooks import distortion, lloyd_max, random_rotation
from kvcalib_runtime.layouts.quant import QuantSpec, dequantize, fake_quantize, quantize

PAPER = {1: (0.36, 0.01), 2: (0.117, 0.001), 3: (0.03, 0.01), 4: (0.009, 0.001)}  # value, unit


def _unit_vectors(n: int, d: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(1, n, d, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_distortion_of_unit_vectors_is_the_papers(bits):
    """At d = 1024 the table's D_mse, and the one measured through the quantizer (rotation,
    norm, nearest level, inverse rotation) on 2000 random unit vectors, truncate to the paper's
    digits; the measurement is within 1% of the table (sampling error ~0.2%)."""
    value, unit = PAPER[bits]
    table = distortion(1024, bits)
    assert value <= table < value + unit
    x = _unit_vectors(2000, 1024)
    measured = (fake_quantize(x, QuantSpec(bits, symmetric=True, method="turboquant")) - x) ** 2
    measured = measured.sum(-1).mean().item()
    assert value <= measured < value + unit
    assert measured == pytest.approx(table, rel=0.01)


@pytest.mark.parametrize("d", [16, 48, 64, 128])  # TurboQuant's sets here: 16 + 48, heads 64/128
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_distortion_within_the_papers_bounds_at_head_sizes(d, bits):
    table = distortion(d, bits)
    assert 4.0**-bits <= table <= math.sqrt(3) * math.pi / 2 * 4.0**-bits


def test_levels_are_the_classical_ones_in_the_limit():
    """Max (1960): 1 bit +-sqrt(2/pi), 2 bits +-0.4528, +-1.510 for a unit Gaussian; a unit
    vector's coordinate has standard deviation 1/sqrt(d)."""
    d = 4096
    one = lloyd_max(d, 1) * math.sqrt(d)
    two = lloyd_max(d, 2) * math.sqrt(d)
    torch.testing.assert_close(
        one, torch.tensor([-1.0, 1.0]) * math.sqrt(2 / math.pi), atol=2e-3, rtol=0
    )
    torch.testing.assert_close(
        two, torch.tensor([-1.510, -0.4528, 0.4528, 1.510]), atol=3e-3, rtol=0
    )


@pytest.mark.parametrize("n", [16, 48, 64])
def test_rotations_are_orthogonal(n):
    r = random_rotation(n)
    torch.testing.assert_close(r @ r.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert not torch.allclose(r.abs(), torch.eye(n, dtype=torch.float64))


def test_the_outlier_set_gets_its_bits():
    """16 of 64 channels 10x larger: with them as the outlier set (4 bits, the rest 2 bits) the
    error is several times smaller than with 16 ordinary channels there instead — the split is
    by channel, before the rotations. Codes fit their set's width; norms are per set."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 200, 64, generator=g)
    loud = torch.stack([torch.randperm(64, generator=g)[:16] for _ in range(2)]).sort(-1).values
    x.scatter_(-1, loud[:, None].expand(2, 200, 16), 10 * torch.randn(2, 200, 16, generator=g))
    quiet = torch.stack([torch.tensor([c for c in range(64) if c not in h][:16]) for h in loud])
    spec = QuantSpec(2, symmetric=True, method="turboquant", split_channels=16, split_bits=4)
    q = quantize(x, spec, split=loud)
    assert q.codes[..., :16].max() == 15 and q.codes[..., 16:].max() == 3
    assert q.scale.shape == (2, 200, 2, 1)
    right = ((dequantize(q, spec, split=loud) - x) ** 2).sum()
    wrong = ((fake_quantize(x, spec, split=quiet) - x) ** 2).sum()
    assert right < wrong / 4
    assert right / (x**2).sum() < 0.03  # 4-bit error (~0.01) on the outliers' energy


def test_split_needs_its_channels():
    spec = QuantSpec(2, symmetric=True, method="turboquant", split_channels=4, split_bits=3)
    with pytest.raises(ValueError, match="pass split"):
        quantize(torch.randn(1, 2, 16), spec)
    with pytest.raises(ValueError, match="names a channel twice"):
        quantize(torch.randn(1, 2, 16), spec, split=torch.tensor([[0, 0, 1, 2]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_body_stores_what_the_quantizer_computes(dtype):
    """Packed at 4 and 2 bits per set and unpacked again: bit for bit what fake_quantize gives
    (the norms rounded to the cache dtype in both)."""
    spec = QuantSpec(2, symmetric=True, method="turboquant", split_channels=16, split_bits=4)
    split = torch.stack([torch.arange(16), torch.arange(48, 64)])
    x = torch.randn(1, 2, 7, 64, dtype=dtype)
    body = spec.layout.allocate((1, 2, 9, 64), "cpu", dtype, split=split)
    assert [c.shape[-1] for c in body.codes] == [8, 12]  # 16 x 4 bits, 48 x 2 bits
    body.write(x, torch.tensor([0]), torch.tensor([2]))
    stored = body.dequantize(dtype, b=0, n=9)
    assert torch.equal(stored[:, 2:], fake_quantize(x[0], spec, split=split))
    assert not stored[:, :2].any()
