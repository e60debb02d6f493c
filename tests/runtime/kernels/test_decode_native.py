"""The CPU decode path's C kernel (kernels/decode_cpu.c through decode_native) against the
reference, held to the rule the Triton kernel is (test_kernels.py): against the reference in
float64 on the same stored bits, its error at most twice a plain fp16 implementation's (the
reference run in fp16); and each case shows the bound can fail: codes or slots the kernel
misread move the result by more than ten times it. The kernel reads a float32 cache (the CPU
runtime's): bodies in float32 (read in place), or with fp16 metadata and slots (read through
float32 copies)."""

import copy
import gc
import hashlib
import shutil

import pytest
import torch
from support.bodies import random_codebook, random_data
from support.decode_cases import DECODE_CASES, decode_inputs, reference
from support.native_cases import forget

from kvcalib_runtime.cache.kvcache import QuantizedCache
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.kernels import decode_native, decode_torch, native
from kvcalib_runtime.kernels.operands import Sinks
from kvcalib_runtime.layouts.packed_body import PackedBody
from kvcalib_runtime.layouts.quant import QuantSpec
from kvcalib_runtime.model.rope import Rope
from kvcalib_runtime.model.transforms import Transforms

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the CPU path decodes with torch ops"
)

READ = [c for c, spec in DECODE_CASES.items() if spec[-1] is None]  # ring bodies: the reference


def _inputs(case, in_place: bool):
    """decode_inputs' fp16 cache with everything but the bodies in float32 (q, the new token, the
    rings, the sinks; the same numbers), and the bodies' metadata and slots (and bodies left in
    full precision) too where in_place (which the kernel reads as they lie; fp16 metadata and
    slots it reads through float32 copies)."""
    args, options = decode_inputs(case, torch.Generator().manual_seed(len(case)))
    q, k_new, v_new, keys, values, sinks, lengths = args
    f = [t.float() for t in (q, k_new, v_new, keys.tail, values.tail, sinks.keys, sinks.values)]
    stored = []
    for side, tail in ((keys, f[3]), (values, f[4])):
        body = side.body
        if in_place and isinstance(body, PackedBody):
            body = copy.copy(body)
            for name in ("scale", "offset", "slot_delta"):
                t = getattr(body, name)
                if t is not None and t.is_floating_point():
                    setattr(body, name, t.float())
        elif in_place and isinstance(body, torch.Tensor):  # left in full precision
            body = body.float()
        stored.append(side._replace(tail=tail, body=body))
    sinks = Sinks(f[5], f[6], sinks.positions, sinks.is_sink)
    return (*f[:3], *stored, sinks, lengths), options


def _native_calls(monkeypatch) -> list:
    calls, real = [], decode_native.attend

    def counted(*a, **k):
        calls.append(a[2])  # the sequence's length
        return real(*a, **k)

    monkeypatch.setattr(decode_native, "attend", counted)
    return calls


def test_the_kernel_builds_where_a_compiler_is():
    assert native.library() is not None


@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "copies"])
@pytest.mark.parametrize("case", READ)
def test_the_c_kernel_matches_the_reference(case, in_place, monkeypatch):
    args, options = _inputs(case, in_place)
    calls = _native_calls(monkeypatch)
    ours = decode_torch.decode_attention_torch(*args, **options).double()
    keys, values = args[3], args[4]
    read = all(decode_torch._native(s.body, 0, 1) is not None for s in (keys, values))
    assert calls == ([150, 61, 0] if read else [])  # every sequence, the empty one included
    exact = reference(args, options, dtype=torch.float64)
    bound = 2 * (reference(args, options, dtype=torch.float16).double() - exact).abs().max()
    assert (ours - exact).abs().max() <= bound
    if not read:
        return
    for stored, i in ((keys, 3), (values, 4)):
        if isinstance(stored.body, torch.Tensor):  # left in full precision: its rows swapped
            broken = [stored.body.roll(7, 2)]
        else:
            broken = [copy.copy(stored.body)]
            broken[0].codes = broken[0].codes ^ 0x55
        if getattr(stored.body, "slot_delta", None) is not None:
            broken.append(copy.copy(stored.body))
            broken[-1].slot_delta = torch.zeros_like(stored.body.slot_delta)
        for body in broken:
            changed = (*args[:i], stored._replace(body=body), *args[i + 1 :])
            wrong = decode_torch.decode_attention_torch(*changed, **options)
            assert (wrong.double() - exact).abs().max() > 10 * bound


