"""Profiles: the folder round-trips; stale or foreign profiles are refused with the fix; the API
kvcalib.core.plan calls returns what it documents; the CLI writes a profile that `inspect` reads."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.tiny import save_with_tokenizer, tiny_model

from kvcalib import calibration
from kvcalib.api import default_profile
from kvcalib.calibration import Settings, calibrate_model
from kvcalib.cli import main
from kvcalib.core.models import ModelSource
from kvcalib.core.plan import plan
from kvcalib.core.profile import Profile
from kvcalib.core.recipe import load_recipe, parse_recipe
from kvcalib.errors import ProfileError
from kvcalib.inspect import profile_summary

SOURCE = ModelSource("tiny", Path("tiny"), "f" * 64)


class CharTokenizer:
    """Characters as token ids below 128: a tokenizer for the tiny models' vocabulary."""

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [ord(c) % 128 for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """A complete profile (all phases) of a tiny Llama: 2 layers, 2 KV heads of 16 channels."""
    out = tmp_path_factory.mktemp("tiny") / "profile"
    settings = Settings(sensitivity_windows=1, sensitivity_tokens=16, codebook_windows=1)
    return calibrate_model(
        tiny_model("llama"),
        CharTokenizer(),
        out,
        source=SOURCE,
        num_samples=2,
        seq_len=32,
        settings=settings,
        progress=False,
    )


def _copy(profile, tmp_path, name="copy") -> Path:
    return Profile(json.loads(json.dumps(profile.meta)), dict(profile.tensors)).save(
        tmp_path / name
    )


# -- files ---------------------------------------------------------------------------------------


def test_round_trip(profile, tmp_path):
    loaded = Profile.load(_copy(profile, tmp_path))
    assert loaded.meta == profile.meta
    assert loaded.tensors.keys() == profile.tensors.keys()
    for k, v in profile.tensors.items():  # bit-exact (NaN: no later sinks in key_groups)
        torch.testing.assert_close(loaded.tensors[k], v, rtol=0, atol=0, equal_nan=True, msg=k)
    assert loaded.fingerprint == SOURCE.fingerprint and loaded.path == tmp_path / "copy"


def test_format_version_mismatch_says_recalibrate(profile, tmp_path):
    path = _copy(profile, tmp_path)
    meta = json.loads((path / "profile.json").read_text())
    meta["format_version"] = 0
    (path / "profile.json").write_text(json.dumps(meta))
    with pytest.raises(
        ProfileError,
        match=r"has format version 0; this kvcalib reads 1: "
        r"recalibrate with kvcalib calibrate tiny -o",
    ):
        Profile.load(path)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("folder", "no such folder; create it with kvcalib calibrate"),
        ("profile.safetensors", "profile.safetensors is missing"),
        ("json", "profile.json is not valid JSON"),
    ],
)
def test_broken_profiles_name_the_fix(profile, tmp_path, damage, message):
    path = _copy(profile, tmp_path)
    if damage == "folder":
        path = tmp_path / "nowhere"
    elif damage == "json":
        (path / "profile.json").write_text("{not json")
    else:
        (path / damage).unlink()
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)


def test_fingerprint_mismatch(profile):
    profile.check_model(SOURCE)
    other = ModelSource("smollm2-135m", Path("x"), "a" * 64)
    with pytest.raises(
        ProfileError,
        match=r"calibrated on model tiny \(fingerprint ffff.*\), "
        r"not smollm2-135m \(fingerprint aaaa.*\): recalibrate",
    ):
        profile.check_model(other)


# -- the planning API ----------------------------------------------------------------------------


def test_ranges_are_non_sink_quantiles_and_narrow_with_outliers(profile):
    t = profile.tensors
    lo, hi = profile.range("key", 1, position="pre_rope")
    assert lo.shape == hi.shape == (2, 16) and lo.dtype == torch.float32
    assert torch.equal(lo, t["key_pre_rope.nonsink.min"][1])  # no outliers: the extremes
    assert torch.equal(hi, t["key_pre_rope.nonsink.max"][1])
    previous = profile.range("key", 1, position="post_rope")
    for f in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05):  # leaving more out never widens it
        lo, hi = profile.range("key", 1, position="post_rope", outliers=f)
        assert (lo >= previous[0]).all() and (hi <= previous[1]).all() and (lo <= hi).all()
        previous = (lo, hi)
    assert torch.equal(
        profile.range("value", 0, position="pre_rope")[0], profile.range("value", 0)[0]
    )
    with pytest.raises(ProfileError, match=r"outliers = 0.03; the calibrated fractions are 0.0"):
        profile.range("key", 0, outliers=0.03)
    with pytest.raises(ProfileError, match="layer 2 out of range; the model has 2 layers"):
        profile.range("key", 2)


