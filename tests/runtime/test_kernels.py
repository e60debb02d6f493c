"""The Triton kernels against their plain-torch references (TRITON_INTERPRET=1 on CPU).

quant_pack and flush are index and rounding math: codes, metadata and exact slots must be
bit-identical to quant.quantize + packing.pack (torch.equal), every other byte left alone.

decode_attention is float math, held to flash-attention's rule: against the reference run in
float64 on the same stored bits (the exact result), its error is at most twice that of the
reference run in the cache's dtype (fp16: what a plain low-precision torch implementation gets).
Each case also shows the bound can fail: corrupting the codes, dropping the exact slots or
ignoring the window moves the exact result by more than ten times the bound.
"""

import copy
import threading

import pytest
import torch
import triton
import triton.language as tl

from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels import decode_torch, tiles
from kvcalib_runtime.kernels import quant_pack as qp
from kvcalib_runtime.kernels.layout import Sinks, Stored
from kvcalib_runtime.layouts import fp8
from kvcalib_runtime.layouts.affine import PackedBody
from kvcalib_runtime.layouts.quant import QuantSpec

S = QuantSpec
BODY = ("codes", "scale", "offset", "slot_index", "slot_delta")


def _data(shape, gen, dtype=torch.float32):
    """Key-like data: channels of very different ranges and offsets, some huge outliers."""
    d = shape[-1]
    spread = torch.exp(torch.randn(d, generator=gen))
    x = torch.randn(shape, generator=gen) * spread + torch.randn(d, generator=gen)
    x.view(-1, d)[::7, 3] *= 20
    return x.to(dtype)


def _codebook(spec, heads, gen):
    """Sorted levels in [0, 1] (asymmetric) or [-1, 1]; per head when `heads`, else per layer."""
    lv = torch.rand(heads or 1, spec.levels, generator=gen).sort(-1).values
    lv = lv * 2 - 1 if spec.symmetric else lv
    return lv if heads else lv[0]


def _body(spec, shape, dtype, gen, per_head_codebook=False):
    """A body of shape (B, Hkv, slots, D) filled with random bits: codes, positive scales,
    offsets, slots at random channels with random deltas (or exact values when spec is None)."""
    _b, h, _, d = shape
    if spec is None:
        return torch.randn(shape, generator=gen).to(dtype)
    static = None
    if spec.layout.calibrated_range:
        static = (-torch.rand(h, d, generator=gen) * 3, torch.rand(h, d, generator=gen) * 3)
    cb = _codebook(spec, h if per_head_codebook else 0, gen) if spec.codebook else None
    body = spec.layout.allocate(shape, "cpu", dtype, static_range=static, codebook=cb)
    body.codes.copy_(torch.randint(0, 256, body.codes.shape, generator=gen))
    if spec.granularity != "static":
        body.scale.copy_(torch.rand(body.scale.shape, generator=gen) * 0.8 + 0.2)
        if body.offset is not None:
            body.offset.copy_(-torch.rand(body.offset.shape, generator=gen))
    if body.slot_index is not None:
        body.slot_index.copy_(torch.randint(0, body.width, body.slot_index.shape, generator=gen))
        if spec.slot_code == "fp8":  # any E4M3 byte but NaN's: up to 448 steps either way
            code = torch.randint(0, 127, body.slot_delta.shape, generator=gen)
            sign = torch.randint(0, 2, body.slot_delta.shape, generator=gen) * 128
            body.slot_delta.copy_(code + sign)
        else:
            body.slot_delta.copy_(torch.randn(body.slot_delta.shape, generator=gen) * 10)
    return body


def _assert_same_body(ours: PackedBody, ref: PackedBody):
    for name in BODY:
        a, b = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


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
]  # fmt: skip


