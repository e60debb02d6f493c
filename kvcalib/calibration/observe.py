"""The statistics phase: one full-precision forward per window, observed at every layer.

The windows run through the decoder layers of a LayerSource (kvcalib.calibration.layerwise): in
memory window by window, from shards every window through each layer as it is loaded. The Simulator
(no scheme) hands each layer's AttentionRecord to an observer that keeps that window's keys before
RoPE (k_proj / k_norm output), keys after RoPE and values, [Hkv, T, D] each, and feeds the attention
weights to the sink meter. As each layer finishes, its tensors and its output (the residual stream)
are checked for NaN and Inf (NumericsError naming the layer) and the output updates the
massive-activation meter. When a window has been through every layer its sink flags are known, and
its tensors update the channel statistics and the per-position key error, vectorized over layers.
Between layers only the windows in flight are held (their hidden states and tensors), plus the layer
inputs of the gradient windows (gradients.py). The head is never run: the statistics need no logits.
"""

import torch

from kvcalib.calibration.layerwise import ActivationStore, LayerSource
from kvcalib.calibration.massive import Massive, MassiveMeter
from kvcalib.calibration.sinks import SinkMeter
from kvcalib.calibration.stats import ChannelStats
from kvcalib.errors import NumericsError
from kvcalib.sim.hooks import hidden_of
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.layouts.quant import QuantSpec, fake_quantize
from kvcalib_runtime.model.geometry import Geometry

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
    """What the statistics phase keeps across windows, fed window by window (in memory) or layer
    by layer (from shards) in the same calls, so both give the same tensors:

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


def stats_pass(
    lm: LayerSource, windows: torch.Tensor, settings, store: ActivationStore, advance, keep: int = 0
) -> tuple[dict, Massive]:
    """Observe every window of windows [N, T]; `advance(work)` after each window and layer
    (work: the layer's parameters). Keeps ("input", w, i) for every layer i and ("h", w), the
    last layer's output, in `store` for the first `keep` windows (the gradient pass). Returns
    the profile tensors of this phase and the massive-activation findings."""

    n, t = windows.shape
    num_layers = lm.config.num_hidden_layers
    per_load = lm.windows_per_load or n
    acc = StatsAccumulator(lm.config, n, t, settings, open_windows=per_load)
    layer_work, _ = lm.work()
    now = {"window": 0, "slot": 0}
    kv = {}  # the layer just run, [Hkv, T, D] per kind

    def observe(record) -> None:
        for kind, x in zip(KINDS, (record.key_pre, record.key, record.value), strict=True):
            kv[kind] = x[0]
            store.put((kind, now["window"], record.layer), x[0])
        acc.sinks.observe(record.layer, record.probs[0].cpu(), now["slot"])

    sim = Simulator(lm.model, None, observers=[observe])
    with torch.no_grad(), sim.layerwise(windows[:1]):
        for chunk in lm.chunks(n):
            with lm.embedding():
                for w in chunk:
                    hidden, kwargs = lm.inputs(windows[w : w + 1])
                    store.put(("h", w), hidden)
            for i in range(num_layers):
                with lm.layer(i) as layer:
                    for w in chunk:
                        now["window"], now["slot"] = w, w - chunk.start
                        h = store.get(("h", w))
                        if w < keep:
                            store.put(("input", w, i), h)
                        out = hidden_of(layer(h.to(lm.device), **kwargs[i]))
                        acc.layer_done(w, i, kv, out[0])
                        store.put(("h", w), out)
                        advance(layer_work)
            for w in chunk:
                done = {k: [store.pop((k, w, i)) for i in range(num_layers)] for k in KINDS}
                acc.window_done(
                    w - chunk.start, {k: torch.stack(v).float() for k, v in done.items()}
                )
                if w >= keep:
                    store.pop(("h", w))
    return acc.result()
