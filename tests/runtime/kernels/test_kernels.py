"""The decode kernel against its plain-torch reference (TRITON_INTERPRET=1 on CPU; the writers'
tests are in test_quant_pack.py).

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
from support.bodies import random_body, tensors, to_device
from support.decode_cases import DECODE_CASES, GLUON_CASES, decode_inputs, reference
from support.ptx import run_ptx

from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels import decode_config as cfg
from kvcalib_runtime.kernels import decode_torch, packed, tiles
from kvcalib_runtime.kernels import quant_pack as qp
from kvcalib_runtime.layouts.affine import PackedBody
from kvcalib_runtime.layouts.quant import QuantSpec

S = QuantSpec


# -- decode attention: the kernel against its reference ----------------------------------------


@pytest.mark.parametrize(
    ("config", "splits"),
    [((32, 4, 1), 1), ((16, 4, 1), 3), ((64, 4, 1), 2)],
    ids=["32-token tiles", "16-token tiles, 3 splits", "64-token tiles, 2 splits"],
)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_attention_matches_its_reference(case, config, splits, monkeypatch):
    if config != (32, 4, 1) and case not in (
        "kvcalib-2 G4 D128",
        "kvcalib-2 post-RoPE G4 D128",
        "kivi-4 G3 D64",
        "window pre-RoPE ring",
        "vector values G3 D64",
    ):
        pytest.skip("tile and split variants run on four layouts")  # fmt: skip
    monkeypatch.setattr(cfg, "INTERPRETED", config)
    monkeypatch.setattr(cfg, "num_splits", lambda *a: splits)
    gen = torch.Generator().manual_seed(len(case))
    args, options = decode_inputs(case, gen)
    ours = dec.decode_attention(*args, **options).double()
    exact = reference(args, options, dtype=torch.float64)
    low = reference(args, options).double()
    bound = 2 * (low - exact).abs().max()
    assert (ours - exact).abs().max() <= bound
    # the bound can fail: what a wrong code, a dropped slot or a missed mask would do
    keys, values = args[3], args[4]
    for stored, i in ((keys, 3), (values, 4)):
        if isinstance(stored.body, PackedBody):
            body = copy.copy(stored.body)
            body.codes = body.codes ^ 0x55
            broken = reference((*args[:i], stored._replace(body=body), *args[i + 1:]), options,
                          dtype=torch.float64)  # fmt: skip
            assert (broken - exact).abs().max() > 10 * bound
            if body.slot_delta is not None:
                body = copy.copy(stored.body)
                body.slot_delta = torch.zeros_like(body.slot_delta)
                broken = reference((*args[:i], stored._replace(body=body), *args[i + 1:]), options,
                              dtype=torch.float64)  # fmt: skip
                assert (broken - exact).abs().max() > 10 * bound
    if options["window"]:
        assert (reference(args, options, window=None, dtype=torch.float64) - exact).abs().max() > (
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
        body = random_body(spec, (2, hkv, 64, d), dtype, gen, per_head_codebook=per_head)
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
                                                                   codebook=book),
                 S(bits, metadata_code="byte")):  # fmt: skip
        body = random_body(spec, (2, 3, 40, d), torch.float16, gen)
        for b, n in ((0, 37), (1, 40), (1, 0)):
            ours = decode_torch.dequantize(body, torch.float32, b, n)
            assert torch.equal(ours, body.dequantize(torch.float32, b, n)), spec


@pytest.mark.parametrize("bits", [4, 8], ids=["q4_0", "q8_0"])
def test_cpu_dequantize_reads_each_layouts_own_levels(bits):
    # llama.cpp's q4_0 levels are c - 8, not the symmetric grid's c - 7: the CPU path takes the
    # levels from the layout (before the layouts owned them it read q4_0 bodies a level off).
    spec = S(bits, group_size=32, symmetric=True, method="ggml")
    body = random_body(spec, (2, 2, 64, 64), torch.float16, torch.Generator().manual_seed(bits))
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
    args, options = decode_inputs(case, gen)
    if window and options["window"] is None:
        options["window"] = window
    exact = reference(args, options, dtype=torch.float64)
    ours = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float64)
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-9)
    low = decode_torch.decode_attention_torch(*args, **options)
    assert low.dtype == args[0].dtype
    bound = 2 * (reference(args, options).double() - exact).abs().max() + 1e-3
    assert (low.double() - exact).abs().max() <= bound  # in fp16: no worse than the reference


def test_cpu_decode_path_results_outlive_its_scratch(monkeypatch):
    # The CPU path reads bodies into scratch buffers reused across layers and steps: a result
    # must stand when another call (another layout, other lengths) reuses them, the same call
    # again gives the same bits, and buffers first made in inference mode serve outside it.
    monkeypatch.setattr(decode_torch, "_SCRATCH", threading.local())  # none made yet
    gen = torch.Generator().manual_seed(5)
    args, options = decode_inputs("kvcalib-2 fp8 slots G4 D64", gen)
    other, other_options = decode_inputs("kvcalib-3 G3 D64", gen)
    with torch.inference_mode():
        first = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float32)
    kept = first.clone()
    again = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float32)
    decode_torch.decode_attention_torch(*other, **other_options, dtype=torch.float32)
    last = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float32)
    assert torch.equal(first, kept) and torch.equal(again, kept) and torch.equal(last, kept)


@triton.jit
def _trig_kernel(A, COS, SIN, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    c, s = tiles.trig(tl.load(A + i, mask=i < n, other=0.0))
    tl.store(COS + i, c, mask=i < n)
    tl.store(SIN + i, s, mask=i < n)


def test_the_kernels_trig_is_within_3_ulp_of_cos_and_sin():
    """tiles.trig (polynomials after reducing the angle, no libdevice: its slow path put local
    memory in the decode loop) against float64 cos / sin at RoPE's angles (a position times a
    frequency up to 128K) and in every quadrant: within 3 fp32 ulp of 1 (3.6e-7), far below
    the fp16 keys it rotates (4.9e-4)."""
    gen = torch.Generator().manual_seed(0)
    angle = torch.cat([torch.linspace(-7, 7, 4001), torch.rand(4000, generator=gen) * 131072,
                       torch.arange(0, 131072, 37.0) * 0.75])  # fmt: skip
    cos, sin = torch.empty_like(angle), torch.empty_like(angle)
    _trig_kernel[(1,)](angle, cos, sin, angle.numel(), BLOCK=tiles.next_pow2(angle.numel()))
    exact = angle.double()
    assert (cos.double() - exact.cos()).abs().max() <= 3.6e-7
    assert (sin.double() - exact.sin()).abs().max() <= 3.6e-7


def test_splits_fill_the_gpu_by_the_compiled_kernels_occupancy(monkeypatch):
    """num_splits is FlashInfer's rule: resident programs per SM (from the compiled kernel's
    registers, warps and shared memory) x SMs, no split when the programs fill that. At
    32/8/128 x batch 16 on an H100 (132 SMs, 128 programs): 208 registers x 8 warps hold one
    program per SM, so splitting only adds a second wave; 128 registers x 4 warps hold four.
    Shared memory caps it, each program's and the 1 KB the system reserves a program: the Gluon
    tiles before RoPE (56 KB) fit four to an H100's 228 KB, two to an A100's 164 KB."""
    monkeypatch.setattr(cfg, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    h100 = cfg.SHARED_PER_SM[9, 0]
    assert cfg.resident(208, 8, 22000, h100) == 1
    assert cfg.resident(128, 4, 22000, h100) == 4
    assert cfg.resident(128, 4, 100000, h100) == 2
    assert cfg.resident(128, 4, 57344, h100) == 4
    assert cfg.resident(128, 4, 57344, cfg.SHARED_PER_SM[8, 0]) == 2
    assert cfg.resident(128, 4, 57345, h100) == 3  # a byte more than fits four
    assert cfg.num_splits(cuda, 128, 32768, 64, cfg.resident(208, 8, 22000, h100)) == 1
    assert cfg.num_splits(cuda, 128, 32768, 64, cfg.resident(128, 4, 22000, h100)) == 4
    assert cfg.num_splits(cuda, 8, 32768, 64, 4) == 66  # batch 1: 4 x 132 / 8
    assert cfg.num_splits(cuda, 8, 1024, 64, 4) == 4  # at least 4 blocks a split
    assert cfg.num_splits(torch.device("cpu"), 8, 32768, 64, 4) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_packed_2_bit_lookup_is_the_plain_decode_for_every_code(dtype):
    """kernels.packed's inline PTX (which only a GPU runs) executed here instruction by
    instruction on words holding every 2-bit code at every one of their 16 positions, for each
    level set a 2-bit layout has (uniform 0..3; codebooks: random, sorted, with negative, tiny
    and repeated levels): output n is the plain decode's level of code n, bit for bit, in fp16
    and bf16 (the interpreter's path, plain Triton on the same table, is held to the reference
    by the decode tests)."""
    gen = torch.Generator().manual_seed(0)
    books = [torch.arange(4.0), torch.randn(4, generator=gen),
             torch.randn(4, generator=gen).sort().values, torch.tensor([-3.5, -1e-3, 1e-3, 7.25]),
             torch.tensor([0.5, 0.5, -0.5, -0.5])]  # fmt: skip
    every = torch.arange(4).repeat_interleave(16).reshape(4, 16)  # each code at each position
    codes = torch.cat([every, torch.randint(0, 4, (64, 16), generator=gen)])
    words = (codes << 2 * torch.arange(16)).sum(1)
    for levels in books:
        bits = levels.to(dtype).view(torch.int16).long() & 0xFFFF
        lo, hi = bits[0] | bits[1] << 16, bits[2] | bits[3] << 16
        regs = run_ptx(packed.LUT16_ASM.value, {"$16": words, "$17": lo, "$18": hi})
        out = torch.stack([regs[f"${n}"] for n in range(16)], 1)
        assert torch.equal(out, bits[codes])


@triton.jit
def _table_kernel(LEVELS, OUT, BITS: tl.constexpr, DT: tl.constexpr):
    words = tiles.level_table(LEVELS, BITS, True, DT)
    for k in tl.static_range(8):
        tl.store(OUT + k, words[k])


@triton.jit
def _pick_kernel(WORDS, TABLE, OUT, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    word = tl.load(WORDS + i, mask=i < n, other=0)
    table = (tl.load(TABLE), tl.load(TABLE + 1), tl.load(TABLE + 2), tl.load(TABLE + 3),
             tl.load(TABLE + 4), tl.load(TABLE + 5), tl.load(TABLE + 6),
             tl.load(TABLE + 7))  # fmt: skip
    for k in tl.static_range(8):
        tl.store(OUT + i * 8 + k, packed._pick8(word, k, BITS, table), mask=i < n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [3, 4])
def test_the_packed_3_and_4_bit_lookups_are_the_plain_decode_for_every_code(bits, dtype):
    """LUT3_ASM / LUT4_ASM (inline PTX only a GPU runs) executed here instruction by
    instruction on the byte tables tiles.level_table builds, for words holding every code at
    each of their 8 positions and random words (3 bits: the 24-bit groups of 3 bytes; 4 bits:
    int32 words, the top code's bit 3 in the sign bit), for codebooks random, sorted, with
    negative, tiny and repeated levels: output n is code n's level in the cache dtype, bit for
    bit, in fp16 and bf16; so is the interpreter's plain-Triton pick (`_pick8`) on the same
    words (the decode tests hold it to the reference)."""
    levels = 2**bits
    gen = torch.Generator().manual_seed(bits)
    books = [torch.linspace(-1, 1, levels), torch.randn(levels, generator=gen),
             torch.randn(levels, generator=gen).sort().values,
             torch.tensor([-3.5, -1e-3, 1e-3, 7.25] * (levels // 4)),
             torch.tensor([0.5, -0.5]).repeat_interleave(levels // 2)]  # fmt: skip
    every = torch.arange(levels).repeat_interleave(8).reshape(levels, 8)
    codes = torch.cat([every, torch.randint(0, levels, (64, 8), generator=gen)])
    words = (codes << bits * torch.arange(8)).sum(1)
    asm = (packed.LUT3_ASM if bits == 3 else packed.LUT4_ASM).value
    for book in books:
        # levels the dtype holds: the interpreter casts fp32 to bf16 by truncation, a GPU rounds
        book = book.to(dtype).float()
        table = torch.zeros(8, dtype=torch.int32)
        _table_kernel[(1,)](book, table, BITS=bits, DT=tl.float16 if dtype == torch.float16
                            else tl.bfloat16)  # fmt: skip
        table = table.long() & 0xFFFFFFFF
        inputs = {f"${9 + k}": table[k] for k in range(8)}
        if bits == 3:  # LUT3_ASM reads the low words L0, L1 then the high H0, H1
            inputs = {"$9": table[0], "$10": table[1], "$11": table[4], "$12": table[5]}
        regs = run_ptx(asm, {"$8": words, **inputs})
        out = torch.stack([regs[f"${n}"] for n in range(8)], 1)
        expected = book.to(dtype).view(torch.int16)[codes]
        assert torch.equal(out, expected.long() & 0xFFFF)
        plain = torch.empty_like(expected)
        signed = [torch.where(t >= 2**31, t - 2**32, t).to(torch.int32) for t in (words, table)]
        _pick_kernel[(1,)](*signed, plain, len(words), BITS=bits,
                           BLOCK=tiles.next_pow2(len(words)))  # fmt: skip
        assert torch.equal(plain, expected)


def test_supports_every_preset_layout():
    """Every layout kvcalib's presets and the peers the runtime serves store, at the head dims
    of real models, is read by both kernels (no reference fallback)."""
    layouts = [
        S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error"),
        S(3, symmetric=True, codebook=True),
        S(2, "channel", 32), S(4, group_size=32), S(3), S(4), S(3, codebook=True, outliers=0.01),
        S(3, "vector", outliers=0.01),
    ]  # fmt: skip
    vq = [S(6, "static", 4, codebook=True, method="vq", pairing=p) for p in ("rope", "adjacent")]
    for d in (64, 80, 96, 128, 256):
        for spec in layouts:
            if spec.group_size and d % spec.group_size:
                continue
            assert dec.supports(spec, d, 8) and qp.supports(spec, d, 8), (spec, d)
        for spec in vq:  # kvcalib-1.5: written by its body's own quantize, read by the kernel
            assert dec.supports(spec, d, 8), (spec, d)
    assert not dec.supports(S(3), 72, 1)  # 36 3-bit codes a half: not whole bytes, reference


# -- real sizes on a GPU, and a compile check that needs none ----------------------------------


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_the_gpu_tests_inputs_move_whole(case):
    """to_device (checked on the meta device, no GPU needed) moves every tensor of the decode
    inputs and keeps Stored and Sinks named: the first GPU run found Sinks turned into a plain
    tuple, which no CPU test reached."""
    args, options = decode_inputs(case, torch.Generator().manual_seed(1))
    moved, options = to_device(args, "meta"), {k: to_device(v, "meta") for k, v in options.items()}
    assert [type(a) for a in moved] == [type(a) for a in args]
    assert {t.device.type for t in tensors((moved, list(options.values())))} == {"meta"}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["kvcalib-2 G4 D128", "kvcalib-2 fp8 slots G4 D64",
                                  "kivi-2 G1 D128", "window pre-RoPE ring",
                                  "kvquant-3 G4 D128"])  # fmt: skip
def test_decode_attention_on_gpu(case, dtype, monkeypatch):
    """The same rule at fp16 and bf16 on a GPU, for every tile size the tuner may pick."""
    args, options = decode_inputs(case, torch.Generator().manual_seed(1), dtype)
    args, options = to_device(args), {k: to_device(v) for k, v in options.items()}
    exact = reference(args, options, dtype=torch.float64)
    bound = 2 * (reference(args, options).double() - exact).abs().max()
    for config in cfg.CONFIGS:
        monkeypatch.setattr(cfg, "choose", lambda key, device, launch, config=config: config)
        ours = dec.decode_attention(*args, **options)
        assert (ours.double() - exact).abs().max() <= bound, config


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GLUON_CASES))
def test_the_gluon_whole_tiles_on_gpu(case):
    """kernels.decode_gluon's whole tiles (kvcalib-2's layout, 128 channels, fp16) at the same
    rule on a GPU, over sequences of 1,090, 700 and 130 positions (1,024, 640 and 64 of them in
    its tiles); test_ptx_cta.py holds them to it on the CPU."""
    from kvcalib_runtime.kernels import decode_gluon

    args, options = decode_inputs(f"gluon: {case}", torch.Generator().manual_seed(3),
                                  lengths=(1090, 700, 130))  # fmt: skip
    args, options = to_device(args), {k: to_device(v) for k, v in options.items()}
    exact = reference(args, options, dtype=torch.float64)
    bound = 2 * (reference(args, options).double() - exact).abs().max()
    assert decode_gluon.available()
    assert (dec.decode_attention(*args, **options).double() - exact).abs().max() <= bound


COMPILE_SCRIPT = """
import sys, torch
from triton.runtime.jit import JITFunction
sys.path.insert(0, BENCHMARKS)
from budget_read import compile_launch, to_meta, ttgir_loops

