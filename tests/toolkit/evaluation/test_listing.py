"""`kvcalib recipes`: every preset with its description and bits per element at 4K tokens,
walked from the buffers of a meta-device cache of the default model's geometry. The counts of
the layouts whose sizes are known by hand are checked exactly."""

import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcalib.cli import main
from kvcalib.core import recipe
from kvcalib.core.recipe import load_recipe, presets
from kvcalib.errors import RecipeError
from kvcalib.evaluation.listing import DEFAULT_GEOMETRY, recipe_bits

ROOT = Path(__file__).resolve().parents[3]


def _rows() -> dict[str, tuple[int, float, float, str]]:
    result = CliRunner().invoke(main, ["recipes"])
    assert result.exit_code == 0, result.output
    rows = {}
    for line in result.output.splitlines():
        m = re.fullmatch(r"\| (\S+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| (.+) \|", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), float(m.group(3)), float(m.group(4)), m.group(5))
    return rows


def _table() -> dict[str, tuple[float, float, str]]:
    return {name: row[1:] for name, row in _rows().items()}


def test_every_preset_is_listed_with_its_version():
    # One name, one recipe: a preset's version is what its records are labelled with, so the
    # listing shows it, every preset has one, and CHANGELOG.md names each current version.
    rows = _rows()
    assert set(rows) == set(presets())
    changelog = " ".join((Path(__file__).resolve().parents[3] / "CHANGELOG.md").read_text().split())
    for name, (version, *_) in rows.items():
        assert version == load_recipe(name).version >= 1, name
        assert f"`{name}` version {version}" in changelog, name


def test_every_preset_is_listed_with_its_description():
    rows = _table()
    assert set(rows) == set(presets())
    for name, (_, _, description) in rows.items():
        assert description == load_recipe(name).description


def test_bits_per_element_at_4k():
    rows = _table()
    # (at 4K, body): fp16 is 16 plus a one-token ring and bookkeeping
    assert rows["llamacpp-q4_0"][1] == 4.50 and rows["llamacpp-q8_0"][1] == 8.50
    assert rows["turboquant-2.5"][1] == 3.00 and rows["turboquant-3.5"][1] == 4.00
    assert rows["per-token-2"][1] == 2.50
    # KIVI: 3 bits of body + a 128-token fp16 window over 4096 tokens (0.5 bits)
    assert rows["kivi-2"][:2] == (3.50, 3.00)
    # KVQuant as it stores: keys 3 + 1 slot / 64 (0.375), values 3 + (32 + 2 slots x 24) / 192
    assert 3.38 <= rows["kvquant-3"][1] <= 3.42 and 2.38 <= rows["kvquant-2"][1] <= 2.42
    # kvcalib-1.5: 1.5 code bits, its codebooks, ranges and scales amortized (issue 26: <= 1.6)
    assert 1.5 < rows["kvcalib-1.5"][1] <= 1.6
    # kvcalib-1.5s (retired to a variant): 1.25 code bits + a one-byte slot per 64 channels
    # (0.25), the same amortized
    slots = ROOT / "benchmarks" / "long_context" / "smollm2-135m" / "variants" / "kvcalib-1.5s.toml"
    assert 1.5 < recipe_bits(str(slots), **DEFAULT_GEOMETRY)[1] <= 1.6  # (at 4K, body)
    for name, (total, body, _) in rows.items():
        assert total >= body > 1.5, name


def test_the_listing_says_why_allocating_recipes_differ_from_eval():
    """kvcalib-2 is listed at 2.44 bits of body, the README's eval tables say 2.48: the listing
    is at 4K with placeholder sensitivities, eval at its own context with the real profile."""
    output = CliRunner().invoke(main, ["recipes"]).output
    assert output.splitlines()[-1] == (
        "kvcalib-2, kvcalib-3, kvcalib-4 allocate bits per layer by sensitivity: listed as "
        "uniform sensitivities allocate them, so a calibrated profile's allocation differs a "
        "little. kvcalib eval reports the body at the context it evaluates (1024 tokens by "
        "default), where per-layer constants weigh more than at 4K."
    )


@pytest.fixture
def damaged_presets(tmp_path, monkeypatch):
    """The shipped presets plus entries named *.toml that are no preset: a folder, a FIFO, a
    link to nothing, a link loop, a file that is not TOML (issue 52: any one of them ended the
    listing with "recipe zz: no such preset; did you mean zz?", naming no file)."""
    folder = tmp_path / "recipes"
    shutil.copytree(recipe.RECIPE_DIRS[-1], folder)
    shipped = {p.stem for p in folder.glob("*.toml")}
    (folder / "zz.toml").mkdir()
    os.mkfifo(folder / "fifo.toml")
    (folder / "gone.toml").symlink_to(tmp_path / "nowhere.toml")
    (folder / "loop.toml").symlink_to(folder / "loop.toml")
    (folder / "broken.toml").write_text("name = \n")
    monkeypatch.setattr(recipe, "RECIPE_DIRS", (folder,))
    return folder, shipped


def test_a_bad_entry_among_the_presets_is_named_and_the_listing_goes_on(damaged_presets):
    """Each bad entry is one warning line naming its path and what it is; the good presets are
    all listed (a user picks from them; exit 0)."""
    result = CliRunner().invoke(main, ["recipes"])
    assert result.exit_code == 0, result.output
    rows = {line.split(" | ")[0][2:] for line in result.stdout.splitlines() if line[:2] == "| "}
    d, shipped = damaged_presets
    assert rows - {"recipe"} == shipped and len(shipped) >= 19  # the 19 shipped today
    assert result.stderr.splitlines() == [
        f"warning: {d / 'fifo.toml'}: a FIFO, not a preset; remove it (a preset is a TOML file)",
        f"warning: {d / 'gone.toml'}: a symlink to nothing, not a preset; remove it (a preset "
        "is a TOML file)",
        f"warning: {d / 'loop.toml'}: a symlink loop, not a preset; remove it (a preset is a "
        "TOML file)",
        f"warning: {d / 'zz.toml'}: a folder, not a preset; remove it (a preset is a TOML file)",
        f"warning: preset broken left out: recipe {d / 'broken.toml'}: not valid TOML (Invalid "
        "value (at line 1, column 8)); fix the file",
    ]


@pytest.mark.parametrize(
    "name, what", [("zz", "a folder"), ("fifo", "a FIFO"), ("loop", "a symlink loop")]
)
def test_a_bad_preset_entry_named_by_a_command_is_refused_naming_it(damaged_presets, name, what):
    with pytest.raises(
        RecipeError,
        match=rf"recipe {name}: the preset's entry {damaged_presets[0] / name}\.toml is {what}, "
        "not a TOML file; remove it, or reinstall kvcalib",
    ):
        load_recipe(name)
