"""The answer probe's modes (answerprobe.MODES): they measure only what decides an allocation and
extrapolate the rest, and so plan what the full measurement plans.

On the long-context suite's committed profiles (every width measured) the cut's profile (2 and 3
bits for every tensor) and the screen's (2 bits for every tensor, 3 for the third with the
largest 2-bit loss) plan kvcalib-2 exactly as the full one; 2 bits alone does not, so the check
can fail when a mode misses a measurement that flips a decision."""

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


def _measured(profile: Profile, widths, screen: bool) -> dict:
    """Which entries a probe measuring every tensor at `widths` (and, with `screen`, the
    screened third one width up) would have measured, from the full measurement's losses."""
    t, n = profile.tensors, profile.meta["model"]["num_layers"]
    out = {name: torch.zeros(n, len(BITS), dtype=torch.bool) for name in TENSORS}
    for name in TENSORS:
        out[name][:, [BITS.index(b) for b in widths]] = True
    if screen:
        w = BITS.index(max(widths))
        loss = {(name, i): float(t[f"sensitivity.answer.{name}"][i, w]) for name in TENSORS
                for i in range(n)}  # fmt: skip
        for name, i in sorted(loss, key=loss.get, reverse=True)[: answerprobe.screened(n)]:
            out[name][i, w + 1] = True
    return out


def _cut(profile: Profile, widths, screen: bool = False) -> Profile:
    """`profile` with its answer loss kept where a probe in that mode measures and the rest
    extrapolated."""
    t = profile.tensors
    which = _measured(profile, widths, screen)
    answer = {}
    for name in TENSORS:
        a = t[f"sensitivity.answer.{name}"].clone()
        a[~which[name]] = 0.0
        answer[f"sensitivity.answer.{name}"] = a
    text = {f"sensitivity.{n}": t[f"sensitivity.{n}"] for n in TENSORS}
    return Profile(profile.meta, {**t, **answerprobe.extrapolate(answer, text, which)})


def _plan(recipe: str, profile: Profile):
    m = profile.meta["model"]
    scheme, params = plan(
        load_recipe(recipe), num_layers=m["num_layers"], head_dim=m["head_dim"], profile=profile
    )
    return scheme, sorted((k, v.tolist()) for k, v in params.tensors().items())


@pytest.mark.parametrize("model", MODELS)
def test_the_cut_and_the_screen_plan_what_every_width_plans_on_the_committed_profiles(model):
    full = Profile.load(PROFILES / model / "profile")
    for mode in ("cut", "screen"):
        partial = _cut(full, *answerprobe.MODES[mode])
        for recipe in ANSWER_PRESETS:
            assert _plan(recipe, partial) == _plan(recipe, full), (mode, recipe)
    # the 3-bit measurement decides: without it the allocation moves on both models
    narrow = _cut(full, (2,))
    assert any(_plan(r, narrow)[0] != _plan(r, full)[0] for r in ANSWER_PRESETS)


def _bits(recipe: str, profile: Profile) -> list:
    scheme, _ = _plan(recipe, profile)
    return [(layer.key.bits, layer.value.bits) for layer in scheme.layers]


def test_eight_prompts_plan_what_sixteen_plan_on_smollm2_and_not_on_qwen():
    """The default calibration reads 8 retrieval prompts (issue 56): on SmolLM2-135M a default
    calibration with 8 gives kvcalib-2 the bits the committed profile's 16 give (so its records
    stand for today's default), on Qwen2.5-0.5B 8 move them (what long_context_probe8 measured,
    paired). The profiles say how many prompts they read."""
    smol = Profile.load(PROFILES / "smollm2-135m" / "profile")
    smol8 = Profile.load(PROFILES / "smollm2-135m" / "profile-8-prompts")
    qwen = Profile.load(PROFILES / "qwen2.5-0.5b" / "profile")
    qwen8 = Profile.load(PROFILES / "qwen2.5-0.5b" / "profile-probe8")
    read = [p.meta["probe"]["answer"]["prompts"] for p in (smol, smol8, qwen, qwen8)]
    assert read == [16, 8, 16, 8]
    assert smol8.meta["settings"]["retrieval_prompts"] == Settings().retrieval_prompts
    for recipe in ANSWER_PRESETS:
        assert _bits(recipe, smol8) == _bits(recipe, smol)
        assert _bits(recipe, qwen8) != _bits(recipe, qwen)


def test_the_other_presets_read_no_answer_loss():
    """The cut can move only allocations that read the answer loss: every other preset that
    allocates reads the text's alone."""
    for name in presets():
        a = load_recipe(name).allocation
        if a is not None and "answer" in a.losses:
            assert name in ANSWER_PRESETS, name


