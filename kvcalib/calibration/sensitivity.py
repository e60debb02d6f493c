"""Per-layer sensitivity: how much the model's predictions suffer when only one layer's keys (or
values) are quantized, at every probed bit width — what bit allocation (kvcalib.core.plan) spends
on.

Each tensor is quantized by its probe quantizer:

    key    "static" per-channel ranges before RoPE (KVQuant's keys), calibrated on non-sink tokens
           with 1% outliers left out of the range; they clamp (no outlier storage); asymmetric,
           uniform levels
    value  "token" granularity, one group per head (KIVI's values), asymmetric, uniform levels

at BITS (8 bits too, so that allocation can spend on the few layers whose keys need it), and
the damage is measured one of two ways (`kvcalib calibrate --sensitivity`):

    fisher  (default; KVQuant's sensitivity, Hooper et al. 2024) from the loss gradients g of
            the gradient pass (gradients.py), which the codebooks use too, so it costs nothing
            of its own: sensitivity(tensor, layer, bits) = 1/2 sum over non-sink tokens of
            g^2 (x - Q_bits(x))^2, per predicted token — the second-order (Fisher) estimate of
            the mean per-token KL(p_fp || p_quantized) with that tensor of that layer quantized,
            for every width at once (x: pre-RoPE keys, values; g of the window's summed
            next-token loss). The same estimate on the retrieval prompts (retrieval.py), g of
            their answer tokens' loss and the sum over their context, is one answer-loss
            sensitivity ("sensitivity.answer.*", Settings(answer_sensitivity="fisher")): per
            answer token, where the text's weighs every token of prose alike. By default the
            answer loss is measured instead, with these quantizers (answerprobe.py).
    probe   the KL itself: mean per-token KL(p_fp || p_q) of the final logits, p_q with only that
            tensor of that layer quantized through the Simulator (fake mode, the first token kept
            exact), on the first `tokens` tokens of the first `windows` windows, batched. Layer by
            layer: every probe branches off an unquantized stream at its layer and continues
            unquantized from there (2 x BITS x layers branches, each through the head).
"""

import torch

from kvcalib.calibration.layerwise import ActivationStore, LayerSource
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.layouts.quant import QuantSpec, fake_quantize

BITS = (2, 3, 4, 8)
METHODS = ("fisher", "probe")
TENSORS = ("key", "value")
KEY_RANGE_OUTLIERS = 0.01
SINKS_FIRST = 1  # the probe keeps the first token exact


def describe(method: str, windows: int, tokens: int) -> dict:
    """The sensitivity measurement as profile.json records it (its "probe" entry)."""
    out = {
        "method": method,
        "key": {
            "granularity": "static",
            "position": "pre_rope",
            "symmetric": False,
            "range": f"non-sink quantiles, {KEY_RANGE_OUTLIERS:.0%} outliers left out",
            "range_outliers": KEY_RANGE_OUTLIERS,
            "outliers": 0.0,
        },
        "value": {"granularity": "token", "group_size": 0, "symmetric": False},
        "bits": list(BITS),
        "windows": windows,
        "tokens": tokens,
    }
    if method == "fisher":
        out["sinks"] = "ground-truth sink tokens left out"
        out["metric"] = (
            "1/2 sum of g^2 (x - Q(x))^2 over non-sink tokens per predicted token, g the "
            "gradient of the summed next-token loss: the Fisher estimate of the mean per-token "
            "KL(p_fp || p_quantized)"
        )
    else:
        out["sinks_first"] = SINKS_FIRST
        out["residual"] = 0
        out["metric"] = "mean per-token KL(p_fp || p_quantized) of the final logits, mode fake"
    return out


