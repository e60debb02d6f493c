"""The bad-input corpus, part 5: recipes that name one layer's field twice, and entries of the
presets folder that are no preset (a folder, a FIFO, a link to nothing, a link loop named
*.toml), met by `convert` and `eval`.

Same contract as part 1 (test_bad_inputs.py, `corpus.check`): exit 2, one line naming the
input and a fix, nothing written, no input changed, answered before any model loads. Issue 52:
the later [[layers]] entry won silently, and `--recipe zz` with a folder zz.toml among the
presets said "recipe zz: no such preset; did you mean zz?", naming no file. (`kvcalib recipes`
itself lists the others and warns: test_listing.py.)
"""

import os
import shutil

import pytest
from support.corpus import Case, Workspace, check, out

from kvcalib.core import recipe

OVERLAP = """name = "overlap"
[key]
bits = 2
[[layers]]
index = "0-1"
key = {bits = 4}
[[layers]]
index = 1
key = {bits = 3}
value = {bits = 4}
"""


def conv(name: str):
    return lambda ctx: [ctx.src, "--recipe", name, "-o", out(ctx)]


def ev(name: str):
    return lambda ctx: [ctx.src, "--seq-len", "16", "--windows", "1", "--recipe", name]


def overlap(command):
    def build(ctx):
        args = (conv if command == "convert" else ev)("x")(ctx)
        args[args.index("x")] = ctx.recipe(OVERLAP)
        return args

    return build


# what the entry named zz.toml among the presets is, as the line calls it
BROKEN = ("a folder", "a FIFO", "a symlink to nothing", "a symlink loop")

CASES = [
    Case(
        "numbers",
        command,
        overlap(command),
        "recipe overlap: layers[0] and layers[1] both set key.bits of layer 1; set each "
        "layer's key.bits in one [[layers]] entry",
    )
    for command in ("convert", "eval")
] + [
    Case("special", command, (conv if command == "convert" else ev)("zz"), what)
    for command in ("convert", "eval")
    for what in BROKEN
]


def _presets_with(folder, what: str):
    """A copy of the shipped presets plus zz.toml as `what` (one of BROKEN)."""
    shutil.copytree(recipe.RECIPE_DIRS[-1], folder)
    entry = folder / "zz.toml"
    if what == "a folder":
        entry.mkdir()
    elif what == "a FIFO":
        os.mkfifo(entry)
    elif what == "a symlink to nothing":
        entry.symlink_to(folder / "nowhere.toml")
    else:
        entry.symlink_to(entry)
    return folder


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.command}-{c.fragment[:28]}")
def test_bad_input_is_refused_early_in_one_line(case, corpus, tmp_path, monkeypatch):
    if case.cls == "special":
        folder = _presets_with(tmp_path / "presets", case.fragment)
        monkeypatch.setattr(recipe, "RECIPE_DIRS", (folder,))
        line = check(case, Workspace(tmp_path / "work", corpus), monkeypatch)
        assert line.startswith(f"error: recipe zz: the preset's entry {folder / 'zz.toml'} is ")
        assert line.endswith("not a TOML file; remove it, or reinstall kvcalib")
    else:
        check(case, Workspace(tmp_path / "work", corpus), monkeypatch)
