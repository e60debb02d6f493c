"""The one parser of a model config's shapes: every other module asks `Geometry`.

    geo = Geometry.from_config(config)        # an HF config.json dict, or a transformers config
    geo.layers, geo.kv_heads, geo.head_dim, geo.group, geo.windows[i], geo.rope[i], geo.arch

Sizes must be positive integers (JSON `true` is not an integer), whole KV-head groups, an even
head_dim (RoPE rotates channel pairs); the numbers the forward divides by, raises to powers or
takes roots of must be finite and in range (`_check_numbers`: rms_norm_eps, every layer type's
rope_theta and scaling factors, Gemma's query_pre_attn_scalar and soft-caps); anything else is a
FormatError naming the key. Sliding
windows come from `layer_types` ("sliding_attention" / "full_attention") with `sliding_window`,
or, without `layer_types`, from the family's pattern (Gemma 2: every 2nd layer global, Gemma 3:
every 6th, or `sliding_window_pattern`), Mistral's `sliding_window` on every layer and Qwen2's
`use_sliding_window` on the layers from `max_window_layers` on. A layer with window w attends,
from position p, to the keys at positions p - w < j <= p (transformers' sliding mask). RoPE
parameters are per layer type (`rope.rope_parameters`): Gemma 3's local and global bases.
"""

import math
from dataclasses import dataclass

from kvcalib_runtime.errors import FormatError
from kvcalib_runtime.model import archs
from kvcalib_runtime.model.rope import rope_parameters

CONFIG = "config.json"
LAYER_TYPES = ("full_attention", "sliding_attention")


def _as_dict(config) -> dict:
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise FormatError(f"{CONFIG}: expected a JSON object, not {type(config).__name__}")


def _size(config: dict, key: str, default: int | None = None) -> int:
    v = config.get(key)
    if v is None and default is not None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise FormatError(
            f"{CONFIG}: {key} = {v!r}; expected a positive integer: use the model's own value"
        )
    return v


