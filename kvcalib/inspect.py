"""`kvcalib inspect`: a short text summary of a model, a profile or a converted checkpoint."""

import json
from pathlib import Path

from kvcalib.calibration.report import summary_lines
from kvcalib.core import models
from kvcalib.core.profile import FORMAT_VERSION, Profile
from kvcalib.core.profile import META as PROFILE_META
from kvcalib.errors import ProfileError
from kvcalib_runtime.cache.memory import planned_bits
from kvcalib_runtime.checkpoint import format
from kvcalib_runtime.checkpoint.format import META
from kvcalib_runtime.layouts.quant import QuantSpec
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.transforms import FUSED, KINDS, NONE, ONLINE, LayerTransforms

SUMMARY_CONTEXT = 4096  # tokens of the one sequence whose cache a checkpoint's summary sizes


def model_summary(spec: str | None, *, trust_remote_code: bool = False) -> str:
    """Architecture and KV-cache size per token of a model (its config only: no weights load)."""
    source = models.resolve(spec, trust_remote_code=trust_remote_code)  # config checked
    cfg = json.loads((source.path / "config.json").read_text())
    geo = Geometry.from_config(cfg)
    layers, heads, kv_heads, head_dim = geo.layers, geo.heads, geo.kv_heads, geo.head_dim
    thetas = sorted({p["rope_theta"] for p in geo.rope})
    rope = geo.rope[-1]
    windows = sorted({w for w in geo.windows if w is not None})
    sliding = sum(w is not None for w in geo.windows)
    elements = 2 * layers * kv_heads * head_dim  # keys and values of one token, all layers
    lines = [
        f"model        {source.spec}  ({source.path})",
        f"architecture {geo.model_type}  {cfg.get('architectures', ['?'])[0]}  ("
        + ("convert and runtime: yes" if geo.arch else "eval and calibrate only")
        + ")",
        f"layers       {layers}"
        + (f"  ({sliding} slide over {', '.join(map(str, windows))} tokens)" if sliding else ""),
        f"heads        {heads} query / {kv_heads} key-value (GQA {heads // kv_heads}:1)",
        f"head_dim     {head_dim}   hidden {geo.hidden}",
        f"RoPE         {rope.get('rope_type', 'default')}, theta "
        + " / ".join(f"{t:g}" for t in thetas)
        + (f", rotates {rope['partial_rotary_factor']:g} of a head" if geo.partial_rotary else ""),
        f"context      {geo.max_position} tokens",
        "KV cache per token (keys + values, all layers):",
        f"  fp16       {elements * 2:>8,} bytes",
    ]
    for bits in (4, 3, 2):
        bpe = QuantSpec(bits).layout.bits_per_element(head_dim, tokens=1)
        lines.append(
            f"  {bits}-bit      {elements * bpe / 8:>8,.0f} bytes  "
            f"({bpe:.2f} bits/element: codes + fp16 scale and offset per token and head)"
        )
    return "\n".join(lines)


def summary(path: str | None, *, trust_remote_code: bool = False) -> str:
    """Dispatch on what `path` is: a profile folder, a converted folder, or a model spec
    (refused when it names custom code, unless `trust_remote_code`)."""
    if path is not None and (Path(path) / PROFILE_META).is_file():
        return profile_summary(Path(path))
    if path is not None and (Path(path) / META).is_file():
        return checkpoint_summary(Path(path))
    return model_summary(path, trust_remote_code=trust_remote_code)


def profile_summary(path) -> str:
    """What `kvcalib inspect PROFILE_DIR` prints."""
    profile = Profile.load(path)
    try:
        lines = summary_lines(profile)
    except (KeyError, TypeError, IndexError, ValueError) as e:  # profile.json fields it reports
        raise ProfileError(
            f"profile {path}: {PROFILE_META} lacks or garbles a field the summary reports "
            f"({type(e).__name__}: {e}); recalibrate with kvcalib calibrate"
        ) from None
    return "\n".join([f"profile      {profile.path}  (format {FORMAT_VERSION})", *lines])


