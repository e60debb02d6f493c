"""What a profile folder must mean before anything is planned from it (`Profile.load` runs it).

Hashes prove a file is the one that was written; this checks that what it says makes sense:

- profile.json: the model's sizes are positive integers (never booleans or floats),
  num_samples and seq_len too; quantile_levels and outlier_fractions are the ones this kvcalib
  computes ranges with (sorted, in [0, 1]); the sink predictor, when there is one, names a layer
  of the model, distinct hidden dims in range and a finite threshold; probe.bits are integers;
- profile.safetensors: every floating tensor is finite (position_error.key_groups alone may
  hold NaN: no later sinks); the per-channel statistics are [L, Hkv, D] (quantiles
  [L, Hkv, D, len(quantile_levels)], non-decreasing along the levels; min <= max; absmax and
  std >= 0), attention.token0 [L, H], massive.max_abs [L, E], sensitivity.{key,value} and
  sensitivity.answer.{key,value} [L, len(probe.bits)], codebook.{variant}.{bits} [L, 2**bits],
  sorted, in [0, 1] ([-1, 1] for ":symmetric" variants), vqbook.{variant}.{bits}
  [L, Hc, 2**bits, w] (w and Hc, 1 or Hkv, as the variant names them); windows.input_ids
  int64 [num_samples, seq_len] with ids >= 0; attention.received, sinks.*, massive.median_abs
  and position_error.* of the dtype and shape kvcalib.core.profile lists;
- profile.json's structure: no number anywhere is NaN or Inf (with the field's path); the
  top level, model, tokens, codebooks, layers[i], sinks, massive and sink_predictor hold only
  the keys the writer writes (`KEYS`; settings, versions, probe and timings are descriptive);
  layers has one entry per layer, in order, with a weight per head and outlier lists per KV
  head; codebooks names bit widths in [1, 8] and a positive count of windows and bins, and
  its vector variants ({variant: [bits, ...]}) widths in [1, 8];
- the binding: profile.json's tensors_sha256 is the sha256 of profile.safetensors (checked
  last, so that a damaged file is named by what is wrong in it; a profile written before the
  binding has none).

Everything raises ProfileError naming the profile, the field and the fix (recalibrate).
"""

import math
import re

import torch

from kvcalib.errors import ProfileError

