"""The statistics phase: one full-precision forward per window, observed at every layer.

The Simulator (no scheme) hands each layer's AttentionRecord to an observer that copies that
window's keys before RoPE (k_proj / k_norm output), keys after RoPE and values into one buffer
per kind, [L, Hkv, T, D], and feeds the attention weights to the sink meter; an owned forward
hook on every decoder layer hands its output (the residual stream) to the accumulator.
As each layer finishes, its slice of the buffers and its output are checked for NaN and Inf
(NumericsError naming the layer) and the output updates the massive-activation meter. When the
window's forward ends the sink flags are known, and the buffers update the channel statistics
and the per-position key error, vectorized over layers. Nothing is held across windows but the
accumulators and the buffers. `StatsAccumulator` is shared with the layer-by-layer pass
(sequential.py), which feeds it the same tensors in another order.
"""

import torch

from kvcalib.calibration.massive import Massive, MassiveMeter
from kvcalib.calibration.sinks import SinkMeter
from kvcalib.calibration.stats import ChannelStats
from kvcalib.errors import NumericsError
from kvcalib.sim.hooks import Hooks, decoder_layers, hidden_of
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.geometry import Geometry
from kvcalib_runtime.quant import QuantSpec, fake_quantize

KINDS = ("key_pre_rope", "key_post_rope", "value")
NAMES = {
    "key_pre_rope": "keys before RoPE",
    "key_post_rope": "keys after RoPE",
    "value": "values",
    "residual": "residual stream (decoder layer output)",
}
POSITION_BITS = (2, 4)  # per-token (one group per head) asymmetric, on post-RoPE keys


def check_finite(tensors: dict[str, torch.Tensor], first: int = 0) -> None:
    """NumericsError naming the first layer (and tensor) holding NaN or Inf; tensors maps a
    description to a [L, ...] tensor whose index 0 is layer `first`, checked in the order given
    within each layer. (Min and max propagate NaN and Inf: one pass, where
    torch.isfinite(x).all() makes two.)"""
    ok = []
    for x in tensors.values():
        lo, hi = torch.aminmax(x.reshape(len(x), -1), dim=1)
        ok.append(lo.isfinite() & hi.isfinite())
    ok = torch.stack(ok)  # [kinds, L]
    if not ok.all():
        layer = int((~ok).any(0).nonzero()[0])
        what = list(tensors)[int((~ok[:, layer]).nonzero()[0])]
        raise NumericsError(
            f"layer {first + layer}: NaN or Inf in the {what}; the model's weights hold "
            "non-finite values, or its activations overflow the dtype (calibrate with "
            "--dtype float32)"
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


class StatsAccumulator:
    """What the statistics phase keeps across windows, fed in the same calls by the in-memory
    pass (below) and the layer-by-layer one (sequential.py), so both give the same tensors:

        layer_done(window, layer, kv, hidden)   after each layer of each window (any order
                                                that keeps windows in order within a layer)
        window_done(window, kv)                 once per window, every layer done, in order
        result()                                the profile tensors and the massive findings

    `open_windows` is how many windows may be open at once (their sink weights are held).
    """

    def __init__(self, cfg, num_windows: int, seq_len: int, settings, open_windows: int = 1):
        layers, t = cfg.num_hidden_layers, seq_len
        shape = (layers, cfg.num_key_value_heads, Geometry.from_config(cfg).head_dim)
        self.seq_len = t
        self.stats = {kind: ChannelStats(shape, num_windows * t) for kind in KINDS}
        self.sinks = SinkMeter(
            layers,
            cfg.num_attention_heads,
            t,
            weight=settings.sink_weight,
            ratio=settings.sink_ratio,
            min_layers=settings.sink_layers,
            windows=open_windows,
        )
        self.massive = MassiveMeter(layers, cfg.hidden_size)
        self.massive_ratio = settings.massive_ratio
        self.error = torch.zeros(len(POSITION_BITS), layers, t, dtype=torch.float64)
        self.groups = torch.zeros(len(POSITION_BITS), layers, 3, dtype=torch.float64)
        self.counts = torch.zeros(3)  # token 0, later sinks, non-sink tokens
        self.windows = 0

    def layer_done(self, window: int, layer: int, kv: dict, hidden: torch.Tensor) -> None:
        """kv[kind] [Hkv, T, D] (any float dtype) and the layer's output hidden [T, E]: checked
        for NaN and Inf, the residual stream measured."""
        h = hidden.detach().to("cpu", torch.float32)
        check_finite(
            {**{NAMES[k]: kv[k].cpu()[None] for k in KINDS}, NAMES["residual"]: h[None]}, layer
        )
        self.massive.add(window, layer, h)

    def window_done(self, window: int, kv: dict) -> None:
        """kv[kind] float32 [L, Hkv, T, D] of the window (`window` < open_windows): its sink
        flags decide which tokens the channel statistics count as sinks."""
        t = self.seq_len
        flags = self.sinks.end_window(window)
        for kind in KINDS:
            self.stats[kind].update(kv[kind], flags)
        e = position_error(kv["key_post_rope"]).double()  # [bits, L, T]
        self.error += e
        later = flags.clone()
        later[0] = False
        for g, mask in enumerate((torch.arange(t) == 0, later, ~flags)):
            self.groups[..., g] += e[..., mask].sum(-1)
            self.counts[g] += int(mask.sum())
        self.windows += 1

    def result(self) -> tuple[dict, Massive]:
        out = {
            f"{kind}.{name}": v for kind in KINDS for name, v in self.stats[kind].result().items()
        }
        out.update(self.sinks.result())
        out["position_error.key"] = (self.error / self.windows).float()
        # NaN where no later sinks
        out["position_error.key_groups"] = (self.groups / self.counts).float()
        massive = self.massive.result(self.massive_ratio)
        out.update(massive.tensors())
        return out, massive


def stats_pass(model, windows: torch.Tensor, settings, step) -> tuple[dict, Massive]:
    """Observe every window of windows [N, T]; `step()` after each. Returns the profile tensors
    of this phase and the massive-activation findings (for the predictor and the report)."""

    cfg = model.config
    n, t = windows.shape
    acc = StatsAccumulator(cfg, n, t, settings)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, t, Geometry.from_config(cfg).head_dim)
    window = {kind: torch.empty(shape) for kind in KINDS}  # [L, Hkv, T, D]
    current = [0]

    def observe(record) -> None:
        for kind, x in zip(KINDS, (record.key_pre, record.key, record.value), strict=True):
            window[kind][record.layer].copy_(x[0])
        acc.sinks.observe(record.layer, record.probs[0].cpu())

    def done(i: int):
        def hook(module, args, output):
            kv = {kind: window[kind][i] for kind in KINDS}
            acc.layer_done(current[0], i, kv, hidden_of(output)[0])

        return hook

    sim = Simulator(model, None, observers=[observe])
    with Hooks(model) as hooks, torch.no_grad():
        for i, layer in enumerate(decoder_layers(model)):
            hooks.forward(layer, done(i))
        for w in range(n):
            current[0] = w
            sim(windows[w : w + 1])
            acc.window_done(0, window)
            step()
    return acc.result()
