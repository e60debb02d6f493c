"""The C writer of a decode step (kernels/commit_cpu.c through commit_native) against the torch
path it replaces: the same cache fed the same tokens through both, every buffer equal bit for
bit after every step, on each layout it takes, with sliding-window rings and sequences of
different lengths. The tokens are key-like (huge outlier channels) and the calibrated ranges
narrower than they are, so codes clamp and exact slots are taken; the test also checks that
the steps wrote codes and slots, so two untouched caches cannot pass."""

import shutil

import pytest
import torch
from support.bodies import random_codebook, random_data

from kvcalib_runtime.cache.kvcache import QuantizedCache
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.kernels import commit_native, native
from kvcalib_runtime.layouts.quant import QuantSpec
from kvcalib_runtime.model.rope import Rope
from kvcalib_runtime.model.transforms import Transforms

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the cache writes with torch ops"
)

HKV, D, LAYERS, RESIDUAL = 3, 64, 2, 8
PRE = dict(key_position="pre_rope")
S = QuantSpec
LAYOUTS = {  # (keys, values, layer options, streams of the 4 the C writer takes)
    "kvcalib-2": (
        S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
          slot_code="fp8"),
        S(2, metadata_code="byte"), PRE, 4,
    ),
    "kvcalib-3 widths": (
        S(3, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error",
          slot_code="fp8"),
        S(6, metadata_code="byte"), PRE, 4,
    ),
    "uniform outside slots": (
        S(3, "static", outliers=0.01, outlier_slots=2), S(4, symmetric=True, group_size=16), {}, 4,
    ),
    "symmetric codebooks": (
        S(2, "static", symmetric=True, codebook=True, outliers=0.01, outlier_slots=1,
          slot_rule="error"),
        S(2, symmetric=True, codebook=True, metadata_code="byte", clip=0.9), PRE, 4,
    ),
    "8 bits, float metadata": (S(8, "static"), S(8, group_size=32, clip=0.95), {}, 4),
    "exact keys": (None, S(5, metadata_code="byte"), {}, 4),
    "kivi keys stay in torch": (S(2, "channel", 8), S(2, group_size=32), dict(key_flush=8), 2),
    "vector values stay in torch": (S(3, "static"), S(3, "vector", outliers=0.01), {}, 2),
    "llama.cpp blocks stay in torch": (
        S(4, group_size=32, symmetric=True, method="ggml"),
        S(8, group_size=32, symmetric=True, method="ggml"), {}, 0,
    ),
}  # fmt: skip
WINDOWS = {"global": None, "ring": (None, 20)}


def _params(scheme: KVScheme, gen) -> KVParams:
    """Calibrated ranges a third of the data's spread (clamped outliers), random codebooks; the
    last layer's ranges are [-0.5, 0.5] in every channel, which `_edges` needs."""
    params = KVParams()
    for i, layer in enumerate(scheme.layers):
        for name, spec in (("key", layer.key), ("value", layer.value)):
            if spec is not None and spec.layout.calibrated_range:
                lo = -torch.rand(HKV, D, generator=gen) - 0.2
                hi = torch.rand(HKV, D, generator=gen) + 0.2
                if i == LAYERS - 1:
                    lo, hi = torch.full((HKV, D), -0.5), torch.full((HKV, D), 0.5)
                getattr(params, f"{name}_range")[i] = (lo, hi)
            if spec is not None and spec.codebook:
                getattr(params, f"{name}_codebook")[i] = random_codebook(spec, HKV, gen)
    return params


def _cache(scheme, params, batch: int, windows, native_writes: bool) -> QuantizedCache:
    cache = QuantizedCache(scheme, params, Transforms.online(scheme, params), num_layers=LAYERS,
                           batch=batch, kv_heads=HKV, head_dim=D, max_len=96, device="cpu",
                           dtype=torch.float32, use_kernels=False, windows=windows)  # fmt: skip
    if not native_writes:
        cache._commit_plan = lambda: None
    return cache


def _feed(cache, prompts, steps) -> None:
    """Prefill each sequence's prompt alone (lengths differ), then decode steps for all."""
    rope = Rope({}, D)
    for b, prompt in enumerate(prompts):
        view = cache.view(b)
        for layer, (k, v) in enumerate(prompt):
            view.stage(layer, k, v, rope, view.positions(k.shape[2]))
        view.commit(prompt[0][0].shape[2])
    for step in steps:
        for layer, (k, v) in enumerate(step):
            cache.stage(layer, k, v, rope, cache.positions(1))
        cache.commit(1)


def _tokens(gen, batch: int, t: int):
    return [tuple(random_data((batch, HKV, t, D), gen) for _ in range(2)) for _ in range(LAYERS)]


