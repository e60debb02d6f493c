"""The statistics phase: one full-precision forward per window, observed at every layer.

The Simulator (no scheme) hands each layer's AttentionRecord to an observer that copies that
window's keys before RoPE (k_proj / k_norm output), keys after RoPE and values into one buffer
per kind, [L, Hkv, T, D], and feeds the attention weights to the sink meter; an owned forward
hook on every decoder layer copies its output (the residual stream) into a buffer [L, T, E].
When the window's forward ends, the buffers are checked for NaN and Inf (NumericsError naming
the first layer), the sink flags are known, and the buffers update the channel statistics, the
massive-activation meter and the per-position key error. The work after the forward is
vectorized over layers. Nothing is held across windows but the accumulators and the buffers.
"""

import torch

from kvcalib.calibration.massive import Massive, MassiveMeter
from kvcalib.calibration.sinks import SinkMeter
from kvcalib.calibration.stats import ChannelStats
from kvcalib.errors import NumericsError
from kvcalib.hooks import Hooks, decoder_layers, hidden_of
from kvcalib.models import head_dim
from kvcalib_runtime.quant import QuantSpec, fake_quantize

KINDS = ("key_pre_rope", "key_post_rope", "value")
NAMES = {
    "key_pre_rope": "keys before RoPE",
    "key_post_rope": "keys after RoPE",
    "value": "values",
    "residual": "residual stream (decoder layer output)",
}
POSITION_BITS = (2, 4)  # per-token (one group per head) asymmetric, on post-RoPE keys


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """NumericsError naming the first layer (and tensor) holding NaN or Inf; tensors maps a
    description to a [L, ...] tensor, checked in the order given within each layer. (Min and
    max propagate NaN and Inf: one pass, where torch.isfinite(x).all() makes two.)"""
    ok = []
    for x in tensors.values():
        lo, hi = torch.aminmax(x.reshape(len(x), -1), dim=1)
        ok.append(lo.isfinite() & hi.isfinite())
    ok = torch.stack(ok)  # [kinds, L]
    if not ok.all():
        layer = int((~ok).any(0).nonzero()[0])
        what = list(tensors)[int((~ok[:, layer]).nonzero()[0])]
        raise NumericsError(
            f"layer {layer}: NaN or Inf in the {what}; the model's weights hold non-finite "
            "values, or its activations overflow the dtype (calibrate with --dtype float32)"
        )


def position_error(key: torch.Tensor) -> torch.Tensor:
    """Relative error ||k_hat - k|| / ||k|| per position, mean over heads, under per-token
    asymmetric quantization at POSITION_BITS: key [L, Hkv, T, D] -> [len(bits), L, T]."""
    norm = key.norm(dim=-1).clamp_min(torch.finfo(key.dtype).tiny)
    return torch.stack(
        [
            ((fake_quantize(key, QuantSpec(b)) - key).norm(dim=-1) / norm).mean(1)
            for b in POSITION_BITS
        ]
    )


def stats_pass(model, windows: torch.Tensor, settings, step) -> tuple[dict, Massive]:
    """Observe every window of windows [N, T]; `step()` after each. Returns the profile tensors
    of this phase and the massive-activation findings (for the predictor and the report)."""
    from kvcalib.simulate import Simulator

    cfg = model.config
    n, t = windows.shape
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim(cfg))
    stats = {kind: ChannelStats(shape, n * t) for kind in KINDS}
    sinks = SinkMeter(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        t,
        weight=settings.sink_weight,
        ratio=settings.sink_ratio,
        min_layers=settings.sink_layers,
    )
    massive = MassiveMeter(cfg.num_hidden_layers, cfg.hidden_size)
    error = torch.zeros(len(POSITION_BITS), cfg.num_hidden_layers, t, dtype=torch.float64)
    groups = torch.zeros(len(POSITION_BITS), cfg.num_hidden_layers, 3, dtype=torch.float64)
    counts = torch.zeros(3)  # token 0, later sinks, non-sink tokens
    window = {kind: torch.empty(*shape[:2], t, shape[2]) for kind in KINDS}  # [L, Hkv, T, D]
    residual = torch.empty(cfg.num_hidden_layers, t, cfg.hidden_size)  # [L, T, E]

    def observe(record) -> None:
        for kind, x in zip(KINDS, (record.key_pre, record.key, record.value), strict=True):
            window[kind][record.layer].copy_(x[0])
        sinks.observe(record.layer, record.probs[0].cpu())

    def keep_residual(i: int):
        def hook(module, args, output):
            residual[i].copy_(hidden_of(output)[0])

        return hook

    sim = Simulator(model, None, observers=[observe])
    with Hooks(model) as hooks, torch.no_grad():
        for i, layer in enumerate(decoder_layers(model)):
            hooks.forward(layer, keep_residual(i))
        for w in range(n):
            sim(windows[w : w + 1])
            check_finite({**{NAMES[k]: v for k, v in window.items()}, NAMES["residual"]: residual})
            flags = sinks.end_window()
            massive.update(residual)
            for kind in KINDS:
                stats[kind].update(window[kind], flags)
            e = position_error(window["key_post_rope"]).double()  # [bits, L, T]
            error += e
            later = flags.clone()
            later[0] = False
            for g, mask in enumerate((torch.arange(t) == 0, later, ~flags)):
                groups[..., g] += e[..., mask].sum(-1)
                counts[g] += int(mask.sum())
            step()
    out = {f"{kind}.{name}": v for kind in KINDS for name, v in stats[kind].result().items()}
    out.update(sinks.result())
    out["position_error.key"] = (error / n).float()
    out["position_error.key_groups"] = (groups / counts).float()  # NaN: no later sinks
    massive_found = massive.result(settings.massive_ratio)
    out.update(massive_found.tensors())
    return out, massive_found
