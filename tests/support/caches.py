"""The simulated cache's tests' model and reads (tests/toolkit/sim/test_held_bodies.py,
tests/toolkit/evaluation/test_session.py).

    model = small_llama()                 # 2 query heads over 1 KV head of 32 channels
    ids = random_ids(90, seed=0)          # [1, 90] token ids below 128
    keys, values = history(store, layer, rope)   # what attention reads of a QuantizedCache
"""

import torch

from kvcalib_runtime.cache.kvcache import QuantizedCache
from support.tiny import tiny_model


def small_llama():
    """A tiny llama with 2 attention heads over 1 KV head (head_dim 32); autograd off."""
    torch.set_grad_enabled(False)
    return tiny_model("llama", num_attention_heads=2, num_key_value_heads=1)


def random_ids(n: int, seed: int) -> torch.Tensor:
    """[1, n] token ids drawn below 128 from `seed`."""
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def history(store: QuantizedCache, layer: int, rope):
    """Layer `layer`'s keys and values as the cache hands them to attention ([1, Hkv, N, D]
    each, N = the stored length + 1: one zero token staged, then dropped)."""
    d = store.keys[layer].tail.shape[-1]
    store.stage(layer, torch.zeros(1, 1, 1, d), torch.zeros(1, 1, 1, d), rope, store.positions(1))
    keys, values, _ = store.materialize(layer, rope)
    store._pending.clear()
    return keys, values
