"""quant_pack and flush, the cache's writers, against their plain-torch references
(TRITON_INTERPRET=1 on CPU): index and rounding math, so codes, metadata and exact slots must be
bit-identical to quant.quantize + packing.pack (torch.equal), every other byte left alone."""

import copy

import pytest
import torch
import triton
import triton.language as tl
from support.bodies import BODY, assert_same_body, random_body, random_data, to_device

from kvcalib_runtime.kernels import quant_pack as qp
from kvcalib_runtime.kernels import tiles
from kvcalib_runtime.layouts import fp8, metabyte
from kvcalib_runtime.layouts.quant import QuantSpec

S = QuantSpec

# -- quant_pack and flush: bit-exact -----------------------------------------------------------

QUANT_PACK_CASES = [
    # (spec, head_dim, tokens per block, dtype)
    (S(2), 64, 33, torch.float32),
    (S(3), 128, 97, torch.float32),
    (S(4, group_size=32), 128, 1, torch.float16),
    (S(8, symmetric=True), 64, 33, torch.float32),
    (S(2, group_size=16, symmetric=True), 80, 33, torch.float16),
    (S(3, symmetric=True, clip=0.9), 64, 97, torch.float16),
    (S(4, group_size=16, clip=0.85), 64, 33, torch.float32),
    (S(2, codebook=True), 64, 33, torch.float32),
    (S(3, codebook=True, symmetric=True), 128, 33, torch.float16),
    (S(4, group_size=32, codebook=True), 64, 1, torch.float32),
    (S(2, "channel", 32), 128, 64, torch.float16),
    (S(3, "channel", 4, symmetric=True), 64, 8, torch.float32),
    (S(4, "channel", 8, clip=0.9), 80, 16, torch.float16),
    (S(8, "channel", 16), 64, 32, torch.float32),
    (S(2, "channel", 4, codebook=True, symmetric=True), 64, 12, torch.float32),
    (S(2, "static"), 128, 97, torch.float16),
    (S(3, "static", symmetric=True, clip=0.9), 64, 33, torch.float32),
    (S(4, "static", codebook=True), 64, 1, torch.float32),
    (S(8, "static"), 80, 33, torch.float16),
    # exact slots: kvcalib's keys (largest error), KVQuant's (outside the range), dynamic groups
    (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error"), 128, 33,
     torch.float16),
    (S(3, "static", outliers=0.01, outlier_slots=2), 64, 33, torch.float32),
    # one E4M3 byte a slot, in steps of the channel's scale (kvcalib-2's keys)
    (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
       slot_code="fp8"), 128, 33, torch.float16),
    (S(3, "static", outliers=0.01, outlier_slots=2, slot_code="fp8"), 64, 33, torch.float32),
    (S(3, codebook=True, outliers=0.05), 128, 33, torch.float16),
    (S(2, group_size=16, outliers=0.1, slot_rule="error"), 64, 17, torch.float32),
    # rows of every head joined (KVQuant's values), odd bit widths
    (S(3, "vector"), 64, 33, torch.float16),
    (S(2, "vector", group_size=64, outliers=0.01), 64, 17, torch.float32),
    (S(5, symmetric=True), 64, 33, torch.float32),
    (S(6, "static"), 64, 17, torch.float16),
    # one-byte scale and zero point (kvcalib-2's values), symmetric, codebook, groups, slots
    (S(2, metadata_code="byte"), 64, 33, torch.float16),
    (S(8, metadata_code="byte"), 128, 33, torch.float32),
    (S(3, symmetric=True, clip=0.9, metadata_code="byte"), 64, 17, torch.float32),
    (S(2, codebook=True, metadata_code="byte"), 64, 33, torch.float32),
    (S(4, group_size=16, outliers=0.1, slot_rule="error", metadata_code="byte"), 64, 17,
     torch.float16),
    (S(3, "vector", metadata_code="byte"), 64, 17, torch.float32),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "d", "n", "dtype"), QUANT_PACK_CASES, ids=str)