def _edges(steps, scheme: KVScheme, params: KVParams) -> None:
    """Every third step, sequence 0's last layer gets rows where rounding rules decide: a
    constant row out of range (every channel's error equal: ties among slots; a zero range), a
    positive row (a byte zero point widens its range to 0), and a row on the decision
    thresholds (codebook mids exactly, where the range is [-0.5, 0.5]: scale 1, offset -0.5),
    else zeros."""
    layer = scheme.layers[-1]
    for step in steps[::3]:
        for j, spec in enumerate((layer.key, layer.value)):
            x = step[-1][j][0, :, 0]
            x[0], x[1] = 3.0, 0.25
            book = getattr(params, ("key", "value")[j] + "_codebook").get(LAYERS - 1)
            if spec is not None and spec.codebook and not spec.symmetric:
                mids = (book[2, 1:] + book[2, :-1]) / 2
                x[2] = (mids - 0.5).repeat(D)[:D]
            else:
                x[2] = 0.0


def _buffers(cache) -> list[torch.Tensor]:
    return [t for part in cache.parts().values() for t in part]


@pytest.mark.parametrize("windows", list(WINDOWS))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_c_writer_stores_the_torch_paths_bits(name, windows):
    keys, values, options, taken = LAYOUTS[name]
    scheme = KVScheme((LayerScheme(keys, values, **options),) * LAYERS, residual=RESIDUAL,
                      sinks_first=1, sink_budget=0)  # fmt: skip
    gen = torch.Generator().manual_seed(len(name))
    params = _params(scheme, gen)
    prompts = [_tokens(gen, 1, 5), _tokens(gen, 1, 23)]  # inside, past the residual ring
    steps = [_tokens(gen, 2, 1) for _ in range(40)]  # both sequences flush
    _edges(steps, scheme, params)
    theirs = _cache(scheme, params, 2, WINDOWS[windows], native_writes=False)
    ours = _cache(scheme, params, 2, WINDOWS[windows], native_writes=True)
    _feed(theirs, prompts, steps)
    _feed(ours, prompts, steps)
    plan = ours._commit_plan()
    assert (len(plan.order) if plan is not None else 0) == taken
    assert ours.lengths.tolist() == [45, 63]
    for a, b in zip(_buffers(ours), _buffers(theirs), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for stream in ours.keys + ours.values:  # the steps wrote: codes, and slots where kept
        body = stream.body
        if body is not None and hasattr(body, "codes"):
            assert body.codes.any()
            if getattr(body, "slot_delta", None) is not None:
                assert body.slot_delta.any()


def test_what_the_c_writer_does_not_take_is_refused():
    keys, values, options, _ = LAYOUTS["kvcalib-2"]
    scheme = KVScheme((LayerScheme(keys, values, **options),) * LAYERS, residual=RESIDUAL)
    params = _params(scheme, torch.Generator().manual_seed(2))
    cache = _cache(scheme, params, 2, None, native_writes=True)
    streams = [(0, i, s) for i, s in enumerate(cache.keys)]
    plan = commit_native.Plan(streams, 2)
    pending = {i: tuple(torch.zeros(2, HKV, 1, D) for _ in range(2)) for i in range(LAYERS)}
    with pytest.raises(ValueError, match="lengths: contiguous int64"):
        plan.run(pending, cache.lengths.int())
    with pytest.raises(ValueError, match=r"new tokens torch.float32 \(1, 3, 64\) for streams of 2"):
        plan.run({i: tuple(t[:1] for t in kv) for i, kv in pending.items()}, cache.lengths)
    with pytest.raises(ValueError, match=r"new tokens torch\.float64"):
        plan.run({i: tuple(t.double() for t in kv) for i, kv in pending.items()}, cache.lengths)
    assert not plan.run({0: pending[0]}, cache.lengths)  # a layer missing: torch writes
    with pytest.raises(ValueError, match="a stream of 2 sequences in a cache of 3"):
        commit_native.Plan(streams, 3)
    cache.keys[0].tail = cache.keys[0].tail.transpose(2, 3)
    with pytest.raises(ValueError, match=r"tail: torch\.float32"):
        commit_native.Plan(streams, 2)
    fp16 = QuantizedCache(scheme, params, Transforms.online(scheme, params), num_layers=LAYERS,
                          batch=1, kv_heads=HKV, head_dim=D, max_len=16, device="cpu",
                          dtype=torch.float16, use_kernels=False)  # fmt: skip
    assert not any(commit_native.takes(s) for s in fp16.keys + fp16.values)
    assert fp16._commit_plan() is None


def test_kvcalib_native_0_writes_with_torch(monkeypatch):
    monkeypatch.setenv("KVCALIB_NATIVE", "0")
    assert native.library() is None
    keys, values, options, _ = LAYOUTS["kvcalib-2"]
    scheme = KVScheme((LayerScheme(keys, values, **options),) * LAYERS, residual=RESIDUAL)
    params = _params(scheme, torch.Generator().manual_seed(3))
    assert _cache(scheme, params, 1, None, native_writes=True)._commit_plan() is None