class FisherSensitivity:
    """Accumulates the Fisher sensitivity of every layer, window and width from the gradient
    pass (a consumer of gradients.gradient_pass).

    key_range (lo, hi), each [L, Hkv, D]: the pre-RoPE probe ranges; counted bool [W, T]: the
    positions whose keys and values the first W windows sum over (prose: every non-sink token;
    retrieval prompts: the context, predicted sinks left out); predicted: how many tokens the
    windows' loss predicts in all (the per-token normalization); `name` prefixes the result's
    tensors ("sensitivity", or "sensitivity.answer" for the retrieval prompts' answer loss)."""

    def __init__(self, key_range, counted: torch.Tensor, predicted: int, name="sensitivity"):
        self.lo, self.hi = (r.float().cpu() for r in key_range)
        self.counted, self.predicted, self.name = counted, predicted, name
        self.sums = torch.zeros(len(TENSORS), len(self.lo), len(BITS), dtype=torch.float64)
        self.seen = set()

    def add(self, window: int, layer: int, x: dict, g: dict) -> None:
        """One window and layer: x and g as gradients.fisher_layer gives them, [Hkv, T, D]."""
        if window >= len(self.counted):
            return
        self.seen.add(window)
        keep = self.counted[window]
        ranges = (self.lo[layer][:, None, :], self.hi[layer][:, None, :])
        specs = {"key": lambda b: QuantSpec(b, "static"), "value": lambda b: QuantSpec(b)}
        for t, (tensor, source) in enumerate((("key", "pre"), ("value", "value"))):
            v, weight = x[source][:, keep], g[source][:, keep].square()
            kwargs = {"static_range": ranges} if tensor == "key" else {}
            for j, bits in enumerate(BITS):
                error = v - fake_quantize(v, specs[tensor](bits), **kwargs)
                self.sums[t, layer, j] += float((weight * error.square()).double().sum())

    def result(self) -> dict[str, torch.Tensor]:
        """{name.key, name.value}: float32 [L, len(BITS)]."""
        assert len(self.seen) == len(self.counted), "every counted window went through"
        return {
            f"{self.name}.{tensor}": (self.sums[t] / (2 * self.predicted)).float()
            for t, tensor in enumerate(TENSORS)
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


def probe_work(lm: LayerSource) -> float:
    """What `probe_pass` costs, in the units its `advance` counts: parameters run per token."""
    layer, head = lm.work()
    n = lm.config.num_hidden_layers
    probes = len(TENSORS) * len(BITS)
    forwards = sum(2 + probes * (1 + i) for i in range(n))  # reference, plain, branches so far
    return layer * forwards + head * (1 + probes * n)


def probe_pass(
    lm: LayerSource, ids: torch.Tensor, key_range, store: ActivationStore, advance
) -> dict[str, torch.Tensor]:
    """{"sensitivity.key", "sensitivity.value"}: float32 [L, len(BITS)], the probe's KL for
    ids [B, T]; key_range = (lo, hi), each [L, Hkv, D], the pre-RoPE probe ranges. Streams: a
    reference (the model's own attention), an unquantized one through the kvcalib attention,
    and per probe a branch with its layer quantized that continues unquantized; then each
    branch through the head for its KL to the reference."""

    num_layers = lm.config.num_hidden_layers
    dev = lm.device
    layer_work, head_work = lm.work()
    plain = Simulator(lm.model)  # the kvcalib attention, nothing quantized
    with torch.no_grad():
        own = lm.layer_kwargs(*ids.shape)  # the model's own attention: the reference
        with plain.layerwise(ids):
            kwargs = lm.layer_kwargs(*ids.shape)
        with lm.embedding():
            hidden, _ = lm.inputs(ids)
        store.put("reference", hidden)
        store.put("plain", hidden)
        branches = []  # (tensor, layer, bits index), each a stream in the store
        for i in range(num_layers):
            with lm.layer(i) as layer:
                store.put("reference", layer(store.get("reference").to(dev), **own[i]))
                x = store.get("plain").to(dev)
                for tensor in TENSORS:
                    params = KVParams()
                    if tensor == "key":
                        params.key_range[i] = tuple(r[i].to(dev) for r in key_range)
                    for j, bits in enumerate(BITS):
                        probe = probe_scheme(tensor, i, bits, num_layers)
                        with Simulator(lm.model, probe, params, mode="fake").layerwise(ids):
                            store.put((tensor, i, j), layer(x, **kwargs[i]))
                with plain.layerwise(ids):
                    for branch in branches:
                        store.put(branch, layer(store.get(branch).to(dev), **kwargs[i]))
                    store.put("plain", layer(x, **kwargs[i]))
                advance(layer_work * (2 + len(TENSORS) * len(BITS) + len(branches)))
                branches += [(tensor, i, j) for tensor in TENSORS for j in range(len(BITS))]
        store.pop("plain")
        kl = {tensor: torch.zeros(num_layers, len(BITS)) for tensor in TENSORS}
        with lm.head():
            reference = torch.log_softmax(lm.logits(store.pop("reference")).float(), -1)
            advance(head_work)
            for tensor, i, j in branches:
                logits = lm.logits(store.pop((tensor, i, j)))
                kl[tensor][i, j] = _kl(reference, torch.log_softmax(logits.float(), -1))
                advance(head_work)
    return {f"sensitivity.{tensor}": v for tensor, v in kl.items()}


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """Mean over positions of KL(p || q), both [B, T, V] log-probabilities."""
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
