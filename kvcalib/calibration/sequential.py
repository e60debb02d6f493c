"""Calibration layer by layer (`kvcalib calibrate --sequential`): run.py's three phases on a
kvcalib.layerwise.LayerwiseModel, each decoder layer read from the shards once per phase, every
window run through it, then freed. The profile equals the in-memory one bit for bit
(tests/toolkit/test_sequential.py): the same layers run on the same inputs, and feed the same
accumulators (observe.StatsAccumulator, codebooks.Codebooks) the same tensors.

  stats        Each window's hidden state [1, T, E] is kept between layers. A layer's keys
               before and after RoPE and values of every window are kept until the last layer
               has run, because which tokens are sinks (they are left out of the non-sink
               statistics) is known only then; then each window goes to the accumulator as the
               in-memory pass hands it over. The inputs of the codebook windows to every layer
               and their last hidden state are kept for the codebook phase: its forward is this
               one (full precision, the kvcalib attention, one window at a time).
  sensitivity  A reference stream (the model's own attention), an unquantized stream through
               the kvcalib attention, and at each layer j, per tensor and bits, a branch with
               layer j quantized by its probe that continues unquantized to the last layer;
               then each branch through the head for its KL to the reference. Half the layer
               forwards of the in-memory pass, which reruns layers < j for every probe.
  codebooks    Backward layer by layer: the loss gradient of the last hidden state from the
               head; then from the last layer down, the layer's forward recomputed from its kept
               input under autograd, and autograd.grad of its output (grad_outputs: the gradient
               from the layer above) for its input, pre-RoPE keys, keys and values. These are
               the Fisher weights of the in-memory backward, computed a layer at a time.

Memory: one layer's weights (or the embedding, or the head) plus the ActivationStore: during the
statistics phase N windows x L layers x 3 of [Hkv, T, D] in the model dtype, N hidden states,
and the codebook windows' layer inputs [1, T, E]; during the sensitivity phase 6 L + 2 streams
[B, T, E]; during the codebook phase 6 float32 [Hkv, T, D] per codebook window and layer.
`--offload-dir` keeps the store in files instead of memory.
"""

import torch

from kvcalib.calibration.codebooks import (
    Codebooks,
    fisher_layer,
    stack_fisher,
    variants,
    window_loss,
)
from kvcalib.calibration.observe import KINDS, StatsAccumulator
from kvcalib.calibration.sensitivity import BITS, _kl, probe_scheme
from kvcalib.sim.hooks import Hooks, key_module
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.geometry import Geometry
from kvcalib_runtime.scheme import KVParams

TENSORS = ("key", "value")
FISHER = ("x.pre", "x.key", "x.value", "g.pre", "g.key", "g.value")


def steps(num_windows: int, num_layers: int, code_windows: int) -> dict[str, int]:
    """Progress steps of each phase: one per window and layer (sensitivity: per probe)."""
    return {
        "stats": num_windows * num_layers,
        "sensitivity": len(TENSORS) * len(BITS) * num_layers,
        "codebooks": code_windows * num_layers,
    }


def stats_pass(lm, windows: torch.Tensor, settings, step, store, keep: int = 0):
    """observe.stats_pass layer by layer: windows [N, T]; `step()` per window and layer. Keeps
    ("input", w, i) and ("h", w) in `store` for the first `keep` windows (codebook_pass)."""

    n, t = windows.shape
    num_layers = lm.config.num_hidden_layers
    acc = StatsAccumulator(lm.config, n, t, settings, open_windows=n)
    now = {"window": 0}
    kv = {}  # the layer just run, [Hkv, T, D] per kind

    def observe(record) -> None:
        w = now["window"]
        for kind, x in zip(KINDS, (record.key_pre, record.key, record.value), strict=True):
            kv[kind] = x[0]
            store.put((kind, w, record.layer), x[0])
        acc.sinks.observe(record.layer, record.probs[0].cpu(), w)

    sim = Simulator(lm.model, None, observers=[observe])
    with torch.no_grad():
        with lm.embedding():
            for w in range(n):
                with sim.layerwise(windows[w : w + 1]):
                    hidden, kwargs = lm.inputs(windows[w : w + 1])
                store.put(("h", w), hidden)
        for i in range(num_layers):
            with lm.layer(i) as layer:
                for w in range(n):
                    now["window"] = w
                    h = store.get(("h", w))
                    if w < keep:
                        store.put(("input", w, i), h)
                    with sim.layerwise(windows[w : w + 1]):
                        out = layer(h.to(lm.device), **kwargs[i])
                    acc.layer_done(w, i, kv, out[0])
                    store.put(("h", w), out)
                    step()
        for w in range(n):
            layers = {k: [store.pop((k, w, i)) for i in range(num_layers)] for k in KINDS}
            acc.window_done(w, {k: torch.stack(v).float() for k, v in layers.items()})
            if w >= keep:
                store.pop(("h", w))
    return acc.result()