def _spec_text(spec) -> str:
    if spec is None:
        return "fp16"
    parts = [f"{spec.bits}-bit {spec.granularity}"]
    if spec.group_size:
        parts.append(f"g{spec.group_size}")
    parts.append("sym" if spec.symmetric else "asym")
    if spec.clip != 1.0:
        parts.append(f"clip {spec.clip:g}")
    if spec.codebook:
        parts.append("codebook")
    if spec.outliers:
        parts.append(f"{spec.outliers:.1%} outliers")
    return " ".join(parts)


def _layer_text(layer, transforms: LayerTransforms) -> tuple[str, str]:
    key = _spec_text(layer.key)
    if layer.key_position == "pre_rope":
        key += ", pre-RoPE"
    if transforms.key_smooth != NONE:
        key += f", smoothed ({transforms.key_smooth})"
    if transforms.key_rotation != NONE:
        key += f", Hadamard ({transforms.key_rotation})"
    value = _spec_text(layer.value)
    if transforms.value_rotation != NONE:
        value += f", Hadamard ({transforms.value_rotation})"
    return key, value


def checkpoint_summary(path: Path) -> str:
    """What `kvcalib inspect CONVERTED_DIR` prints (the folder is validated first)."""
    ckpt = format.read_checkpoint(path, hashes=False)
    meta, scheme, cfg = ckpt.meta, ckpt.scheme, ckpt.config
    profile = meta["profile"]
    places = {(kind, getattr(t, kind)) for t in ckpt.transforms.layers for kind in KINDS}
    fused = {kind for kind, place in places if place == FUSED}
    if meta["residual_rotation_seed"] is not None:
        fused.add("residual_rotation")
    online = sorted(kind for kind, place in places if place == ONLINE)
    lines = [
        f"converted    {path}  (format {meta['format_version']})",
        f"source       {meta['source']['spec']}  (sha256 {meta['source']['fingerprint'][:16]})",
        f"recipe       {meta['recipe']['name']}",
        "profile      "
        + (
            "none"
            if profile is None
            else f"{profile.get('path')}  (fingerprint {profile['fingerprint'][:16]})"
        ),
        f"weights      {cfg['model_type']}, {cfg.get('dtype', '?')}; fused: "
        + (", ".join(sorted(fused)) or "nothing"),
        f"online       {', '.join(online) or 'nothing'}",
    ]
    if meta["untied_embeddings"]:
        lines.append("embeddings   untied (the residual rotation makes lm_head differ)")
    if meta["export"]:
        lines.append(f"export       {meta['export']} (config.json quantization_config)")
    sinks = f"first {scheme.sinks_first}" + (
        f" + up to {scheme.sink_budget} predicted" if scheme.sink_budget else ""
    )
    lines += [
        f"cache        residual window {scheme.residual} tokens; sinks {sinks}",
        f"  {'layers':<8} {'key':<40} value",
    ]
    rows = [_layer_text(*lt) for lt in zip(scheme.layers, ckpt.transforms.layers, strict=True)]
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            lines.append(f"  {span:<8} {rows[start][0]:<40} {rows[start][1]}")
            start = i
    n = SUMMARY_CONTEXT
    geo = ckpt.geometry
    sizes = dict(num_layers=geo.layers, kv_heads=geo.kv_heads, head_dim=geo.head_dim)
    bits, _ = planned_bits(scheme, ckpt.params, ckpt.transforms, **sizes, context=n)
    elements = 2 * geo.layers * geo.kv_heads * geo.head_dim  # keys and values of one token
    quantized, fp16 = elements * bits / 8, elements * 2
    lines.append(
        f"KV cache     {quantized:,.0f} bytes/token allocated for one sequence of {n} tokens, "
        f"fp16 cache {fp16:,} ({fp16 / quantized:.2f}x smaller)"
    )
    return "\n".join(lines)