@pytest.mark.parametrize(("spec", "d", "n", "dtype"), QUANT_PACK_CASES, ids=str)
def test_quant_pack_is_bit_exact(spec, d, n, dtype):
    gen = torch.Generator().manual_seed(n * d + spec.bits)
    heads, batch, slots = 3, 2, 128
    ours = _body(
        spec, (batch, heads, slots, d), dtype, gen, d == 128 and spec.granularity != "vector"
    )
    ref = copy.deepcopy(ours)
    x = _data((2, heads, n, d), gen, dtype)
    g = spec.group_size if spec.granularity == "channel" else 1
    seq, start = torch.tensor([1, 0]), torch.tensor([g * 2, 0])  # two blocks, two sequences
    exclude = torch.rand(batch, slots, generator=gen) < 0.15  # kept sinks
    exclude[0, :4] = True  # a whole channel group excluded
    qp.quant_pack(x, ours, seq, start, exclude)
    qp.quant_pack_reference(x, ref, seq, start, exclude)
    _assert_same_body(ours, ref)
    # not vacuous: the written codes use the whole grid, the slots hold something
    assert len(ours.codes[1, :, g * 2 : g * 2 + n].unique()) > spec.levels // 2
    if ours.slot_delta is not None:
        assert ours.slot_delta[1, :, g * 2 : g * 2 + n].abs().max() > 0


@pytest.mark.parametrize("spec", [S(2, "channel", 8), S(3, "static", outliers=0.02,
                                  outlier_slots=1), S(4, group_size=16)], ids=str)  # fmt: skip
def test_quant_pack_wraps_a_ring_body(spec):
    """A sliding window's body: position p in slot p % slots, blocks that wrap around."""
    gen = torch.Generator().manual_seed(spec.bits)
    ours = _body(spec, (2, 2, 48, 64), torch.float32, gen)
    ref, before = copy.deepcopy(ours), copy.deepcopy(ours)
    x = _data((2, 2, 16, 64), gen)
    seq, start = torch.tensor([0, 1]), torch.tensor([40, 96])  # slots 40..55 % 48, 96..111
    exclude = torch.rand(2, 128, generator=gen) < 0.1
    qp.quant_pack(x, ours, seq, start, exclude)
    qp.quant_pack_reference(x, ref, seq, start, exclude)
    _assert_same_body(ours, ref)
    assert not torch.equal(ours.codes[0, :, :8], before.codes[0, :, :8])  # 48..55 wrapped to 0..7
    assert torch.equal(ours.codes[0, :, 8:40], before.codes[0, :, 8:40])  # the rest untouched


@pytest.mark.parametrize(("spec", "flush", "residual"), [
    (S(2, "channel", 4), 8, 8),  # KIVI keys: a block of R at a time
    (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error"), 1, 8),
    (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
       slot_code="fp8"), 1, 8),
    (S(3, "vector", outliers=0.02), 2, 4),
    (S(4, symmetric=True), 1, 1),
], ids=str)  # fmt: skip
def test_flush_reads_the_ring_in_place(spec, flush, residual):
    """A decode step's flush: positions [start, start + flush) from the ring (below the length)
    and the new token, only for the sequences whose block is due; the others keep every bit."""
    gen = torch.Generator().manual_seed(flush)
    B, H, D = 3, 3, 64
    ours = _body(spec, (B, H, 64, D), torch.float16, gen)
    ref, before = copy.deepcopy(ours), copy.deepcopy(ours)
    tail = _data((B, H, residual, D), gen, torch.float16)
    new = _data((B, H, D), gen, torch.float16)
    lengths = torch.tensor([flush * 5 + flush - 1, flush * 3 + flush - 1, 20])
    start = lengths + 1 - flush  # the block ending with the new token
    end = start + torch.tensor([flush, flush, 0])  # the third sequence has nothing due
    exclude = torch.rand(B, 64, generator=gen) < 0.1
    qp.flush(tail, new, lengths, ours, start, end, flush, exclude)
    qp.flush_reference(tail, new, lengths, ref, start, end, flush, exclude)
    _assert_same_body(ours, ref)
    for name in BODY:
        if getattr(ours, name) is not None and getattr(ours, name).dim() == 4:
            assert torch.equal(getattr(ours, name)[2], getattr(before, name)[2]), name
    assert not torch.equal(ours.codes[0], before.codes[0])