@dataclass(frozen=True)
class Geometry:
    """Shapes of a decoder-only model.

    layers, hidden, heads, kv_heads, head_dim, vocab, intermediate: the config's sizes
    max_position:  the context the model was trained for (None when the config has none)
    windows:       per layer, the sliding-window length, or None for global attention
    rope:          per layer, the RoPE parameters (`rope.rope_parameters`: rope_type,
                   rope_theta, partial_rotary_factor, ...); their numbers checked here, the
                   rope_type where a Rope is built
    arch:          the architecture table's entry (archs.ARCHITECTURES), or None when the
                   model_type is not one the runtime serves
    """

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    max_position: int | None
    windows: tuple[int | None, ...]
    rope: tuple[dict, ...]
    arch: archs.Arch | None

    @classmethod
    def from_config(cls, config) -> "Geometry":
        """FormatError when a size is missing, not a positive integer, or inconsistent."""
        config = _as_dict(config)
        model_type = config.get("model_type")
        if not isinstance(model_type, str):
            raise FormatError(f"{CONFIG}: model_type = {model_type!r}; expected a string")
        if archs.lookup(model_type) is None and "num_attention_heads" not in config:
            raise FormatError(
                f"{CONFIG}: model_type {model_type!r} names its sizes its own way (no "
                "num_attention_heads): kvcalib reads Llama-style configs; the architecture table "
                f"has {archs.supported()}"
            )
        heads, hidden = _size(config, "num_attention_heads"), _size(config, "hidden_size")
        kv_heads = _size(config, "num_key_value_heads", heads)
        if config.get("head_dim") is None and hidden % heads:
            raise FormatError(
                f"{CONFIG}: hidden_size {hidden} is not a multiple of {heads} attention heads "
                "and there is no head_dim: use the model's own sizes"
            )
        head_dim = _size(config, "head_dim", hidden // heads)
        if heads % kv_heads:
            raise FormatError(
                f"{CONFIG}: num_attention_heads = {heads} is not a multiple of "
                f"num_key_value_heads = {kv_heads}: use the model's own head counts"
            )
        if head_dim % 2:
            raise FormatError(
                f"{CONFIG}: head_dim = {head_dim} is odd; RoPE needs pairs: use the model's own"
            )
        layers = _size(config, "num_hidden_layers")
        max_position = (
            _size(config, "max_position_embeddings")
            if config.get("max_position_embeddings") is not None
            else None
        )
        arch = archs.lookup(model_type)
        windows = _windows(config, layers, arch)
        types = ["full_attention" if w is None else "sliding_attention" for w in windows]
        rope = tuple(rope_parameters(config, t) for t in types)
        _check_numbers(config, arch, dict(zip(types, rope, strict=True)))
        return cls(
            model_type=model_type,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=_size(config, "vocab_size"),
            intermediate=_size(config, "intermediate_size"),
            max_position=max_position,
            windows=windows,
            rope=rope,
            arch=arch,
        )

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def partial_rotary(self) -> bool:
        """Whether RoPE leaves some channels of a head unrotated (phi3's partial rotary)."""
        return any(p["partial_rotary_factor"] != 1.0 for p in self.rope)

    def require_arch(self) -> archs.Arch:
        """The architecture entry, or a FormatError listing the supported families."""
        if self.arch is None:
            raise FormatError(
                f"{CONFIG}: model_type {self.model_type!r} is not supported (supported: "
                f"{archs.supported()})"
            )
        return self.arch


# The config's numbers the forward divides by, raises to powers or takes roots of, and what it
# does with them. rms_norm_eps defaults to 1e-6 when unset; Gemma's are off when unset or null.
NUMBERS = {"rms_norm_eps": "RMSNorm takes 1/sqrt(mean square + eps)"}
GEMMA_NUMBERS = {
    "query_pre_attn_scalar": "queries are scaled by sqrt(head_dim / it)",
    "attn_logit_softcapping": "scores are capped to cap * tanh(s / cap)",
    "final_logit_softcapping": "logits are capped to cap * tanh(x / cap)",
}
ROPE_NUMBERS = {  # per rope_type, RoPE's parameters: key -> (use, the key it must exceed)
    "default": {"rope_theta": ("RoPE raises it to powers", None)},
    "linear": {"factor": ("RoPE divides its frequencies by it", None)},
    "llama3": {
        "factor": ("RoPE divides its low frequencies by it", None),
        "low_freq_factor": ("RoPE divides the old context by it", None),
        "high_freq_factor": ("RoPE divides by it minus low_freq_factor", "low_freq_factor"),
        "original_max_position_embeddings": ("RoPE divides it by the frequency factors", None),
    },
}


def _number(key: str, value, why: str, above: float = 0.0, name: str | None = None) -> None:
    """FormatError unless `value` is a finite number > `above` (the value of key `name`)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and value > above):
        bound = f"> {name} ({above:g})" if name else "> 0"
        raise FormatError(f"{CONFIG}: {key} = {value!r}; {why}: use a finite number {bound}")


def _check_numbers(config: dict, arch: archs.Arch | None, ropes: dict[str, dict]) -> None:
    """FormatError for a number of `config`, or of a layer type's RoPE parameters (`ropes`:
    layer type -> rope.rope_parameters), that would make the forward divide by zero, take a
    root or power of a negative, or compute with NaN or Inf."""
    for key, why in NUMBERS.items():
        if key in config:
            _number(key, config[key], why)
    for key, why in GEMMA_NUMBERS.items() if arch is not None and arch.gemma else ():
        if config.get(key) is not None:
            _number(key, config[key], why)
    for layer_type, params in ropes.items():
        where = f" ({layer_type} layers)" if len(ropes) > 1 else ""
        factor = params["partial_rotary_factor"]
        _number(f"partial_rotary_factor{where}", factor, "RoPE rotates that share of a head")
        if factor > 1:
            raise FormatError(
                f"{CONFIG}: partial_rotary_factor{where} = {factor!r}; RoPE rotates that share "
                "of a head: use a number in (0, 1]"
            )
        rules = {**ROPE_NUMBERS["default"], **ROPE_NUMBERS.get(params["rope_type"], {})}
        for key, (why, name) in rules.items():  # `name` is checked before the key above it
            label = key if key == "rope_theta" else f"rope_parameters.{key}"
            _number(f"{label}{where}", params.get(key), why, params[name] if name else 0.0, name)


def _windows(config: dict, layers: int, arch: archs.Arch | None) -> tuple[int | None, ...]:
    """Per layer: the sliding window, or None (see the module docstring)."""
    types = config.get("layer_types")
    window = config.get("sliding_window")
    if types is None and window is not None and arch is not None and arch.sliding_every:
        every = config.get("sliding_window_pattern", arch.sliding_every)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise FormatError(f"{CONFIG}: sliding_window_pattern = {every!r}; expected an integer")
        types = [LAYER_TYPES[bool((i + 1) % every)] for i in range(layers)]
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise FormatError(f"{CONFIG}: layer_types must list one type per layer ({layers})")
        if any(t not in LAYER_TYPES for t in types):
            raise FormatError(f"{CONFIG}: layer_types holds a type outside {LAYER_TYPES}")
        if "sliding_attention" in types:
            window = _size(config, "sliding_window")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if window is None or config.get("use_sliding_window") is False:
        return (None,) * layers
    window = _size(config, "sliding_window")
    if config.get("use_sliding_window"):  # Qwen2: layers below max_window_layers are global
        first = config.get("max_window_layers", 0)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise FormatError(f"{CONFIG}: max_window_layers = {first!r}; expected an integer")
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers
