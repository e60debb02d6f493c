"""Reference quantizers: exact against hand-computed oracles (atol=0), and within the uniform
quantizer's half-step bound for every element."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcalib_runtime.layouts import metabyte
from kvcalib_runtime.layouts.quant import (
    QTensor,
    QuantSpec,
    dequantize,
    fake_quantize,
    quantize,
    uniform_codebook,
)


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_kivi_asymmetric_formula_by_hand():
    # min -1, max 2, 2 bits: scale = 3/3 = 1; (x - min)/scale = [0, 1.25, 1.5, 3] -> round-half-even
    x = _t([-1.0, 0.25, 0.5, 2.0])
    q = quantize(x, QuantSpec(2))
    assert q.codes.tolist() == [[0, 1, 2, 3]]
    assert q.scale.item() == 1.0 and q.offset.item() == -1.0  # offset is the float min itself
    assert torch.equal(dequantize(q, QuantSpec(2)), _t([-1.0, 0.0, 1.0, 2.0]))


def test_symmetric_by_hand():
    # absmax 0.75, 3 bits: qmax 3, scale 0.25; x/scale = [-2, 0.5, 1, 3] -> codes + 3
    x = _t([-0.5, 0.125, 0.25, 0.75])
    q = quantize(x, QuantSpec(3, symmetric=True))
    assert q.offset is None and q.scale.item() == 0.25
    assert q.codes.tolist() == [[1, 3, 4, 6]]
    assert torch.equal(dequantize(q, QuantSpec(3, symmetric=True)), _t([-0.5, 0.0, 0.25, 0.75]))


def test_channel_groups_along_tokens_by_hand():
    # 3 tokens x 2 channels, groups of 2 tokens: rows {0,1} share a range per channel, row 2 alone
    x = _t([0.0, 10.0], [3.0, 4.0], [5.0, 5.0])
    spec = QuantSpec(2, "channel", 2)
    q = quantize(x, spec)
    # channel 0, tokens 0-1: [0, 3] step 1; channel 1: [4, 10] step 2; row 2: constant groups
    assert q.codes.tolist() == [[0, 3], [3, 0], [0, 0]]
    assert torch.equal(dequantize(q, spec), x)


def test_exclude_keeps_sink_out_of_channel_range():
    x = _t([100.0, -100.0], [1.0, 2.0], [4.0, 5.0])
    spec = QuantSpec(2, "channel", 4)
    exclude = torch.tensor([True, False, False])
    q = quantize(x, spec, exclude=exclude)
    # range of channel 0 is [1, 4] (step 1), channel 1 is [2, 5]: the sink did not widen it
    assert torch.equal(q.scale.flatten(), _t([1.0, 1.0]).flatten())
    assert torch.equal(dequantize(q, spec)[1:], x[1:])


def test_excluded_tokens_never_reach_a_channel_range():
    # An excluded token (a kept sink) may hold anything, even inf: the others' range is theirs.
    x = _t([float("inf"), 7.0], [1.0, 2.0], [1.0 + 2**-20, 5.0], [3.0, 2.0])
    exclude = torch.tensor([True, False, False, False])
    q = quantize(x, QuantSpec(2, "channel", 4), exclude=exclude)
    assert q.scale.isfinite().all() and q.offset.isfinite().all()
    assert q.offset.flatten().tolist() == [1.0, 2.0]  # min over kept tokens, exactly


def test_codebook_by_hand():
    # range [0, 10] -> normalized [0, .1, .4, 1]; nearest of levels [0, .1, .5, 1]
    x = _t([0.0, 1.0, 4.0, 10.0])
    spec = QuantSpec(2, codebook=True)
    cb = torch.tensor([0.0, 0.1, 0.5, 1.0])
    q = quantize(x, spec, codebook=cb)
    assert q.codes.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(dequantize(q, spec, codebook=cb), _t([0.0, 1.0, 5.0, 10.0]))


def test_per_head_codebooks_match_shared_one():
    x = torch.randn(2, 3, 17, 64)
    spec = QuantSpec(3, codebook=True)
    cb = torch.sort(torch.rand(8)).values
    shared = fake_quantize(x, spec, codebook=cb)
    per_head = fake_quantize(x, spec, codebook=cb.expand(3, 8).contiguous())
    assert torch.equal(shared, per_head)


def test_dynamic_outliers_kept_exactly_by_hand():
    # group of 8, outliers 0.25 -> ceil(0.25 * 8 / 2) = 1 kept at each end; range of the rest
    x = _t([-50.0, 0.0, 1.0, 2.0, 3.0, 1.5, 0.5, 90.0])
    spec = QuantSpec(2, outliers=0.25)
    q = quantize(x, spec)
    assert spec.layout.slots(8) == 2 and q.slot_index.dtype == torch.uint8
    assert q.slot_index.tolist() == [[7, 0]]  # 90 is 87 outside [0, 3], -50 is 50 outside
    assert q.slot_delta.tolist() == [[87.0, -50.0]]  # x - x_hat: clamped to 3 and to 0
    assert q.offset.item() == 0.0 and q.scale.item() == 1.0
    y = dequantize(q, spec)
    assert y[0, 0] == -50.0 and y[0, 7] == 90.0  # exact
    assert torch.equal(y[0, 1:5], x[0, 1:5])


def test_static_ranges_and_outlier_slots():
    x = _t([0.0, 0.0, 1.0], [2.0, 9.0, -5.0], [-7.0, 4.0, 2.0])
    lo, hi = _t([0.0, 0.0, -3.0]), _t([3.0, 6.0, 3.0])
    clamped = fake_quantize(x, QuantSpec(2, "static"), static_range=(lo, hi))
    assert clamped[2, 0] == 0.0 and clamped[1, 1] == 6.0  # clamped to the calibrated range
    spec = QuantSpec(2, "static", outliers=0.01, outlier_slots=1)
    kept = fake_quantize(x, spec, static_range=(lo, hi))
    assert kept[2, 0] == -7.0  # the only channel outside its range: its slot holds it
    assert kept[1, 1] == 9.0 and kept[1, 2] == -3.0  # 3 outside beats 2 outside: -5 clamped
    assert kept[1, 0] == 2.0 and kept[2, 1] == 4.0  # on the grid of steps 1 and 2
    two = fake_quantize(
        x, QuantSpec(2, "static", outliers=0.01, outlier_slots=2), **{"static_range": (lo, hi)}
    )
    assert two[1, 1] == 9.0 and two[1, 2] == -5.0  # two slots hold both


def test_the_error_rule_spends_slots_on_the_worst_rounding_too():
    # range [0, 3], step 1: 1.5 rounds to 2 (error 0.5), 2.25 to 2 (0.25), 4.0 clamps (1.0)
    x = _t([1.5, 2.25, 4.0, 0.0])
    lo, hi = _t([0.0] * 4), _t([3.0] * 4)
    for rule, kept in (("outside", [2]), ("error", [2, 0])):
        spec = QuantSpec(2, "static", outliers=0.01, outlier_slots=2, slot_rule=rule)
        q = quantize(x, spec, static_range=(lo, hi))
        used = q.slot_delta[0] != 0
        assert q.slot_index[0][used].tolist() == kept
        y = dequantize(q, spec)
        assert torch.equal(y[0, kept], x[0, kept])


def test_fp8_slots_restore_a_sixteenth_of_the_delta_in_one_byte():
    """slot_code "fp8" stores a slot's delta in steps of its channel's scale as one E4M3 byte:
    rounding to nearest keeps the restored element within 1/16 of the delta (3 mantissa bits)
    and near zero within 2**-10 steps; a delta beyond 448 steps saturates instead of wrapping."""
    gen = torch.Generator().manual_seed(5)
    scale = torch.tensor([0.01, 1.0, 30.0, 0.0]).repeat(16)  # the last: a constant channel
    x = torch.randn(3, 200, 64, generator=gen) * scale.clamp_min(1e-3) * 4
    x[0, 0, 2] = 1e6  # far beyond 448 steps of its channel
    lo, hi = -scale * 1.5, scale * 1.5
    for rule in ("error", "outside"):
        exact = QuantSpec(2, "static", outliers=0.01, outlier_slots=2, slot_rule=rule)
        fp8 = dataclasses.replace(exact, slot_code="fp8")
        qe, q8 = (quantize(x, s, static_range=(lo, hi)) for s in (exact, fp8))
        assert q8.slot_delta.dtype == torch.uint8 and torch.equal(q8.slot_index, qe.slot_index)
        assert torch.equal(q8.codes, qe.codes)
        at = qe.slot_index.long()
        ye, y8 = (dequantize(q, s).gather(-1, at) for q, s in ((qe, exact), (q8, fp8)))
        step = torch.where(scale > 0, scale, 1.0).expand_as(x).gather(-1, at)
        delta = qe.slot_delta.float()
        far = delta.abs() / step > 448
        bound = delta.abs() / 16 + step * 2**-10
        assert ((y8 - ye).abs() <= bound * 1.0001)[~far].all()
        assert far[0, 0].any() and (y8 - ye).abs()[far].min() > 0  # saturated, not wrapped
        assert (y8 - ye).abs()[~far].max() > 0  # not vacuous: the byte does round
    with pytest.raises(ValueError, match="for 'static' granularity with outlier_slots"):
        QuantSpec(2, outliers=0.1, slot_rule="error", slot_code="fp8")
    with pytest.raises(ValueError, match="slot_code = 'fp4' is unknown"):
        QuantSpec(2, "static", outliers=0.01, outlier_slots=1, slot_code="fp4")


def test_byte_scales_round_up_within_an_eighth_at_every_magnitude():
    """layouts.metabyte's scale byte: every code decodes to (1 + m/8) * 2**(e - 20) and encodes
    back to itself; any scale in [2**-20, 3840] comes back no smaller and less than 1/8 larger
    (3 mantissa bits rounded up), 0 and anything smaller as 2**-20, anything larger as 3840."""
    codes = torch.arange(256, dtype=torch.uint8)
    grid = metabyte.decode_scale(codes)
    expected = (1 + (codes.long() & 7) / 8) * 2.0 ** ((codes.long() >> 3) - 20)
    assert torch.equal(grid, expected.float()) and torch.equal(metabyte.encode_scale(grid), codes)
    gen = torch.Generator().manual_seed(0)
    s = torch.exp(torch.empty(100_000).uniform_(math.log(2**-20), math.log(3840.0), generator=gen))
    back = metabyte.decode_scale(metabyte.encode_scale(s))
    assert (back >= s).all() and (back < s * 1.125).all()
    edges = metabyte.decode_scale(metabyte.encode_scale(torch.tensor([0.0, 1e-12, 1e9])))
    assert edges.tolist() == [2.0**-20, 2.0**-20, 3840.0]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_byte_metadata_keeps_every_element_on_its_groups_grid(bits):
    """metadata_code "byte": the scale rounded up and the range widened to contain 0 leave no
    element clamped, so each comes back within half a step plus the zero point's rounding
    (span / 510 steps), ranges away from zero included; the rounding costs 2-bit Gaussian rows
    at most a fifth more squared error than fp32 metadata."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(4, 300, 64, generator=gen) * torch.rand(4, 300, 1, generator=gen) * 10
    x[0] += 50.0  # whole rows far from zero
    x[1] -= 50.0
    for spec in (QuantSpec(bits, metadata_code="byte"), QuantSpec(bits, group_size=16,
                 metadata_code="byte", codebook=bits <= 4)):  # fmt: skip
        book = uniform_codebook(bits) if spec.codebook else None
        q = quantize(x, spec, codebook=book)
        assert q.scale.dtype == torch.uint8 and q.offset.dtype == torch.uint8
        scale = spec.layout.expand(metabyte.decode_scale(q.scale), x.shape)
        y = dequantize(q, spec, codebook=book)
        span = 1 if spec.codebook else spec.levels - 1
        bound = scale * (0.5 * (1 if not spec.codebook else 1 / (spec.levels - 1)) + span / 510)
        assert ((y - x).abs() <= bound * 1.0001 + 1e-6).all(), spec
    wide, byte = QuantSpec(bits), QuantSpec(bits, metadata_code="byte")
    z = torch.randn(8, 400, 64, generator=gen)
    err = [(fake_quantize(z, s) - z).pow(2).mean() for s in (wide, byte)]
    assert err[1] <= err[0] * 1.2
    with pytest.raises(ValueError, match="per-token groups"):
        QuantSpec(2, "static", metadata_code="byte")
    with pytest.raises(ValueError, match="metadata_code = 'fp8' is unknown"):
        QuantSpec(2, metadata_code="fp8")


