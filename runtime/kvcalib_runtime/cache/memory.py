"""A quantized cache's memory, outside the cache: what its buffers hold (`walk`), what a cache
of given sizes will hold before it is built (`planned_memory`, `planned_bits`: the same cache on
the meta device, walked), the check that it fits in a device's free memory (`check_fits`), and a
copy of every buffer to go back to (`Snapshot`).

Memory is measured, not derived: there is no formula here, only walks of the buffers a
`QuantizedCache` allocates (ARCHITECTURE.md).
"""

import math
from dataclasses import dataclass

import torch

from kvcalib_runtime.cache.scheme import KVParams, KVScheme
from kvcalib_runtime.errors import CapacityError
from kvcalib_runtime.model.transforms import Transforms


def walk(parts: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per part of `parts` (name -> tensors), each storage counted once (on the meta
    device, each tensor)."""
    seen, out = set(), {}
    for part, tensors in parts.items():
        out[part] = 0
        for t in tensors:
            key = id(t) if t.device.type == "meta" else (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                out[part] += t.untyped_storage().nbytes()
    return out


def planned_memory(
    scheme: KVScheme,
    params: KVParams,
    transforms: Transforms,
    *,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    context: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float16,
    windows: tuple[int | None, ...] | None = None,
) -> dict[str, int]:
    """`QuantizedCache.memory()` of a cache for `batch` sequences of `context` tokens, built on
    the meta device: the buffers' real sizes, nothing allocated."""
    # kvcache imports this module (the fit check, Snapshot): its cache is imported when planned
    from kvcalib_runtime.cache.kvcache import QuantizedCache

    cache = QuantizedCache(
        scheme,
        params,
        transforms,
        num_layers=num_layers,
        batch=batch,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_len=context,
        device="meta",
        dtype=dtype,
        use_kernels=False,
        windows=windows,
    )
    return cache.memory()


def planned_bits(scheme: KVScheme, params: KVParams, transforms: Transforms, **sizes):
    """(everything allocated, the quantized body alone) in bits per key/value element of the
    cache `planned_memory(scheme, params, transforms, **sizes)` plans (sizes: num_layers,
    kv_heads, head_dim, context, and optionally batch): its bytes over the 2 * layers * kv_heads
    * head_dim * context * batch elements it represents."""
    memory = planned_memory(scheme, params, transforms, **sizes)
    shape = ("num_layers", "kv_heads", "head_dim", "context")
    elements = 2 * math.prod(sizes[k] for k in shape) * sizes.get("batch", 1)
    return sum(memory.values()) * 8 / elements, memory["body"] * 8 / elements


def free_bytes(device) -> int | None:
    """Free memory of a CUDA device; None elsewhere (no check)."""
    device = torch.device(device)
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def check_fits(scheme, params, transforms, batch, max_len, device, windows, sizes) -> None:
    """CapacityError when a cache for `batch` sequences of `max_len` tokens (sizes: num_layers,
    kv_heads, head_dim, dtype) needs more than the device's free memory, before anything is
    allocated; no check on the meta device (a plan) or where free memory is not known."""
    free = None if torch.device(device).type == "meta" else free_bytes(device)
    if free is None:
        return
    memory = planned_memory(
        scheme, params, transforms, context=max_len, batch=batch, windows=windows, **sizes
    )
    need = sum(memory.values())
    if need > free:
        raise CapacityError(
            f"a KV cache for {batch} sequences of max_len = {max_len} needs {need / 2**30:.2f} "
            f"GiB and {device} has {free / 2**30:.2f} GiB free: lower max_len or the batch"
        )


@dataclass(frozen=True)
class Snapshot:
    """What `QuantizedCache.snapshot` copied: the cache (or view) that took it, (buffer, its
    copy) pairs, the host lengths of its rows."""

    owner: object
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    lengths: list[int]
