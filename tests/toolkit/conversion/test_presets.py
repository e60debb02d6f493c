"""The shipped kvcalib-* recipes on the real default model: each converts, the converted folder
evaluates as the recipe does online (what `kvcalib eval CONVERTED_DIR` reports), and the
runtime generates what that evaluation predicts."""

from pydoc_data.topics import topics

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvcalib_runtime
from kvcalib.calibration import Settings, calibrate_model
from kvcalib.conversion.convert import convert
from kvcalib.core.data import eval_windows
from kvcalib.core.plan import plan_for_model
from kvcalib.sim.cache import QuantizedKVCache
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.checkpoint.format import read_checkpoint

# Every phase, small: enough windows for ranges, codebooks, a sink predictor and sensitivities,
# and three short retrieval prompts for the answer-loss sensitivity kvcalib-2 allocates by.
FAST = Settings(
    sensitivity_windows=1,
    sensitivity_tokens=32,
    codebook_windows=1,
    retrieval_prompts=3,
    retrieval_tokens=512,
)


@pytest.fixture(scope="module")
def profile(real_model, tmp_path_factory):
    model, tokenizer = real_model
    return calibrate_model(
        model,
        tokenizer,
        tmp_path_factory.mktemp("presets") / "profile",
        source=model.kvcalib_source,
        num_samples=4,
        seq_len=256,
        settings=FAST,
        progress=False,
    )


def _kl(p_logits, q_logits) -> float:
    p, q = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kvcalib-1.5", "kvcalib-2", "kvcalib-3", "kvcalib-4"])
def test_converted_preset_evaluates_as_the_online_recipe(name, real_model, profile, tmp_path):
    model, tokenizer = real_model
    out = convert(None, recipe=name, output=tmp_path / name, profile=profile)
    ckpt = read_checkpoint(out)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    scheme, params = plan_for_model(model, name, profile)
    assert ckpt.scheme == scheme  # the side-car stores the plan itself
    ids = eval_windows(tokenizer, windows=1, seq_len=320)  # past the 128-token window
    with torch.no_grad():
        exact = model(ids).logits
        online = Simulator(model, scheme, params, mode="decode")(ids)
        fused = Simulator(
            converted, ckpt.scheme, ckpt.params, mode="decode", transforms=ckpt.transforms
        )(ids)
    error = _kl(exact, online)
    # The fused rotation only reorders fp32 sums: a few codes flip at level boundaries, which
    # moves the output by far less than quantization itself does.
    assert _kl(online, fused) < 0.05 * error
    assert error > 1e-4  # the low-bit cache does change the output


@pytest.fixture(scope="module")
def kvcalib_2(profile, tmp_path_factory):
    """The default model converted with kvcalib-2 on the module's profile: the folder."""
    return convert(
        None, recipe="kvcalib-2", output=tmp_path_factory.mktemp("k2") / "k2", profile=profile
    )


@pytest.fixture(scope="module")
def runtime_greedy(kvcalib_2):
    """(runtime model, prompt, new): 32 greedy tokens from kvcalib_runtime (float32, CPU, the
    reference path) after a 150-token prompt, the body growing past the 128-token window."""
    rm = kvcalib_runtime.load(kvcalib_2, device="cpu", dtype=torch.float32, use_kernels=False)
    prompt = rm.encode(topics["assert"])[:150]
    [new] = rm.generate([prompt], 32, eos_token_id=[])
    return rm, prompt, new


@pytest.mark.slow
def test_runtime_generates_what_the_simulation_predicts_with_kvcalib_2(kvcalib_2, runtime_greedy):
    """The runtime contract with the shipped 2-bit recipe (static codebook keys with outliers,
    rotated codebook values, predicted sinks): 32 greedy tokens after a 150-token prompt, the
    body growing past the 128-token window, are the argmax of eval's decode simulation; and the
    cache stores at most a fifth of fp16's bytes per token at 4K, everything included."""
    rm, prompt, new = runtime_greedy
    assert rm.kv_bytes_per_token(4096) <= rm.fp16_bytes_per_token(4096) / 5
    converted = AutoModelForCausalLM.from_pretrained(kvcalib_2, dtype=torch.float32)
    ids = torch.tensor([prompt + new])
    with torch.no_grad():
        simulated = Simulator(
            converted,
            rm.scheme,
            rm.params,
            mode="decode",
            transforms=rm.transforms,
            prefill=len(prompt),
        )(ids)
    assert simulated[0, len(prompt) - 1 : -1].argmax(-1).tolist() == new


@pytest.mark.slow
def test_transformers_generate_through_the_side_car_is_the_runtime(kvcalib_2, runtime_greedy):
    """A user's path: the converted folder loaded in transformers, generating with
    `past_key_values=QuantizedKVCache.from_checkpoint(...)`, gives the runtime's 32 greedy
    tokens on the same folder (float32, CPU, same prompt); and not those of an unquantized
    cache, so a cache that generate bypassed could not pass."""
    _, prompt, new = runtime_greedy
    model = AutoModelForCausalLM.from_pretrained(kvcalib_2, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as the runtime's eos_token_id=[]
    ids = torch.tensor([prompt])
    greedy = dict(max_new_tokens=len(new), do_sample=False, attention_mask=torch.ones_like(ids))
    with QuantizedKVCache.from_checkpoint(model, kvcalib_2, max_len=256) as cache:
        out = model.generate(ids, past_key_values=cache, **greedy)[0, len(prompt) :].tolist()
    assert out == new
    assert model.generate(ids, **greedy)[0, len(prompt) :].tolist() != new