MAY_HOLD_NAN = ("position_error.key_groups",)  # NaN: a window without later sinks
_SIZES = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size")
_STAT = re.compile(
    r"(key_pre_rope|key_post_rope|value)\.(all|nonsink)\.(\w+)|(key_\w+)\.range_ratio"
)
_CODEBOOK = re.compile(r"codebook\.(.+)\.(\d+)")
_VQBOOK = re.compile(
    r"vqbook\.(?:key|value):vq(\d+):(?:.+:)?(layer|head):(?:fisher|fisher\+answer|plain)\.(\d+)"
)
_SENSITIVITIES = tuple(
    f"sensitivity{loss}.{t}" for loss in ("", ".answer") for t in ("key", "value")
)
KEYS = {
    "": {
        "format_version", "model", "data", "num_samples", "seq_len", "seed", "device", "dtype",
        "sequential", "phases", "versions", "settings", "quantile_levels", "outlier_fractions",
        "position_error_bits", "tokens", "probe", "codebooks", "layers", "sinks", "massive",
        "sink_predictor", "timings", "tensors_sha256",
    },
    "model": {"spec", "path", "fingerprint", "model_type", *_SIZES},
    "tokens": {"all", "nonsink"},
    "codebooks": {"variants", "bits", "windows", "bins", "vectors"},
    "layers[]": {
        "index", "token0_attention", "token0_sink", "key_outlier_channels_pre_rope",
        "key_outlier_channels_post_rope", "massive_dims", "massive_tokens",
    },
    "sinks": {
        "definition", "token0_windows", "token0_layers", "windows", "later_windows", "count",
        "positions", "tokens",
    },
    "massive": {"ratio", "first_layer"},
    "sink_predictor": {"layer", "dims", "threshold", "precision", "recall", "f1", "held_out"},
}  # fmt: skip


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check(
    meta: dict,
    tensors: dict[str, torch.Tensor],
    where: str,
    *,
    quantile_levels: tuple[float, ...],
    outlier_fractions: tuple[float, ...],
) -> None:
    """ProfileError unless profile.json `meta` and the `tensors` make sense together; the
    levels and fractions are the ones this kvcalib reads ranges at (kvcalib.core.profile)."""

    def fail(msg: str):
        raise ProfileError(f"profile {where}: {msg}; recalibrate with kvcalib calibrate")

    model = meta["model"]
    for k in _SIZES:
        if not _int(model.get(k)) or model[k] < 1:
            fail(f"model.{k} = {model.get(k)!r} is not a positive integer")
    for k in ("num_samples", "seq_len"):
        if not _int(meta.get(k)) or meta[k] < 1:
            fail(f"{k} = {meta.get(k)!r} is not a positive integer")
    _check_structure(meta, fail)
    for k, want in (("quantile_levels", quantile_levels), ("outlier_fractions", outlier_fractions)):
        got = meta.get(k)
        numbers = isinstance(got, list) and all(_number(x) for x in got)
        if not numbers or [float(x) for x in got] != list(want):
            fail(f"{k} {str(got)[:60]} are not the sorted levels this kvcalib reads ranges at")
    L, hkv, d = model["num_layers"], model["num_kv_heads"], model["head_dim"]
    _check_predictor(meta.get("sink_predictor"), L, model["hidden_size"], fail)
    probe, bits = meta.get("probe"), None
    if probe is not None:
        bits = probe.get("bits") if isinstance(probe, dict) else None
        if not isinstance(bits, list) or not bits or not all(_int(b) and b > 0 for b in bits):
            fail(f"probe.bits = {str(bits)[:40]} is not a list of bit widths")
    for name, t in tensors.items():
        if t.is_floating_point() and name not in MAY_HOLD_NAN and not bool(t.isfinite().all()):
            fail(f"tensor {name} holds {int((~t.isfinite()).sum())} NaN or Inf value(s)")
        m = _CODEBOOK.fullmatch(name)
        if m and not 1 <= int(m.group(2)) <= 8:
            fail(f"tensor {name}: a codebook of {m.group(2)} bits")
        if name.startswith("vqbook.") and not _VQBOOK.fullmatch(name):
            fail(f"tensor {name} names no vector codebook kvcalib reads")
        want = _shape(name, L, hkv, d, len(quantile_levels), model, bits)
        if want is not None and (tuple(t.shape) != want or not t.is_floating_point()):
            fail(f"tensor {name} is {t.dtype} {list(t.shape)}, profile.json implies {list(want)}")
        if m:
            _check_codebook(name, t, m.group(1), fail)
        stat = _STAT.fullmatch(name)
        if stat and stat.group(3) == "quantiles" and bool((t.diff(dim=-1) < 0).any()):
            fail(f"tensor {name}: quantiles decrease along the levels")
        if stat and stat.group(3) in ("absmax", "std") and bool((t < 0).any()):
            fail(f"tensor {name}: negative values of a magnitude")
        if stat and stat.group(3) == "min":
            hi = tensors.get(name[: -len("min")] + "max")
            if hi is not None and hi.shape == t.shape and bool((t > hi).any()):
                fail(f"tensor {name} exceeds its max in {int((t > hi).sum())} channel(s)")
    ids = tensors.get("windows.input_ids")
    windows = (meta["num_samples"], meta["seq_len"])
    if ids is not None and (ids.dtype != torch.int64 or tuple(ids.shape) != windows):
        fail(f"windows.input_ids is not int64 {list(windows)} (num_samples, seq_len)")
    if ids is not None and bool((ids < 0).any()):
        fail("windows.input_ids holds negative token ids")
    for name, (dtype, want) in _fixed(meta, L, model["num_heads"]).items():
        t = tensors.get(name)
        if t is not None and (t.dtype != dtype or tuple(t.shape) != want):
            fail(
                f"tensor {name} is {t.dtype} {list(t.shape)}, profile.json implies "
                f"{dtype} {list(want)}"
            )
    for name in _SENSITIVITIES:
        if name in tensors and bits is None:
            fail(f"tensor {name} without probe.bits to index it")


def _check_structure(meta: dict, fail) -> None:
    """Non-finite numbers, unknown keys, the layers list and the codebooks' counts."""
    for path, value in _leaves(meta, ""):
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"profile.json {path} = {value} is not a finite number")
    for section, known in KEYS.items():
        docs = meta.get("layers") if section == "layers[]" else _at(meta, section)
        for i, doc in enumerate(
            docs if section == "layers[]" and isinstance(docs, list) else [docs]
        ):
            if not isinstance(doc, dict):
                continue
            where = f"layers[{i}]." if section == "layers[]" else f"{section}." if section else ""
            if unknown := sorted(set(doc) - known):
                fail(f"profile.json has an unknown key {where}{unknown[0]}")
    model, layers = meta.get("model"), meta.get("layers")
    if isinstance(model, dict) and layers is not None:
        _check_layers(layers, model, fail)
    books = meta.get("codebooks")
    if books is not None:
        bits = books.get("bits") if isinstance(books, dict) else None
        if not isinstance(bits, list) or not all(_int(b) and 1 <= b <= 8 for b in bits):
            fail(f"codebooks.bits = {str(bits)[:40]} is not a list of bit widths in [1, 8]")
        for k in ("windows", "bins"):
            if not _int(books.get(k)) or books[k] < 1:
                fail(f"codebooks.{k} = {books.get(k)!r} is not a positive integer")
        vectors = books.get("vectors", {})
        ok = isinstance(vectors, dict) and all(
            isinstance(b, list) and all(_int(x) and 1 <= x <= 8 for x in b)
            for b in vectors.values()
        )
        if not ok:
            fail(f"codebooks.vectors = {str(vectors)[:40]} is not {{variant: [bits, ...]}}")