def compile_instead(self, *args, grid, warmup, **kwargs):  # compile for sm_90, launch nothing
    if "PACKED" in kwargs:  # what a GPU launch compiles: the inline PTX, not the interpreter's
        kwargs["PACKED"] = True
    kernel, _log = compile_launch(self, to_meta(args), to_meta(kwargs), 90)
    copies = sum(loop["async_copies"] for loop in ttgir_loops(kernel.asm["ttgir"]))
    print("compiled", self.fn.__name__, copies)

JITFunction.run = compile_instead
from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels import decode_config as cfg
from kvcalib_runtime.kernels.operands import Sinks, Stored
from kvcalib_runtime.layouts.affine import PackedBody
from kvcalib_runtime.kernels.quant_pack import flush, quant_pack
from kvcalib_runtime.layouts.quant import QuantSpec

cfg.choose = lambda key, device, launch: cfg.CONFIGS[3]
B, H, N, D = 2, 8, 256, 128
kvcalib2 = QuantSpec(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error")
fp8 = QuantSpec(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
                slot_code="fp8")
for dtype, key, value, rope in [
    (torch.bfloat16, kvcalib2, QuantSpec(2, symmetric=True, codebook=True), True),
    (torch.float16, QuantSpec(3, "channel", 32, symmetric=True), QuantSpec(3, "vector"), False),
    (torch.float16, fp8, QuantSpec(3, "static", outliers=0.01, outlier_slots=1, slot_code="fp8"),
     True),
    (torch.bfloat16, fp8, QuantSpec(2, metadata_code="byte"), True),
    # 3- and 4-bit codebooks: levels by byte tables (kernels.packed's LUT3_ASM, LUT4_ASM)
    (torch.float16, QuantSpec(3, "static", codebook=True, outliers=0.01, outlier_slots=1,
                              slot_rule="error"), QuantSpec(4, symmetric=True, codebook=True),
     True),
]:
    static = (torch.zeros(H, D), torch.ones(H, D))
    def body(spec):
        if spec is None:
            return torch.zeros(B, H, N, D, dtype=dtype)
        book = torch.linspace(-1, 1, 2 ** spec.bits)
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
                                     codebook=torch.linspace(-1, 1, 4))
                for spec in (kvcalib2, QuantSpec(2)))