@pytest.mark.parametrize(("spec", "dtype"), [
    (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
       slot_code="fp8"), torch.float32),  # kvcalib-2's keys
    (S(3, "static", outliers=0.02, outlier_slots=1), torch.float16),
    (S(2, codebook=True), torch.float32),  # kvcalib-2's values
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
        body = _body(spec, (B, H, 64, D), dtype, gen, per_head_codebook=i != 1)
        if body.levels is not None and i == 1:  # one layer's levels shared by its heads
            assert torch.equal(body.levels[0], body.levels[1])
        tail, new = _data((B, H, R, D), gen, dtype) * (i + 1), _data((B, H, D), gen, dtype)
        start = lengths + 1 - R + torch.tensor([0, 0, i])  # a body behind the others (i = 2)
        end = start + torch.tensor([1, 0, 1])  # the second sequence has nothing due
        flushes.append((tail, new, body, start, end))
        refs.append(copy.deepcopy(body))
    qp.flush_many(flushes, lengths, 1)
    for (tail, new, body, start, end), ref in zip(flushes, refs, strict=True):
        before = copy.deepcopy(ref)
        qp.flush_reference(tail, new, lengths, ref, start, end, 1)
        _assert_same_body(body, ref)
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


# -- decode attention: the kernel against its reference ----------------------------------------

DECODE_CASES = {
    # name: (key spec, value spec, query heads, KV heads, head_dim, pre-RoPE, window)
    "kvcalib-2 G4 D128": (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1,
                            slot_rule="error"), S(2, symmetric=True, codebook=True), 8, 2, 128,
                          True, None),
    "kvcalib-3 G3 D64": (S(3, "static", codebook=True, outliers=0.01, outlier_slots=2,
                           slot_rule="error"), S(3, symmetric=True, codebook=True), 9, 3, 64,
                         True, None),
    "kvcalib-4 G8 D256 one KV head": (S(4, "static", codebook=True, outliers=0.01,
                                        outlier_slots=1), S(4, symmetric=True, codebook=True),
                                      8, 1, 256, True, None),
    "kvcalib-2 fp8 slots G4 D64": (S(2, "static", codebook=True, outliers=0.01, outlier_slots=2,
                                     slot_rule="error", slot_code="fp8"),
                                   S(3, "static", outliers=0.01, outlier_slots=1,
                                     slot_code="fp8"), 8, 2, 64, True, None),
    "kivi-2 G1 D128": (S(2, "channel", 32), S(2, group_size=32), 2, 2, 128, False, None),
    "kivi-4 G3 D64": (S(4, "channel", 16), S(4, group_size=16), 6, 2, 64, False, None),
    "per-token-3 G4 D64": (S(3), S(3), 8, 2, 64, False, None),
    "quarot-kv4 G8 D128": (S(4), S(4), 8, 1, 128, False, None),
    "kvquant-3 G4 D128": (S(3, "static", codebook=True, outliers=0.01, outlier_slots=1),
                          S(3, codebook=True, outliers=0.01), 8, 2, 128, True, None),
    "vector values G3 D64": (S(2, "static"), S(3, "vector", outliers=0.01), 9, 3, 64, True,
                             None),
    "head_dim 80": (S(2), S(3, symmetric=True), 4, 2, 80, True, None),
    "head_dim 96, groups across halves": (S(2, group_size=32), S(4, group_size=32), 4, 2, 96,
                                          False, None),
    "window pre-RoPE ring": (S(2, "static"), S(2, group_size=16), 8, 2, 64, True, 50),
    "window exact keys": (None, S(4, "channel", 16), 2, 1, 64, False, 37),
    "8-bit keys exact values D256": (S(8), None, 4, 1, 256, True, None),
    "5/6-bit": (S(6, "static"), S(5, symmetric=True), 2, 2, 64, True, None),
}  # fmt: skip


