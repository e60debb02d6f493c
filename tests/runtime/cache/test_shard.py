"""Tensor-parallel head sharding (`cache.shard`): each rank's cache, built from its share of the
calibrated tensors, attends as the unsharded cache does on its heads."""

import pytest
import torch

from kvcalib_runtime.cache.kvcache import QuantizedCache
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.cache.shard import head_share, shard_params
from kvcalib_runtime.layouts.quant import QuantSpec as S
from kvcalib_runtime.model.rope import Rope
from kvcalib_runtime.model.transforms import Transforms

HKV, G, D = 4, 2, 64
LAYERS = (
    # kvcalib-2: static codebook keys with an exact slot (smoothed), per-head codebook values
    LayerScheme(S(2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error"),
                S(2, symmetric=True, codebook=True), key_position="pre_rope"),
    # TurboQuant: an outlier set of channels per head
    LayerScheme(S(2, symmetric=True, method="turboquant", split_channels=16, split_bits=4),
                S(3, "static", outliers=0.01, outlier_slots=1, slot_code="fp8")),
    # kvcalib-1.5: vector codes, keys RoPE quads with one codebook per layer, values per head
    LayerScheme(S(4, "static", 4, codebook=True, method="vq", pairing="rope"),
                S(4, "static", 4, codebook=True, method="vq"), key_position="pre_rope"),
)  # fmt: skip
SCHEME = KVScheme(LAYERS, residual=8, sinks_first=1, sink_budget=0)


def _params(gen) -> KVParams:
    """Every per-head tensor different per head, so a rank given another's share attends
    differently."""
    params = KVParams()
    lo = -torch.rand(HKV, D, generator=gen) * 3 - 0.5
    params.key_range[0] = (lo, torch.rand(HKV, D, generator=gen) * 3 + 0.5)
    params.key_codebook[0] = torch.linspace(0, 1, 4)  # per layer: shared
    params.value_codebook[0] = torch.rand(HKV, 4, generator=gen).sort(-1).values * 2 - 1
    half = torch.rand(HKV, D // 2, generator=gen) + 0.5
    params.key_smooth[0] = torch.cat([half, half], -1)  # equal on RoPE pairs
    params.key_split[1] = torch.stack([torch.randperm(D, generator=gen)[:16] for _ in range(HKV)])
    lo = -torch.rand(HKV, D, generator=gen) * 2 - 0.5
    params.value_range[1] = (lo, torch.rand(HKV, D, generator=gen) * 2 + 0.5)
    for name in ("key_range", "value_range"):
        lo = -torch.rand(HKV, D, generator=gen) * 3 - 0.5
        getattr(params, name)[2] = (lo, torch.rand(HKV, D, generator=gen) * 3 + 0.5)
    params.key_codebook[2] = torch.rand(1, 16, 4, generator=gen)  # per layer: shared
    params.value_codebook[2] = torch.rand(HKV, 16, 4, generator=gen)
    return params


def _run(params, heads: slice, steps, kv_heads: int):
    """Outputs of every layer and step (a 30-token prefill, then single tokens past the residual
    window of 8) of a float32 cache of `kv_heads` heads fed the KV heads `heads` (and their
    query heads) of `steps`."""
    cache = QuantizedCache(SCHEME, params, Transforms.online(SCHEME, params),
                           num_layers=len(LAYERS), batch=1, kv_heads=kv_heads, head_dim=D,
                           max_len=64, device="cpu", dtype=torch.float32,
                           use_kernels=False)  # fmt: skip
    rope = Rope({}, D)
    q_heads = slice(heads.start * G, heads.stop * G)
    out = []
    for q, k, v in steps:
        pos = cache.positions(q.shape[2])
        for layer in range(len(LAYERS)):
            out.append(cache.attend(layer, rope.apply(q[:, q_heads], pos), k[:, heads],
                                    v[:, heads], rope, pos))  # fmt: skip
        cache.commit(q.shape[2])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_attend_as_the_unsharded_cache(world):
    # Attention never mixes KV heads and every calibrated tensor is per head or shared, so the
    # ranks' outputs, concatenated over heads, are the unsharded output: bit for bit on one
    # CPU thread, 1e-6 allowed for batched float32 matmuls over fewer heads that a threaded
    # BLAS may round differently. A rank given its neighbour's share misses by more than 1e-2.
    gen = torch.Generator().manual_seed(world)
    params = _params(gen)
    steps = [tuple(torch.randn(1, h, t, D, generator=gen) * 2 for h in (HKV * G, HKV, HKV))
             for t in (30, *[1] * 12)]  # fmt: skip
    whole = _run(params, slice(0, HKV), steps, HKV)
    ranks = []
    for rank in range(world):
        share = shard_params(SCHEME, params, kv_heads=HKV, rank=rank, world=world)
        ranks.append(_run(share, head_share(HKV, rank, world), steps, HKV // world))
    for i, theirs in enumerate(whole):
        ours = torch.cat([r[i] for r in ranks], 1)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=f"output {i}")
    wrong = shard_params(SCHEME, params, kv_heads=HKV, rank=1, world=world)
    missed = _run(wrong, head_share(HKV, 0, world), steps, HKV // world)
    heads = slice(0, HKV // world * G)
    assert max((a - b[:, heads]).abs().max() for a, b in zip(missed, whole, strict=True)) > 1e-2


def test_shard_refuses_what_heads_cannot_split():
    with pytest.raises(ValueError, match=r"3 ranks .* cannot share 4 KV heads: use a world size"):
        head_share(4, 0, 3)
    vector = KVScheme((LayerScheme(S(2, "static"), S(3, "vector")),))
    with pytest.raises(ValueError, match=r"layer 0 values .* cannot be split by heads"):
        shard_params(vector, KVParams(), kv_heads=4, rank=0, world=2)
