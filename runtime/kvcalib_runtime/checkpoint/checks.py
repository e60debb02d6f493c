"""What a KV scheme and its calibrated tensors must mean before a cache is built from them.

`format` checks names, dtypes and shapes of the side-car's files; this module checks their
numbers, for every reader of them: the side-car loader (`format.read_checkpoint`), kvcalib's
planner (numbers that came from a profile) and its converter (before any weight is written).

    check_params(scheme, params, geo)   # ValueError naming the layer and the tensor
    check_scheme(scheme, geo)           # ValueError: a size beyond the context, a rotation
                                        # of an order without a Hadamard matrix

- static ranges: [Hkv, D], finite, lo <= hi, present exactly for the "static" layers;
- codebooks: 2^bits levels for the layer's spec, [L] or [rows, L] (rows 1 or Hkv; 1 for
  "vector"), finite, sorted, in [0, 1] ([-1, 1] when symmetric), present exactly for the layers
  whose spec has a codebook; a "vq" codebook: 2^bits finite entries of group_size coordinates,
  [1 or Hkv, 2^bits, group_size];
- any other calibrated tensor a layout declares (a "turboquant" split): present where the
  layout's `calibrated` asks for it, of the shape it asks, finite;
- key smoothing: [Hkv, D], finite, positive, equal on RoPE pairs (j, j + D/2);
- sink predictor: a finite threshold >= 0, a layer and distinct dims of the model;
- scheme: the residual window, the sink slots and every flush block fit in the model's context
  (max_position_embeddings; MAX_TOKENS when the config has none); rotated heads have an order
  with a Hadamard matrix.
"""

import math

import torch

from kvcalib_runtime.cache.scheme import calibrated_names
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.hadamard import is_supported

MAX_TOKENS = 1 << 24  # the context bound of a config without max_position_embeddings
_SLACK = 1e-6  # codebook levels may sit this far outside their domain (rounding of fp16 files)


def context_of(geo: Geometry) -> int:
    """The most tokens a sequence of this model may hold."""
    return geo.max_position if geo.max_position is not None else MAX_TOKENS


def check_scheme(scheme, geo: Geometry) -> None:
    """ValueError when the scheme rotates heads of an order no Hadamard matrix has, or when the
    residual window, the sink slots or a flush block exceed the model's context (naming the
    bytes per sequence the request would take, fp16 keys and values)."""
    rotated = [i for i, x in enumerate(scheme.layers) if x.key_rotation or x.value_rotation]
    if rotated and not is_supported(geo.head_dim):
        raise ValueError(
            f"layer {rotated[0]} rotates heads of head_dim = {geo.head_dim}, an order no "
            "Hadamard matrix here has: use rotation 'none'"
        )
    context = context_of(geo)
    row = 2 * geo.layers * geo.kv_heads * geo.head_dim * 2  # bytes of one exact token, K and V
    asks = [
        ("residual", scheme.residual, "the residual window of exact tokens"),
        ("sinks_first + sink_budget", scheme.num_sink_slots, "sink slots"),
    ]
    for i, layer in enumerate(scheme.layers):
        for kind in ("key", "value"):
            asks.append((f"layer {i} {kind}_flush", getattr(layer, f"{kind}_flush"), "tokens"))
    for name, n, what in asks:
        if n > context:
            raise ValueError(
                f"{name} = {n} asks for {what} that would take {n * row / 2**30:.3g} GiB per "
                f"sequence, beyond the model's context of {context} tokens: use at most {context}"
            )


def check_params(scheme, params, geo: Geometry) -> None:
    """ValueError unless `params` holds exactly the calibrated tensors `scheme` uses, each
    meaning what it says (see the module docstring)."""
    shape = (geo.kv_heads, geo.head_dim)
    declared = calibrated_names()
    for i, layer in enumerate(scheme.layers):
        for kind in ("key", "value"):
            spec = getattr(layer, kind)
            where = f"layer {i} {kind}"
            need = spec.layout.calibrated(*shape) if spec is not None else {}
            for name, c in declared.items():
                if name.startswith(f"{kind}_"):
                    found = getattr(params, name).get(i)
                    if c.name in _MEANING:
                        _MEANING[c.name](where, spec, found, geo)
                    else:
                        _check_declared(f"layers.{i}.{name}", need.get(c.argument), found)
        if i in params.key_smooth:
            _check_smooth(f"layer {i} key_smooth", params.key_smooth[i], shape)
    for name in (*declared, "key_smooth"):
        if extra := [i for i in getattr(params, name) if not 0 <= i < len(scheme.layers)]:
            raise ValueError(f"{name} of layer {extra[0]}, past the scheme's {len(scheme.layers)}")
    sp = params.sink_predictor
    if sp is not None:
        if not (isinstance(sp.threshold, float | int) and math.isfinite(sp.threshold)):
            raise ValueError(f"sink predictor threshold = {sp.threshold}: use a finite number")
        if sp.threshold < 0:
            raise ValueError(f"sink predictor threshold = {sp.threshold}: |h| is never below 0")
        dims = list(sp.dims)
        if not dims or len(set(dims)) != len(dims) or not all(0 <= d < geo.hidden for d in dims):
            raise ValueError(
                f"sink predictor dims {dims[:8]}: use distinct dims in [0, {geo.hidden})"
            )
        if not 0 <= sp.layer < geo.layers:
            raise ValueError(f"sink predictor layer {sp.layer}: the model has {geo.layers} layers")