def _decode_inputs(case, gen, dtype=torch.float16):
    """A cache's worth of random stored bits for case: 3 sequences (lengths 150, 61, 0), a ring of
    16 (key and value bodies end at different positions), 3 sink slots, fp16."""
    key, value, H, hkv, D, pre_rope, window = DECODE_CASES[case]
    B, P, R = 3, 151, 16
    slots = P if window is None else 64  # a window's ring body: position p in slot p % 64
    kb, vb = (_body(s, (B, hkv, slots, D), dtype, gen) for s in (key, value))
    lengths = torch.tensor([150, 61, 0])
    k_nb, v_nb = ((lengths - r).clamp(min=0) for r in (9, 14))
    keys = Stored(kb, torch.randn(B, hkv, R, D, generator=gen).to(dtype), k_nb)
    values = Stored(vb, torch.randn(B, hkv, R, D, generator=gen).to(dtype), v_nb)
    sink_pos = torch.tensor([[0, 37, 140], [0, -1, -1], [-1, -1, -1]])
    is_sink = torch.zeros(B, P, dtype=torch.bool)
    for b, row in enumerate(sink_pos.tolist()):
        is_sink[b, [p for p in row if p >= 0]] = True
    sink_kv = (torch.randn(B, hkv, 3, D, generator=gen).to(dtype) for _ in range(2))
    sinks = Sinks(*sink_kv, sink_pos, is_sink)
    q = torch.randn(B, H, 1, D, generator=gen).to(dtype)
    new = (torch.randn(B, hkv, 1, D, generator=gen).to(dtype) for _ in range(2))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D) if pre_rope else None
    return (q, *new, keys, values, sinks, lengths), dict(inv_freq=inv_freq, window=window)


def _ref(args, options, **changes):
    return dec.decode_attention_reference(*args, **{**options, **changes})


@pytest.mark.parametrize(
    ("config", "splits"),
    [((32, 4, 1), 1), ((16, 4, 1), 3), ((64, 4, 1), 2)],
    ids=["32-token tiles", "16-token tiles, 3 splits", "64-token tiles, 2 splits"],
)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_attention_matches_its_reference(case, config, splits, monkeypatch):
    if config != (32, 4, 1) and case not in (
        "kvcalib-2 G4 D128",
        "kivi-4 G3 D64",
        "window pre-RoPE ring",
        "vector values G3 D64",
    ):
        pytest.skip("tile and split variants run on four layouts")  # fmt: skip
    monkeypatch.setattr(dec, "INTERPRETED", config)
    monkeypatch.setattr(dec, "num_splits", lambda *a: splits)
    gen = torch.Generator().manual_seed(len(case))
    args, options = _decode_inputs(case, gen)
    ours = dec.decode_attention(*args, **options).double()
    exact = _ref(args, options, dtype=torch.float64)
    low = _ref(args, options).double()
    bound = 2 * (low - exact).abs().max()
    assert (ours - exact).abs().max() <= bound
    # the bound can fail: what a wrong code, a dropped slot or a missed mask would do
    keys, values = args[3], args[4]
    for stored, i in ((keys, 3), (values, 4)):
        if isinstance(stored.body, PackedBody):
            body = copy.copy(stored.body)
            body.codes = body.codes ^ 0x55
            broken = _ref((*args[:i], stored._replace(body=body), *args[i + 1:]), options,
                          dtype=torch.float64)  # fmt: skip
            assert (broken - exact).abs().max() > 10 * bound
            if body.slot_delta is not None:
                body = copy.copy(stored.body)
                body.slot_delta = torch.zeros_like(body.slot_delta)
                broken = _ref((*args[:i], stored._replace(body=body), *args[i + 1:]), options,
                              dtype=torch.float64)  # fmt: skip
                assert (broken - exact).abs().max() > 10 * bound
    if options["window"]:
        assert (_ref(args, options, window=None, dtype=torch.float64) - exact).abs().max() > (
            10 * bound
        )


