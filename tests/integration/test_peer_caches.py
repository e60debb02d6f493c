"""The peers' own layouts inside the runtime cache: llama.cpp's rotated q4_0 / q8_0 blocks,
TurboQuant's split rows and KVQuant's vector values with static slotted keys. Decoding a prompt
prefilled in one chunk, then a token at a time, gives the logits of the one-pass Simulator in
decode mode (the bound of tests/integration/test_kvcache.py: 1e-5 relative, against a quantization
effect > 1e-3). The Triton kernels implement the affine numerics only: asked to run, a cache of
llama.cpp's or TurboQuant's numerics warns once and stores and reads through the reference path,
with the same logits; KVQuant's layout is affine and runs on the kernels."""

import warnings

import pytest
import torch
from support.tiny import text_key_ranges, tiny_model

from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.layouts.quant import QuantSpec, uniform_codebook
from kvcalib_runtime.model.forward import Transformer
from kvcalib_runtime.model.transforms import Transforms

RTOL = 1e-5
T, PROMPT = 20, 7
TURBO = QuantSpec(2, symmetric=True, method="turboquant", split_channels=8, split_bits=4)
SCHEMES = {
    "llamacpp": dict(
        key=QuantSpec(4, group_size=32, symmetric=True, method="ggml"),
        value=QuantSpec(8, group_size=32, symmetric=True, method="ggml"),
        residual=0,
        layer=dict(key_rotation=True, value_rotation=True),
    ),
    "turboquant": dict(
        key=TURBO,
        value=QuantSpec(3, symmetric=True, method="turboquant"),
        residual=4,
        layer=dict(key_flush=2, value_flush=1),
    ),
    "kvquant": dict(
        key=QuantSpec(2, "static", codebook=True, outliers=0.01, outlier_slots=1),
        value=QuantSpec(2, "vector", codebook=True, outliers=0.05),
        residual=0,
        sinks_first=1,
        layer=dict(key_position="pre_rope"),
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny llama with heads of 32 channels (one llama.cpp block), and its runtime model."""
    hf = tiny_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    folder = tmp_path_factory.mktemp("tiny-llama-32")
    hf.save_pretrained(folder)
    return hf, Transformer.from_folder(folder)


def _scheme_and_params(hf, name, ids):
    kw = dict(SCHEMES[name])
    key, value, layer = kw.pop("key"), kw.pop("value"), kw.pop("layer")
    n, hkv = hf.config.num_hidden_layers, hf.config.num_key_value_heads
    scheme = KVScheme(tuple(LayerScheme(key, value, **layer) for _ in range(n)), **kw)
    params = KVParams()
    for i in range(n):
        if key.split_channels:
            params.key_split[i] = torch.arange(0, 32, 4).expand(hkv, -1)  # every 4th channel
        if key.codebook:
            params.key_codebook[i] = uniform_codebook(key.bits)
            params.value_codebook[i] = uniform_codebook(value.bits)
    if key.granularity == "static":  # per-channel pre-RoPE ranges of this text, shrunk a bit
        params.key_range = text_key_ranges(hf, ids)
    return scheme, params


@torch.no_grad()
def _decode(model, scheme, params, ids, kernels):
    cache = model.new_cache(
        1, T, scheme, params, Transforms.online(scheme, params), use_kernels=kernels
    )
    out = [model(ids[:, :PROMPT], cache)]
    out += [model(ids[:, t : t + 1], cache) for t in range(PROMPT, T)]
    return torch.cat(out, 1)


def _rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_decoding_equals_the_one_pass_simulation(models, name):
    hf, model = models
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(3))
    scheme, params = _scheme_and_params(hf, name, ids)
    with torch.no_grad():
        simulated = Simulator(hf, scheme, params, mode="decode", prefill=PROMPT)(ids)
        full_precision = hf(ids).logits
    reference = _decode(model, scheme, params, ids, kernels=False)
    assert _rel_err(reference, simulated) < RTOL
    assert _rel_err(simulated, full_precision) > 1e-3
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        asked = _decode(model, scheme, params, ids, kernels=True)
    method = SCHEMES[name]["key"].method  # the warning names the layout from its registry entry
    own = [w for w in record if f"layout {method}, whose own numerics" in str(w.message)]
    assert len(own) == (name != "kvquant")  # once, and only for the non-affine numerics
    assert _rel_err(asked, reference) < RTOL
