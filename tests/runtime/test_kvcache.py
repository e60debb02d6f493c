"""The quantized KV cache inside the runtime's Transformer, with kernels on (Triton's
interpreter) and off (the reference path).

Decoding a prompt prefilled in one chunk, then one token at a time, must give the logits that
kvcalib's one-pass Simulator computes in decode mode with prefill = the prompt length: the two
implement the same rule. Bound 1e-5 relative, as in tests/toolkit/test_simulate.py: the same
numerics in a different fp32 summation order move logits by ~1e-7, far below what quantization
does (> 1e-3, checked second so the equality is not vacuous). A code flipped by a wrong
rounding, a wrong flush boundary or a sink read from the body would move them by > 1e-3.
"""

import pytest
import torch
from tiny import tiny_model

from kvcalib.sim.hooks import Hooks, capture_keys, key_module
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime import kvcache
from kvcalib_runtime.errors import CapacityError
from kvcalib_runtime.kvcache import QuantizedCache
from kvcalib_runtime.model import Transformer
from kvcalib_runtime.quant import QuantSpec
from kvcalib_runtime.scheme import KVParams, KVScheme, LayerScheme, SinkPredictor
from kvcalib_runtime.transforms import Transforms

RTOL = 1e-5
T, PROMPT = 24, 9

