"""The runtime's transformer against transformers itself, on tiny random fp32 models of every
family in the architecture table (and Mistral / Qwen2 configs that declare a sliding window).

Logit bound: both sides run the same fp32 ops in possibly different orders, which moves logits
by ~1e-6 relative; 1e-4 leaves margin yet catches any wrong weight, bias, norm, RoPE frequency
or mask, each of which moves them by > 1e-3 relative at these weights (std 0.1 makes attention
peaky, so positions matter: a default RoPE where llama3 is configured is off by ~0.6). Norm
weights are randomized too (transformers initializes Gemma's to 0, where x * (1 + w) and x * w
would differ by a constant only). Sliding windows are 5 tokens and sequences up to 19, so
attention beyond the window is exercised; soft-caps are small enough to bend the scores.
Token tests are exact: greedy decoding is deterministic and the logits agree that closely.
"""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvcalib_runtime.cache.fpcache import FullPrecisionCache
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.errors import CapacityError, FormatError
from kvcalib_runtime.layouts.quant import QuantSpec
from kvcalib_runtime.model.forward import Transformer
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.rope import Rope
from kvcalib_runtime.model.transforms import Transforms
from kvcalib_runtime.model.weights import load_tokenizer

RTOL = 1e-4
VOCAB = 128
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    initializer_range=0.1,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # head_dim 16 then has high, medium and low bands
}
WINDOW = 5
GEMMA3 = {
    **SMALL,
    "query_pre_attn_scalar": 24,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    },
}
CASES = {
    "llama": (transformers.LlamaConfig, SMALL),
    "llama-tied-llama3": (
        transformers.LlamaConfig,
        {**SMALL, "tie_word_embeddings": True, "rope_parameters": LLAMA3},
    ),
    "llama-attention-bias": (transformers.LlamaConfig, {**SMALL, "attention_bias": True}),
    "llama-head-dim-80": (
        transformers.LlamaConfig,
        {
            **SMALL,
            "hidden_size": 160,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 80,
        },
    ),
    "llama-linear": (
        transformers.LlamaConfig,
        {**SMALL, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
    ),
    "mistral": (transformers.MistralConfig, SMALL),
    "mistral-sliding": (transformers.MistralConfig, {**SMALL, "sliding_window": WINDOW}),
    "qwen2-tied": (transformers.Qwen2Config, {**SMALL, "tie_word_embeddings": True}),
    "qwen2-sliding": (
        transformers.Qwen2Config,
        {**SMALL, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": (transformers.Qwen3Config, SMALL),
    "gemma2": (
        transformers.Gemma2Config,
        {
            **SMALL,
            "query_pre_attn_scalar": 24,  # not head_dim: the score scale is checked
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3_text": (transformers.Gemma3TextConfig, GEMMA3),
    "phi3-partial-rotary": (
        transformers.Phi3Config,
        {
            **SMALL,
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5},
            "pad_token_id": 0,  # the defaults lie outside the tiny vocabulary
            "eos_token_id": 1,
        },
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: on a loaded machine, syncing CPU threads costs ~10x the math. Restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _save(name: str, folder, **save_options):
    config_class, kwargs = CASES[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_class(**kwargs)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    hf.generation_config.eos_token_id = None  # generate all 12 tokens
    hf.save_pretrained(folder, **save_options)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, runtime model loaded from its saved folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = _save(request.param, folder)
    return hf, Transformer.from_folder(folder)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-folder")
    _save("llama", folder)
    return folder


def _ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def test_logits_match_transformers(pair):
    hf, model = pair
    ids = _ids(2, 19)
    out = model(ids, model.new_cache(2, 19))
    assert out.dtype == torch.float32 and out.shape == (2, 19, VOCAB)
    assert _rel_err(out, hf(ids).logits) < RTOL


@pytest.mark.parametrize("batch", [1, 2])
@torch.no_grad()
def test_incremental_logits_match_transformers(pair, batch):
    """Prefill 7 tokens, then 5 at once (mask over the cache), then 1: same as one pass."""
    hf, model = pair
    ids = _ids(batch, 13)
    cache = model.new_cache(batch, 16)
    out = torch.cat([model(ids[:, a:b], cache) for a, b in ((0, 7), (7, 12), (12, 13))], dim=1)
    assert cache.lengths.tolist() == [13] * batch
    assert _rel_err(out, hf(ids).logits) < RTOL


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
@torch.no_grad()
def test_bf16_error_is_no_worse_than_transformers_bf16(tmp_path, name):
    """Flash-attention's rule: against the fp32 reference, at most twice the error of a plain
    bf16 run of transformers (RMSNorm and RoPE stay fp32 inside, as there; Gemma's 1 + w too)."""
    hf = _save(name, tmp_path)
    ids = _ids(2, 19)
    ref = hf(ids).logits
    ref_bf16 = hf.to(torch.bfloat16)(ids).logits.float()
    model = Transformer.from_folder(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert _rel_err(model(ids, model.new_cache(2, 19)), ref) <= 2 * _rel_err(ref_bf16, ref)


def test_greedy_matches_transformers_generate(pair):
    hf, model = pair
    ids = _ids(1, 9)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert model.generate([ids[0].tolist()], 12) == [ref[0, 9:].tolist()]


def test_hidden_states_reach_the_cache(pair):
    """observe_hidden sees the residual stream after every layer (HF's hidden_states[i + 1]; the
    last one HF returns after the final norm, so only earlier layers compare)."""

    class Recorder(FullPrecisionCache):
        def observe_hidden(self, layer, hidden):
            seen.append((layer, hidden.clone()))

    hf, model = pair
    seen = []
    ids = _ids(2, 6)
    geo = model.geometry
    cache = Recorder(
        geo.layers, 2, geo.kv_heads, geo.head_dim, 8, "cpu", torch.float32,
        windows=geo.windows, softcap=model.attn_softcap,
    )  # fmt: skip
    with torch.no_grad():
        model(ids, cache)
        ref = hf(ids, output_hidden_states=True).hidden_states
    assert [layer for layer, _ in seen] == [0, 1]
    assert _rel_err(seen[0][1], ref[1]) < RTOL


def test_batch_gives_each_prompt_its_own_tokens(llama_folder):
    model = Transformer.from_folder(llama_folder)
    prompts = [_ids(1, n, seed=n)[0].tolist() for n in (5, 11, 2)]
    alone = [model.generate([p], 12)[0] for p in prompts]
    assert model.generate(prompts, 12) == alone


def test_eos_stops_only_its_sequence(llama_folder):
    model = Transformer.from_folder(llama_folder)
    prompts = [_ids(1, n, seed=n)[0].tolist() for n in (4, 7)]
    free = model.generate(prompts, 12)
    eos = next(token for token in free[0][1:] if token not in free[1])  # ends 0, never 1
    expected = [free[0][: free[0].index(eos) + 1], free[1]]
    steps = []
    got = model.generate(prompts, 12, eos_token_id=[eos], callback=lambda s, t: steps.append(t))
    assert got == expected and len(got[0]) < 12 == len(got[1])
    assert all(tokens[0] is None for tokens in steps[len(got[0]) :])  # finished: None


def test_sampling_is_seeded_and_differs_from_greedy(llama_folder):
    model = Transformer.from_folder(llama_folder)
    prompts = [_ids(1, 6)[0].tolist()]
    greedy = model.generate(prompts, 12)
    runs = [model.generate(prompts, 12, temperature=1.0, top_p=0.9, seed=s) for s in range(3)]
    assert runs[0] == model.generate(prompts, 12, temperature=1.0, top_p=0.9, seed=0)
    assert any(run != greedy for run in runs)
    # a nucleus smaller than any probability keeps only the most likely token: greedy again
    assert model.generate(prompts, 12, temperature=1.0, top_p=1e-6, seed=0) == greedy


def test_prompt_longer_than_cache_raises(llama_folder):
    model = Transformer.from_folder(llama_folder)
    with pytest.raises(CapacityError, match=r"holds \[0\] tokens .* 10 more .* max_len = 8"):
        model.generate([list(range(10))], 4, cache=model.new_cache(1, 8))


def test_sharded_checkpoint_loads(tmp_path):
    hf = _save("qwen3", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = Transformer.from_folder(tmp_path)
    ids = _ids(1, 5)
    with torch.no_grad():
        assert _rel_err(model(ids, model.new_cache(1, 5)), hf(ids).logits) < RTOL


def test_missing_tensor_is_named(tmp_path):
    _save("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        Transformer.from_folder(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    _save("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = {**load_file(file), "model.layers.0.extra.weight": torch.zeros(2)}
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"model\.layers\.0\.extra\.weight"):
        Transformer.from_folder(tmp_path)


def test_legacy_rope_keys_and_derived_head_dim(tmp_path):
    """Pre-transformers-5 configs: rope_theta + rope_scaling, no head_dim key."""
    hf = _save("llama-linear", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"], config["head_dim"]
    config.update(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = Transformer.from_folder(tmp_path)
    ids = _ids(1, 12)
    with torch.no_grad():
        assert _rel_err(model(ids, model.new_cache(1, 12)), hf(ids).logits) < RTOL


@pytest.mark.parametrize("params", [LLAMA3, {"rope_type": "linear", "factor": 4.0}])
def test_inv_freq_equals_transformers(params):
    """Bit-exact: the same fp32 formula as transformers' ROPE_INIT_FUNCTIONS."""
    config = transformers.LlamaConfig(**{**SMALL, "rope_parameters": dict(params)})
    ref, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    assert torch.equal(Rope(config.to_dict(), config.head_dim).inv_freq, ref)


def test_unknown_rope_type_is_refused():
    config = {**SMALL, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(FormatError, match="'yarn'"):
        Rope(config, 16)


def test_bytes_per_token():
    cache = FullPrecisionCache(3, 2, 4, 80, 16, "cpu", torch.bfloat16)
    assert cache.bytes_per_token() == 2 * 3 * 4 * 80 * 2  # K and V, 3 layers, 4 heads, bf16


def test_missing_tokenizer_is_named(llama_folder):
    with pytest.raises(FormatError, match=r"tokenizer\.json"):
        load_tokenizer(llama_folder)


def test_legacy_gemma_configs_slide_and_rotate_per_layer_type():
    """Configs without layer_types (Gemma 2: every 2nd layer global; Gemma 3: every 6th, or
    sliding_window_pattern) and Gemma 3's pre-transformers-5 RoPE keys: rope_theta (global,
    scaled by rope_scaling) and rope_local_base_freq (local, unscaled)."""
    base = {**SMALL, "num_hidden_layers": 6, "sliding_window": 4}
    gemma2 = Geometry.from_config({**base, "model_type": "gemma2"})
    assert gemma2.windows == (4, None) * 3
    gemma3 = {
        **base,
        "model_type": "gemma3_text",
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    geo = Geometry.from_config(gemma3)
    assert geo.windows == (4, 4, 4, 4, 4, None)
    assert [p["rope_theta"] for p in geo.rope] == [1e4] * 5 + [1e6]
    assert [p["rope_type"] for p in geo.rope] == ["default"] * 5 + ["linear"]
    assert Geometry.from_config({**gemma3, "sliding_window_pattern": 3}).windows == (4, 4, None) * 2
    ref = transformers.Gemma3TextConfig(**{k: v for k, v in gemma3.items() if k != "model_type"})
    assert ref.layer_types == ["sliding_attention"] * 5 + ["full_attention"]  # the same reading
    assert ref.rope_parameters["sliding_attention"]["rope_theta"] == 1e4


def test_partial_rotary_refuses_what_needs_whole_heads(tmp_path):
    _save("phi3-partial-rotary", tmp_path)
    model = Transformer.from_folder(tmp_path)
    layer = LayerScheme(QuantSpec(4), QuantSpec(4), key_position="pre_rope")
    scheme = KVScheme((layer,) * model.geometry.layers)
    with pytest.raises(FormatError, match=r"rotates 8 of 16 channels .* 'post_rope'"):
        model.new_cache(1, 4, scheme, KVParams(), Transforms.none(model.geometry.layers))


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
@torch.no_grad()
def test_quantized_cache_serves_soft_caps_and_windows(tmp_path, name):
    """Gemma 2's soft-capped scores and Gemma 3's sliding layers through the quantized cache,
    prefill and decode past the window: at 8 bits per token the logits stay within 2% of the
    full-precision cache's (the quantized cache without the cap is 9% off on Gemma 2 here)."""
    _save(name, tmp_path)
    model = Transformer.from_folder(tmp_path)
    layers = model.geometry.layers
    scheme = KVScheme((LayerScheme(QuantSpec(8), QuantSpec(8)),) * layers)
    ids = _ids(1, 3 * WINDOW)
    outs = []
    for cache in (
        model.new_cache(1, 3 * WINDOW),
        model.new_cache(1, 3 * WINDOW, scheme, KVParams(), Transforms.none(layers)),
    ):
        steps = [model(ids[:, :WINDOW], cache)]
        steps += [model(ids[:, t : t + 1], cache) for t in range(WINDOW, 3 * WINDOW)]
        outs.append(torch.cat(steps, 1))
    assert _rel_err(outs[1], outs[0]) < 2e-2