@pytest.mark.parametrize("per_head", [False, True], ids=["layer codebook", "head codebooks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_cpu_dequantize_is_the_bodys_own_bit_for_bit(case, dtype, per_head):
    # decode_torch's byte-table read must be PackedBody.dequantize exactly (the CPU decode path
    # and the reference then see the same keys and values): random bits in every buffer, slots
    # with large deltas, a sequence read in part (n = 37) and whole.
    key, value, _, hkv, d, *_ = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(d)
    for spec in (key, value):
        if spec is None:
            continue
        body = _body(spec, (2, hkv, 64, d), dtype, gen, per_head_codebook=per_head)
        for b, n in ((0, 37), (1, 64), (1, 0)):
            ours = decode_torch.dequantize(body, torch.float32, b, n)
            assert torch.equal(ours, body.dequantize(torch.float32, b, n))


@pytest.mark.parametrize("d", [64, 72, 80])
@pytest.mark.parametrize("bits", [3, 5, 6])
def test_cpu_dequantize_reads_codes_across_bytes_bit_for_bit(bits, d):
    # 3 and 6-bit codes straddle bytes: the CPU path reads a row's 3-byte words as four 6-bit
    # windows (72 channels of 6 bits: 54 bytes; 80 of 3: 30), 5-bit rows go to the body's own
    # read; static channels with slots and token groups alike must equal it bit for bit.
    gen = torch.Generator().manual_seed(bits * d)
    book = bits <= 4  # codebooks are for 2-4 bits
    for spec in (S(bits, "static", codebook=book, outliers=0.01, outlier_slots=1,
                   slot_code="fp8"), S(bits, group_size=d // 2), S(bits, symmetric=True,
                                                                   codebook=book)):  # fmt: skip
        body = _body(spec, (2, 3, 40, d), torch.float16, gen)
        for b, n in ((0, 37), (1, 40), (1, 0)):
            ours = decode_torch.dequantize(body, torch.float32, b, n)
            assert torch.equal(ours, body.dequantize(torch.float32, b, n)), spec


@pytest.mark.parametrize("bits", [4, 8], ids=["q4_0", "q8_0"])
def test_cpu_dequantize_reads_each_layouts_own_levels(bits):
    # llama.cpp's q4_0 levels are c - 8, not the symmetric grid's c - 7: the CPU path takes the
    # levels from the layout (before the layouts owned them it read q4_0 bodies a level off).
    spec = S(bits, group_size=32, symmetric=True, method="ggml")
    body = _body(spec, (2, 2, 64, 64), torch.float16, torch.Generator().manual_seed(bits))
    for b, n in ((0, 37), (1, 64)):
        ours = decode_torch.dequantize(body, torch.float32, b, n)
        assert torch.equal(ours, body.dequantize(torch.float32, b, n))


@pytest.mark.parametrize("window", [None, 50], ids=["no window", "window 50"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_cpu_decode_path_matches_the_reference(case, window):
    # The CPU path reads each sequence in position order, dequantizing only its body's positions:
    # in float64 it must give the reference's result to rounding (1e-9), across every layout,
    # lengths 150 / 61 / 0, key and value bodies that end at different positions, kept sinks and
    # a window mask. Ring bodies (the window cases) fall back to the reference itself.
    gen = torch.Generator().manual_seed(len(case))
    args, options = _decode_inputs(case, gen)
    if window and options["window"] is None:
        options["window"] = window
    exact = _ref(args, options, dtype=torch.float64)
    ours = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float64)
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-9)
    low = decode_torch.decode_attention_torch(*args, **options)
    assert low.dtype == args[0].dtype
    bound = 2 * (_ref(args, options).double() - exact).abs().max() + 1e-3
    assert (low.double() - exact).abs().max() <= bound  # in fp16: no worse than the reference


def test_cpu_decode_path_results_outlive_its_scratch(monkeypatch):
    # The CPU path reads bodies into scratch buffers reused across layers and steps: a result
    # must stand when another call (another layout, other lengths) reuses them, the same call
    # again gives the same bits, and buffers first made in inference mode serve outside it.
    monkeypatch.setattr(decode_torch, "_SCRATCH", threading.local())  # none made yet
    gen = torch.Generator().manual_seed(5)
    args, options = _decode_inputs("kvcalib-2 fp8 slots G4 D64", gen)
    other, other_options = _decode_inputs("kvcalib-3 G3 D64", gen)
    with torch.inference_mode():
        first = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float32)
    kept = first.clone()
    again = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float32)
    decode_torch.decode_attention_torch(*other, **other_options, dtype=torch.float32)
    last = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float32)
    assert torch.equal(first, kept) and torch.equal(again, kept) and torch.equal(last, kept)


