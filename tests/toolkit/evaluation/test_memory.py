"""Every preset's memory: the bits eval reports (walked from the buffers of a cache planned on
the meta device) are what the same cache allocates on the CPU, part by part, at 1K and 4K; and
kvcalib-2 meets the memory targets of
the real-memory issue on SmolLM2-135M's geometry (30 layers, 3 KV heads of 64 channels, fp16):
at most 0.20 of an fp16 cache at 4K, 0.17 at 32K, and at most 2.5 bits per body element.

A calibration profile only decides values here, never sizes, so a stand-in profile supplies
tensors of the right shapes."""

import pytest
import torch
from support.tiny import ShapeProfile

from kvcalib.core.plan import plan
from kvcalib.core.recipe import load_recipe, presets
from kvcalib_runtime.cache.fpcache import FullPrecisionCache
from kvcalib_runtime.cache.kvcache import QuantizedCache
from kvcalib_runtime.cache.memory import planned_memory
from kvcalib_runtime.model.transforms import Transforms

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 30, 3, 64, 576  # SmolLM2-135M
CONTEXTS = (1024, 4096, 32768)


def _planned(name):
    recipe = load_recipe(name)
    scheme, params = plan(
        recipe, num_layers=LAYERS, head_dim=HEAD_DIM, profile=ShapeProfile(KV_HEADS, HEAD_DIM)
    )
    return scheme, params, Transforms.online(scheme, params)


def _memory(scheme, params, transforms, context):
    return planned_memory(
        scheme,
        params,
        transforms,
        num_layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        context=context,
    )


def _fp16(context: int) -> int:
    return FullPrecisionCache(LAYERS, 1, KV_HEADS, HEAD_DIM, context, "meta", torch.float16)


SERVED = [name for name in presets() if not load_recipe(name).external]


@pytest.mark.parametrize("context", CONTEXTS[:2])
@pytest.mark.parametrize("name", SERVED)
def test_the_reported_bits_are_what_is_allocated(name, context):
    scheme, params, transforms = _planned(name)
    sizes = dict(num_layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float16)
    cache = QuantizedCache(scheme, params, transforms, batch=1, max_len=context, device="cpu",
                           **sizes)  # fmt: skip
    assert _memory(scheme, params, transforms, context) == cache.memory()


def test_kvcalib_2_meets_the_memory_targets():
    scheme, params, transforms = _planned("kvcalib-2")
    elements = {n: 2 * LAYERS * KV_HEADS * HEAD_DIM * n for n in CONTEXTS}
    memory = {n: _memory(scheme, params, transforms, n) for n in CONTEXTS}
    ratio = {n: sum(memory[n].values()) / _fp16(n).allocated_bytes() for n in CONTEXTS}
    assert ratio[4096] <= 0.20 and ratio[32768] <= 0.17, ratio
    assert memory[1024]["body"] * 8 / elements[1024] <= 2.5
    # and it stores less than KIVI-2 at every context quoted
    kivi = _planned("kivi-2")
    for n in CONTEXTS:
        assert sum(memory[n].values()) < sum(_memory(*kivi, n).values())
