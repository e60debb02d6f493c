"""The simulated cache keeps each quantized body dequantized between forwards and extends it by
what was committed since (kvcalib_runtime.cache.held): for every recipe preset's layouts, after
every commit — a prefill, chunks, single decode tokens, a snapshot restored and the positions
filled again with other tokens — the history attention reads must be bit for bit the whole body
dequantized again, as a cache that keeps nothing reads it. Snapshot and restore put every buffer
back."""

from pathlib import Path

import pytest
import torch
from support.caches import history, random_ids, small_llama
from support.tiny import ShapeProfile

from kvcalib.core.recipe import load_recipe
from kvcalib.evaluation.score import candidates
from kvcalib.sim.cache import QuantizedKVCache

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
PRESETS = sorted(p.stem for p in RECIPES.glob("*.toml") if not load_recipe(p.stem).external)


@pytest.fixture(scope="module")
def model():
    return small_llama()


class Whole(QuantizedKVCache):
    """The simulated cache as it was: every read dequantizes the whole body."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.store._held = None


@pytest.mark.parametrize("recipe", PRESETS)
def test_the_held_history_is_the_whole_body_read_again(model, recipe):
    (c,) = candidates(model, [recipe], ShapeProfile(1, 32), residual=32)
    plan = (c.scheme, c.params, c.transforms)
    caches = [cls(model, *plan, max_len=320) for cls in (QuantizedKVCache, Whole)]
    kept = caches[0]

    def step(ids):
        got = [model(ids, cache=cache, use_cache=True).logits for cache in caches]
        assert torch.equal(*got)
        for layer, rope in enumerate(kept.ropes):
            ours, theirs = (history(cache.store, layer, rope) for cache in caches)
            for a, b in zip(ours, theirs, strict=True):
                assert torch.equal(a, b), (recipe, layer, kept.seq_length())

    step(random_ids(70, 0))  # a prefill: the body holds what the window does not
    step(random_ids(23, 1))  # a chunk against it
    for i in range(40):  # decode steps: each flushes a token, or a whole KIVI group
        step(random_ids(1, 100 + i))
    snaps = [cache.store.snapshot() for cache in caches]
    step(random_ids(45, 2))
    for cache, snap in zip(caches, snaps, strict=True):
        cache.store.restore(snap)
    step(random_ids(45, 3))  # the restored positions, filled again with other tokens
    for i in range(10):
        step(random_ids(1, 200 + i))
    held = kept.store._held._held  # every quantized body was read through its kept copy
    quantized = sum(s.spec is not None for s in kept.store.keys + kept.store.values)
    assert len(held) == quantized and all(done > 0 for _, done in held.values())
    for cache in caches:
        cache.close()


def test_restore_puts_every_buffer_back(model):
    (c,) = candidates(model, ["kvcalib-2"], ShapeProfile(1, 32), residual=32)
    with QuantizedKVCache(model, c.scheme, c.params, c.transforms, max_len=200) as cache:
        model(random_ids(70, 4), cache=cache, use_cache=True)
        before = [t.clone() for ts in cache.store.parts().values() for t in ts]
        snap = cache.store.snapshot()
        model(random_ids(60, 5), cache=cache, use_cache=True)  # flushes the window, sinks, lengths
        after = [t for ts in cache.store.parts().values() for t in ts]
        assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        cache.store.restore(snap)
        assert cache.seq_length() == 70 and cache.store._host() == [70]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        other = QuantizedKVCache(model, c.scheme, c.params, c.transforms, max_len=200)
        with other, pytest.raises(ValueError, match=r"the cache \(or view\) that took it"):
            other.store.restore(snap)
