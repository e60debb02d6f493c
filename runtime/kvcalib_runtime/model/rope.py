"""Rotary position embedding (RoPE) in Hugging Face's "rotate_half" layout.

Channel i of a head is rotated together with channel i + r/2 by the angle
position * inv_freq[i], over the first r = rotary_dim channels (r = head_dim unless the config
has a `partial_rotary_factor`, Phi-3's partial rotary; the other channels pass unrotated):

    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]

`inv_freq` follows transformers' `modeling_rope_utils` for the rope types the runtime supports:
"default" (1 / theta^(2i/r)), "linear" (default / factor) and "llama3" (Llama 3.1's
wavelength-dependent scaling, `_compute_llama3_parameters`). Other types are refused.

Gemma 3 has one parameter set per layer type (local layers theta 1e4, global 1e6):
transformers 5 writes `rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}`,
older configs `rope_theta` (global, with `rope_scaling`) and `rope_local_base_freq` (local).
`rope_parameters(config, layer_type)` reads every form; `Geometry.rope` holds them per layer.
"""

import math

import torch

from kvcalib_runtime.errors import FormatError

ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_THETA = 10_000.0
BY_LAYER_TYPE = ("full_attention", "sliding_attention")


def rope_parameters(config: dict, layer_type: str = "full_attention") -> dict:
    """The RoPE parameters of an HF config dict for layers of `layer_type`, transformers-5 style.

    Reads `rope_parameters` (transformers 5; a dict per layer type for Gemma 3) or the legacy
    `rope_scaling` + `rope_theta` (+ `rope_local_base_freq`) keys; always returns a dict with
    `rope_type`, `rope_theta` and `partial_rotary_factor`.
    """
    raw = config.get("rope_parameters")
    if isinstance(raw, dict) and any(t in raw for t in BY_LAYER_TYPE):
        params = dict(raw.get(layer_type) or raw.get("full_attention") or {})
    elif layer_type == "sliding_attention" and config.get("rope_local_base_freq") is not None:
        params = {"rope_theta": config["rope_local_base_freq"]}  # scaling is for global layers
    else:
        params = dict(raw or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    for key, default in (("rope_theta", DEFAULT_THETA), ("partial_rotary_factor", 1.0)):
        if params.get(key) is None:  # unset or null; 0 stays, for Geometry to refuse
            params[key] = default if config.get(key) is None else config[key]
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] along the last dim (channel i pairs with i + n/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by cos/sin [..., r] (broadcast against x) on its first r channels; the
    other D - r pass unrotated (partial rotary). Computes in the dtype of x, cos and sin."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :r], x[..., r:]
    return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)


class Rope:
    """RoPE of one parameter set: frequencies computed once, cos/sin per forward.

    rotary_dim: r, the leading channels of a head that rotate (head_dim, or fewer under a
               partial_rotary_factor)
    inv_freq:  float32 [r/2], on the device of the last positions seen
    scaling:   multiplier of cos and sin (transformers' `attention_scaling`); 1.0 for every
               supported rope type, kept so the formula reads like the reference
    """

    def __init__(self, config: dict, head_dim: int, layer_type: str = "full_attention"):
        """config: the HF config dict (its RoPE keys); head_dim: the channels of a head;
        layer_type: whose parameters, where the config has one set per layer type."""
        self._build(rope_parameters(config, layer_type), head_dim)

    @classmethod
    def from_params(cls, params: dict, head_dim: int) -> "Rope":
        """From `rope_parameters`' dict (one of `Geometry.rope`)."""
        rope = cls.__new__(cls)
        rope._build(params, head_dim)
        return rope

    def _build(self, params: dict, head_dim: int) -> None:
        rope_type = params["rope_type"]
        if rope_type not in ROPE_TYPES:
            raise FormatError(
                f"rope_type {rope_type!r} in config.json is not supported: use one of {ROPE_TYPES}"
            )
        factor = params["partial_rotary_factor"]
        dim = int(head_dim * factor)
        if not 0 < dim <= head_dim or dim % 2:
            raise FormatError(
                f"partial_rotary_factor = {factor} in config.json rotates {dim} of {head_dim} "
                "channels: RoPE needs an even number of channels, at least 2"
            )
        self.head_dim, self.rotary_dim = head_dim, dim
        exponents = torch.arange(0, dim, 2, device="cpu").float() / dim  # CPU even under meta
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        self.rope_type = rope_type
        self.inv_freq = inv_freq
        self.scaling = 1.0
        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def partial(self) -> bool:
        """Whether some channels of a head pass unrotated."""
        return self.rotary_dim < self.head_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every angle: positions LongTensor[B, T] -> 2 x float32 [B, T, r].

        Every layer of one forward passes the same positions tensor, so the last result is
        memoized by the tensor's identity.
        """
        if self._memo is not None and self._memo[0] is positions:
            return self._memo[1], self._memo[2]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, r/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, r]
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        self._memo = (positions, cos, sin)
        return cos, sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [B, heads, T, D] at positions LongTensor[B, T]; fp32 math, x's dtype out."""
        cos, sin = self.cos_sin(positions)
        return rotate(x.float(), cos[:, None], sin[:, None]).to(x.dtype)  # cos [B, 1, T, r]


def layer_ropes(params: tuple[dict, ...], head_dim: int) -> list[Rope]:
    """One Rope per layer from `Geometry.rope`; layers with equal parameters share one object
    (its cos/sin memo then serves all of them)."""
    shared = {}
    for p in params:
        shared.setdefault(repr(sorted(p.items())), Rope.from_params(p, head_dim))
    return [shared[repr(sorted(p.items()))] for p in params]
