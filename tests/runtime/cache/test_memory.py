"""Memory is measured, not derived: `QuantizedCache.memory()` walks the buffers a cache holds,
and every plan (`planned_memory`: the capacity check, the bit counts) walks the buffers of the
same cache built on the meta device. The two are held equal here on every layout the cache knows,
and layouts are counted by hand, so neither can drift without a test failing. Toolkit presets get
the same check in tests/toolkit/evaluation/test_memory.py; on CUDA, torch.cuda.memory_allocated
agrees too."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcalib_runtime.cache.fpcache import FullPrecisionCache
from kvcalib_runtime.cache.kvcache import QuantizedCache
from kvcalib_runtime.cache.memory import planned_memory
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.layouts.quant import QuantSpec
from kvcalib_runtime.model.transforms import Transforms

HKV, D = 3, 64
LAYOUTS = {
    "kivi": (QuantSpec(2, "channel", 32), QuantSpec(2, group_size=32), dict(key_flush=32)),
    "static-slots": (
        QuantSpec(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error"),
        QuantSpec(2, symmetric=True, codebook=True),
        dict(key_position="pre_rope"),
    ),
    "static-fp8-slots": (
        QuantSpec(2, "static", outliers=0.01, outlier_slots=2, slot_rule="error", slot_code="fp8"),
        QuantSpec(3, "static", outliers=0.01, outlier_slots=1, slot_code="fp8"),
        dict(key_position="pre_rope"),
    ),
    "byte-metadata": (
        QuantSpec(2, "static", outliers=0.01, outlier_slots=1, slot_rule="error", slot_code="fp8"),
        QuantSpec(2, metadata_code="byte"),
        dict(key_position="pre_rope"),
    ),
    "vector": (QuantSpec(3, "static"), QuantSpec(3, "vector", outliers=0.01), {}),
    "token-outliers": (QuantSpec(4, group_size=16, outliers=0.1), None, {}),
    "exact-keys": (None, QuantSpec(8, symmetric=True), {}),
    "kvquant": (
        QuantSpec(3, "static", codebook=True, outliers=0.01, outlier_slots=1),
        QuantSpec(3, "vector", codebook=True, outliers=0.01),
        dict(key_position="pre_rope"),
    ),
    "llamacpp": (
        QuantSpec(4, group_size=32, symmetric=True, method="ggml"),
        QuantSpec(8, group_size=32, symmetric=True, method="ggml"),
        dict(key_rotation=True, value_rotation=True),
    ),
    "turboquant": (
        QuantSpec(2, symmetric=True, method="turboquant", split_channels=16, split_bits=4),
        QuantSpec(3, symmetric=True, method="turboquant"),
        {},
    ),
}


def _params(scheme: KVScheme) -> KVParams:
    params = KVParams()
    for i, layer in enumerate(scheme.layers):
        for name, spec in (("key", layer.key), ("value", layer.value)):
            if spec is not None and spec.layout.calibrated_range:
                getattr(params, f"{name}_range")[i] = (-torch.ones(HKV, D), torch.ones(HKV, D))
            if spec is not None and spec.codebook:
                book = torch.linspace(-1 if spec.symmetric else 0, 1, spec.levels)
                getattr(params, f"{name}_codebook")[i] = book
            if spec is not None and spec.split_channels:
                split = torch.arange(spec.split_channels).expand(HKV, -1)
                getattr(params, f"{name}_split")[i] = split
    return params


def _cache(scheme, layers, batch, max_len, device) -> QuantizedCache:
    params = _params(scheme)
    return QuantizedCache(
        scheme,
        params,
        Transforms.online(scheme, params),
        num_layers=layers,
        batch=batch,
        kv_heads=HKV,
        head_dim=D,
        max_len=max_len,
        device=device,
        dtype=torch.float16,
    )


def _scheme(name: str, layers: int = 2) -> KVScheme:
    key, value, extra = LAYOUTS[name]
    return KVScheme(
        tuple(LayerScheme(key, value, **extra) for _ in range(layers)),
        residual=32,
        sinks_first=1,
        sink_budget=3,
    )


# per layer: global, a window the body reaches (a ring), one it never reaches (R = 32 >= W)
WINDOWS = {"global": None, "windowed": (None, 100), "short windows": (20, 48)}


@pytest.mark.parametrize("windows", list(WINDOWS))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("context", [1, 97, 1024])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_plan_is_what_a_cache_allocates(name, context, batch, windows):
    # The plan walks a meta-device cache, the CPU cache walks storages: part by part they must
    # agree (a view counted twice on meta, or a buffer one side misses, breaks this).
    scheme = _scheme(name)
    params = _params(scheme)
    memory = planned_memory(
        scheme,
        params,
        Transforms.online(scheme, params),
        num_layers=2,
        kv_heads=HKV,
        head_dim=D,
        context=context,
        batch=batch,
        windows=WINDOWS[windows],
    )
    cache = QuantizedCache(scheme, params, Transforms.online(scheme, params), num_layers=2,
                           batch=batch, kv_heads=HKV, head_dim=D, max_len=context, device="cpu",
                           dtype=torch.float16, windows=WINDOWS[windows])  # fmt: skip
    assert memory == cache.memory()


def test_one_layout_counted_by_hand():
    """kvcalib-2's layout at 1024 tokens, one layer, 3 KV heads of 64 channels, fp16: keys are
    2-bit codes (16 bytes a row) + 1 slot (1-byte index + 2-byte delta) per row, with per-layer
    constants (fp16 scale + offset and fp32 lo + hi per channel, fp32 4 levels + 3 thresholds
    per head); values 16 bytes of codes + an fp16 scale per row, the same codebook constants;
    a ring of 32 and 4 sink slots of fp16 for both; bookkeeping (is_sink bytes, int64 lengths,
    body sizes, sink positions)."""
    cache = _cache(_scheme("static-slots", layers=1), 1, 1, 1024, "cpu")
    rows = 1024 * HKV
    codebook = HKV * (4 + 3) * 4
    keys = rows * (16 + 3) + HKV * D * (2 + 2 + 4 + 4) + codebook
    values = rows * (16 + 2) + codebook
    ring = 2 * HKV * 32 * D * 2
    sinks = 2 * HKV * 4 * D * 2 + 4 * 8
    bookkeeping = 1024 + 8 + 2 * 8
    assert cache.memory() == {
        "body": keys + values,
        "ring": ring,
        "sinks": sinks,
        "bookkeeping": bookkeeping,
    }
    assert cache.bytes_per_token() == (keys + values + ring + sinks + bookkeeping) / 1024


def test_fp8_slots_are_one_byte_each():
    """slot_code "fp8" at 1024 tokens, 3 KV heads of 64 channels, fp16: a key row is 16 bytes of
    2-bit codes + 2 slots of a 1-byte index and a 1-byte delta, a value row 24 bytes of 3-bit
    codes + 1 slot; the per-layer constants are fp16 scale + offset and fp32 lo + hi per
    channel. Exact slots (2-byte deltas) cost a byte more each."""
    cache = _cache(_scheme("static-fp8-slots", layers=1), 1, 1, 1024, "cpu")
    rows, constants = 1024 * HKV, HKV * D * (2 + 2 + 4 + 4)
    assert cache.memory()["body"] == rows * (16 + 2 * 2) + rows * (24 + 2) + 2 * constants
    key = LAYOUTS["static-fp8-slots"][0]
    exact = dataclasses.replace(key, slot_code="exact")
    per_slot = exact.layout.bits_per_element(D, 1024) - key.layout.bits_per_element(D, 1024)
    assert per_slot == 2 * 8 / D  # two slots, 8 bits fewer each


def test_byte_metadata_is_one_byte_a_scale_and_one_an_offset():
    """metadata_code "byte" at 1024 tokens, 3 KV heads of 64 channels, fp16: a value row is 16
    bytes of 2-bit codes + a 1-byte scale + a 1-byte zero point, 18 bytes, what a symmetric row
    with an fp16 scale takes; with the cache's dtype (fp16 scale and offset) 20 bytes."""
    cache = _cache(_scheme("byte-metadata", layers=1), 1, 1, 1024, "cpu")
    assert cache.values[0].body.scale.dtype == torch.uint8
    rows, key_constants = 1024 * HKV, HKV * D * (2 + 2 + 4 + 4)  # fp16 scale, offset, lo, hi
    assert cache.memory()["body"] == rows * (16 + 2) + key_constants + rows * (16 + 1 + 1)
    value = LAYOUTS["byte-metadata"][1]
    wide = dataclasses.replace(value, metadata_code="dtype")
    per_row = wide.layout.bits_per_element(D, 1024) - value.layout.bits_per_element(D, 1024)
    symmetric = dataclasses.replace(wide, symmetric=True)
    assert per_row == 2 * 8 / D  # two bytes fewer a row
    assert value.layout.bits_per_element(D, 1024) == symmetric.layout.bits_per_element(D, 1024)


def test_a_window_allocates_its_ring_not_the_context():
    """kivi's layout at 32K, windows of 20 and 100: keys flushed 32 at a time keep a ring of
    whole flush blocks and token groups (32, 128 slots: right after a flush the residual window
    holds one token, so even a window of 20 reaches the body); values flushed one at a time keep
    100 slots, or none for the window of 20 (the residual window of 32 always holds it)."""
    scheme = _scheme("kivi")
    params = _params(scheme)
    cache = QuantizedCache(scheme, params, Transforms.online(scheme, params), num_layers=2,
                           batch=1, kv_heads=HKV, head_dim=D, max_len=32768, device="meta",
                           dtype=torch.float16, windows=(20, 100))  # fmt: skip
    assert [s.slots for s in cache.keys + cache.values] == [32, 128, 0, 100]
    full = planned_memory(scheme, params, Transforms.online(scheme, params), num_layers=2,
                          kv_heads=HKV, head_dim=D, context=32768)  # fmt: skip
    assert cache.memory()["body"] * 50 < full["body"]


def test_turboquant_counted_by_hand():
    """turboquant-2.5's layout at 1024 tokens, one layer, 3 KV heads of 64 channels, fp16: a
    key or value row is 16 codes of 4 bits (8 bytes) + 48 of 2 bits (12 bytes) + two fp16 norms
    (4 bytes), 24 bytes for 64 elements: 3 bits each; the outlier channels are a per-layer
    constant of 3 x 16 int64 per tensor (one head's 16 over its 1024 x 64 elements: 1/64 bit)."""
    spec = QuantSpec(2, symmetric=True, method="turboquant", split_channels=16, split_bits=4)
    scheme = KVScheme((LayerScheme(spec, spec),))
    params = _params(scheme)
    memory = planned_memory(
        scheme,
        params,
        Transforms.online(scheme, params),
        num_layers=1,
        kv_heads=HKV,
        head_dim=D,
        context=1024,
    )
    assert memory["body"] == 2 * (1024 * HKV * (8 + 12 + 4) + HKV * 16 * 8)
    assert spec.layout.bits_per_element(D, 1024) == 3.0 + 16 * 64 / (1024 * 64)


