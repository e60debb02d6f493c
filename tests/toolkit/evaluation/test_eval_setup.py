"""What `kvcalib eval` prints and writes says what it measured: a header line with the setup,
full precision as the first row, each recipe's residual window and kept sinks; the JSON keeps
one object per recipe and adds the setup to each. `--residual` gives every recipe the same
window, with flush blocks by the recipe's own rule. On a tiny random model (fast)."""

import importlib.util
import json

import pytest
from click.testing import CliRunner
from support.tiny import save_with_tokenizer, tiny_model

from kvcalib.cli import main

SINKS = 'name = "sinky"\n[key]\nbits = 2\n[value]\nbits = 2\n[sinks]\nfirst = 1\n'


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = tiny_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("eval") / "tiny")


def _eval(folder, tmp_path, *extra):
    recipe = tmp_path / "sinky.toml"
    recipe.write_text(SINKS)
    out = tmp_path / "r.json"
    args = ["eval", str(folder), "--recipe", "kivi-2", "--recipe", str(recipe)]
    args += ["--seq-len", "96", "--windows", "1", "--json", str(out), *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.stdout, {r["recipe"]: r for r in json.loads(out.read_text())}


def test_each_recipe_keeps_its_own_window_by_default(folder, tmp_path):
    output, rows = _eval(folder, tmp_path)
    lines = output.splitlines()
    assert lines[0] == (
        f"model {folder} · text builtin (Python docs, evaluation split) · 1 windows × 96 tokens "
        "· decode mode · each recipe's own residual window (column R)"
    )
    assert lines[2] == "| recipe | mode | bits/elem | R | sinks | ppl | Δppl | KLD | top-1 |"
    assert lines[4].startswith("| full precision | - | 16.00 | - | - | ")
    assert "| kivi-2 | decode | 3.00 | 128 | none |" in output
    assert "| sinky | decode | 3.00 | 0 | first 1 |" in output
    # 96 tokens inside its 128-token window: all exact (fp32 reordering only, ~1e-9)
    assert rows["kivi-2"]["kld"] < 1e-6
    for row in rows.values():  # the per-recipe objects keep their keys and gain the setup
        assert {"recipe", "mode", "ppl", "ppl_fp", "kld", "bits_per_element", "residual"} <= set(
            row
        )
        assert row["setup"] == {
            "model": str(folder),
            "data": "builtin (Python docs, evaluation split)",
            "windows": 1,
            "seq_len": 96,
            "mode": "decode",
            "residual": None,
        }


def test_residual_gives_every_recipe_the_same_window(folder, tmp_path):
    output, rows = _eval(folder, tmp_path, "--residual", "32")
    assert output.splitlines()[0].endswith("· decode mode · residual window 32 for every recipe")
    assert "| kivi-2 | decode | 3.00 | 32 | none |" in output
    assert "| sinky | decode | 3.00 | 32 | first 1 |" in output  # sinks stay the recipe's
    assert {r["residual"] for r in rows.values()} == {32}
    assert rows["kivi-2"]["setup"]["residual"] == 32
    assert rows["kivi-2"]["kld"] > 1e-4  # tokens past the window are quantized now


def test_fake_mode_says_that_every_position_is_quantized(folder, tmp_path):
    output, rows = _eval(folder, tmp_path, "--mode", "fake")
    assert output.splitlines()[0].endswith(
        "· fake mode · every position quantized (external peers: decode, column R)"
    )
    assert "| kivi-2 | fake | 3.00 | - | none |" in output
    assert rows["kivi-2"]["setup"]["mode"] == "fake" and rows["kivi-2"]["kld"] > 1e-3
    # no window in fake mode: the JSON records none (it said kivi-2's 128)
    assert rows["kivi-2"]["residual"] is None and rows["sinky"]["residual"] is None
    assert rows["kivi-2"]["setup"]["residual"] is None


def test_residual_in_fake_mode_is_refused_not_ignored(folder):
    args = ["eval", str(folder), "--recipe", "kivi-2", "--mode", "fake", "--residual", "32"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: --residual 32 does not apply to --mode fake, which quantizes every position "
        "(no window): drop --residual, or use --mode decode"
    )


@pytest.mark.skipif(
    importlib.util.find_spec("optimum.quanto") is None, reason="needs the peers extra"
)
def test_an_hf_quanto_peer_runs_from_the_cli(folder, tmp_path):
    """The CLI plans recipes from config.json before the load: the external peer's check read
    model.config of that dict and ended in AttributeError."""
    out = tmp_path / "r.json"
    args = ["eval", str(folder), "--recipe", "hf-quanto-2", "--seq-len", "32", "--windows", "1"]
    result = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "| hf-quanto-2 | decode | 2.50 | 128 | none |" in result.stdout
    (row,) = [r for r in json.loads(out.read_text()) if r["recipe"] == "hf-quanto-2"]
    assert row["mode"] == "decode" and row["residual"] == 128


def test_a_window_that_breaks_a_recipes_flush_rule_is_refused(folder):
    args = ["eval", str(folder), "--recipe", "kivi-2", "--residual", "20", "--seq-len", "64"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "recipe kivi-2 with --residual 20: its keys are grouped over 32 tokens" in result.output
    assert "use a positive multiple of 32" in result.output


def test_no_recipe_points_to_the_list(folder):
    result = CliRunner().invoke(main, ["eval", str(folder)])
    assert result.exit_code == 2
    assert "name at least one --recipe: `kvcalib recipes` lists the presets" in result.output