def test_quant_pack_is_bit_exact(spec, d, n, dtype):
    gen = torch.Generator().manual_seed(n * d + spec.bits)
    heads, batch, slots = 3, 2, 128
    ours = random_body(
        spec, (batch, heads, slots, d), dtype, gen, d == 128 and spec.granularity != "vector"
    )
    ref = copy.deepcopy(ours)
    x = random_data((2, heads, n, d), gen, dtype)
    g = spec.group_size if spec.granularity == "channel" else 1
    seq, start = torch.tensor([1, 0]), torch.tensor([g * 2, 0])  # two blocks, two sequences
    exclude = torch.rand(batch, slots, generator=gen) < 0.15  # kept sinks
    exclude[0, :4] = True  # a whole channel group excluded
    qp.quant_pack(x, ours, seq, start, exclude)
    qp.quant_pack_reference(x, ref, seq, start, exclude)
    assert_same_body(ours, ref)
    # not vacuous: the written codes use the whole grid, the slots hold something
    assert len(ours.codes[1, :, g * 2 : g * 2 + n].unique()) > spec.levels // 2
    if ours.slot_delta is not None:
        assert ours.slot_delta[1, :, g * 2 : g * 2 + n].abs().max() > 0


@pytest.mark.parametrize("spec", [S(2, "channel", 8), S(3, "static", outliers=0.02,
                                  outlier_slots=1), S(4, group_size=16)], ids=str)  # fmt: skip
def test_quant_pack_wraps_a_ring_body(spec):
    """A sliding window's body: position p in slot p % slots, blocks that wrap around."""
    gen = torch.Generator().manual_seed(spec.bits)
    ours = random_body(spec, (2, 2, 48, 64), torch.float32, gen)
    ref, before = copy.deepcopy(ours), copy.deepcopy(ours)
    x = random_data((2, 2, 16, 64), gen)
    seq, start = torch.tensor([0, 1]), torch.tensor([40, 96])  # slots 40..55 % 48, 96..111
    exclude = torch.rand(2, 128, generator=gen) < 0.1
    qp.quant_pack(x, ours, seq, start, exclude)
    qp.quant_pack_reference(x, ref, seq, start, exclude)
    assert_same_body(ours, ref)
    assert not torch.equal(ours.codes[0, :, :8], before.codes[0, :, :8])  # 48..55 wrapped to 0..7
    assert torch.equal(ours.codes[0, :, 8:40], before.codes[0, :, 8:40])  # the rest untouched


@pytest.mark.parametrize(("spec", "flush", "residual"), [
    (S(2, "channel", 4), 8, 8),  # KIVI keys: a block of R at a time
    (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error"), 1, 8),
    (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
       slot_code="fp8"), 1, 8),
    (S(3, "vector", outliers=0.02), 2, 4),
    (S(4, symmetric=True), 1, 1),
    (S(2, metadata_code="byte"), 1, 8),
], ids=str)  # fmt: skip
def test_flush_reads_the_ring_in_place(spec, flush, residual):
    """A decode step's flush: positions [start, start + flush) from the ring (below the length)
    and the new token, only for the sequences whose block is due; the others keep every bit."""
    gen = torch.Generator().manual_seed(flush)
    B, H, D = 3, 3, 64
    ours = random_body(spec, (B, H, 64, D), torch.float16, gen)
    ref, before = copy.deepcopy(ours), copy.deepcopy(ours)
    tail = random_data((B, H, residual, D), gen, torch.float16)
    new = random_data((B, H, D), gen, torch.float16)
    lengths = torch.tensor([flush * 5 + flush - 1, flush * 3 + flush - 1, 20])
    start = lengths + 1 - flush  # the block ending with the new token
    end = start + torch.tensor([flush, flush, 0])  # the third sequence has nothing due
    exclude = torch.rand(B, 64, generator=gen) < 0.1
    qp.flush(tail, new, lengths, ours, start, end, flush, exclude)
    qp.flush_reference(tail, new, lengths, ref, start, end, flush, exclude)
    assert_same_body(ours, ref)
    for name in BODY:
        if getattr(ours, name) is not None and getattr(ours, name).dim() == 4:
            assert torch.equal(getattr(ours, name)[2], getattr(before, name)[2]), name
    assert not torch.equal(ours.codes[0], before.codes[0])


