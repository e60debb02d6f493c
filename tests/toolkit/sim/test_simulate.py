"""The one-pass simulation is exactly a decoding cache: decode mode equals token-by-token
generation through QuantizedKVCache, fake mode quantizes every position, fp16 is the model."""

import pytest
import torch
from support.tiny import tiny_model

from kvcalib.sim import attention
from kvcalib.sim.cache import QuantizedKVCache
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.cache.attention import attention as runtime_attention
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme, SinkPredictor
from kvcalib_runtime.layouts.quant import QuantSpec

T = 45


def _scheme(model, key, value, **kw):
    layer = kw.pop("layer", {})
    n = model.config.num_hidden_layers
    return KVScheme(tuple(LayerScheme(key, value, **layer) for _ in range(n)), **kw)


def _static_params(model, ids, position):
    """Static per-channel ranges (from the data itself, slightly clipped) for every layer."""
    from kvcalib.sim.hooks import Hooks, capture_keys, key_module

    keys = {}
    with Hooks(model) as hooks, torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            hooks.forward(key_module(model, i), capture_keys(model, keys, i))
        model(ids)
    assert position == "pre_rope"
    return KVParams(
        key_range={i: (k[0].amin(1) * 0.8, k[0].amax(1) * 0.8) for i, k in keys.items()}
    )


CASES = {
    # KIVI-like: keys per channel in groups of 4 tokens flushed 8 at a time, values sliding.
    "kivi": dict(
        key=QuantSpec(2, "channel", 4),
        value=QuantSpec(2, "token", 8),
        residual=8,
        layer=dict(key_flush=8, value_flush=1),
    ),
    "per-token-no-window": dict(key=QuantSpec(3), value=QuantSpec(3), residual=0),
    "rotated+sinks": dict(
        key=QuantSpec(2),
        value=QuantSpec(2, symmetric=True),
        residual=4,
        sinks_first=2,
        rotation_seed=3,
        layer=dict(key_rotation=True, value_rotation=True, key_flush=2, value_flush=2),
    ),
    "pre-rope-static": dict(
        key=QuantSpec(2, "static", outliers=0.01, outlier_slots=1),
        value=QuantSpec(4, "token", 8),
        residual=6,
        sinks_first=1,
        layer=dict(key_position="pre_rope", key_flush=3, value_flush=3),
    ),
}


def _incremental(model, scheme, params, ids, prefill):
    """Logits [T, vocab] from feeding ids through a QuantizedKVCache, prefill then one by one."""
    out = []
    with QuantizedKVCache(model, scheme, params, max_len=ids.shape[1]) as cache, torch.no_grad():
        out.append(model(ids[:, :prefill], cache=cache).logits[0])
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache=cache).logits[0])
    return torch.cat(out)


# qwen3 / gemma3_text: keys pass through k_norm; gemma2: soft-capped scores and logits; gemma and
# mistral-sliding: windows of 8 < T; phi3-partial: keys in qkv_proj rows, RoPE on half a head.
ARCHS = ["llama", "qwen3", "gemma2", "gemma3_text", "mistral-sliding", "phi3-partial"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("prefill", [1, 13])
@pytest.mark.parametrize("block", [attention.BLOCK, 7])  # 7: bands of several blocks, one ragged
def test_decode_mode_equals_incremental_decoding(arch, case, prefill, block, monkeypatch):
    monkeypatch.setattr(attention, "BLOCK", block)
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(1))
    kw = dict(CASES[case])
    scheme = _scheme(model, kw.pop("key"), kw.pop("value"), **kw)
    pre_rope = scheme.layers[0].key_position == "pre_rope"
    params = _static_params(model, ids, "pre_rope") if pre_rope else KVParams()
    with torch.no_grad():
        one_pass = Simulator(model, scheme, params, mode="decode", prefill=prefill)(ids)[0]
        reference = model(ids).logits[0]
    step = _incremental(model, scheme, params, ids, prefill)
    err = (one_pass - step).abs().max() / step.abs().max()
    # Same numerics, different summation order only: fp32 rounding, far below the effect of
    # quantization itself (checked second, so the equality is not vacuous).
    assert err < 1e-5, err
    assert (one_pass - reference).abs().max() / reference.abs().max() > 1e-3


