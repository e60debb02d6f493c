"""What a quantized KV cache stores, per layer, and the rule for when a token gets quantized.

A `KVScheme` is the resolved, per-layer form of a recipe: what `kvcalib.json` records and what
both the cache and kvcalib's one-pass simulation obey. `KVParams` holds the calibrated tensors
a scheme refers to (static ranges, codebooks, the sink predictor).

The decode rule. The cache keeps the most recent tokens in full precision (the residual window,
R tokens) and moves older ones into the quantized body in blocks of F tokens (the flush block,
per tensor). When the token at position t attends, the body holds positions [0, n_q(t)):

    n_q(t) = min(F * ceil(max(0, t + 1 - R) / F), t)

so the residual holds between R - F + 1 and R tokens, the current token is always exact, and
with F = R keys are flushed R at a time (KIVI's keys) while F = 1 slides one token at a time
(KIVI's values). Sink tokens — the first `sinks_first` positions, and up to `sink_budget`
positions flagged by the sink predictor when they are flushed — stay in full precision; the body
excludes them from its group ranges. A prompt prefilled in one chunk attends to itself in full
precision and to the body as it stood before the chunk.
"""

import dataclasses
import math
from dataclasses import asdict, dataclass

import torch

from kvcalib_runtime.checkpoint.closed import closed
from kvcalib_runtime.layouts.base import Calibrated, calibrated_tensors
from kvcalib_runtime.layouts.quant import QuantSpec

KEY_POSITIONS = ("pre_rope", "post_rope")
# QuantSpec fields newer than the side-car's format version 3, written only when they differ
# from this value: a scheme that does not use them reads in a runtime that predates them.
LATER_FIELDS = {"slot_code": "exact", "pairing": "adjacent", "metadata_code": "dtype"}


@dataclass(frozen=True)
class LayerScheme:
    """One layer's keys and values.

    key, value:      how each is quantized, or None for full precision
    key_position:    "pre_rope" (RoPE applied after dequantization) or "post_rope"
    key_rotation:    online Hadamard on queries and keys after RoPE (QuaRot); not fusable
    value_rotation:  Hadamard per KV head, fused into v_proj rows and o_proj columns
    key_flush, value_flush: tokens moved from the residual window to the body at a time
    """

    key: QuantSpec | None
    value: QuantSpec | None
    key_position: str = "post_rope"
    key_rotation: bool = False
    value_rotation: bool = False
    key_flush: int = 1
    value_flush: int = 1

    def __post_init__(self):
        _typed(self, (("key_flush", int), ("value_flush", int)))
        _typed(self, (("key_rotation", bool), ("value_rotation", bool)))
        for name in ("key", "value"):
            if not isinstance(getattr(self, name), QuantSpec | None):
                raise ValueError(f"{name} = {getattr(self, name)!r} must be a QuantSpec or None")
        if self.key_position not in KEY_POSITIONS:
            raise ValueError(f"key_position = {self.key_position!r}: use one of {KEY_POSITIONS}")
        if self.key_rotation and self.key_position != "post_rope":
            raise ValueError("the online key rotation acts after RoPE: use key_position post_rope")
        for name, spec, flush in (
            ("key", self.key, self.key_flush),
            ("value", self.value, self.value_flush),
        ):
            if flush < 1:
                raise ValueError(f"{name} flush = {flush} must be >= 1")
            if spec is not None and flush % spec.layout.token_group():
                raise ValueError(
                    f"{name} flush = {flush} must be a multiple of its token group "
                    f"({spec.layout.token_group()}), so that flushed blocks hold whole groups"
                )