def sensitivity_pass(lm, ids: torch.Tensor, key_range, step, store) -> dict[str, torch.Tensor]:
    """sensitivity.sensitivity_pass layer by layer, for ids [B, T]; `step()` per probe."""

    num_layers = lm.config.num_hidden_layers
    dev = lm.device
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
                        step()
                with plain.layerwise(ids):
                    for branch in branches:
                        store.put(branch, layer(store.get(branch).to(dev), **kwargs[i]))
                    store.put("plain", layer(x, **kwargs[i]))
                branches += [(tensor, i, j) for tensor in TENSORS for j in range(len(BITS))]
        store.pop("plain")
        kl = {tensor: torch.zeros(num_layers, len(BITS)) for tensor in TENSORS}
        with lm.head():
            reference = torch.log_softmax(lm.logits(store.pop("reference")).float(), -1)
            for tensor, i, j in branches:
                logits = lm.logits(store.pop((tensor, i, j)))
                kl[tensor][i, j] = _kl(reference, torch.log_softmax(logits.float(), -1))
    return {f"sensitivity.{tensor}": v for tensor, v in kl.items()}


def codebook_pass(
    lm, ids, sinks, quantiles, bins: int, step, store, wanted=None
) -> dict[str, torch.Tensor]:
    """codebooks.codebook_pass layer by layer, for windows ids [N, T] whose layer inputs
    stats_pass(keep=N) left in `store`; `step()` per window and layer."""

    n, t = ids.shape
    num_layers, d, dev = (
        lm.config.num_hidden_layers,
        Geometry.from_config(lm.config).head_dim,
        lm.device,
    )
    books = Codebooks(variants(lm, wanted), num_layers, bins)
    seen = {}

    def observe(record) -> None:
        seen["key"], seen["value"] = record.key, record.value

    def keep_pre(module, args, output):
        seen["pre"] = output  # the tensor attention reads; a view of it would get no gradient

    sim = Simulator(lm.model, None, observers=[observe])
    with sim.layerwise(ids[:1]):
        kwargs = lm.layer_kwargs(1, t)
    grad = {}
    with torch.enable_grad():
        with lm.head():
            for w in range(n):
                h = store.pop(("h", w)).to(dev).detach().requires_grad_()
                (grad[w],) = torch.autograd.grad(window_loss(lm.logits(h), ids[w : w + 1]), h)
        for i in reversed(range(num_layers)):
            with lm.layer(i) as layer, Hooks(lm.model) as hooks:
                hooks.forward(key_module(lm.model, i), keep_pre)
                for w in range(n):
                    h = store.pop(("input", w, i)).to(dev).detach().requires_grad_()
                    with sim.layerwise(ids[w : w + 1]):
                        out = layer(h, **kwargs[i])
                    acts = (seen["pre"], seen["key"], seen["value"])
                    grads = torch.autograd.grad(out, (h, *acts), grad_outputs=grad[w])
                    grad[w] = grads[0]
                    for name, x in fisher_layer(d, acts, grads[1:]).items():
                        store.put((name, w, i), x)
                    seen.clear()
                    step()
    for w in range(n):
        layers = [{name: store.pop((name, w, i)) for name in FISHER} for i in range(num_layers)]
        books.add(*stack_fisher(layers), sinks[w], quantiles)
    return books.result()
