"""A peer is measured as on the original model: `kvcalib eval CONVERTED_DIR --recipe kivi-2`
undoes the transforms kvcalib fused into the weights (key smoothing, the per-head value
rotation) before quantizing, so it scores what kivi-2 scores on the source model. quarot-kv4
keeps the value rotation the weights already hold (its own, same seed) and has the smoothing
undone. Same quantizer inputs up to fp32 rounding (measured: KL equal to 1e-7 relative; a code
flipped at a level boundary could move it more): KL within 0.1% and ppl within 0.01% of the
source's. Quantizing the converted weights as given (the old behaviour) moves kivi-2's KL by
~30%, so the equality is not vacuous."""

import pytest
import torch
from support.tiny import save_with_tokenizer, tiny_model

from kvcalib.api import evaluate
from kvcalib.conversion.convert import convert
from kvcalib.core.models import load_model
from kvcalib.evaluation.score import candidates, score
from kvcalib_runtime.model.geometry import Geometry

CONVERT_TOML = """name = "smooth-rotate"
[key]
bits = 4
smooth = 0.5
[value]
bits = 4
rotation = "hadamard"
"""
RUN = dict(seq_len=96, windows=2, mode="fake", progress=False)


class SmoothingProfile:
    """What convert and plan ask of a profile for key smoothing: per-head scales equal on RoPE
    pairs, far from 1 so that undoing them matters."""

    fingerprint, path = "fake-profile", None

    def __init__(self, model):
        self.kv_heads = model.config.num_key_value_heads
        self.d = Geometry.from_config(model.config).head_dim

    def check_model(self, source):
        pass

    def smoothing(self, layer, alpha, position="post_rope"):
        g = torch.Generator().manual_seed(100 + layer)
        half = torch.exp(torch.randn(self.kv_heads, self.d // 2, generator=g))
        return torch.cat([half, half], -1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers")
    model = tiny_model(
        "llama", seed=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2
    )  # heads of 32 channels: one KIVI value group
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    src = save_with_tokenizer(model, tmp / "src")
    recipe = tmp / "convert.toml"
    recipe.write_text(CONVERT_TOML)
    out = convert(src, recipe=recipe, output=tmp / "out", profile=SmoothingProfile(model))
    return src, out


def _by_name(results):
    return {r.recipe: r for r in results}


@pytest.mark.parametrize("peer", ["kivi-2", "quarot-kv4"])
def test_a_peer_on_the_converted_folder_scores_as_on_its_source(folders, peer):
    src, out = folders
    on_source = _by_name(evaluate(src, [peer], **RUN))[peer]
    on_converted = _by_name(evaluate(out, [peer], **RUN))
    assert set(on_converted) == {"smooth-rotate (converted)", peer}
    ours = on_converted[peer]
    assert ours.ppl_fp == pytest.approx(on_source.ppl_fp, rel=1e-5)  # the same model
    assert ours.kld == pytest.approx(on_source.kld, rel=1e-3)
    assert ours.ppl == pytest.approx(on_source.ppl, rel=1e-4)
    assert on_source.kld > 1e-3  # the peer does quantize


def test_quantizing_the_converted_weights_as_given_is_another_number(folders):
    src, out = folders
    on_source = _by_name(evaluate(src, ["kivi-2"], **RUN))["kivi-2"]
    model, tokenizer = load_model(out)
    (as_given,) = score(model, tokenizer, candidates(model, ["kivi-2"]), **RUN)
    assert abs(as_given.kld - on_source.kld) > 0.1 * on_source.kld
