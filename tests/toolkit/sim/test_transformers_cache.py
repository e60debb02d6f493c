"""`kvcalib.QuantizedKVCache` through transformers' own `model.generate`: greedy tokens are the
argmax of eval's decode simulation (from a recipe) and the runtime's (from a converted folder),
and differ from an unquantized cache's, so a cache that generate bypassed could not pass."""

import pytest
import torch
from support.tiny import save_with_tokenizer, tiny_model
from transformers import AutoModelForCausalLM

import kvcalib
import kvcalib.sim.cache
import kvcalib_runtime
from kvcalib.conversion.convert import convert
from kvcalib.core.plan import plan_for_model
from kvcalib.sim.simulate import Simulator

PROMPT, NEW = 20, 24
# 2-bit keys and values with a Hadamard value rotation: converted, the rotation is fused into
# v_proj/o_proj and the side-car says so; a cache that rotated again would change the tokens.
ROTATED_2BIT = 'name = "r2"\n[key]\nbits = 2\n[value]\nbits = 2\nrotation = "hadamard"\n'


def _prompt(seed=0):
    return torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, **cache):
    """NEW greedy tokens from transformers' generate, end-of-sequence ignored."""
    model.generation_config.eos_token_id = None
    out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **cache)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("argument", ["past_key_values", "cache"])  # transformers 5.25 takes both
def test_generate_from_recipe_is_the_decode_simulation(argument):
    model, ids = tiny_model("llama"), _prompt()
    with kvcalib.QuantizedKVCache.from_recipe(model, "per-token-2", max_len=64) as cache:
        new = _greedy(model, ids, **{argument: cache})
        assert cache.seq_length() == PROMPT + NEW - 1  # the last token is never fed back
    scheme, params = plan_for_model(model, "per-token-2")
    with torch.no_grad():
        logits = Simulator(model, scheme, params, mode="decode", prefill=PROMPT)(
            torch.cat([ids, torch.tensor([new])], 1)
        )
    assert logits[0, PROMPT - 1 : -1].argmax(-1).tolist() == new
    assert new != _greedy(model, ids)  # 2 bits change the tokens: the cache was used


def test_a_forward_without_the_cache_leaves_it_as_it_was():
    """The cache's hooks stay on the model until it closes; a forward that does not pass the
    cache (another cache's, or none) must neither store into it nor advance it."""
    model, ids = tiny_model("llama"), _prompt()
    step = ids[:, -1:]
    with torch.no_grad():
        plain = model(ids).logits
        with kvcalib.QuantizedKVCache.from_recipe(model, "per-token-2", max_len=64) as cache:
            model(ids[:, :-1], past_key_values=cache)
            assert torch.equal(model(ids).logits, plain)  # no cache passed: the model as it is
            assert cache.seq_length() == PROMPT - 1
            resumed = model(step, past_key_values=cache).logits
        with kvcalib.QuantizedKVCache.from_recipe(model, "per-token-2", max_len=64) as cache:
            model(ids[:, :-1], past_key_values=cache)
            direct = model(step, past_key_values=cache).logits
    assert torch.equal(resumed, direct)


def test_generate_from_checkpoint_is_the_runtime(tmp_path):
    """A converted folder: transformers loads its weights (value rotation fused), the cache
    reads its side-car (which says so); greedy tokens are the runtime's on the same folder."""
    src = save_with_tokenizer(tiny_model("llama"), tmp_path / "src")
    recipe = tmp_path / "r2.toml"
    recipe.write_text(ROTATED_2BIT)
    out = convert(src, recipe=recipe, output=tmp_path / "out")
    rm = kvcalib_runtime.load(out, device="cpu", dtype=torch.float32, use_kernels=False)
    prompt = _prompt(1)[0].tolist()
    [runtime] = rm.generate([prompt], NEW, eos_token_id=[])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with kvcalib.QuantizedKVCache.from_checkpoint(model, out, max_len=64) as cache:
        assert _greedy(model, ids, past_key_values=cache) == runtime
    assert runtime != _greedy(model, ids)
    other = tiny_model("llama", hidden_size=32)  # another model's shapes
    with pytest.raises(kvcalib.KvcalibError, match=r"side-car is for a 2-layer llama model"):
        kvcalib.QuantizedKVCache.from_checkpoint(other, out, max_len=64)


@pytest.mark.slow
def test_the_usage_in_the_docstring_runs_on_the_default_model():
    """The lines `kvcalib.QuantizedKVCache`'s module docstring gives a user, run as written."""
    doc = kvcalib.sim.cache.__doc__
    code = "\n".join(line[4:] for line in doc.splitlines() if line.startswith("    "))
    assert "past_key_values=cache" in code and "from_recipe" in code
    names = {}
    exec(code, names)
    ids, out, cache = names["ids"], names["out"], names["cache"]
    cache.close()
    assert out.shape[1] == ids.shape[1] + 32
    assert cache.seq_length() == ids.shape[1] + 31  # every step went through the cache
