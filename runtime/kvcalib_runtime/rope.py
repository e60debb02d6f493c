"""Rotary position embedding (RoPE) in Hugging Face's "rotate_half" layout.

Channel i of a head is rotated together with channel i + D/2 by the angle
position * inv_freq[i mod D/2]:

    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]

`inv_freq` follows transformers' `modeling_rope_utils` for the rope types the runtime supports:
"default" (1 / theta^(2i/D)), "linear" (default / factor) and "llama3" (Llama 3.1's
wavelength-dependent scaling, `_compute_llama3_parameters`). Other types are refused.
"""

import math

import torch

from kvcalib_runtime.errors import FormatError

ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_THETA = 10_000.0


def rope_parameters(config: dict) -> dict:
    """The RoPE parameters of an HF config dict, transformers-5 style.

    Reads `rope_parameters` (transformers 5) or the legacy `rope_scaling` + `rope_theta` keys;
    always returns a dict with `rope_type` and `rope_theta`.
    """
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta") or DEFAULT_THETA)
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
    """[x1, x2] -> [-x2, x1] along the last dim (channel i pairs with i + D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope:
    """RoPE of one model: frequencies computed once from the config, cos/sin per forward.

    inv_freq:  float32 [D/2], on the device of the last positions seen
    scaling:   multiplier of cos and sin (transformers' `attention_scaling`); 1.0 for every
               supported rope type, kept so the formula reads like the reference
    """

    def __init__(self, config: dict, head_dim: int):
        """config: the HF config dict (its RoPE keys); head_dim: the channels of a head."""
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type not in ROPE_TYPES:
            raise FormatError(
                f"rope_type {rope_type!r} in config.json is not supported: use one of {ROPE_TYPES}"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise FormatError(
                f"partial_rotary_factor = {params['partial_rotary_factor']} is not supported: "
                "the runtime rotates whole heads"
            )
        self.head_dim = dim = head_dim
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

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every angle: positions LongTensor[B, T] -> 2 x float32 [B, T, D].

        Every layer of one forward passes the same positions tensor, so the last result is
        memoized by the tensor's identity.
        """
        if self._memo is not None and self._memo[0] is positions:
            return self._memo[1], self._memo[2]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        self._memo = (positions, cos, sin)
        return cos, sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [B, heads, T, D] at positions LongTensor[B, T]; fp32 math, x's dtype out."""
        cos, sin = self.cos_sin(positions)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
        xf = x.float()
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