def test_vector_granularity_joins_the_heads():
    # 2 heads x 1 token x 2 channels: one group of 4 values per token
    x = torch.tensor([[[0.0, 1.0]], [[2.0, 3.0]]])  # [H=2, T=1, D=2]
    spec = QuantSpec(2, "vector")
    q = quantize(x, spec)
    assert q.heads == 2 and q.codes.shape == (1, 1, 4)
    assert q.scale.flatten().tolist() == [1.0] and q.offset.flatten().tolist() == [0.0]
    assert torch.equal(dequantize(q, spec), x)
    wide = QuantSpec(2, "vector", outliers=0.01)  # 300 channels: ceil(3 / 2) = 2 per side
    q = quantize(torch.randn(3, 5, 100), wide)
    assert q.slot_index.shape == (1, 5, 4) and q.slot_index.dtype == torch.int16


def test_clip_shrinks_the_range():
    x = _t([-4.0, 0.0, 1.0, 4.0])
    q = quantize(x, QuantSpec(4, clip=0.5))
    assert q.offset.item() == -2.0 and q.scale.item() == pytest.approx(4.0 / 15)


def test_constant_group_is_exact():
    # A zero-width range must not divide by zero: asymmetric groups reproduce the constant
    # exactly (offset = min), symmetric ones up to one rounding of absmax/qmax*qmax.
    x = torch.full((1, 3, 5, 64), 0.37)
    for spec in (QuantSpec(2), QuantSpec(2, "channel", 4)):
        assert torch.equal(fake_quantize(x, spec), x)
    y = fake_quantize(x, QuantSpec(3, symmetric=True))
    assert torch.allclose(y, x, rtol=2e-7, atol=0)


