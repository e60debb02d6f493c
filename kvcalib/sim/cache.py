"""`QuantizedKVCache` (`kvcalib.QuantizedKVCache`): any kvcalib recipe, or a converted folder's
side-car, as a transformers `Cache` for `model.generate`. Given a model and its tokenizer,

    import kvcalib
    model, tokenizer = kvcalib.load_model("smollm2-135m")  # or a local folder, or a hub id

three lines generate through a 2-bit cache:

    cache = kvcalib.QuantizedKVCache.from_recipe(model, "kivi-2", max_len=4096)
    ids = tokenizer("def fib(n):", return_tensors="pt").input_ids
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32, do_sample=False)

A recipe that needs calibration (kvcalib-*, kvquant-*) takes `profile=` (a Profile or its
folder). A converted folder: load it in transformers (its weights carry the fused rotations),
then `QuantizedKVCache.from_checkpoint(model, folder, max_len=...)`. transformers 5.25 also
names the argument `cache=` and warns that `past_key_values=` goes in 6.0; both reach this cache.

Storage and the decode rule are kvcalib_runtime's `QuantizedCache` (its reference path), so
what generation sees here is what the runtime serves and what `kvcalib eval --mode decode`
simulates. The cache hooks the model while it is open — capturing pre-RoPE keys, handing the
sink predictor its residual stream and committing each forward — only in forwards that pass
this cache (any other forward leaves it as it was); `close()`, or leaving a `with` block,
removes the hooks.
"""

import contextlib

from transformers.cache_utils import Cache, CacheLayerMixin

from kvcalib.core.plan import plan_for_model
from kvcalib.core.profile import Profile
from kvcalib.errors import ModelError
from kvcalib.sim.hooks import Hooks, capture_keys, decoder_layers, hidden_of, key_module
from kvcalib_runtime.cache.kvcache import QuantizedCache
from kvcalib_runtime.cache.scheme import KVParams, KVScheme
from kvcalib_runtime.checkpoint.format import read_checkpoint
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.rope import layer_ropes
from kvcalib_runtime.model.transforms import Transforms


class _Layer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, owner: "QuantizedKVCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.max_len


