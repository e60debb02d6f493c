"""A quantized KV cache simulated inside a transformers model, in one forward pass.

    sim = Simulator(model, scheme, params, mode="decode")
    logits = sim(input_ids)                  # [B, T, vocab]; the model is unchanged afterwards

mode "fake":   every position's keys and values are quantized before attention (the QuaRot /
               KVQuant perplexity convention); kept sinks stay exact.
mode "decode": each query sees exactly what a decoding cache holds at its step (the rule in
               kvcalib_runtime.cache.scheme): the residual window and kept sinks exact, everything
               older as the body stores it.

Both modes attend in one pass over every query (kvcalib.sim.attention): through PyTorch's fused
attention, plus in decode mode the band of positions some query still sees exactly (the
residual window and a flush block), a block of queries at a time; with observers, through the
eager reference, which also yields the attention weights they see.

With a sink budget, the predicted sinks are a fixed point: the predictor reads the residual
stream of the quantized model, which depends on which tokens are kept. Each pass runs only up to
the predictor's layer (at most MAX_SINK_PASSES, until the flags repeat); the whole model then runs
once with the sinks the last pass decided.

All quantization goes through kvcalib_runtime.layouts.quant, so what this measures is what the
runtime stores. Smoothing and rotations go through kvcalib_runtime.model.transforms: those the
weights already contain are not applied again, the others are applied before quantization and undone
after it (the same function), and a transform the weights contain but the recipe does not quantize
in is undone first.
"""

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvcalib.errors import ModelError
from kvcalib.sim import attention
from kvcalib.sim.hooks import Hooks, capture_keys, decoder_layers, hidden_of, key_module
from kvcalib_runtime.cache.attention import attention as runtime_attention
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme, quantized_prefix
from kvcalib_runtime.layouts.quant import fake_quantize
from kvcalib_runtime.model.rope import rotate
from kvcalib_runtime.model.transforms import Transforms

ATTENTION = "kvcalib"
MODES = ("fake", "decode")
_ACTIVE: ContextVar["Simulator | None"] = ContextVar("kvcalib_simulator", default=None)
MAX_SINK_PASSES = 3


@dataclass
class AttentionRecord:
    """What an observer sees of one layer's attention in one forward.

    query [B, H, T, D] post-RoPE; key, value [B, Hkv, T, D] exact (key post-RoPE);
    key_pre [B, Hkv, T, D] pre-RoPE; key_hat, value_hat as attention used them where quantized
    (post-RoPE, unrotated), or None; probs [B, Hkv, G, T, T] the attention weights used
    (G = query heads per KV head); sinks bool [B, T] the positions kept exact; key_exact bool
    [B, T] the keys the last query sees exactly (kept sinks, and in decode mode the residual
    window).
    """

    layer: int
    query: torch.Tensor
    key: torch.Tensor
    key_pre: torch.Tensor
    value: torch.Tensor
    key_hat: torch.Tensor | None
    value_hat: torch.Tensor | None
    probs: torch.Tensor
    sinks: torch.Tensor
    key_exact: torch.Tensor


class _EarlyExit(Exception):
    pass