def test_the_kernel_masks_what_the_reference_masks():
    # a window (of 50, and of 3: the ring's last positions and the new token only) changes the
    # result beyond the bound, and the kernel's follows the reference's (sink slots held and
    # empty are in every case's inputs)
    case = "kvcalib-2 byte values G4 D128"
    args, options = _inputs(case, True)
    unmasked = reference(args, options, dtype=torch.float64)
    for window in (50, 3):
        ours = decode_torch.decode_attention_torch(*args, **{**options, "window": window})
        exact = reference(args, options, window=window, dtype=torch.float64)
        bound = 2 * (reference(args, options, window=window, dtype=torch.float16) - exact).abs()
        assert (ours.double() - exact).abs().max() <= bound.max()
        assert (unmasked - exact).abs().max() > 10 * bound.max()


def test_the_kernel_refuses_what_it_would_read_out_of_bounds():
    # every index the C code forms is checked before the call: rows past the table, codes of
    # another type, too few rows, metadata or slots of another shape, dtype or layout
    table, rows = torch.zeros(2 * 256, 4), torch.tensor([[0], [256]], dtype=torch.int32)
    codes = torch.zeros(2, 8, 16, dtype=torch.uint8)
    scale, index = torch.ones(2, 8, 2), torch.zeros(2, 8, 1, dtype=torch.uint8)
    decode_native.Body(table, rows, codes, 8, 4, 64, 8, scale=scale, slot_index=index,
                       slot_delta=torch.zeros(2, 8, 1))  # well formed  # fmt: skip
    refused = {
        "past the table": dict(rows=rows + 1),
        "codes": dict(codes=codes.int()),
        r">= 9": dict(n=9),
        "scale": dict(scale=torch.ones(2, 7, 2)),
        "laid out as scale": dict(scale=scale, offset=torch.ones(2, 10, 2)),
        "float32 \\(256,\\)": dict(scale=scale.to(torch.uint8)),  # byte codes, no table
        "slot_delta": dict(slot_index=index, slot_delta=torch.zeros(2, 8, 1).half()),
        "None": dict(slot_index=index, slot_delta=index),  # E4M3 bytes, no table
    }
    for why, change in refused.items():
        args = {"table": table, "rows": rows, "codes": codes, "n": 8, **change}
        with pytest.raises(ValueError, match=why):
            decode_native.Body(args.pop("table"), args.pop("rows"), args.pop("codes"), 8, 4, 64,
                               args.pop("n"), **args)  # fmt: skip


def test_kvcalib_native_0_keeps_the_torch_ops(monkeypatch):
    monkeypatch.setenv("KVCALIB_NATIVE", "0")
    assert native.library() is None
    args, options = _inputs("kvcalib-2 byte values G4 D128", True)
    calls = _native_calls(monkeypatch)
    decode_torch.decode_attention_torch(*args, **options)
    assert calls == []


def test_a_kept_reader_reads_the_bodys_rows_as_they_are_now():
    # readers of the body's own buffers are kept across calls: rows written in place since (the
    # next flushed token, another sequence in the slot) must be read as they are now, and the
    # readers go when the body does
    args, options = _inputs("kvcalib-2 byte values G4 D128", True)
    decode_torch.decode_attention_torch(*args, **options)
    for stored in args[3:5]:
        body = stored.body
        for t in (body.codes, body.scale, body.offset, body.slot_index, body.slot_delta):
            if t is not None and t.dim() == 4:  # per token (a static range is per layer)
                t[:, :, :40] = t[:, :, 40:80].clone()
    ours = decode_torch.decode_attention_torch(*args, **options).double()
    exact = reference(args, options, dtype=torch.float64)
    low = reference(args, options, dtype=torch.float16).double()
    assert (ours - exact).abs().max() <= 2 * (low - exact).abs().max()
    kept = len(decode_torch._READERS)
    assert kept > 0
    del args, stored, body, t
    gc.collect()
    assert len(decode_torch._READERS) == kept - 6  # 2 sides x 3 sequences


def test_a_build_that_fails_leaves_the_torch_ops(tmp_path, monkeypatch):
    # a compiler that fails (here `false`) or a cache folder it cannot write: one warning, no
    # library, and decode_torch's own ops give the attention
    forget(monkeypatch, tmp_path)
    monkeypatch.setenv("CC", "false")
    with pytest.warns(UserWarning, match="did not build"):
        assert native.library() is None
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.delenv("CC")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(tmp_path / "file"))
    with pytest.warns(UserWarning, match="did not build"):
        assert native.library() is None
    args, options = _inputs("kvcalib-2 byte values G4 D128", True)
    ours = decode_torch.decode_attention_torch(*args, **options).double()
    exact = reference(args, options, dtype=torch.float64)
    low = reference(args, options, dtype=torch.float16).double()
    assert (ours - exact).abs().max() <= 2 * (low - exact).abs().max()