def test_extrapolation_scales_each_rows_widest_measured_width_by_the_text_ratio():
    text_rows = torch.tensor([[8.0, 2.0, 0.5, 0.0], [4.0, 2.0, 1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    answer_rows = torch.tensor([[3.0, 1.0, 0, 0], [6.0, 0, 0, 0], [5.0, 7.0, 0, 0]])
    text = {f"sensitivity.{n}": text_rows for n in TENSORS}
    answer = {f"sensitivity.answer.{n}": answer_rows for n in TENSORS}
    measured = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    out = answerprobe.extrapolate(answer, text, dict.fromkeys(TENSORS, measured))
    for n in TENSORS:
        # row 0 from its 3-bit loss, row 1 (screened out) from its 2-bit one, row 2: text 0
        want = torch.tensor([[3.0, 1.0, 0.25, 0.0], [6.0, 3.0, 1.5, 0.75], [5.0, 7.0, 0, 0]])
        torch.testing.assert_close(out[f"sensitivity.answer.{n}"], want)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_cut_and_the_screen_measure_what_the_full_probe_measures(arch):
    """The measured entries are the full probe's bit for bit (one pass with fewer branches; the
    screen's second round from the first round's kept prompts, no second forward of them), the
    others 0 until extrapolated; the screen re-measures the screened tensors with the largest
    2-bit loss; the predicted work falls from all to cut to screen and is what the pass counts
    (the screen's second round within the estimate's spread of depths)."""
    model = tiny_model(arch)
    prompts = retrieval.build(CharTokenizer(), calibration_tokens(CharTokenizer()), 2, 700, 0)
    lm = InMemory(model)
    hkv = model.config.num_key_value_heads
    d = model.config.hidden_size // model.config.num_attention_heads
    n = model.config.num_hidden_layers
    key_range = (torch.full((n, hkv, d), -0.5), torch.full((n, hkv, d), 0.5))
    args = (lm, len(prompts), prompts.ids.shape[1], int(prompts.answer.sum()))
    got, spent = {}, {}
    with torch.no_grad():
        for mode in answerprobe.MODES:
            spent[mode] = []
            got[mode] = answerprobe.answer_pass(
                lm, prompts, prompts.context, key_range, spent[mode].append, mode
            )
    full, everything = got["all"]
    assert all(bool(m.all()) for m in everything.values())
    for mode in ("cut", "screen"):
        losses, which = got[mode]
        for name in TENSORS:
            m, v, f = (
                which[name],
                losses[f"sensitivity.answer.{name}"],
                full[f"sensitivity.answer.{name}"],
            )
            assert torch.equal(v[m], f[m]), (mode, name)
            assert bool((v[~m] == 0).all())
            assert float(f.abs().max()) > 1e-3  # what is compared is no trivial zero
    _, which = got["screen"]
    again = {(name, i) for name in TENSORS for i in range(n) if which[name][i, 1]}
    assert len(again) == answerprobe.screened(n)
    two_bit = {(name, i): float(full[f"sensitivity.answer.{name}"][i, 0]) for name in TENSORS
               for i in range(n)}  # fmt: skip
    assert min(two_bit[k] for k in again) >= max(two_bit[k] for k in two_bit.keys() - again)
    work = {mode: answerprobe.work(*args, mode) for mode in answerprobe.MODES}
    assert work["all"] > work["cut"] > work["screen"]
    for mode in ("all", "cut"):
        assert sum(spent[mode]) == work[mode]
    assert abs(sum(spent["screen"]) / work["screen"] - 1) < 0.1


@pytest.mark.parametrize("text", ["fisher", "probe"])
def test_a_calibration_prints_the_probe_cost_and_records_what_it_measured(tmp_path, capfd, text):
    """With the text's Fisher sensitivity in before the answer probe, the screen (the default);
    with the text's measured by its own probe (which runs after), every width is measured."""
    settings = Settings(sensitivity=text, sensitivity_windows=1, sensitivity_tokens=16,
                        codebook_windows=1, retrieval_prompts=2, retrieval_tokens=512)  # fmt: skip
    profile = calibrate_tiny(tmp_path / "p", settings, progress=True)
    n = profile.meta["model"]["num_layers"]
    printed = capfd.readouterr().err
    answer = profile.meta["probe"]["answer"]
    if text == "fisher":
        again = answerprobe.screened(n)
        what = f"every tensor at 2 bits, the {again} with the largest loss at 3 too"
        assert answer["probe"] == "screen" and answer["widths"] == [2]
        assert answer["screened"]["bits"] == 3
        assert sum(len(answer["screened"][name]) for name in TENSORS) == again
    else:
        what = "every tensor at 2, 3, 4, 8 bits"
        assert answer["probe"] == "all" and answer["widths"] == list(BITS)
    assert f"answer probe: 2 prompts x 512 tokens, {what}, predicted" in printed
    assert "with --answer-probe all)" in printed
    assert ("extrapolated" in answer) == (text == "fisher")
    t = profile.tensors
    for name in TENSORS:
        a, text_loss = t[f"sensitivity.answer.{name}"], t[f"sensitivity.{name}"]
        assert float(a[:, 0].abs().sum()) > 0  # measured
        if text == "fisher":
            for i in range(n):
                w = 1 if i in answer["screened"][name] else 0
                want = a[i, w] * text_loss[i, w + 1 :] / text_loss[i, w]
                torch.testing.assert_close(a[i, w + 1 :], want)


def test_cli_answer_probe_option(tmp_path, monkeypatch):
    """The screen is the default, `--answer-probe cut` and `all` measure more; another value is
    refused by Settings."""
    seen = []
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: seen.append(k) or 1 / 0)
    base = ["calibrate", str(tmp_path), "-o", str(tmp_path / "p")]  # a model path that exists
    for extra in ([], ["--answer-probe", "cut"], ["--answer-probe", "all"]):
        CliRunner().invoke(main, base + extra)
    assert [k["settings"].answer_probe for k in seen] == ["screen", "cut", "all"]
    with pytest.raises(ValueError, match="answer_probe"):
        Settings(answer_probe="some")