class QuantizedKVCache(Cache):
    """A transformers cache storing keys and values as a KVScheme says.

    model:      the transformers model it serves (hooks are attached while the cache is open)
    transforms: where each layer's smoothing and rotations are (kvcalib_runtime.model.transforms;
                default: all online, the model's own weights)
    max_len:    tokens per sequence the cache pre-allocates
    """

    def __init__(
        self,
        model,
        scheme: KVScheme,
        params: KVParams | None = None,
        transforms: Transforms | None = None,
        *,
        max_len: int,
        batch: int = 1,
    ):
        cfg = model.config
        geo = Geometry.from_config(cfg)
        self.model, self.scheme, self.max_len = model, scheme, max_len
        self.params = params or KVParams()
        self.ropes = layer_ropes(geo.rope, geo.head_dim)
        param = next(model.parameters())
        self.store = QuantizedCache(
            scheme,
            self.params,
            transforms or Transforms.online(scheme, self.params),
            num_layers=geo.layers,
            batch=batch,
            kv_heads=geo.kv_heads,
            head_dim=geo.head_dim,
            max_len=max_len,
            device=param.device,
            dtype=param.dtype,
            use_kernels=False,  # transformers attends itself: the reference path stores alone
            keep_dequantized=True,  # every forward reads the whole history: extend it, same bits
        )
        self._key_pre = {}
        self._active = False  # whether the forward under way passes this cache
        self._hooks = Hooks(model)
        layers = decoder_layers(model)
        self._hooks.pre_forward(model.model, self._activate)
        for i in range(len(layers)):
            capture = capture_keys(model, self._key_pre, i)
            self._hooks.forward(key_module(model, i), self._when_active(capture))
        sp = self.params.sink_predictor
        if sp is not None and scheme.sink_budget:
            self._hooks.forward(layers[sp.layer], self._when_active(self._observe(sp.layer)))
        self._hooks.forward(layers[-1], self._when_active(self._commit))
        super().__init__(layers=[_Layer(self, i) for i in range(len(layers))])

    @classmethod
    def from_recipe(cls, model, recipe, profile=None, *, max_len: int, **kwargs):
        """Build from a recipe (a preset name, a TOML path or a Recipe) and, when it needs one,
        a profile (a Profile or the folder `kvcalib calibrate` wrote, checked against the model
        `kvcalib.load_model` loaded)."""
        if profile is not None and not isinstance(profile, Profile):
            profile = Profile.load(profile, getattr(model, "kvcalib_source", None))
        scheme, params = plan_for_model(model, recipe, profile)
        return cls(model, scheme, params, max_len=max_len, **kwargs)

    @classmethod
    def from_checkpoint(cls, model, path, *, max_len: int, **kwargs):
        """Build from a converted folder's side-car (scheme, calibrated tensors, and which
        transforms its weights already carry); `model` is that folder loaded in transformers.
        FormatError names a file of the folder that is missing or changed; ModelError, a model
        of other shapes (the side-car's rotations are fused in that folder's weights only)."""
        ckpt = read_checkpoint(path)
        if Geometry.from_config(model.config) != ckpt.geometry:
            raise ModelError(
                f"checkpoint {path}: its side-car is for a {ckpt.geometry.layers}-layer "
                f"{ckpt.config.get('model_type')} model, not this one: load the folder itself "
                "(AutoModelForCausalLM.from_pretrained of it)"
            )
        return cls(model, ckpt.scheme, ckpt.params, ckpt.transforms, max_len=max_len, **kwargs)

    def __enter__(self) -> "QuantizedKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the cache's hooks from the model."""
        self._hooks.remove()

    def fill(self, keys: list, values: list, hidden: dict) -> None:
        """Take in a prompt as a forward over it through this cache would (a prefill: the prompt
        attends to itself exact, then is stored), from a full-precision forward recorded
        elsewhere, so one prefill serves many caches. keys[i] / values[i]: layer i's pre-RoPE
        keys (what `capture_keys` records) and values, [B, Hkv, T, D]; hidden: {layer: the
        residual stream [B, T, hidden] out of that decoder layer}, read at the sink predictor's
        layer."""
        positions = self.store.positions(keys[0].shape[2])
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.store.stage(i, k, v, self.ropes[i], positions)
        sp = self.params.sink_predictor
        if sp is not None and self.scheme.sink_budget:
            self.store.observe_hidden(sp.layer, hidden[sp.layer])
        self.store.commit(keys[0].shape[2])

    @contextlib.contextmanager
    def tentative(self):
        """Forwards inside leave the cache as it was before: the store is put back on exit
        (`QuantizedCache.snapshot` / `restore`: every buffer and the lengths), for a
        teacher-forced score of a continuation the session does not keep."""
        snap = self.store.snapshot()
        try:
            yield self
        finally:
            self.store.restore(snap)
            self._key_pre.clear()

    def seq_length(self) -> int:
        return int(self.store.lengths.max())

    def _activate(self, module, args, kwargs) -> None:
        """Before each forward of the decoder stack: is this cache the one it was passed?"""
        passed = kwargs.get("cache", kwargs.get("past_key_values"))
        self._active = passed is self

    def _when_active(self, hook):
        def gated(module, args, output):
            if self._active:
                hook(module, args, output)

        return gated

    def _observe(self, layer: int):
        def hook(module, args, output):
            self.store.observe_hidden(layer, hidden_of(output))

        return hook

    def _commit(self, module, args, output) -> None:
        self.store.commit(hidden_of(output).shape[1])

    def _update(self, i: int, key_states, value_states):
        """Stage layer i's new tokens and return all keys/values as the cache holds them."""
        k = self._key_pre.pop(i)
        positions = self.store.positions(k.shape[2])
        self.store.stage(i, k, value_states, self.ropes[i], positions)
        keys, values, _ = self.store.materialize(i, self.ropes[i])
        return keys.to(key_states.dtype), values.to(value_states.dtype)
