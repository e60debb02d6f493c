"""The shipped kvcalib-* recipes on the real default model: each converts, and the converted
folder evaluates as the recipe does online (what `kvcalib eval CONVERTED_DIR` reports)."""

import pytest
import torch

from kvcalib.calibration import Settings, calibrate_model
from kvcalib.conversion import convert
from kvcalib.data import eval_windows
from kvcalib.plan import plan_for_model
from kvcalib.simulate import Simulator
from kvcalib_runtime.format import read_checkpoint

# Every phase, small: enough windows for ranges, codebooks, a sink predictor and sensitivities.
FAST = Settings(sensitivity_windows=1, sensitivity_tokens=32, codebook_windows=1)


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
@pytest.mark.parametrize("name", ["kvcalib-2", "kvcalib-3", "kvcalib-4"])
def test_converted_preset_evaluates_as_the_online_recipe(name, real_model, profile, tmp_path):
    from transformers import AutoModelForCausalLM

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
        fused = Simulator(converted, ckpt.scheme, ckpt.params, mode="decode", fused=ckpt.fused)(ids)
    error = _kl(exact, online)
    # The fused rotation only reorders fp32 sums: a few codes flip at level boundaries, which
    # moves the output by far less than quantization itself does.
    assert _kl(online, fused) < 0.05 * error
    assert error > 1e-4  # the low-bit cache does change the output
