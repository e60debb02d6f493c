"""The tables in README.md and docs/ that hold no measurement are written by hand (the results
tables are `make docs`'s, tests/toolkit/docs/test_docs_tables.py): the extras tables must name every
extra pyproject.toml declares, the preset tables every preset under recipes/, and nothing else."""

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def table(page: str, head: str) -> list[str]:
    """The first cells of the rows of the Markdown table in `page` whose header starts `head`."""
    lines = (ROOT / page).read_text().splitlines()
    [start] = [i for i, ln in enumerate(lines) if ln.startswith(head)]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])
    return rows


def names(cell: str) -> list[str]:
    """The names a cell spells: `kivi-{2,4}` is kivi-2 and kivi-4; a `-3` after `kvcalib-2` is
    kvcalib-3."""
    out = []
    for token in re.findall(r"`([^`]+)`", cell):
        if token.startswith("-"):
            token = out[-1].rsplit("-", 1)[0] + token
        stem, braces, tail = re.fullmatch(r"([^{]*)(?:\{([^}]*)\})?(.*)", token).groups()
        out += [stem + b + tail for b in braces.split(",")] if braces else [token]
    return out


def test_names_reads_the_shorthands():
    assert names("`kvcalib-2`, `-3`, `-4`") == ["kvcalib-2", "kvcalib-3", "kvcalib-4"]
    assert names("`per-token-{2,3,4}`") == ["per-token-2", "per-token-3", "per-token-4"]


@pytest.mark.parametrize(
    "page, head", [("README.md", "| extra |"), ("docs/install.md", "| extra |")]
)
def test_every_extra_is_listed(page, head):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    listed = [n for cell in table(page, head) for n in names(cell)]
    assert sorted(listed) == sorted(extras)


@pytest.mark.parametrize(
    "page, head", [("README.md", "| preset |"), ("docs/recipes.md", "| preset |")]
)
def test_every_preset_is_listed(page, head):
    presets = [p.stem for p in (ROOT / "recipes").glob("*.toml")]
    listed = [n for cell in table(page, head) for n in names(cell)]
    assert sorted(listed) == sorted(presets)