SCHEMES = {
    # KIVI: keys per channel in groups of 4 tokens flushed 8 at a time, values sliding
    "kivi": dict(
        key=QuantSpec(2, "channel", 4),
        value=QuantSpec(2, "token", 8),
        residual=8,
        layer=dict(key_flush=8, value_flush=1),
    ),
    "per-token": dict(key=QuantSpec(3), value=QuantSpec(3, symmetric=True), residual=0),
    # kvcalib's own: calibrated per-channel pre-RoPE keys, per-token values, a kept first token
    "pre-rope-static": dict(
        key=QuantSpec(2, "static"),
        value=QuantSpec(4, "token", 8),
        residual=6,
        sinks_first=1,
        layer=dict(key_position="pre_rope", key_flush=3, value_flush=3),
    ),
    "rotated": dict(
        key=QuantSpec(2),
        value=QuantSpec(2, symmetric=True),
        residual=4,
        sinks_first=2,
        rotation_seed=3,
        layer=dict(key_rotation=True, key_flush=2, value_flush=2),
    ),
    # exact slots: the largest error of each key vector, two outliers per value group of 8
    "outlier-slots": dict(
        key=QuantSpec(2, "static", outliers=0.01, outlier_slots=2, slot_rule="error"),
        value=QuantSpec(2, "token", 8, outliers=0.1),
        residual=4,
        sinks_first=1,
        layer=dict(key_position="pre_rope", key_flush=2, value_flush=1),
    ),
    "predicted-sinks": dict(
        key=QuantSpec(2, "channel", 4),
        value=QuantSpec(2),
        residual=8,
        sinks_first=1,
        sink_budget=3,
        layer=dict(key_flush=8, value_flush=4),
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, the runtime Transformer loaded from its save_pretrained folder)."""
    hf = tiny_model("llama")
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder)
    return hf, Transformer.from_folder(folder)


def _ids(batch, length, seed=1):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _scheme_and_params(hf, name, ids):
    kw = dict(SCHEMES[name])
    key, value, layer = kw.pop("key"), kw.pop("value"), kw.pop("layer", {})
    n = hf.config.num_hidden_layers
    scheme = KVScheme(tuple(LayerScheme(key, value, **layer) for _ in range(n)), **kw)
    params = KVParams()
    if key.granularity == "static":  # per-channel pre-RoPE ranges of this text, shrunk a bit
        keys = {}
        with Hooks(hf) as hooks, torch.no_grad():
            for i in range(n):
                hooks.forward(key_module(hf, i), capture_keys(hf, keys, i))
            hf(ids)
        params.key_range = {i: (k[0].amin(1) * 0.8, k[0].amax(1) * 0.8) for i, k in keys.items()}
    if scheme.sink_budget:  # flags about 20% of tokens: channel 5 after layer 0
        with torch.no_grad():
            hidden = hf(ids, output_hidden_states=True).hidden_states[1][0]
        threshold = float(hidden[:, 5].abs().quantile(0.8))
        params.sink_predictor = SinkPredictor(layer=0, dims=(5,), threshold=threshold)
    return scheme, params


def _cache(model, scheme, params, batch, max_len, kernels):
    transforms = Transforms.online(scheme, params)
    return model.new_cache(batch, max_len, scheme, params, transforms, use_kernels=kernels)


@torch.no_grad()
def _decode(model, cache, ids, prefill):
    """Logits [B, T, vocab]: ids[:, :prefill] in one chunk, then one token at a time."""
    out = [model(ids[:, :prefill], cache)]
    out += [model(ids[:, t : t + 1], cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(out, 1)


def _rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_decoding_equals_the_one_pass_simulation(models, name, kernels):
    hf, model = models
    ids = _ids(1, T)
    scheme, params = _scheme_and_params(hf, name, ids)
    with torch.no_grad():
        simulated = Simulator(hf, scheme, params, mode="decode", prefill=PROMPT)(ids)
        full_precision = hf(ids).logits
    decoded = _decode(model, _cache(model, scheme, params, 1, T, kernels), ids, PROMPT)
    assert _rel_err(decoded, simulated) < RTOL
    assert _rel_err(simulated, full_precision) > 1e-3


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
def test_a_batch_of_prompts_equals_each_alone(models, kernels):
    """Prompts of 5, 11 and 8 tokens prefilled alone (views), then decoded together: each
    sequence flushes and keeps sinks at its own positions, as when decoded alone."""
    hf, model = models
    ids = _ids(3, 16, seed=4)
    scheme, params = _scheme_and_params(hf, "predicted-sinks", ids)
    prompts = (5, 11, 8)
    steps = 16 - max(prompts)
    batch = _cache(model, scheme, params, 3, 16, kernels)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            model(ids[b : b + 1, :p], batch.view(b))
        nxt = [torch.stack([ids[b, p + s] for b, p in enumerate(prompts)]) for s in range(steps)]
        together = torch.cat([model(tokens[:, None], batch) for tokens in nxt], 1)
    for b, p in enumerate(prompts):
        alone = _cache(model, scheme, params, 1, 16, kernels)
        logits = _decode(model, alone, ids[b : b + 1, : p + steps], p)[:, p:]
        assert _rel_err(together[b : b + 1], logits) < RTOL
    assert batch.lengths.tolist() == [p + steps for p in prompts]
    assert (batch.sink_pos[:, 1:] >= 0).any()  # predicted sinks were kept, not only token 0


def test_kernels_and_reference_store_the_same_bits(models):
    """Layer 0's keys and values are the same tensors on both paths (deeper layers see attention
    outputs that differ in the last bits), so its body must be bit-identical."""
    hf, model = models
    ids = _ids(1, 18)
    scheme, params = _scheme_and_params(hf, "kivi", ids)
    caches = [_cache(model, scheme, params, 1, 18, kernels) for kernels in (True, False)]
    for cache in caches:
        _decode(model, cache, ids, 5)
    ours, ref = caches
    for a, b in ((ours.keys[0], ref.keys[0]), (ours.values[0], ref.values[0])):
        assert int(a.n_body[0]) == int(b.n_body[0]) > 8  # several flushes
        for name in ("codes", "scale", "offset"):
            assert torch.equal(getattr(a.body, name), getattr(b.body, name))


def test_outlier_slots_decode_through_the_reference_path_with_one_warning(models):
    _, model = models
    ids = _ids(1, 12)
    scheme = KVScheme(
        tuple(LayerScheme(QuantSpec(2, outliers=0.1), QuantSpec(2)) for _ in range(2)),
        residual=2,
        sinks_first=1,
    )
    with pytest.warns(UserWarning, match="outlier slots") as record:
        ours = _decode(model, _cache(model, scheme, KVParams(), 1, 12, True), ids, 4)
    assert len(record) == 1
    ref = _decode(model, _cache(model, scheme, KVParams(), 1, 12, False), ids, 4)
    assert _rel_err(ours, ref) < RTOL


def test_capacity_errors(models, monkeypatch):
    hf, model = models
    scheme, params = _scheme_and_params(hf, "kivi", _ids(1, 8))
    cache = _cache(model, scheme, params, 1, 8, False)
    with pytest.raises(CapacityError, match="max_len = 8"):
        model.generate([list(range(6))], 4, cache=cache)
    # a cache larger than the device's free memory is refused before anything is allocated
    monkeypatch.setattr(kvcache, "_free_bytes", lambda device: 10_000)
    with pytest.raises(CapacityError, match="GiB"):
        _cache(model, scheme, params, 4, 4096, False)


def test_use_kernels_needs_somewhere_to_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    scheme = KVScheme((LayerScheme(QuantSpec(2), QuantSpec(2)),))
    shape = dict(num_layers=1, batch=1, kv_heads=1, head_dim=16, max_len=8)
    where = dict(device="cpu", dtype=torch.float32)
    none = Transforms.none(1)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        QuantizedCache(scheme, KVParams(), none, **shape, **where, use_kernels=True)
    auto = QuantizedCache(scheme, KVParams(), none, **shape, **where)
    assert not auto.kernels