def _check_layers(layers, model: dict, fail) -> None:
    n, heads, kv = (model.get(k) for k in ("num_layers", "num_heads", "num_kv_heads"))
    if not isinstance(layers, list) or len(layers) != n:
        size = len(layers) if isinstance(layers, list) else type(layers).__name__
        fail(f"layers holds {size} entries for the model's {n} layers")
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or layer.get("index") != i:
            fail(f"layers[{i}] is not the entry of layer {i}")
        if len(layer.get("token0_attention") or ()) != heads:
            fail(f"layers[{i}].token0_attention does not hold one weight per head ({heads})")
        for k in ("key_outlier_channels_pre_rope", "key_outlier_channels_post_rope"):
            if not isinstance(layer.get(k), list) or len(layer[k]) != kv:
                fail(f"layers[{i}].{k} does not hold one list per KV head ({kv})")


def _at(meta: dict, section: str):
    return meta if not section else meta.get(section)


def _leaves(doc, path: str):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, doc


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _fixed(meta: dict, L: int, H: int) -> dict[str, tuple[torch.dtype, tuple]]:
    """The dtype and shape profile.json implies for the tensors of fixed names (module
    docstring of kvcalib.core.profile): N windows of T tokens, P position-error widths."""
    N, T = meta["num_samples"], meta["seq_len"]
    out = {
        "attention.received": (torch.float32, (L, H, T)),
        "sinks.flags": (torch.uint8, (N, T)),
        "sinks.layers": (torch.int32, (N, T)),
        "sinks.weight": (torch.float32, (N, T)),
        "sinks.judged": (torch.uint8, (T,)),
        "sinks.token0": (torch.float32, (L,)),
        "massive.median_abs": (torch.float32, (L,)),
    }
    bits = meta.get("position_error_bits")
    if isinstance(bits, list):
        out["position_error.key"] = (torch.float32, (len(bits), L, T))
        out["position_error.key_groups"] = (torch.float32, (len(bits), L, 3))
    return out


def _shape(name, L, hkv, d, quantiles, model, bits) -> tuple | None:
    """The shape profile.json implies for a tensor, or None when it implies none."""
    if m := _STAT.fullmatch(name):
        return (L, hkv, d, quantiles) if m.group(3) == "quantiles" else (L, hkv, d)
    if name == "attention.token0":
        return (L, model["num_heads"])
    if name == "massive.max_abs":
        return (L, model["hidden_size"])
    if name in _SENSITIVITIES and bits is not None:
        return (L, len(bits))
    if m := _CODEBOOK.fullmatch(name):
        return (L, 2 ** int(m.group(2)))
    if m := _VQBOOK.fullmatch(name):
        w, scope, bits = m.groups()
        return (L, hkv if scope == "head" else 1, 2 ** int(bits), int(w))
    return None


def _check_codebook(name: str, t: torch.Tensor, variant: str, fail) -> None:
    low = -1.0 if "symmetric" in variant.split(":") else 0.0
    if bool((t.diff(dim=-1) < 0).any()):
        fail(f"tensor {name}: codebook levels are not sorted")
    if float(t.min()) < low - 1e-6 or float(t.max()) > 1 + 1e-6:
        fail(f"tensor {name}: codebook levels leave the normalized domain [{low:g}, 1]")


def _check_predictor(p, layers: int, hidden: int, fail) -> None:
    if p is None:
        return
    if not isinstance(p, dict):
        fail("sink_predictor is neither null nor an object")
    layer, dims, threshold = p.get("layer"), p.get("dims"), p.get("threshold")
    if not _int(layer) or not 0 <= layer < layers:
        fail(f"sink_predictor.layer = {layer!r} is not a layer of the model's {layers}")
    ok = isinstance(dims, list) and dims and all(_int(x) and 0 <= x < hidden for x in dims)
    if not ok or len(set(dims)) != len(dims):
        fail(f"sink_predictor.dims {str(dims)[:40]} are not distinct dims in [0, {hidden})")
    if not _number(threshold) or threshold < 0:
        fail(f"sink_predictor.threshold = {threshold!r} is not a finite number >= 0")