@pytest.mark.parametrize(("spec", "dtype"), [
    (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
       slot_code="fp8"), torch.float32),  # kvcalib-2's keys
    (S(3, "static", outliers=0.02, outlier_slots=1), torch.float16),
    (S(2, codebook=True), torch.float32),
    (S(2, metadata_code="byte"), torch.float32),  # kvcalib-2's values
    (S(4, group_size=16, outliers=0.1, slot_rule="error"), torch.float16),
], ids=str)  # fmt: skip
def test_flush_many_is_each_bodys_own_flush_bit_for_bit(spec, dtype):
    """A decode step's flushes of several layers stacked into one quantize (the cache's torch
    path) write what each layer's own flush_reference writes: each body keeps its own ranges and
    levels, its own n_body and its own inactive sequences."""
    gen = torch.Generator().manual_seed(spec.bits)
    B, H, D, R = 3, 2, 64, 8
    lengths = torch.tensor([20, 13, 30])
    flushes, refs = [], []
    for i in range(3):  # three layers' bodies of one spec: their own ranges, levels and rings
        body = random_body(spec, (B, H, 64, D), dtype, gen, per_head_codebook=i != 1)
        if body.levels is not None and i == 1:  # one layer's levels shared by its heads
            assert torch.equal(body.levels[0], body.levels[1])
        tail = random_data((B, H, R, D), gen, dtype) * (i + 1)
        new = random_data((B, H, D), gen, dtype)
        start = lengths + 1 - R + torch.tensor([0, 0, i])  # a body behind the others (i = 2)
        end = start + torch.tensor([1, 0, 1])  # the second sequence has nothing due
        flushes.append((tail, new, body, start, end))
        refs.append(copy.deepcopy(body))
    qp.flush_many(flushes, lengths, 1)
    for (tail, new, body, start, end), ref in zip(flushes, refs, strict=True):
        before = copy.deepcopy(ref)
        qp.flush_reference(tail, new, lengths, ref, start, end, 1)
        assert_same_body(body, ref)
        assert not torch.equal(ref.codes, before.codes)  # not vacuous: the flush wrote


@triton.jit
def _codec(X, CODE, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(CODE + i, tiles.fp8_encode(tl.load(X + i)))
    tl.store(Y + i, tiles.fp8_decode(tl.load(CODE + i)))


def test_the_kernels_fp8_codec_is_torchs_bit_for_bit():
    """tiles.fp8_encode / fp8_decode (E4M3FN by integer bit work) against torch's conversion:
    every byte but NaN's decodes to torch's value; fp32 inputs from 2**-12 to 1e6 (subnormals,
    halfway ties, +-0, saturation past 448) encode to torch's byte."""
    gen = torch.Generator().manual_seed(0)
    grid = fp8.decode(torch.arange(256, dtype=torch.uint8))
    grid = grid[grid.isfinite()]
    ties = (grid[1:] + grid[:-1]) / 2  # halfway between neighbours: round half to even
    scales = 2.0 ** torch.randint(-12, 20, (2048,), generator=gen)
    x = torch.cat(
        [
            grid,
            ties,
            torch.randn(2048, generator=gen) * scales,
            torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 1e6, -1e6]),
        ]
    )
    n = triton.next_power_of_2(len(x))
    x = torch.nn.functional.pad(x, (0, n - len(x)))
    code, y = torch.empty(n, dtype=torch.uint8), torch.empty(n)
    _codec[(1,)](x, code, y, n)
    assert torch.equal(code, fp8.encode(x))
    assert torch.equal(y, fp8.decode(code))
    assert torch.equal(fp8.decode(fp8.encode(grid)), grid)  # the grid itself round-trips