def test_pending_says_whether_library_would_compile(tmp_path, monkeypatch):
    # what `kvcalib generate` announces before the load builds the library
    forget(monkeypatch, tmp_path)
    assert native.pending()
    target = native._target(native._compiler())
    target.parent.mkdir(parents=True)
    target.write_bytes(b"")
    assert native.pending()  # no digest: a build that ended early, built again
    native._digest_of(target).write_text(hashlib.sha256(b"").hexdigest())
    assert not native.pending()  # in the cache and intact: loaded, not compiled
    target.write_bytes(b"changed")
    assert native.pending()  # its bytes are not the digest's: built again
    target.unlink()
    monkeypatch.setenv("KVCALIB_NATIVE", "0")
    assert not native.pending()
    monkeypatch.delenv("KVCALIB_NATIVE")
    monkeypatch.setattr(native, "_LOADED", {"lib": None})
    assert not native.pending()  # tried once in this process: never again


def test_positions_in_an_empty_ring_are_refused():
    # C would take t % 0 for them: refused before the call
    args, options = _inputs("kvcalib-2 byte values G4 D128", True)
    keys, values = (s._replace(tail=s.tail[:, :, :0]) for s in args[3:5])
    with pytest.raises(ValueError, match="empty ring"):
        decode_torch.decode_attention_torch(*args[:3], keys, values, *args[5:], **options)


def test_a_float64_default_dtype_changes_nothing():
    # the kernel writes float32 into the buffers decode_native allocates, whatever torch's
    # default dtype: a float64 default must give the same attention bit for bit
    args, options = _inputs("kvcalib-2 byte values G4 D128", True)
    want = decode_torch.decode_attention_torch(*args, **options)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = decode_torch.decode_attention_torch(*args, **options)
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(got, want)


KVCALIB_2 = (
    QuantSpec(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
              slot_code="fp8"),
    QuantSpec(2, metadata_code="byte"),
)  # fmt: skip


def _cache_steps(prepared: bool, windows, quantized: bool) -> list[torch.Tensor]:
    """Every layer's output of a float32 cache, kvcalib-2's (pre-RoPE keys) or one left in full
    precision (two layers, batch 2, residual 8, one sink slot), fed a prefill of 5 and 23
    tokens, then 30 steps; with prepared=False the cache never prepares its sequences
    (decode_torch's per-call path)."""
    hkv, groups, d = 3, 3, 64
    layer = (
        LayerScheme(*KVCALIB_2, key_position="pre_rope") if quantized else LayerScheme(None, None)
    )
    scheme = KVScheme((layer,) * 2, residual=8, sinks_first=1, sink_budget=0)
    gen = torch.Generator().manual_seed(5)
    params = KVParams()
    for i in range(2 if quantized else 0):
        params.key_range[i] = (-torch.rand(hkv, d, generator=gen) - 0.2,
                               torch.rand(hkv, d, generator=gen) + 0.2)  # fmt: skip
        params.key_codebook[i] = random_codebook(KVCALIB_2[0], hkv, gen)
    cache = QuantizedCache(scheme, params, Transforms.online(scheme, params), num_layers=2,
                           batch=2, kv_heads=hkv, head_dim=d, max_len=64, device="cpu",
                           dtype=torch.float32, use_kernels=False, windows=windows)  # fmt: skip
    if not prepared:
        cache._prepared = lambda layer: None
    rope, outs = Rope({}, d), []

    def step(view, t):
        pos = view.positions(t)
        b = view.lengths.shape[0]
        for layer in range(2):
            q, k, v = (random_data((b, h, t, d), gen) for h in (hkv * groups, hkv, hkv))
            outs.append(view.attend(layer, rope.apply(q, pos), k, v, rope, pos))
        view.commit(t)

    step(cache.view(0), 5)
    step(cache.view(1), 23)
    for _ in range(30):
        step(cache, 1)
    return outs


@pytest.mark.parametrize("quantized", [True, False], ids=["kvcalib-2", "full precision"])
@pytest.mark.parametrize("windows", [None, (None, 20)], ids=["global", "a window's ring"])
def test_prepared_sequences_attend_as_the_per_call_path(windows, quantized, monkeypatch):
    # the cache prepares each layer's sequences once and runs the same C kernel on them: its
    # outputs equal the per-call path's bit for bit at every step; the C kernel ran on both, for
    # 30 steps of 2 sequences in 2 layers (the windowed layer's ring of 20 slots holds fewer
    # positions than either sequence: the reference attends there, on both paths)
    calls = _native_calls(monkeypatch)
    theirs = _cache_steps(False, windows, quantized)
    assert len(calls) == 30 * 2 * (2 if windows is None else 1)
    ran = []
    real = decode_native.Sequence.attend
    monkeypatch.setattr(decode_native.Sequence, "attend",
                        lambda self, *a: ran.append(a[0]) or real(self, *a))  # fmt: skip
    ours = _cache_steps(True, windows, quantized)
    assert len(ran) == len(calls)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
