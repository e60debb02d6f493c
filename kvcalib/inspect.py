"""`kvcalib inspect`: a short text summary of a model, a profile or a converted checkpoint."""

import json
from pathlib import Path

from kvcalib.calibration.report import summary_lines
from kvcalib.conversion.convert import checkpoint_summary
from kvcalib.core import models
from kvcalib.core.profile import FORMAT_VERSION, Profile
from kvcalib.core.profile import META as PROFILE_META
from kvcalib.errors import ProfileError
from kvcalib_runtime.format import META
from kvcalib_runtime.geometry import Geometry
from kvcalib_runtime.quant import QuantSpec


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
        bpe = QuantSpec(bits).bits_per_element(head_dim, tokens=1)
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
