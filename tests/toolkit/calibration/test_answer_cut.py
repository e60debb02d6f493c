"""The answer probe's cut (Settings(answer_probe="cut")): it measures only the widths that
decide an allocation and extrapolates the others, and so plans what the full measurement plans.

On the long-context suite's committed profiles (every width measured) the cut's profile plans
kvcalib-2 exactly as the full one; a narrower cut (2 bits only) does not, so the check can fail
when the window misses a measurement that flips a decision."""

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.calibrate import calibrate_tiny
from support.tiny import CharTokenizer, tiny_model

from kvcalib import calibration
from kvcalib.calibration import Settings, answerprobe, retrieval
from kvcalib.calibration.layerwise import InMemory
from kvcalib.calibration.sensitivity import BITS, TENSORS
from kvcalib.cli import main
from kvcalib.core.data import calibration_tokens
from kvcalib.core.plan import plan
from kvcalib.core.profile import Profile
from kvcalib.core.recipe import load_recipe, presets

PROFILES = Path(__file__).resolve().parents[3] / "benchmarks" / "long_context"
MODELS = ("smollm2-135m", "qwen2.5-0.5b")
# presets whose allocation reads the answer loss (the others read no probe at all)
ANSWER_PRESETS = ("kvcalib-2",)


def _cut(profile: Profile, widths) -> Profile:
    """`profile` with its answer loss kept at `widths` only and the rest extrapolated."""
    t = profile.tensors
    measured = {f"sensitivity.answer.{n}": t[f"sensitivity.answer.{n}"].clone() for n in TENSORS}
    for v in measured.values():
        v[:, [j for j, b in enumerate(BITS) if b not in widths]] = 0.0
    text = {f"sensitivity.{n}": t[f"sensitivity.{n}"] for n in TENSORS}
    return Profile(profile.meta, {**t, **answerprobe.extrapolate(measured, text, widths)})


def _plan(recipe: str, profile: Profile):
    m = profile.meta["model"]
    scheme, params = plan(
        load_recipe(recipe), num_layers=m["num_layers"], head_dim=m["head_dim"], profile=profile
    )
    return scheme, sorted((k, v.tolist()) for k, v in params.tensors().items())


@pytest.mark.parametrize("model", MODELS)
def test_the_cut_plans_what_every_width_plans_on_the_committed_profiles(model):
    full = Profile.load(PROFILES / model / "profile")
    cut = _cut(full, answerprobe.WIDTHS["cut"])
    for recipe in ANSWER_PRESETS:
        assert _plan(recipe, cut) == _plan(recipe, full), recipe
    # the 3-bit measurement decides: without it the allocation moves on both models
    narrow = _cut(full, (2,))
    assert any(_plan(r, narrow)[0] != _plan(r, full)[0] for r in ANSWER_PRESETS)


def test_the_other_presets_read_no_answer_loss():
    """The cut can move only allocations that read the answer loss: every other preset that
    allocates reads the text's alone."""
    for name in presets():
        a = load_recipe(name).allocation
        if a is not None and "answer" in a.losses:
            assert name in ANSWER_PRESETS, name


def test_extrapolation_scales_the_widest_measured_width_by_the_text_ratio():
    text = {f"sensitivity.{n}": torch.tensor([[8.0, 2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
            for n in TENSORS}  # fmt: skip
    answer = {f"sensitivity.answer.{n}": torch.tensor([[3.0, 1.0, 0.0, 0.0], [5.0, 7.0, 0, 0]])
              for n in TENSORS}  # fmt: skip
    out = answerprobe.extrapolate(answer, text, (2, 3))
    for n in TENSORS:
        want = torch.tensor([[3.0, 1.0, 0.25, 0.0], [5.0, 7.0, 0.0, 0.0]])  # text 0: nothing
        torch.testing.assert_close(out[f"sensitivity.answer.{n}"], want)


def test_a_cut_probe_measures_its_widths_as_the_full_one_does():
    """The measured columns are the full probe's (one pass, fewer branches), the others 0 until
    extrapolated; the predicted work falls with the widths."""
    model = tiny_model("llama")
    prompts = retrieval.build(CharTokenizer(), calibration_tokens(CharTokenizer()), 2, 700, 0)
    lm = InMemory(model)
    hkv = model.config.num_key_value_heads
    d = model.config.hidden_size // model.config.num_attention_heads
    n = model.config.num_hidden_layers
    key_range = (torch.full((n, hkv, d), -0.5), torch.full((n, hkv, d), 0.5))
    widths = answerprobe.WIDTHS["cut"]
    with torch.no_grad():
        full = answerprobe.answer_pass(lm, prompts, prompts.context, key_range, lambda w: 0)
        cut = answerprobe.answer_pass(
            lm, prompts, prompts.context, key_range, lambda w: 0, widths=widths
        )
    kept = [j for j, b in enumerate(BITS) if b in widths]
    rest = [j for j, b in enumerate(BITS) if b not in widths]
    for name, v in full.items():
        torch.testing.assert_close(cut[name][:, kept], v[:, kept], atol=1e-6, rtol=0)
        assert bool((cut[name][:, rest] == 0).all())
        assert float(v[:, kept].abs().max()) > 1e-3  # the bound is far below what is compared
    answers = int(prompts.answer.sum())
    args = (lm, len(prompts), prompts.ids.shape[1], answers)
    assert answerprobe.work(*args, widths) < answerprobe.work(*args)


@pytest.mark.parametrize("text", ["fisher", "probe"])
def test_a_calibration_prints_the_probe_cost_and_records_its_widths(tmp_path, capfd, text):
    """With the text's Fisher sensitivity in before the answer probe, the cut; with the text's
    measured by its own probe (which runs after), every width is measured."""
    settings = Settings(sensitivity=text, sensitivity_windows=1, sensitivity_tokens=16,
                        codebook_windows=1, retrieval_prompts=2, retrieval_tokens=512)  # fmt: skip
    profile = calibrate_tiny(tmp_path / "p", settings, progress=True)
    widths = [2, 3] if text == "fisher" else list(BITS)
    printed = capfd.readouterr().err
    assert f"answer probe: 2 prompts x 512 tokens at {', '.join(map(str, widths))} bits" in printed
    assert "with --answer-probe all)" in printed
    answer = profile.meta["probe"]["answer"]
    assert answer["widths"] == widths and ("extrapolated" in answer) == (text == "fisher")
    t = profile.tensors
    for n in TENSORS:
        a, text_loss = t[f"sensitivity.answer.{n}"], t[f"sensitivity.{n}"]
        assert float(a[:, :2].abs().sum()) > 0  # measured
        if text == "fisher":
            want = a[:, 1:2] * text_loss[:, 2:] / text_loss[:, 1:2]
            torch.testing.assert_close(a[:, 2:], want)


def test_cli_answer_probe_option(tmp_path, monkeypatch):
    """`--answer-probe all` keeps the full measurement; the cut is the default; another value
    is refused by Settings."""
    seen = []
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: seen.append(k) or 1 / 0)
    base = ["calibrate", str(tmp_path), "-o", str(tmp_path / "p")]  # a model path that exists
    for extra in ([], ["--answer-probe", "all"]):
        CliRunner().invoke(main, base + extra)
    assert [k["settings"].answer_probe for k in seen] == ["cut", "all"]
    with pytest.raises(ValueError, match="answer_probe"):
        Settings(answer_probe="some")