def _finite(where: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{where} is {t.dtype}, not a floating tensor")
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{where} holds {bad} NaN or Inf value(s)")


def _given(where: str, wanted: bool, found, scheme: str, given: str) -> None:
    """ValueError unless a calibrated tensor is given (found) exactly when the scheme wants it."""
    if wanted != (found is not None):
        raise ValueError(f"{where}: the scheme {scheme}, but {given} is given for it")


def _check_declared(where: str, need, found) -> None:
    """A calibrated tensor checked by its layout's declaration alone: of the shape the layout
    asks for (need: (shape, dtype), or None: not asked for, and ignored as it always was)."""
    if need is None:
        return
    shape = tuple(need[0])
    if found is None or tuple(found.shape) != shape:
        raise ValueError(f"{where} must have shape {shape}")
    if found.is_floating_point():
        _finite(where, found)


def _check_range(where: str, spec, found, geo: Geometry) -> None:
    shape = (geo.kv_heads, geo.head_dim)
    static = spec is not None and spec.layout.calibrated_range
    scheme = f"is {'' if static else 'not '}'static'"
    _given(where, static, found, scheme, f"{'no' if found is None else 'a'} calibrated range")
    if found is None:
        return
    lo, hi = found
    for end, t in (("lo", lo), ("hi", hi)):
        if tuple(t.shape) != shape:
            raise ValueError(f"{where} range {end} has shape {list(t.shape)}, not {list(shape)}")
        _finite(f"{where} range {end}", t)
    if bool((lo > hi).any()):
        raise ValueError(f"{where} range has lo > hi in {int((lo > hi).sum())} channel(s)")
    if not bool(torch.isfinite(hi.float() - lo.float()).all()):
        raise ValueError(f"{where} range is wider than float32 holds (hi - lo overflows)")


def _check_codebook(where: str, spec, book, geo: Geometry) -> None:
    wanted = spec is not None and spec.codebook
    scheme = f"{'uses a' if wanted else 'has no'} codebook"
    _given(where, wanted, book, scheme, "none" if book is None else "one")
    if book is None:
        return
    try:
        spec.layout.check_codebook(book, geo.kv_heads)
    except ValueError as e:
        raise ValueError(f"{where} {e}") from None
    _finite(f"{where} codebook", book)
    if spec.layout.vectors:  # entries of vectors: no order, any finite coordinates
        return
    if bool((book.diff(dim=-1) < 0).any()):
        raise ValueError(f"{where} codebook levels are not sorted in increasing order")
    low = -1.0 if spec.symmetric else 0.0
    if float(book.min()) < low - _SLACK or float(book.max()) > 1 + _SLACK:
        raise ValueError(
            f"{where} codebook levels span [{float(book.min()):.4g}, {float(book.max()):.4g}], "
            f"outside the normalized domain [{low:g}, 1]"
        )


# what a calibrated tensor's numbers must mean beyond its declaration, by Calibrated.name
_MEANING = {"range": _check_range, "codebook": _check_codebook}


def _check_smooth(where: str, s: torch.Tensor, shape) -> None:
    if tuple(s.shape) != shape:
        raise ValueError(f"{where} has shape {list(s.shape)}, not {list(shape)}")
    _finite(where, s)
    if bool((s <= 0).any()):
        raise ValueError(f"{where} holds {int((s <= 0).sum())} scale(s) <= 0; keys are divided")
    half = shape[1] // 2
    if not torch.equal(s[:, :half], s[:, half:]):
        raise ValueError(
            f"{where} differs between RoPE pair members (j, j + {half}), which RoPE mixes"
        )