def test_supports_every_preset_layout():
    """Every layout kvcalib's presets and the peers the runtime serves store, at the head dims
    of real models, is read by both kernels (no reference fallback)."""
    layouts = [
        S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error"),
        S(3, symmetric=True, codebook=True),
        S(2, "channel", 32), S(4, group_size=32), S(3), S(4), S(3, codebook=True, outliers=0.01),
        S(3, "vector", outliers=0.01),
    ]  # fmt: skip
    for d in (64, 80, 96, 128, 256):
        for spec in layouts:
            if spec.group_size and d % spec.group_size:
                continue
            assert dec.supports(spec, d, 8) and qp.supports(spec, d, 8), (spec, d)
    assert not dec.supports(S(3), 72, 1)  # 36 3-bit codes a half: not whole bytes, reference


# -- real sizes on a GPU, and a compile check that needs none ----------------------------------


def _cuda(value):
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, tuple):
        return tuple(_cuda(v) for v in value)
    if isinstance(value, PackedBody):
        return PackedBody(*(_cuda(getattr(value, f)) for f in PackedBody.__dataclass_fields__))
    if isinstance(value, Stored | Sinks):
        return type(value)(*(_cuda(v) for v in value))
    return value


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["kvcalib-2 G4 D128", "kvcalib-2 fp8 slots G4 D64",
                                  "kivi-2 G1 D128", "window pre-RoPE ring",
                                  "kvquant-3 G4 D128"])  # fmt: skip
def test_decode_attention_on_gpu(case, dtype, monkeypatch):
    """The same rule at fp16 and bf16 on a GPU, for every tile size the tuner may pick."""
    args, options = _decode_inputs(case, torch.Generator().manual_seed(1), dtype)
    args, options = _cuda(args), {k: _cuda(v) for k, v in options.items()}
    exact = _ref(args, options, dtype=torch.float64)
    bound = 2 * (_ref(args, options).double() - exact).abs().max()
    for config in dec.CONFIGS:
        monkeypatch.setattr(dec, "_config", lambda key, device, launch, config=config: config)
        ours = dec.decode_attention(*args, **options)
        assert (ours.double() - exact).abs().max() <= bound, config


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", [S(2, "static"), S(3, group_size=32, clip=0.9),
                                  S(4, "channel", 32, symmetric=True), S(2, codebook=True),
                                  S(2, "static", codebook=True, outliers=0.01, outlier_slots=1,
                                    slot_rule="error"),
                                  S(2, "static", codebook=True, outliers=0.01, outlier_slots=1,
                                    slot_rule="error", slot_code="fp8")], ids=str)  # fmt: skip
def test_quant_pack_is_bit_exact_on_gpu(spec, dtype):
    """On the GPU too (IEEE division, no FMA contraction): the CPU reference's exact bits."""
    gen = torch.Generator().manual_seed(spec.bits)
    ref = _body(spec, (4, 8, 4096, 128), dtype, gen)
    ours = _cuda(copy.deepcopy(ref))
    x = _data((4, 8, 4096, 128), gen, dtype)
    exclude = torch.rand(4, 4096, generator=gen) < 0.01
    seq, start = torch.arange(4), torch.zeros(4, dtype=torch.long)
    qp.quant_pack(x.cuda(), ours, seq.cuda(), start.cuda(), exclude.cuda())
    qp.quant_pack_reference(x, ref, seq, start, exclude)
    for name in BODY:
        if getattr(ref, name) is not None:
            assert torch.equal(getattr(ours, name).cpu(), getattr(ref, name)), name


