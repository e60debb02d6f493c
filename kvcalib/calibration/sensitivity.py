"""Per-layer sensitivity: how much the output moves when one layer's keys (or values) are
quantized and nothing else is, measured through the Simulator in fake mode.

sensitivity(tensor, layer, bits) = mean over tokens of KL(p_fp || p_q) of the final next-token
distributions, p_q with only that tensor of that layer quantized by its probe quantizer:

    key    "static" per-channel ranges before RoPE (KVQuant's keys), calibrated on non-sink tokens
           with 1% outliers left out of the range; they clamp (no outlier storage); asymmetric,
           uniform levels
    value  "token" granularity, one group per head (KIVI's values), asymmetric, uniform levels
    both   the first token kept exact (sinks_first = 1), no residual window

at 2, 3 and 4 bits, on the first `tokens` tokens of the first `windows` calibration windows
(batched: 2 x 30 layers x 3 widths forwards, the dominant cost of a calibration).
"""

import torch

from kvcalib.sim.hooks import key_module
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.quant import QuantSpec
from kvcalib_runtime.scheme import KVParams, KVScheme, LayerScheme

BITS = (2, 3, 4)
KEY_RANGE_OUTLIERS = 0.01
SINKS_FIRST = 1


def probe(windows: int, tokens: int) -> dict:
    """The probe quantizers as profile.json records them."""
    return {
        "key": {
            "granularity": "static",
            "position": "pre_rope",
            "symmetric": False,
            "range": f"non-sink quantiles, {KEY_RANGE_OUTLIERS:.0%} outliers left out",
            "range_outliers": KEY_RANGE_OUTLIERS,
            "outliers": 0.0,
        },
        "value": {"granularity": "token", "group_size": 0, "symmetric": False},
        "sinks_first": SINKS_FIRST,
        "residual": 0,
        "bits": list(BITS),
        "windows": windows,
        "tokens": tokens,
        "metric": "mean per-token KL(p_fp || p_quantized) of the final logits, mode fake",
    }


def probe_scheme(tensor: str, layer: int, bits: int, num_layers: int) -> KVScheme:
    """A scheme that quantizes only `tensor` ("key" / "value") of `layer` with its probe."""
    key = QuantSpec(bits, "static") if tensor == "key" else None
    value = QuantSpec(bits) if tensor == "value" else None
    layers = tuple(
        LayerScheme(key if i == layer else None, value if i == layer else None, "pre_rope")
        for i in range(num_layers)
    )
    return KVScheme(layers, sinks_first=SINKS_FIRST)


def sensitivity_pass(model, ids: torch.Tensor, key_range, step) -> dict[str, torch.Tensor]:
    """{"sensitivity.key", "sensitivity.value"}: float32 [L, len(BITS)] for ids [B, T];
    key_range = (lo, hi), each [L, Hkv, D], the pre-RoPE probe ranges; `step()` after each
    forward."""

    num_layers = model.config.num_hidden_layers
    out = {}
    with torch.no_grad():
        reference = torch.log_softmax(model(ids).logits.float(), -1)
        for tensor in ("key", "value"):
            kl = torch.zeros(num_layers, len(BITS))
            for layer in range(num_layers):
                params = KVParams()
                if tensor == "key":  # on the layer's device (device_map "auto" spreads them)
                    device = key_module(model, layer).weight.device
                    params.key_range[layer] = tuple(r[layer].to(device) for r in key_range)
                for j, bits in enumerate(BITS):
                    scheme = probe_scheme(tensor, layer, bits, num_layers)
                    logits = Simulator(model, scheme, params, mode="fake")(ids)
                    kl[layer, j] = _kl(reference, torch.log_softmax(logits.float(), -1))
                    step()
            out[f"sensitivity.{tensor}"] = kl
    return out


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """Mean over positions of KL(p || q), both [B, T, V] log-probabilities."""
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