def test_predicted_sinks_match_incremental_decoding(monkeypatch):
    monkeypatch.setattr(attention, "BLOCK", 16)
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[1][0]  # after layer 0
    threshold = float(hidden[:, 5].abs().quantile(0.8))  # flags ~20% of tokens on channel 5
    params = KVParams(sink_predictor=SinkPredictor(layer=0, dims=(5,), threshold=threshold))
    scheme = _scheme(
        model,
        QuantSpec(2, "channel", 4),
        QuantSpec(2),
        residual=8,
        sinks_first=1,
        sink_budget=3,
        layer=dict(key_flush=8, value_flush=4),
    )
    with torch.no_grad():
        sim = Simulator(model, scheme, params, mode="decode", prefill=1)
        one_pass = sim(ids)[0]
    assert sim.sinks.sum() == 4  # token 0 + the budget of 3 predicted sinks
    step = _incremental(model, scheme, params, ids, 1)
    assert (one_pass - step).abs().max() / step.abs().max() < 1e-5


def test_predicted_sinks_are_decided_before_the_one_observed_forward():
    # The sink fixed point iterates on forwards that stop after the predictor's layer; the whole
    # model then runs once, with the sinks the last pass decided, and only that run is observed.
    model = tiny_model("llama", num_hidden_layers=3)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[2][0]  # after layer 1
    threshold = float(hidden[:, 5].abs().quantile(0.8))
    params = KVParams(sink_predictor=SinkPredictor(layer=1, dims=(5,), threshold=threshold))
    scheme = _scheme(model, QuantSpec(2), QuantSpec(2), residual=4, sinks_first=1, sink_budget=8)
    records = []
    with torch.no_grad():
        sim = Simulator(model, scheme, params, mode="decode", observers=[records.append])
        sim(ids)
    assert sim.sink_passes == 2  # measured: 2-bit layers 0-1 move a flag across the threshold
    assert [r.layer for r in records] == [0, 1, 2]
    assert all(torch.equal(r.sinks, sim.sinks) for r in records)