def test_an_fp16_cache_is_its_keys_and_values():
    cache = FullPrecisionCache(30, 2, HKV, D, 4096, "meta", torch.float16)
    assert cache.bytes_per_token() == 2 * 30 * HKV * D * 2
    windowed = FullPrecisionCache(2, 1, HKV, D, 4096, "meta", torch.float16, windows=(None, 512))
    assert windowed.allocated_bytes() == 2 * (4096 + 512) * HKV * D * 2


PLAN_ON_META = """
import sys
import torch
from test_memory import D, HKV, LAYOUTS, _params, _scheme
from kvcalib_runtime.cache.fpcache import FullPrecisionCache
from kvcalib_runtime.cache.memory import planned_memory
from kvcalib_runtime.model.forward import Transformer
from kvcalib_runtime.model.transforms import Transforms

config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
with torch.device("meta"):
    Transformer(config)
FullPrecisionCache(2, 1, HKV, D, 64, "meta", torch.float16)
for name in LAYOUTS:
    scheme = _scheme(name)
    params = _params(scheme)
    planned_memory(scheme, params, Transforms.online(scheme, params), num_layers=2,
                   kv_heads=HKV, head_dim=D, context=64)
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_planning_on_the_meta_device_imports_no_compiler():
    """Loading, converting and every memory plan build the model and caches on the meta device.
    A meta op that torch implements in Python (an Embedding's random init, zeros_like) imports
    torch._dynamo or sympy: 1-2 s of CPU at every load and conversion, for nothing. Held in a
    fresh interpreter, over every layout here and the model itself."""
    result = subprocess.run(
        [sys.executable, "-c", PLAN_ON_META],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent,
        check=True,
    )
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.gpu
def test_cuda_allocates_what_the_walk_counts():
    scheme = _scheme("static-slots", layers=4)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = _cache(scheme, 4, 2, 8192, "cuda")
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for part in cache.parts().values()
        for t in part
        if t.is_cuda
    }
    on_gpu = sum(storages.values())
    # the caching allocator rounds each block up to 512 bytes: at most that per tensor
    assert on_gpu <= grown <= on_gpu + 512 * len(storages)
