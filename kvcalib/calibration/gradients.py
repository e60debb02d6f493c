"""The gradient pass: the loss gradient of every layer's keys and values, layer by layer.

For each gradient window (the first windows of the calibration set, whose layer inputs and last
hidden state the statistics pass kept in the store): the gradient of the window's LM loss
(summed next-token cross-entropy) with respect to the last hidden state, through the head; then
from the last layer down, the layer's forward recomputed from its kept input under autograd
(full precision, the kvcalib attention) and autograd.grad of its output, with the gradient from
the layer above as grad_outputs, for its input, its pre-RoPE keys, keys and values. That is the
whole model's backward computed a layer at a time (its own graph, layer by layer), so it runs on
weights read from the shards as well as in memory.

The retrieval prompts of the answer-loss sensitivity (retrieval.py) take the same pass with a
loss of their answer tokens alone (`window_loss`'s targets); `keep_inputs`, a plain forward,
leaves their layer inputs where the statistics pass leaves the text windows'.

Every (window, layer) goes to each consumer as `consumer.add(window, layer, x, g)`: the
activations and their gradients, "pre" (keys before RoPE), "key" (after RoPE) and "value",
float32 [Hkv, T, D] on the CPU. The consumers are the codebooks' Fisher-weighted histograms
(codebooks.Codebooks) and the Fisher sensitivity (sensitivity.FisherSensitivity): one backward
serves both.
"""

import torch

from kvcalib.calibration.layerwise import ActivationStore, LayerSource
from kvcalib.calibration.observe import check_finite
from kvcalib.sim.hooks import Hooks, hidden_of, key_module
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.model.geometry import Geometry

KINDS = ("pre", "key", "value")
BACKWARD = 3  # a recomputed forward and its backward cost about three forwards


def work(lm: LayerSource, windows: int) -> float:
    """What `gradient_pass` costs, in the units its `advance` counts: parameters run."""
    layer, head = lm.work()
    return BACKWARD * windows * (head + lm.config.num_hidden_layers * layer)


def window_loss(
    logits: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor | None = None
) -> torch.Tensor:
    """The LM loss whose gradients are the Fisher weights: summed next-token cross-entropy of
    one window, logits [1, T, V], ids [1, T]; targets bool [T]: the tokens whose prediction
    counts (a retrieval prompt's answer), None: every token after the first."""
    loss = torch.nn.functional.cross_entropy(
        logits[0, :-1].float(), ids[0, 1:].to(logits.device), reduction="none"
    )
    return (loss if targets is None else loss[targets[1:].to(loss.device)]).sum()


def fisher_layer(d: int, acts: tuple, grads: tuple) -> tuple[dict, dict]:
    """One layer's activations and their loss gradients, (x, g), each {"pre", "key", "value"}
    float32 [Hkv, T, D] on the CPU: acts and grads are (pre, key, value) as attention saw them
    (pre [1, T, Hkv * D] or [1, T, Hkv, D], key and value [1, Hkv, T, D])."""

    def tensors(p, k, v) -> dict:
        pre = p.detach().reshape(p.shape[1], -1, d).transpose(0, 1)
        out = {"pre": pre, "key": k[0].detach(), "value": v[0].detach()}
        return {name: x.float().cpu() for name, x in out.items()}

    return tensors(*acts), tensors(*grads)


def keep_inputs(
    lm: LayerSource, ids: torch.Tensor, store: ActivationStore | None, advance, predictor
) -> torch.Tensor:
    """A plain forward of windows ids [N, T] (the kvcalib attention, nothing observed) that
    leaves in `store` what the gradient pass reads: ("input", w, i) for every layer i and
    ("h", w). Returns the windows' predicted sinks, bool [N, T]: `predictor` (profile.json's
    sink_predictor, or None: no later sinks) on the residual stream after its layer. `store`
    None: the sinks alone, from a forward that stops at the predictor's layer."""
    n, t = ids.shape
    sinks = torch.zeros(n, t, dtype=torch.bool)
    layer_work, _ = lm.work()
    layers = lm.config.num_hidden_layers
    if store is None:
        layers = predictor["layer"] + 1 if predictor is not None else 0
    streams = store if store is not None else ActivationStore()  # in memory, dropped after
    with torch.no_grad(), Simulator(lm.model, None).layerwise(ids[:1]):
        for chunk in lm.chunks(n) if layers else ():
            with lm.embedding():
                for w in chunk:
                    hidden, kwargs = lm.inputs(ids[w : w + 1])
                    streams.put(("h", w), hidden)
            for i in range(layers):
                with lm.layer(i) as layer:
                    for w in chunk:
                        h = streams.get(("h", w))
                        if store is not None:
                            store.put(("input", w, i), h)
                        out = hidden_of(layer(h.to(lm.device), **kwargs[i]))
                        if predictor is not None and i == predictor["layer"]:
                            dims = torch.tensor(predictor["dims"], device=out.device)
                            peak = out[0].index_select(-1, dims).abs().amax(-1)
                            sinks[w] = (peak > predictor["threshold"]).cpu()
                        streams.put(("h", w), out)
                        advance(layer_work)
    return sinks


def gradient_pass(
    lm: LayerSource, ids: torch.Tensor, store: ActivationStore, consumers, advance, targets=None
) -> None:
    """Hand every consumer the activations and loss gradients of windows ids [N, T], whose
    ("input", w, i) for every layer i and ("h", w) the statistics pass (or `keep_inputs`) left
    in `store` (this pass takes them out); targets bool [N, T] or None: the tokens each window's
    loss predicts (`window_loss`); `advance(work)` after each step (see `work`)."""

    n, t = ids.shape
    num_layers = lm.config.num_hidden_layers
    d, dev = Geometry.from_config(lm.config).head_dim, lm.device
    layer_work, head_work = lm.work()
    seen = {}

    def observe(record) -> None:
        seen["key"], seen["value"] = record.key, record.value

    def keep_pre(module, args, output):
        seen["pre"] = output  # the tensor attention reads; a view of it would get no gradient

    sim = Simulator(lm.model, None, observers=[observe])
    grad = {}
    with torch.enable_grad(), sim.layerwise(ids[:1]):
        kwargs = lm.layer_kwargs(1, t)
        for chunk in lm.chunks(n):
            with lm.head():
                for w in chunk:
                    h = store.pop(("h", w)).to(dev).requires_grad_()
                    counted = None if targets is None else targets[w]
                    loss = window_loss(lm.logits(h), ids[w : w + 1], counted)
                    (grad[w],) = torch.autograd.grad(loss, h)
                    advance(BACKWARD * head_work)
            for i in reversed(range(num_layers)):
                with lm.layer(i) as layer, Hooks(lm.model) as hooks:
                    hooks.forward(key_module(lm.model, i), keep_pre)
                    for w in chunk:
                        h = store.pop(("input", w, i)).to(dev).requires_grad_()
                        out = hidden_of(layer(h, **kwargs[i]))
                        acts = (seen["pre"], seen["key"], seen["value"])
                        grads = torch.autograd.grad(out, (h, *acts), grad_outputs=grad[w])
                        grad[w] = grads[0]
                        x, g = fisher_layer(d, acts, grads[1:])
                        check_finite(
                            {f"loss gradient of the {k} activations": g[k][None] for k in KINDS},
                            i,
                        )
                        for consumer in consumers:
                            consumer.add(w, i, x, g)
                        seen.clear()
                        advance(BACKWARD * layer_work)
            for w in chunk:
                del grad[w]