@triton.jit
def _metabyte(S, LO, CODE, SCALE, ZERO, OFFSET, SPAN: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    code = tiles.scale_encode(tl.load(S + i))
    scale = tiles.scale_decode(code)
    zero = tiles.zero_encode(tl.load(LO + i), scale, SPAN)
    tl.store(CODE + i, code)
    tl.store(SCALE + i, scale)
    tl.store(ZERO + i, zero)
    tl.store(OFFSET + i, tiles.zero_decode(zero, scale, SPAN))


@pytest.mark.parametrize("span", [1.0, 3.0, 255.0])
def test_the_kernels_metabyte_codec_is_the_layouts_bit_for_bit(span):
    """tiles.scale_encode / scale_decode / zero_encode / zero_decode against layouts.metabyte:
    scales over every code's neighbourhood (the codes themselves, a hair either side, 0, past
    both ends) and zero points of ranges anywhere from 0 to past the scale's reach give the same
    bytes and the same fp32 scales and offsets, for a codebook's span and 2 and 8 bits'."""
    gen = torch.Generator().manual_seed(int(span))
    grid = metabyte.decode_scale(torch.arange(256, dtype=torch.uint8))
    s = torch.cat([grid, grid * (1 + 2**-20), grid * (1 - 2**-20), torch.tensor([0.0, 1e-9, 1e5])])
    n = triton.next_power_of_2(len(s))
    s = torch.nn.functional.pad(s, (0, n - len(s)), value=1.0)
    lo = -torch.rand(n, generator=gen) * s * span * 1.1
    out = [
        torch.empty(n, dtype=t) for t in (torch.uint8, torch.float32, torch.uint8, torch.float32)
    ]
    _metabyte[(1,)](s, lo, *out, span, n)
    code, scale, zero, offset = out
    assert torch.equal(code, metabyte.encode_scale(s))
    assert torch.equal(scale, metabyte.decode_scale(code))
    assert torch.equal(zero, metabyte.encode_zero(lo, scale, span))
    assert torch.equal(offset, metabyte.decode_offset(zero, scale, span))
    assert len(code.unique()) == 256 and len(zero.unique()) > 200  # not vacuous


def test_quant_pack_refuses_what_it_does_not_handle():
    odd_groups = S(2, group_size=12)  # 12 channels: not a power of two, not the whole row
    body = odd_groups.layout.allocate((1, 1, 8, 48), "cpu", torch.float32)
    assert not qp.supports(odd_groups, 48, 1)
    with pytest.raises(ValueError, match="reference"):
        qp.quant_pack(torch.zeros(1, 1, 1, 48), body, torch.tensor([0]), torch.tensor([0]))
    kivi = S(2, "channel", 4)
    body = kivi.layout.allocate((1, 1, 8, 16), "cpu", torch.float32)
    with pytest.raises(ValueError, match="whole token groups"):
        qp.quant_pack(torch.zeros(1, 1, 3, 16), body, torch.tensor([0]), torch.tensor([0]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", [S(2, "static"), S(3, group_size=32, clip=0.9),
                                  S(4, "channel", 32, symmetric=True), S(2, codebook=True),
                                  S(2, "static", codebook=True, outliers=0.01, outlier_slots=1,
                                    slot_rule="error"),
                                  S(2, "static", codebook=True, outliers=0.01, outlier_slots=1,
                                    slot_rule="error", slot_code="fp8"),
                                  S(2, metadata_code="byte")], ids=str)  # fmt: skip
def test_quant_pack_is_bit_exact_on_gpu(spec, dtype):
    """On the GPU too (IEEE division, no FMA contraction): the CPU reference's exact bits."""
    gen = torch.Generator().manual_seed(spec.bits)
    ref = random_body(spec, (4, 8, 4096, 128), dtype, gen)
    ours = to_device(copy.deepcopy(ref))
    x = random_data((4, 8, 4096, 128), gen, dtype)
    exclude = torch.rand(4, 4096, generator=gen) < 0.01
    seq, start = torch.arange(4), torch.zeros(4, dtype=torch.long)
    qp.quant_pack(x.cuda(), ours, seq.cuda(), start.cuda(), exclude.cuda())
    qp.quant_pack_reference(x, ref, seq, start, exclude)
    for name in BODY:
        if getattr(ref, name) is not None:
            assert torch.equal(getattr(ours, name).cpu(), getattr(ref, name)), name