def test_smoothing_is_rotary_pair_equal_with_unit_geometric_mean(profile):
    s = profile.smoothing(0, 0.5, position="pre_rope")
    assert s.shape == (2, 16) and (s > 0).all()
    assert torch.equal(s[:, :8], s[:, 8:])  # RoPE rotates j with j + D/2: one scale per pair
    torch.testing.assert_close(s.log().mean(-1), torch.zeros(2), atol=1e-6, rtol=0)
    absmax = profile.tensors["key_pre_rope.nonsink.absmax"][0]
    pair = torch.maximum(absmax[:, :8], absmax[:, 8:])
    order = pair.argsort(-1)  # s_j = absmax_j ** alpha: monotone in the pair's absmax
    assert (s[:, :8].gather(-1, order).diff(dim=-1) >= 0).all()
    assert torch.equal(profile.smoothing(0, 0.0, position="post_rope"), torch.ones(2, 16))


def test_codebooks_and_sensitivity(profile):
    levels = profile.codebook("key:static:pre_rope:outliers0.01", 1, 3)
    assert levels.shape == (8,) and (levels.diff() >= 0).all()
    with pytest.raises(
        ProfileError,
        match=r"no 3-bit codebook for 'key:token:pre_rope'; it has "
        r"codebooks at \[2, 3, 4\] bits for key:static:pre_rope:outliers0.01, ",
    ):
        profile.codebook("key:token:pre_rope", 1, 3)
    assert profile.sensitivity("value", 1, 2) >= profile.sensitivity("value", 1, 4) >= 0
    assert profile.sensitivity("key", 0, 8) <= profile.sensitivity("key", 0, 4)  # 8: probed too
    with pytest.raises(ProfileError, match=r"no sensitivity at 5 bits; calibrated: \[2, 3, 4, 8\]"):
        profile.sensitivity("key", 0, 5)


def test_plan_reads_everything_it_needs(profile):
    scheme, params = plan(load_recipe("kvquant-3"), num_layers=2, profile=profile)
    assert set(params.key_range) == set(params.key_codebook) == {0, 1}
    recipe = parse_recipe(
        {
            "name": "allocated",
            "key": {"bits": 3, "smooth": 0.5, "position": "pre_rope"},
            "value": {"bits": 3},
            "allocation": {"budget": 3.0},
        }
    )
    scheme, params = plan(recipe, num_layers=2, profile=profile)
    assert sum(layer.key.bits + layer.value.bits for layer in scheme.layers) <= 3 * 4
    assert set(params.key_smooth) == {0, 1}
    predicted = parse_recipe(
        {"name": "p", "key": {"bits": 2}, "sinks": {"predicted": True, "budget": 2}}
    )
    with pytest.raises(ProfileError, match="has no sink predictor"):  # random weights: no sinks
        plan(predicted, num_layers=2, profile=profile)


def test_phases_left_out_are_named(tmp_path):
    stats_only = calibrate_model(
        tiny_model("llama"),
        CharTokenizer(),
        tmp_path / "p",
        source=SOURCE,
        num_samples=1,
        seq_len=32,
        phases=("stats",),
        progress=False,
    )
    with pytest.raises(ProfileError, match="has no sensitivity phase"):
        stats_only.sensitivity("key", 0, 2)
    with pytest.raises(ProfileError, match=r"no codebooks \(calibrated without the codebooks"):
        stats_only.codebook("value:token", 0, 2)