class Simulator:
    """Runs a model with a KVScheme applied to every layer's attention (or none, to observe).

    scheme:    None for full precision (observers still see every layer)
    params:    the calibrated tensors the scheme refers to
    transforms: where each layer's smoothing and rotations are (kvcalib_runtime.model.transforms;
               default: all online, the model's own weights)
    prefill:   decode mode only: the first `prefill` tokens form one prompt chunk that attends
               to itself exactly (as a runtime prefill does); 0 = token-by-token from the start
    observers: callables receiving an AttentionRecord per layer per forward
    """

    def __init__(
        self,
        model,
        scheme: KVScheme | None = None,
        params: KVParams | None = None,
        *,
        mode: str = "fake",
        transforms: Transforms | None = None,
        prefill: int = 0,
        observers=(),
    ):
        if mode not in MODES:
            raise ValueError(f"mode = {mode!r}: use one of {MODES}")
        self.model = model
        self.scheme = scheme
        self.params = params or KVParams()
        self.mode = mode
        if transforms is None and scheme is not None:
            transforms = Transforms.online(scheme, self.params)
        self.transforms = transforms
        self.prefill = prefill
        self.observers = list(observers)
        self.sink_passes = 0
        self._sinks = None
        self._predicted = None
        self._key_pre = {}
        self._rope = {}
        self._bands = {}
        self._attended = set()

    # -- running -------------------------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of the model with this scheme applied."""
        if not self._changes_attention:
            self._sinks = self._first_sinks(input_ids)
            return self.model(input_ids).logits  # the model's own attention: bit-identical
        predictor = self.params.sink_predictor if self._predicts_sinks else None
        if predictor is None:
            self._sinks = self._first_sinks(input_ids)
            return self._forward(input_ids)
        flags = self._predict(input_ids, predictor.layer, quantized=False)
        for self.sink_passes in range(1, MAX_SINK_PASSES + 1):
            self._sinks = self._budget(input_ids, flags)
            predicted = self._predict(input_ids, predictor.layer, quantized=True)
            if torch.equal(predicted, flags):
                break
            flags = predicted  # the quantized pass flags other tokens: decide again
        return self._forward(input_ids)

    @property
    def sinks(self) -> torch.Tensor:
        """bool [B, T]: the positions the last call kept in full precision."""
        return self._sinks

    @property
    def _changes_attention(self) -> bool:
        quantizes = self.scheme is not None and any(
            layer.key or layer.value for layer in self.scheme.layers
        )
        return quantizes or bool(self.observers)

    @property
    def _predicts_sinks(self) -> bool:
        return self.scheme is not None and self.scheme.sink_budget > 0

    def _forward(self, input_ids):
        self._attended.clear()
        with self._active():
            logits = self.model(input_ids).logits
        layers = len(decoder_layers(self.model))
        if len(self._attended) != layers:
            raise ModelError(
                f"model {self.model.config.model_type}: {len(self._attended)} of its {layers} "
                "layers attended through transformers' attention interface, where kvcalib "
                "simulates the cache; it cannot measure this model"
            )
        return logits

    @contextlib.contextmanager
    def layerwise(self, input_ids: torch.Tensor):
        """This simulator in effect for input_ids [B, T] without running the model: for
        kvcalib.calibration.layerwise, which calls the decoder layers one at a time itself (and
        captures their inputs in here, under the kvcalib attention's mask). First-N sinks only:
        a sink predictor needs the full-precision forward up to its layer."""
        if self._predicts_sinks:
            raise ValueError("a sink budget needs the whole model: run the Simulator in memory")
        self._sinks = self._first_sinks(input_ids)
        with self._active():
            yield self

    @contextlib.contextmanager
    def _active(self):
        with Hooks(self.model) as hooks:
            self._install(hooks)
            token = _ACTIVE.set(self)
            try:
                yield
            finally:
                _ACTIVE.reset(token)
                self._key_pre.clear()
                self._rope.clear()
                self._bands.clear()

    @property
    def _needs_pre_rope(self) -> bool:
        """Whether anything reads keys before RoPE: observers, or a pre-RoPE key scheme."""
        return bool(self.observers) or any(
            layer.key is not None and layer.key_position == "pre_rope"
            for layer in (self.scheme.layers if self.scheme is not None else ())
        )

    def _install(self, hooks: Hooks) -> None:
        hooks.attention(ATTENTION)
        layers = decoder_layers(self.model)
        for i, layer in enumerate(layers if self._needs_pre_rope else ()):
            hooks.forward(key_module(self.model, i), capture_keys(self.model, self._key_pre, i))
            hooks.pre_forward(layer.self_attn, self._capture_rope(i))
        if self._predicts_sinks:
            sp = self.params.sink_predictor
            hooks.forward(layers[sp.layer], self._capture_flags)

    def _capture_rope(self, i):
        def hook(module, args, kwargs):
            self._rope[i] = kwargs.get("position_embeddings")  # None: the model has no RoPE

        return hook

    def _capture_flags(self, module, args, output):
        self._predicted = self.params.sink_predictor(hidden_of(output))

    def _predict(self, input_ids, layer: int, *, quantized: bool) -> torch.Tensor:
        """Predictor flags bool [B, T] from a forward that stops after the predictor layer:
        full precision (the model's own attention), or quantized with the current sinks (no
        observers: they see the final forward only)."""

        def stop(module, args, output):
            self._capture_flags(module, args, output)
            raise _EarlyExit

        observers, self.observers = self.observers, [] if quantized else self.observers
        try:
            with contextlib.ExitStack() as stack:
                if quantized:
                    stack.enter_context(self._active())
                hooks = stack.enter_context(Hooks(self.model))
                hooks.forward(decoder_layers(self.model)[layer], stop)
                with contextlib.suppress(_EarlyExit):
                    self.model(input_ids)
        finally:
            self.observers = observers
        return self._predicted.to(input_ids.device)  # layers may sit on other GPUs

    def _first_sinks(self, input_ids) -> torch.Tensor:
        b, t = input_ids.shape
        first = self.scheme.sinks_first if self.scheme else 0
        return (torch.arange(t, device=input_ids.device) < first).expand(b, t)

    def _budget(self, input_ids, flags) -> torch.Tensor:
        """First-N sinks plus the earliest `sink_budget` predicted ones after them."""
        first = self._first_sinks(input_ids)
        extra = flags & ~first
        extra &= extra.cumsum(-1) <= self.scheme.sink_budget
        return first | extra

    # -- attention -----------------------------------------------------------------------------

    def attend(self, module, query, key, value, attention_mask, scaling, softcap=None):
        """transformers' attention interface; softcap: Gemma 2's attention-score cap, applied
        to the scaled scores as cap * tanh(s / cap)."""
        i = module.layer_idx
        self._attended.add(i)
        layer = self.scheme.layers[i] if self.scheme is not None else None
        b, hkv, t, d = key.shape
        sinks = self._sinks.to(key.device)  # a model spread over GPUs (device_map "auto")
        key_hat = self._key_hat(i, layer, key, sinks) if layer and layer.key else None
        value_hat = self._value_hat(i, layer, value, sinks) if layer and layer.value else None
        keep = sinks[:, None, :, None]
        key_q = key if key_hat is None else torch.where(keep, key, key_hat)
        value_q = value if value_hat is None else torch.where(keep, value, value_hat)
        bands = None
        if self.mode == "decode" and (key_hat is not None or value_hat is not None):
            bands = self._rule(t, layer, sinks.device)
        q = query.view(b, hkv, -1, t, d)
        args = (q, key, value, key_q, value_q, attention_mask, scaling, bands)
        seen = []
        if bands is None:  # every position as key_q / value_q hold it: the one attention
            observe = seen.append if self.observers else None
            out = runtime_attention(
                query, key_q, value_q, attention_mask, scaling=scaling, softcap=softcap,
                observer=observe,
            )  # fmt: skip
            probs = seen[0].view(b, hkv, -1, t, t) if seen else None
        elif not self.observers and softcap is None:
            out = attention.fused(*args)
        else:
            out, probs = attention.reference(*args, softcap=softcap)
        if self.observers:
            exact = sinks
            if self.mode == "decode" and layer is not None and layer.key is not None:
                last = quantized_prefix(torch.tensor(t - 1), self.scheme.residual, layer.key_flush)
                exact = sinks | (torch.arange(t, device=sinks.device) >= last.to(sinks.device))
            record = AttentionRecord(
                i, query, key, self._key_pre[i], value, key_hat, value_hat, probs, sinks, exact
            )
            for observe in self.observers:
                observe(record)
        return out.reshape(b, -1, t, d).transpose(1, 2).contiguous(), None

    def _rule(self, t: int, layer: LayerScheme, device) -> attention.Bands:
        """Decode mode's bands of exact positions (kvcalib.sim.attention.bands) for a layer's
        flush blocks; cached per forward."""
        cached = (t, layer.key and layer.key_flush, layer.value and layer.value_flush, device)
        if cached not in self._bands:
            pos = torch.arange(t, device=device)

            def prefix(flush: int) -> torch.Tensor:
                n_q = quantized_prefix(pos, self.scheme.residual, flush)
                return torch.where(pos < self.prefill, 0, n_q) if self.prefill else n_q

            n_key = prefix(layer.key_flush) if layer.key else None
            n_value = prefix(layer.value_flush) if layer.value else None
            self._bands[cached] = attention.bands(n_key, n_value, t)
        return self._bands[cached]

    def _key_hat(self, i: int, layer: LayerScheme, key, sinks):
        """The keys attention uses where quantized: post-RoPE, in the weights' domain."""
        spec, p, t = layer.key, self.params, self.transforms
        kwargs = {"exclude": sinks, "codebook": p.key_codebook.get(i), "split": p.key_split.get(i)}
        if i in p.key_range:
            kwargs["static_range"] = tuple(r[None, :, None, :] for r in p.key_range[i])
        pre = layer.key_position == "pre_rope"
        x = t.key_rotate(i, t.key_in(i, self._key_pre[i] if pre else key, p))
        x_hat = t.key_out(i, t.key_rotate(i, fake_quantize(x, spec, **kwargs), inverse=True), p)
        if pre and self._rope[i] is not None:
            cos, sin = (c.unsqueeze(1) for c in self._rope[i])
            x_hat = rotate(x_hat, cos, sin)
        return x_hat

    def _value_hat(self, i: int, layer: LayerScheme, value, sinks):
        """The values attention uses where quantized, in the weights' domain."""
        spec, p, t = layer.value, self.params, self.transforms
        kwargs = {
            "exclude": sinks,
            "codebook": p.value_codebook.get(i),
            "split": p.value_split.get(i),
        }
        if i in p.value_range:
            kwargs["static_range"] = tuple(r[None, :, None, :] for r in p.value_range[i])
        return t.value_out(i, fake_quantize(t.value_in(i, value), spec, **kwargs))


def _attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs
):
    sim = _ACTIVE.get()
    assert sim is not None, "the kvcalib attention runs only inside a Simulator"
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return sim.attend(module, query, key, value, attention_mask, scaling, softcap)


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, eager_mask)