@dataclass(frozen=True)
class KVScheme:
    """A whole model's cache: one LayerScheme per decoder layer plus the shared token rules."""

    layers: tuple[LayerScheme, ...]
    residual: int = 0
    sinks_first: int = 0
    sink_budget: int = 0
    rotation_seed: int | None = None

    def __post_init__(self):
        _typed(self, (("layers", tuple), ("residual", int), ("sinks_first", int)))
        _typed(self, (("sink_budget", int),))
        if self.rotation_seed is not None:
            _typed(self, (("rotation_seed", int),))
        if self.residual < 0 or self.sinks_first < 0 or self.sink_budget < 0:
            raise ValueError("residual, sinks_first and sink_budget must be >= 0")
        if self.rotation_seed is not None and not 0 <= self.rotation_seed < 2**63:
            raise ValueError(f"rotation_seed = {self.rotation_seed}: use an integer in [0, 2**63)")
        for i, layer in enumerate(self.layers):
            for name, spec, flush in (
                ("key", layer.key, layer.key_flush),
                ("value", layer.value, layer.value_flush),
            ):
                if spec is None:
                    continue
                if self.residual == 0 and flush != 1:
                    raise ValueError(
                        f"layer {i} {name}: with no residual window tokens are quantized one at "
                        f"a time: set flush = 1 (is {flush}) or residual >= flush"
                    )
                if self.residual and flush > self.residual:
                    raise ValueError(
                        f"layer {i} {name}: flush = {flush} exceeds the residual window "
                        f"{self.residual}: use flush <= residual"
                    )

    @property
    def num_sink_slots(self) -> int:
        return self.sinks_first + self.sink_budget

    def to_json(self) -> dict:
        return {
            "residual": self.residual,
            "sinks_first": self.sinks_first,
            "sink_budget": self.sink_budget,
            "rotation_seed": self.rotation_seed,
            "layers": [_layer_json(layer) for layer in self.layers],
        }

    @classmethod
    def from_json(cls, obj: dict) -> "KVScheme":
        """`to_json`'s shape: ValueError (or TypeError) naming the path of an unknown or
        missing key, or of a value its type refuses."""
        fields = [f.name for f in dataclasses.fields(cls)]
        obj = closed(obj, fields, "scheme", required=fields)
        if not isinstance(obj["layers"], list):
            raise ValueError("scheme.layers must be a list")
        layers = tuple(
            _layer_from_json(layer, f"scheme.layers[{i}]") for i, layer in enumerate(obj["layers"])
        )
        return cls(**{**obj, "layers": layers})


def _layer_json(layer: "LayerScheme") -> dict:
    obj = asdict(layer)
    for name in ("key", "value"):
        if obj[name] is not None:
            obj[name] = {
                k: v for k, v in obj[name].items() if k not in LATER_FIELDS or v != LATER_FIELDS[k]
            }
    return obj


def _typed(obj, fields) -> None:
    """ValueError unless each field holds its type (an int is never a bool, nor a bool an int)."""
    for name, kind in fields:
        v = getattr(obj, name)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ValueError(f"{name} = {v!r} must be {kind.__name__}")


def _layer_from_json(obj: dict, where: str) -> LayerScheme:
    fields = [f.name for f in dataclasses.fields(LayerScheme)]
    obj = dict(closed(obj, fields, where, required=("key", "value")))
    specs = [f.name for f in dataclasses.fields(QuantSpec)]
    for name in ("key", "value"):
        if obj[name] is not None:
            obj[name] = QuantSpec(**closed(obj[name], specs, f"{where}.{name}", ("bits",)))
    return LayerScheme(**obj)