COMPILE_SCRIPT = """
import inspect, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

def nested(path, value, mangled, constants):  # a tuple's ints equal to 1: constexpr, as the JIT
    if isinstance(mangled, tuple):
        for j, (v, m) in enumerate(zip(value, mangled)):
            nested((*path, j), v, m, constants)
    elif mangled == "constexpr":
        constants[path] = value

def compile_instead(self, *args, grid, warmup, **kwargs):  # compile for sm_90, launch nothing
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion")
               if k in kwargs}
    bound = inspect.signature(self.fn).bind(*args, **kwargs).arguments
    signature, constants = {}, {}
    for i, (name, value) in enumerate(bound.items()):
        if i in self.constexprs or value is None:
            signature[name], constants[(i,)] = "constexpr", value
        else:
            signature[name] = mangle_type(value)
            nested((i,), value, signature[name], constants)
    source = ASTSource(self, signature, constants)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    print("compiled", self.fn.__name__)

JITFunction.run = compile_instead
from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels.layout import Sinks, Stored
from kvcalib_runtime.layouts.affine import PackedBody
from kvcalib_runtime.kernels.quant_pack import flush, quant_pack
from kvcalib_runtime.layouts.quant import QuantSpec

dec._config = lambda key, device, launch: dec.CONFIGS[3]
B, H, N, D = 2, 8, 256, 128
kvcalib2 = QuantSpec(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error")
fp8 = QuantSpec(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
                slot_code="fp8")
for dtype, key, value, rope in [
    (torch.bfloat16, kvcalib2, QuantSpec(2, symmetric=True, codebook=True), True),
    (torch.float16, QuantSpec(3, "channel", 32, symmetric=True), QuantSpec(3, "vector"), False),
    (torch.float16, fp8, QuantSpec(3, "static", outliers=0.01, outlier_slots=1, slot_code="fp8"),
     True),
]:
    static = (torch.zeros(H, D), torch.ones(H, D))
    book = torch.linspace(-1, 1, 2 ** key.bits)
    def body(spec):
        if spec is None:
            return torch.zeros(B, H, N, D, dtype=dtype)
        return spec.layout.allocate((B, H, N, D), "cpu", dtype, static_range=static, codebook=book)
    keys, values = body(key), body(value)
    tail, nb = torch.zeros(B, H, 8, D, dtype=dtype), torch.zeros(B, dtype=torch.long)
    quant_pack(torch.zeros(1, H, 32, D, dtype=dtype), keys, torch.zeros(1, dtype=torch.long),
               torch.zeros(1, dtype=torch.long), torch.zeros(B, N, dtype=torch.bool))
    flush(tail, tail[:, :, 0], nb, values, nb, nb + 1, 1, torch.zeros(B, N, dtype=torch.bool))
    slots = torch.zeros(B, H, 2, D, dtype=dtype)
    sinks = Sinks(slots, slots, torch.zeros(B, 2, dtype=torch.long),
                  torch.zeros(B, N, dtype=torch.bool))
    new = torch.zeros(B, H, 1, D, dtype=dtype)
    dec.decode_attention(torch.zeros(B, 4 * H, 1, D, dtype=dtype), new, new, Stored(keys, tail, nb),
                         Stored(values, tail, nb), sinks, nb,
                         inv_freq=torch.ones(D // 2) if rope else None, window=64 if rope else None)
# paged (kernels.paged): kvcalib-2's bodies as 16-slot blocks read through a block table
keys, values = (spec.layout.allocate((8, H, 16, D), "cpu", torch.float16, static_range=static,
                                     codebook=book) for spec in (kvcalib2, QuantSpec(2)))
table = torch.zeros(B, N // 16, dtype=torch.int32)
dec.decode_attention(torch.zeros(B, 4 * H, 1, D, dtype=torch.float16), new, new,
                     Stored(keys, tail, nb), Stored(values, tail, nb), sinks, nb,
                     inv_freq=torch.ones(D // 2), block_table=table)
"""


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter never compiles a kernel, so code that only a GPU compile rejects (a
    non-constexpr global, an op without a lowering, a dtype mismatch in a dot) would pass every
    test above: compile the main variants of every kernel for sm_90 in a fresh process."""
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # quant_pack, flush, split, combine; three times (exact slots, none, fp8 slots); paged
    # split and combine
    assert done.stdout.split().count("compiled") == 14


def test_the_decode_benchmark_runs_its_smoke_configuration():
    """benchmarks/bench_decode.py --smoke: the GPU benchmark's code on tiny shapes through the
    interpreter, every method and table (a broken benchmark is found here, not on a GPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "benchmarks/bench_decode.py", "--smoke", "--no-save"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout[done.stdout.index("### Attention") :]
    rows = [line for line in table.splitlines() if line.startswith("| 4/2/64 |")]
    assert len(rows) == 2  # pre- and post-RoPE keys
    assert all(len(row.split("|")) == 24 for row in rows)
    assert "### End to end" in done.stdout