def _step(q: QTensor, spec: QuantSpec) -> torch.Tensor:
    """Per-element grid step, read through the public API: level 1 minus level 0."""
    zero = torch.zeros_like(q.codes)
    one = QTensor(zero + 1, q.scale, q.offset)
    return dequantize(one, spec, dtype=torch.float32) - dequantize(
        QTensor(zero, q.scale, q.offset), spec, dtype=torch.float32
    )


@settings(max_examples=120, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    granularity=st.sampled_from(["token", "channel", "static"]),
    symmetric=st.booleans(),
    tokens=st.integers(1, 70),
    head_dim=st.sampled_from([8, 64, 80]),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**31 - 1),
    slots=st.booleans(),
)
def test_error_within_half_step(bits, granularity, symmetric, tokens, head_dim, scale, seed, slots):
    """Every element within half a step of its group's grid; with exact slots ("outside" for
    dynamic groups, whose trimmed-off elements they hold; "error" for static ranges) too: slots
    only ever remove error."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, tokens, head_dim, generator=gen) * scale
    x[..., 0, :3] *= 40  # an outlier token and channels, as sinks have
    group = {"token": 0 if seed % 2 else 8, "channel": 1 + seed % 32, "static": 0}[granularity]
    extra = {}
    if slots and granularity == "token":
        extra = dict(outliers=0.1)
    elif slots and granularity == "static":
        extra = dict(outliers=0.01, outlier_slots=3, slot_rule="error")
    spec = QuantSpec(bits, granularity, group, symmetric, **extra)
    kwargs = {}
    if granularity == "static":  # calibrated ranges covering the data
        kwargs["static_range"] = (x.amin((0, 2), keepdim=True)[0], x.amax((0, 2), keepdim=True)[0])
    q = quantize(x, spec, **kwargs)
    err = (dequantize(q, spec) - x).abs()
    # Half a grid step for every element; fp32 rounding of (x - offset)/scale adds a few ulps.
    bound = _step(q, spec).abs() / 2 + 4 * torch.finfo(torch.float32).eps * x.abs().amax()
    assert (err <= bound).all(), (err - bound).max()


def test_bits_per_element_accounting():
    # walked from the buffers of a meta-device body of 1024 tokens, against the count by hand
    d = 64

    def bits(spec, **kw):
        return spec.layout.bits_per_element(d, 1024, **kw)

    assert bits(QuantSpec(2)) == 2 + 32 / 64  # per-token: scale + offset per head
    assert bits(QuantSpec(2, "channel", 32)) == 3.0  # KIVI: 32 bits per 32 tokens
    assert bits(QuantSpec(4, symmetric=True)) == 4 + 16 / 64
    static = QuantSpec(2, "static", outliers=0.01, outlier_slots=1)
    # the range per layer (fp16 scale + offset, fp32 lo + hi per channel) over 1024 tokens;
    # one slot per token row: an 8-bit index and a 16-bit delta, used or not
    assert math.isclose(bits(static), 2 + (32 + 64) / 1024 + 24 / 64)
    token = QuantSpec(2, group_size=32, outliers=0.01)  # 1 per side per group of 32
    assert bits(token) == 2 + 32 / 32 + 4 * 24 / 64
    vector = QuantSpec(3, "vector", outliers=0.01)  # 3 heads: 192 channels, 1 per side
    assert math.isclose(bits(vector, kv_heads=3), 3 + 32 / 192 + 48 / 192)


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"bits": 7}, "use one of"),
        ({"bits": 2, "granularity": "row"}, "unknown"),
        ({"bits": 2, "granularity": "channel"}, "group_size > 0"),
        ({"bits": 2, "granularity": "static", "group_size": 4}, "drop group_size"),
        ({"bits": 2, "clip": 0.0}, "(0, 1]"),
        ({"bits": 8, "codebook": True}, "2-4 bits"),
        ({"bits": 2, "outliers": 0.7}, "fraction"),
        ({"bits": 2, "granularity": "channel", "group_size": 4, "outliers": 0.1}, "per token"),
        ({"bits": 2, "granularity": "static", "outliers": 0.01}, "outlier_slots >= 1"),
        ({"bits": 2, "outliers": 0.01, "outlier_slots": 2}, "for 'static'"),
        ({"bits": 2, "slot_rule": "loudest"}, "slot_rule"),
        ({"bits": 2.0}, "integer"),
        ({"bits": 2, "clip": float("nan")}, "finite"),
    ],
)
def test_invalid_specs_say_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace("]", r"\]")):
        QuantSpec(**kwargs)