def quantized_prefix(t: torch.Tensor, residual: int, flush: int) -> torch.Tensor:
    """n_q(t): how many leading positions are in the quantized body when position t attends."""
    over = (t + 1 - residual).clamp_min(0)
    return torch.minimum((over + flush - 1) // flush * flush, t)


def quantized_prefix_int(t: int, residual: int, flush: int) -> int:
    return min(math.ceil(max(0, t + 1 - residual) / flush) * flush, t)


def body_slots(
    spec: QuantSpec | None, flush: int, residual: int, window: int | None, context: int
) -> int:
    """Body slots of one layer's keys or values in a cache of `context` positions per sequence.

    Global attention keeps every position (slot t = position t). A sliding window of W (a query
    at p sees p - W < j <= p) keeps a ring, position t in slot t % slots: W exact slots for a
    tensor left in full precision; none when the window never reaches the quantized body
    (W <= R - F + 1: the residual ring always holds the last W positions); else W, at least one
    flush block F, rounded up to whole token groups (a layout's `token_group`). Never more than
    `context`.
    """
    if window is None:
        return context
    if spec is None:
        return min(window, context)
    if window <= residual - flush + 1:
        return 0
    group = spec.layout.token_group()
    return min(-(-max(window, flush) // group) * group, context)


@dataclass(frozen=True)
class SinkPredictor:
    """Flags a token as an attention sink when max over `dims` of |h| exceeds `threshold`, h being
    the residual stream after decoder layer `layer` (massive activations, Sun et al. 2024)."""

    layer: int
    dims: tuple[int, ...]
    threshold: float

    def __call__(self, hidden: torch.Tensor, dims: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., T, hidden_size] -> bool [..., T]. dims: `self.dims` as a LongTensor on
        hidden's device, when the caller keeps one (no host-to-device copy per call)."""
        if dims is None:
            dims = torch.tensor(self.dims, device=hidden.device)
        return hidden.index_select(-1, dims).abs().amax(-1) > self.threshold


def calibrated_names() -> dict[str, Calibrated]:
    """KVParams' per-layer tables of the layouts' declared calibrated tensors: "key_range",
    "value_range", "key_codebook", ... -> the declaration (layouts.base.Calibrated), read from
    the registry when called (a layout registered later is included)."""
    return {
        f"{kind}_{c.name}": c for c in calibrated_tensors().values() for kind in ("key", "value")
    }


@dataclass(init=False)
class KVParams:
    """Calibrated tensors, per layer index (absent when the scheme needs none).

    tables: {name: {layer: tensor}} for each calibrated tensor a layout declares
        (`calibrated_names`), read and written as attributes of that name:
      key_range / value_range: (lo, hi), each float [Hkv, D], static per-channel ranges
      key_codebook / value_codebook: float [L] or [Hkv, L], sorted normalized levels ("vq":
                  float [1 or Hkv, L, w], entries of vectors of w channels)
      key_split / value_split: int64 [Hkv, n_o], the outlier set's channels per KV head of a
          "turboquant" spec with split_channels = n_o
    key_smooth: float [Hkv, D], keys are divided by it and queries multiplied (RoPE-pair equal)
    """

    tables: dict[str, dict[int, object]]
    key_smooth: dict[int, torch.Tensor]
    sink_predictor: SinkPredictor | None

    def __init__(self, tables=None, key_smooth=None, sink_predictor=None, **named):
        """named: a declared table by its name (key_range={0: (lo, hi)}); TypeError for a name
        no layout declares."""
        tables = {**(tables or {}), **named}
        declared = calibrated_names()
        if unknown := sorted(set(tables) - set(declared)):
            raise TypeError(f"KVParams: {unknown[0]!r} is no declared calibrated tensor")
        object.__setattr__(self, "tables", {n: dict(tables.get(n, {})) for n in declared})
        self.key_smooth = dict(key_smooth or {})
        self.sink_predictor = sink_predictor

    def __getattr__(self, name: str):  # only for names that are not attributes
        if name != "tables" and name in calibrated_names():
            return self.tables.setdefault(name, {})
        raise AttributeError(f"KVParams has no {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in calibrated_names():
            self.tables[name] = value
        else:
            object.__setattr__(self, name, value)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat safetensors names: layers.{i}.key_range_lo, ..., layers.{i}.value_split,
        sink_predictor.dims."""
        out = {f"layers.{i}.key_smooth": t for i, t in self.key_smooth.items()}
        for name, c in calibrated_names().items():  # what the layouts declare (layouts.base)
            for i, t in getattr(self, name).items():
                ends = zip(("_lo", "_hi"), t, strict=True) if c.pair else [("", t)]
                out.update({f"layers.{i}.{name}{end}": part for end, part in ends})
        if self.sink_predictor is not None:
            sp = self.sink_predictor
            out["sink_predictor.dims"] = torch.tensor(sp.dims, dtype=torch.int64)
            out["sink_predictor.threshold"] = torch.tensor([sp.threshold], dtype=torch.float32)
            out["sink_predictor.layer"] = torch.tensor([sp.layer], dtype=torch.int64)
        return {k: v.contiguous() for k, v in out.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "KVParams":
        params = cls()
        for name, t in tensors.items():
            if name.startswith("sink_predictor."):
                continue
            _, i, key = name.split(".", 2)
            i = int(i)
            if key.endswith(("_lo", "_hi")):
                base, end = key[:-3], key[-2:]
                lo, hi = getattr(params, base).get(i, (None, None))
                getattr(params, base)[i] = (t, hi) if end == "lo" else (lo, t)
            else:
                getattr(params, key)[i] = t
        if "sink_predictor.dims" in tensors:
            params.sink_predictor = SinkPredictor(
                layer=int(tensors["sink_predictor.layer"][0]),
                dims=tuple(int(d) for d in tensors["sink_predictor.dims"]),
                threshold=float(tensors["sink_predictor.threshold"][0]),
            )
        return params