def test_unfused_key_smoothing_matches_incremental_decoding():
    model = tiny_model("qwen3")
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(4))
    half = torch.rand(2, 8, generator=torch.Generator().manual_seed(5)) + 0.5
    params = KVParams(key_smooth={i: torch.cat([half, half], -1) for i in range(2)})  # RoPE pairs
    scheme = _scheme(model, QuantSpec(2), QuantSpec(4), residual=8)
    with torch.no_grad():
        one_pass = Simulator(model, scheme, params, mode="decode", prefill=5)(ids)[0]
        plain = Simulator(model, scheme, mode="decode", prefill=5)(ids)[0]
    step = _incremental(model, scheme, params, ids, 5)
    assert (one_pass - step).abs().max() / step.abs().max() < 1e-5
    assert not torch.allclose(one_pass, plain, atol=1e-4)  # the scales did change the codes


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["fake", "decode"])
def test_fused_attention_equals_the_eager_reference(case, mode, monkeypatch):
    # Without observers the Simulator attends through scaled_dot_product_attention (decode mode:
    # plus the window band, swapped in through an extra key); with one, through the eager
    # reference that also yields the weights. Same rule, so the logits agree to fp32 rounding,
    # far closer than quantization moves them (checked second).
    monkeypatch.setattr(attention, "BLOCK", 16)
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(6))
    kw = dict(CASES[case])
    scheme = _scheme(model, kw.pop("key"), kw.pop("value"), **kw)
    pre_rope = scheme.layers[0].key_position == "pre_rope"
    params = _static_params(model, ids, "pre_rope") if pre_rope else KVParams()
    with torch.no_grad():
        fast = Simulator(model, scheme, params, mode=mode, prefill=5)(ids)
        eager = Simulator(model, scheme, params, mode=mode, prefill=5, observers=[id])(ids)
        reference = model(ids).logits
    assert (fast - eager).abs().max() / eager.abs().max() < 1e-5
    assert (eager - reference).abs().max() / reference.abs().max() > 1e-3


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("shape", [(1, 1, 1, 5, 64), (2, 2, 3, 17, 64), (1, 3, 5, 70, 32)])
def test_without_a_rule_the_runtime_attention_is_the_reference_bit_for_bit(shape, softcap):
    # Fake mode and full precision attend through kvcalib_runtime.cache.attention (issue 54):
    # its output and observed probabilities are the decode-rule reference's with no rule, as the
    # simulation computed them before, bit for bit (fp32, GQA groups, a causal additive mask).
    b, hkv, g, t, d = shape
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(b, hkv, g, t, d, generator=gen)
    k, v = (torch.randn(b, hkv, t, d, generator=gen) for _ in range(2))
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1).expand(b, 1, t, t)
    want, probs = attention.reference(q, k, v, k, v, mask, 0.125, None, softcap=softcap)
    seen = []
    flat = q.reshape(b, hkv * g, t, d)
    got = runtime_attention(flat, k, v, mask, scaling=0.125, softcap=softcap, observer=seen.append)
    assert torch.equal(got.view(b, hkv, g, t, d), want)
    assert torch.equal(seen[0].view(b, hkv, g, t, t), probs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_attention_with_a_dominant_sink(dtype):
    # A sink key scored from -120 to +120 across the queries (the window's within +-5): for some
    # queries the window's share underflows (e -> 0), for others it is all there is (e -> 1);
    # neither may overflow or lose precision.
    gen = torch.Generator().manual_seed(7)
    b, hkv, g, t, d = 1, 2, 2, 40, 16
    q = torch.randn(b, hkv, g, t, d, generator=gen)
    key, value = torch.randn(b, hkv, t, d, generator=gen), torch.randn(b, hkv, t, d, generator=gen)
    mask = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -1e30)
    pos = torch.arange(t)
    n = torch.clamp(pos + 1 - 8, min=0).minimum(pos)  # residual window of 8
    for boost in (100.0, -100.0):
        k = key.clone()
        k[..., 0, :] = q.mean((2, 3))[..., :] * boost / q.mean((2, 3)).square().sum(-1, True)
        noise = 0.05 * torch.randn(k.shape, generator=gen)
        args = [x.to(dtype) for x in (q, k, value, k + noise, value + noise)]
        bands = attention.bands(n, n, t)
        want, _ = attention.reference(*[x.float() for x in args], mask[None, None], 0.25, bands)
        got = attention.fused(*args, mask[None, None].to(dtype), 0.25, bands).float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.isfinite(got).all() and (got - want).abs().max() < tol * want.abs().max()


def test_fake_mode_quantizes_every_position():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(3))
    scheme = _scheme(model, QuantSpec(2), QuantSpec(2), residual=16)
    with torch.no_grad():
        fake = Simulator(model, scheme, mode="fake")(ids)[0]
        decode = Simulator(model, scheme, mode="decode")(ids)[0]
        reference = model(ids).logits[0]
    # Position 0 attends only to itself: decode keeps it exact, fake quantizes it.
    assert torch.allclose(decode[0], reference[0], atol=1e-5)
    assert not torch.allclose(fake[0], reference[0], atol=1e-3)
    assert (fake - reference).abs().mean() > (decode - reference).abs().mean()


def test_full_precision_scheme_is_the_model_bit_for_bit():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 128, (2, T))
    scheme = _scheme(model, None, None)
    with torch.no_grad():
        assert torch.equal(Simulator(model, scheme, mode="decode")(ids), model(ids).logits)


def test_hooks_are_removed_after_a_call():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        before = model(ids).logits
        Simulator(model, _scheme(model, QuantSpec(2), QuantSpec(2)), mode="fake")(ids)
        after = model(ids).logits
    assert torch.equal(before, after)
    assert model.config._attn_implementation != "kvcalib"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