table = torch.zeros(B, N // 16, dtype=torch.int32)
dec.decode_attention(torch.zeros(B, 4 * H, 1, D, dtype=torch.float16), new, new,
                     Stored(keys, tail, nb), Stored(values, tail, nb), sinks, nb,
                     inv_freq=torch.ones(D // 2), block_table=table)
# the full-precision stream (a tensor left exact)
exact = Stored(torch.zeros(B, H, N, D, dtype=torch.float16), tail, nb)
dec.decode_attention(torch.zeros(B, 4 * H, 1, D, dtype=torch.float16), new, new, exact, exact,
                     sinks, nb)
# vector codes (kvcalib-1.5): 6-bit indices of RoPE-pair quads (keys) and adjacent quads (values)
vq = [QuantSpec(6, "static", 4, codebook=True, method="vq", pairing=p)
      for p in ("rope", "adjacent")]
keys, values = (spec.layout.allocate((B, H, N, D), "cpu", torch.float16, static_range=static,
                                     codebook=torch.rand(H, 64, 4)) for spec in vq)
dec.decode_attention(torch.zeros(B, 4 * H, 1, D, dtype=torch.float16), new, new,
                     Stored(keys, tail, nb), Stored(values, tail, nb), sinks, nb,
                     inv_freq=torch.ones(D // 2))
# vector codes with exact slots (kvcalib-1.5s): an fp8 slot per key row, two exact per value row
vq = [QuantSpec(5, "static", 4, codebook=True, method="vq", pairing="rope", outlier_slots=1,
                slot_rule="error", slot_code="fp8"),
      QuantSpec(5, "static", 4, codebook=True, method="vq", outlier_slots=2, slot_rule="error")]
keys, values = (spec.layout.allocate((B, H, N, D), "cpu", torch.float16, static_range=static,
                                     codebook=torch.rand(H, 32, 4)) for spec in vq)
dec.decode_attention(torch.zeros(B, 4 * H, 1, D, dtype=torch.float16), new, new,
                     Stored(keys, tail, nb), Stored(values, tail, nb), sinks, nb,
                     inv_freq=torch.ones(D // 2))
"""


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter never compiles a kernel, so code that only a GPU compile rejects (a
    non-constexpr global, an op without a lowering, a dtype mismatch in a dot) would pass every
    test above: compile the main variants of every kernel for sm_90 in a fresh process, through
    Triton's own binder (benchmarks/budget_read.py), so that pointers carry the 16-byte
    alignment a real launch gives them: compiled without it the full-precision stream loses
    every cp.async of its loop."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    benchmarks = str(Path(__file__).resolve().parents[3] / "benchmarks")
    script = COMPILE_SCRIPT.replace("BENCHMARKS", repr(benchmarks))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line.split()[1:] for line in done.stdout.splitlines()
                if line.startswith("compiled")]  # fmt: skip
    # quant_pack, flush, split, combine; five times (exact slots, none, fp8 slots, one-byte
    # value metadata, 3- and 4-bit codebooks); paged split and combine; the full-precision
    # stream's split and combine; vector codes' split and combine, without slots and with them
    assert len(compiled) == 28
    # every decode variant streams its tiles through cp.async (ttg.async_copy_global_to_local)
    splits = [int(copies) for name, copies in compiled if name == "_decode_split_kernel"]
    assert len(splits) == 9 and min(splits) > 0, splits


def test_the_decode_benchmark_runs_its_smoke_configuration():
    """benchmarks/bench_decode.py --smoke: the GPU benchmark's code on tiny shapes through the
    interpreter, every method and table (a broken benchmark is found here, not on a GPU), on
    the shape and dtype its flags name (as make gpu-check names them)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "benchmarks/bench_decode.py", "--smoke", "--no-save",
               "--shapes", "4/2/32", "--dtypes", "float16"]  # fmt: skip
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout[done.stdout.index("### Attention") :]
    rows = [line for line in table.splitlines() if line.startswith("| 4/2/32 |")]
    assert len(rows) == 3  # kvcalib-2 with pre- and post-RoPE keys, kvcalib-1.5
    assert all(len(row.split("|")) == 25 for row in rows)
    assert "### End to end" in done.stdout