def test_allocation_without_sensitivity_falls_back_to_uniform_bits(tmp_path, caplog):
    # --sensitivity none: an allocating recipe still plans, with its nominal bits in every layer,
    # and says so
    unmeasured = calibrate_model(
        tiny_model("llama"),
        CharTokenizer(),
        tmp_path / "p",
        source=SOURCE,
        num_samples=1,
        seq_len=32,
        phases=("stats", "codebooks"),
        settings=Settings(codebook_windows=1),
        progress=False,
    )
    assert unmeasured.meta["probe"] is None
    recipe = parse_recipe(
        {"name": "allocated", "key": {"bits": 3}, "value": {"bits": 2}, "allocation": {"budget": 3}}
    )
    scheme, _ = plan(recipe, num_layers=2, profile=unmeasured)
    assert {(layer.key.bits, layer.value.bits) for layer in scheme.layers} == {(3, 2)}
    assert "the profile has none (calibrated with --sensitivity none)" in caplog.text


# -- the default profile, summary, CLI ------------------------------------------------------


def test_the_default_profile_is_announced_and_calibrated_once(profile, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_calibrate(model, output_dir, progress=True):
        calls.append(model)
        return Profile(profile.meta, profile.tensors).save(output_dir)

    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    lines = []
    with pytest.raises(ProfileError, match="--no-calibrate was given"):
        default_profile(SOURCE, calibrate_missing=False, log=lines.append)
    assert calls == [] and lines == []
    first = default_profile(SOURCE, log=lines.append)
    second = default_profile(SOURCE, log=lines.append)
    assert calls == [str(SOURCE.path)] and first.path == second.path
    assert len(lines) == 1 and "no --profile given" in lines[0]  # announced once, before
    assert default_profile(SOURCE, first.path).path == first.path
    with pytest.raises(ProfileError, match="was calibrated on model tiny"):
        default_profile(ModelSource("b", Path("b"), "b" * 64), first.path)


@pytest.mark.parametrize("command", ["eval", "convert"])
def test_no_calibrate_stops_before_any_calibration(command, tmp_path, monkeypatch):
    # issue 16: without --profile both announce the default calibration; --no-calibrate exits 2
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail())
    src = save_with_tokenizer(tiny_model("llama"), tmp_path / "src")
    args = [command, str(src), "--recipe", "kvcalib-2", "--no-calibrate"]
    args += ["-o", str(tmp_path / "out")] if command == "convert" else []
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "no --profile given" in result.output and "--no-calibrate was given" in result.output
    cost = sys.modules["kvcalib.api"].OTHER_COST  # how long the default calibration takes
    assert f"`kvcalib calibrate`; {cost}" in result.output
    assert not (tmp_path / "out").exists()


