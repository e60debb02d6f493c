"""`--export vllm-fp8`: what vLLM and llm-compressor read for a static FP8 (E4M3) KV cache.

A compressed-tensors `quantization_config` whose only content is a `kv_cache_scheme`, plus one
float32 scale per layer for keys and one for values under vLLM's checkpoint names
(`model.layers.{i}.self_attn.k_scale` / `v_scale`; vLLM maps them onto `self_attn.attn`).
Serve with `vllm serve OUT_DIR --kv-cache-dtype fp8`.

    scale = absmax / 448            (448 = the largest finite float8_e4m3fn)

The absmax is of what the cache will store, over every calibration token, sinks included (the
profile's `key_post_rope.all.absmax` and `value.all.absmax`, float32 [L, Hkv, D]): a scale from
the non-sink range (`Profile.range`) would saturate the sink tokens, whose keys are the
outliers. Keys are divided by the fused key smoothing. Values are rotated when the value
Hadamard is fused, and a channel of v Q is (1/sqrt(D)) sum_i ±v_i, so sum_i absmax_i / sqrt(D)
is the tightest bound the per-channel absmax gives. A generous bound costs FP8 little: it is a
floating-point format, so small values keep their relative precision.
"""

import math

import torch

from kvcalib.errors import ProfileError
from kvcalib_runtime.cache.scheme import KVParams, KVScheme
from kvcalib_runtime.model.transforms import FUSED, Transforms

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
KV_CACHE_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}
SCALE_NAMES = ("model.layers.{}.self_attn.k_scale", "model.layers.{}.self_attn.v_scale")


def quantization_config() -> dict:
    """The config.json `quantization_config` of a KV-cache-only compressed-tensors checkpoint."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "frozen",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": dict(KV_CACHE_SCHEME),
    }


ABSMAX = {"key": "key_post_rope.all.absmax", "value": "value.all.absmax"}


def _absmax(profile, name: str, layer: int) -> torch.Tensor:
    """float64 [Hkv, D]: |x| max over all calibration tokens of one layer's keys or values."""
    tensors = getattr(profile, "tensors", {})
    if ABSMAX[name] not in tensors:
        raise ProfileError(
            f"the profile has no {ABSMAX[name]} (all-token {name} absmax): calibrate again "
            "with kvcalib calibrate (its stats phase records it)"
        )
    return tensors[ABSMAX[name]][layer].double()


def kv_scales(
    profile, scheme: KVScheme, params: KVParams, transforms: Transforms
) -> dict[str, torch.Tensor]:
    """vLLM's per-layer k_scale / v_scale, each float32 [1], from the profile's ranges."""
    out = {}
    for i in range(len(scheme.layers)):
        key = _absmax(profile, "key", i)
        if transforms.layers[i].key_smooth == FUSED:
            key = key / params.key_smooth[i].double()
        value = _absmax(profile, "value", i)
        if transforms.layers[i].value_rotation == FUSED:
            value = value.sum(-1, keepdim=True) / math.sqrt(value.shape[-1])
        for name, absmax in zip(SCALE_NAMES, (key, value), strict=True):
            scale = absmax.max().clamp_min(1e-12) / FP8_E4M3_MAX
            out[name.format(i)] = scale.float().reshape(1)
    return out
