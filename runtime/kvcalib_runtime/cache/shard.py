"""Tensor-parallel head sharding of a side-car's calibrated tensors.

Under tensor parallelism rank r of a world of w holds KV heads [r * Hkv / w, (r + 1) * Hkv / w)
(how vLLM splits k_proj and v_proj) and their query heads. Everything kvcalib calibrates per KV
head moves with its heads (`KVParams`' docstring gives the shapes):

    key_range, value_range  (lo, hi) [Hkv, D]   sliced
    key_codebook, ...       [Hkv, L] per head   sliced; [L] per layer: shared
                            "vq": [Hkv, L, w]   sliced; [1, L, w] per layer: shared
    key_smooth              [Hkv, D]            sliced
    key_split, value_split  [Hkv, n_o]          sliced (channels within a head: unchanged)
    sink_predictor          on the residual stream, which every rank holds whole: shared

Attention never mixes KV heads, so each rank's cache, built from its share, attends exactly as
the unsharded cache does on those heads. A layout whose stored row joins every head
("vector") quantizes across heads and cannot be split by them: refused, as is a world size
that does not divide the KV heads.
"""

from dataclasses import replace

from kvcalib_runtime.cache.scheme import KVParams, KVScheme
from kvcalib_runtime.layouts.base import calibrated_tensors


def head_share(kv_heads: int, rank: int, world: int) -> slice:
    """The KV heads rank `rank` of `world` holds."""
    if world < 1 or kv_heads % world or not 0 <= rank < world:
        raise ValueError(
            f"tensor parallelism: {world} ranks (rank {rank}) cannot share {kv_heads} KV heads: "
            f"use a world size that divides {kv_heads}"
        )
    per = kv_heads // world
    return slice(rank * per, (rank + 1) * per)


def check_shardable(scheme: KVScheme, kv_heads: int, world: int) -> None:
    """ValueError in one line unless `world` ranks can each hold a share of a cache of
    `kv_heads` KV heads stored as `scheme` says (see the module docstring)."""
    head_share(kv_heads, 0, world)
    for i, layer in enumerate(scheme.layers):
        for name, spec in (("key", layer.key), ("value", layer.value)):
            if world > 1 and spec is not None and spec.layout.joins_heads:
                raise ValueError(
                    f"tensor parallelism: layer {i} {name}s are stored as {spec.layout.name!r}, "
                    "one row across every KV head, which cannot be split by heads: convert "
                    "with a per-head layout"
                )


def shard_params(scheme: KVScheme, params: KVParams, *, kv_heads: int, rank: int,
                 world: int) -> KVParams:  # fmt: skip
    """Rank `rank`'s share of `params` (see the module docstring): a KVParams for a cache of
    kv_heads / world KV heads."""
    heads = head_share(kv_heads, rank, world)
    check_shardable(scheme, kv_heads, world)

    def rows(table: dict, per_layer: bool = False) -> dict:
        def shared(t):  # one row for every head of a layer: a codebook's [L], or [1, L, w]
            return per_layer and (t.dim() == 1 or t.shape[0] == 1)

        return {i: t if shared(t) else t[heads] for i, t in table.items()}

    def pairs(table: dict) -> dict:
        return {i: (lo[heads], hi[heads]) for i, (lo, hi) in table.items()}

    share = {"key_smooth": rows(params.key_smooth)}
    for c in calibrated_tensors().values():  # what the layouts declare (layouts.base)
        for name in (f"key_{c.name}", f"value_{c.name}"):
            table = getattr(params, name)
            share[name] = pairs(table) if c.pair else rows(table, per_layer=c.shared)
    return replace(params, **share)