def test_a_context_shorter_than_the_default_calibration_is_refused_before_it(tmp_path, monkeypatch):
    """The default calibration reads windows of 512 tokens: on a shorter model, the refusal
    says how to calibrate it and names --profile (it said "--seq-len 512 exceeds the model's
    context", an option convert and lm-eval do not have)."""
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail())
    src = save_with_tokenizer(tiny_model("llama", max_position_embeddings=256), tmp_path / "src")
    args = ["convert", str(src), "--recipe", "kvcalib-2", "-o", str(tmp_path / "out")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == (
        "error: no --profile given: the recipe needs calibrated tensors, and the default "
        f"calibration reads windows of 512 tokens, longer than {src}'s context of 256: run "
        f"kvcalib calibrate {src} -o DIR --seq-len 256 and pass --profile DIR"
    )
    assert not (tmp_path / "out").exists()


def test_the_default_calibration_cost_is_the_docs():
    """The note said "about a minute" where the README said 36 s: one measured number, the
    committed record of bench_calibrate.py (benchmarks/calibration-cost/), stated in
    docs/models.md (its table generated from the records), in what `kvcalib eval` says before it
    calibrates and in `kvcalib calibrate --help`; the record measured today's default."""
    from kvcalib import api
    from kvcalib.cli import main

    root = Path(__file__).resolve().parents[3]
    record = json.loads(
        (root / "benchmarks" / "calibration-cost" / "smollm2-135m.json").read_text()
    )
    assert record["settings"] == dataclasses.asdict(Settings())
    seconds, times = f"{record['calibrate_seconds']:.0f}", f"{record['ratio']:.1f}"
    assert (
        f"{seconds} s on 2 CPU cores for smollm2-135m, {times}x a plain forward"
    ) == api.DEFAULT_COST
    docs = " ".join((root / "docs" / "models.md").read_text().split())
    assert f"| smollm2-135m | {record['date']} |" in docs
    helped = " ".join(CliRunner().invoke(main, ["calibrate", "--help"]).output.split())
    probe = f"{record['phases']['answer probe'] / min(record['forward_seconds']):.1f}"
    assert f"the screen is {probe} of the default calibration's {times} plain forwards" in helped


def test_the_cost_models_committed_predictions_are_todays():
    # docs/models.md states the cost model's predictions from benchmarks/calibration-cost/
    # predicted.json: a change to the default settings or to the probe's arithmetic that leaves
    # the committed file behind fails here (`python benchmarks/calibration_cost.py --json ...`).
    import importlib.util

    root = Path(__file__).resolve().parents[3] / "benchmarks"
    spec = importlib.util.spec_from_file_location("calibration_cost", root / "calibration_cost.py")
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    committed = json.loads((root / "calibration-cost" / "predicted.json").read_text())
    assert committed["rows"] == cost.predictions()
    assert committed["settings"]["retrieval_prompts"] == Settings().retrieval_prompts
    screen = [r for r in committed["rows"] if r["mode"] == "screen"]
    assert len(screen) == 3 and all(0 < r["phases"]["answer probe"] < 5 for r in screen)


def test_cli_calibrate_sensitivity_and_window_options(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: seen.append(k) or 1 / 0)
    base = ["calibrate", str(tmp_path), "-o", str(tmp_path / "p")]  # a model path that exists
    for extra in (
        [],
        ["--sensitivity", "none", "--gradient-windows", "3"],
        ["--sensitivity", "probe", "--gradient-windows", "3", "--codebook-windows", "1"],
        ["--answer-sensitivity", "fisher"],
        ["--answer-codebooks", "--vector-ablation"],
        ["--retrieval-prompts", "16"],
        ["--retrieval-prompts", "0"],
    ):
        CliRunner().invoke(main, base + extra)
    got = [(k["phases"], k["settings"]) for k in seen]
    assert [
        (s.sensitivity, s.sensitivity_windows, s.codebook_windows, s.answer_sensitivity)
        for _, s in got
    ] == [
        ("fisher", Settings().sensitivity_windows, Settings().codebook_windows, "probe"),
        ("fisher", 3, 3, "probe"),
        ("probe", 3, 1, "probe"),
        ("fisher", Settings().sensitivity_windows, Settings().codebook_windows, "fisher"),
        ("fisher", Settings().sensitivity_windows, Settings().codebook_windows, "probe"),
        ("fisher", Settings().sensitivity_windows, Settings().codebook_windows, "probe"),
        ("fisher", Settings().sensitivity_windows, Settings().codebook_windows, "probe"),
    ]
    assert [(s.answer_codebooks, s.vector_ablation) for _, s in got] == [(False, False)] * 4 + [
        (True, True)
    ] + [(False, False)] * 2
    prompts = [s.retrieval_prompts for _, s in got]
    assert prompts == [Settings().retrieval_prompts] * 5 + [16, 0]
    assert [phases for phases, _ in got] == [
        ("stats", "sensitivity", "codebooks"),
        ("stats", "codebooks"),
        ("stats", "sensitivity", "codebooks"),
        ("stats", "sensitivity", "codebooks"),
        ("stats", "sensitivity", "codebooks"),
    ] + [("stats", "sensitivity", "codebooks")] * 2


def test_summary_names_the_findings(profile):
    text = profile_summary(profile.path)
    for topic in (
        "model",
        "data",
        "token 0",
        "outliers",
        "later sinks",
        "key error",
        "massive",
        "predictor",
        "sensitivity",
        "codebooks",
        "timings",
    ):
        assert f"\n{topic} " in f"\n{text}", topic


def test_cli_calibrate_then_inspect(real_model, tmp_path):
    model_dir, out = tmp_path / "model", tmp_path / "profile"
    tiny_model("llama", vocab_size=real_model[1].vocab_size).save_pretrained(model_dir)
    real_model[1].save_pretrained(model_dir)  # the real tokenizer for the big vocabulary
    args = ["calibrate", str(model_dir), "-o", str(out), "--num-samples", "2", "--seq-len", "32"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert {"profile.json", "profile.safetensors", "report.html"} <= {p.name for p in out.iterdir()}
    assert "predictor" in result.output and "timings" in result.output
    result = CliRunner().invoke(main, ["inspect", str(out)])
    assert result.exit_code == 0 and "token 0      a sink in" in result.output
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert result.output.strip() == f"error: output {out} exists; pass --force to replace it"
