"""The results tables in README.md and docs/ are the committed records' (benchmarks/docs_tables.py,
`make docs`): a table pasted or edited by hand, or a record changed without `make docs`, fails
here. Reads JSON only."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _tables():
    path = ROOT / "benchmarks" / "docs_tables.py"
    spec = importlib.util.spec_from_file_location("docs_tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _tables()


@pytest.mark.parametrize("rel", tables.FILES)
def test_committed_tables_are_the_records(rel):
    text = (ROOT / rel).read_text()
    assert "<!-- docs:" in text  # every file the generator owns holds at least one block
    assert tables.rewrite(text) == text, f"{rel}: a table differs from its record; run make docs"


def test_every_renderer_has_a_block():
    # A renderer whose block was deleted from the docs would leave its records unchecked.
    text = "".join((ROOT / rel).read_text() for rel in tables.FILES)
    assert [n for n in tables.BLOCKS if f"<!-- docs:{n} -->" not in text] == []


def test_a_block_is_replaced_by_its_rendering_and_nothing_else():
    text = "a\n<!-- docs:main -->\nold | table\n<!-- /docs:main -->\nb\n"
    new = tables.rewrite(text, render=lambda name: f"NEW {name}")
    assert new == "a\n<!-- docs:main -->\nNEW main\n<!-- /docs:main -->\nb\n"
    with pytest.raises(SystemExit, match="no renderer"):
        tables.rewrite("<!-- docs:nope -->\n<!-- /docs:nope -->")


def test_kvcalib2_rows_are_todays_recipe_not_the_stale_leaderboard():
    # leaderboard.json's version-less rows predate kvcalib-2's change of values (2026-12-04):
    # their kvcalib-2 rows (decode KL 0.0156 on the Python docs) are another recipe and must
    # never be shown; a row carrying a version (`make leaderboard` since 2026-12-06) is today's.
    board = json.loads((ROOT / "benchmarks" / "leaderboard.json").read_text())["rows"]
    stale = {round(r["kld"], 4) for r in board if r["recipe"] == "kvcalib-2" and "version" not in r}
    row = tables.text_rows("pydoc")[("kvcalib-2", "decode")]
    if "version" not in row:
        today = json.loads((tables.VALUES / "kl_smollm2_python-docs.json").read_text())
        [kv2] = [r for r in today if r["recipe"] == "kvcalib-2"]
        assert row["kld"] == kv2["kld"] and row["source"].startswith("kvcalib-2-values/")
    main = tables.render_main()
    [line] = [ln for ln in main.splitlines() if ln.startswith("| **kvcalib-2**")]
    assert f"{row['kld']:.4f}" in line
    assert not any(f"{k:.4f}" in line for k in stale if k != round(row["kld"], 4))


def test_wilson_matches_the_suites_own_intervals():
    # The pooled "all" rows use this interval; the suite (kvcalib.evaluation.longstats) wrote
    # one per cell into the records: the two must agree on every cell, to float rounding.
    report = tables.lc_report("qwen2.5-0.5b")
    cells = [c for r in report["rows"] for t in r["long_context"].values() for c in t.values()]
    assert len(cells) == 25
    for c in cells:
        lo, hi = tables.wilson(round(c["accuracy"] * c["samples"]), c["samples"])
        assert lo == pytest.approx(c["low"], abs=1e-9) and hi == pytest.approx(c["high"], abs=1e-9)


def test_each_long_context_recipe_was_scored_under_one_plan():
    # A row mixes prompts scored under two plans only if the records were renamed or merged:
    # the tables would then show one name for two recipes.
    shown_in = {"smollm2-135m": "long_context_4bit", "qwen2.5-0.5b": "long_context",
                "qwen2.5-0.5b-long": "long_context"}  # fmt: skip
    for folder, name in shown_in.items():
        digests = tables.plans(tables.LC / folder)
        shown = [r["recipe"] for r in tables.lc_report(folder, name)["rows"]]
        assert all(digests.get(r) != "mixed" for r in shown), (folder, digests)


def test_the_bf16_column_is_its_records_setup():
    # The caption promises: the same windows as the float32 columns, decode mode, residual 128
    # for all, both dtypes from one setup, and kvcalib's rows scored against the source model
    # (its fused rotations' rounding inside the KL), not against its own converted weights.
    record = json.loads(tables.DTYPE.read_text())
    for dtype in ("bfloat16", "float32"):
        for r in record[dtype]:
            setup = r["setup"]
            assert (setup["windows"], setup["seq_len"], setup["mode"]) == (4, 1024, "decode")
            assert setup["residual"] == 128 and setup["data"].startswith("builtin (Python docs")
            converted = r["recipe"].endswith(" (converted)")
            assert setup.get("reference") == ("source" if converted else None), r["recipe"]
    bf16 = tables.dtype_rows("bfloat16")
    [line] = [ln for ln in tables.render_main().splitlines() if ln.startswith("| **kvcalib-2**")]
    assert f"{bf16['kvcalib-2']['kld']:.4f} (" in line


def test_every_row_names_the_recipe_it_was_measured_under():
    # One name has meant several recipes (kvcalib-2 before and after 2026-12-04): each row of the
    # SmolLM2, Gemma and Qwen tables says which, by version and plan digest or by its record's
    # date (the rows of records that predate versions).
    label = re.compile(r"(v\d+ · [0-9a-f]{16}|\d{4}-\d{2}-\d{2})\)?( \|)?$")
    names = ["main", "text-pydoc", "text-licenses", "text-chat", "decode-gemma", "decode-qwen"]
    for name in names:
        rows = [ln for ln in tables.BLOCKS[name]().splitlines() if ln.startswith("| ")][1:]
        assert rows, name
        assert [r for r in rows if not label.search(r)] == [], name


def test_a_row_measured_with_a_version_is_shown_whatever_changed_before(monkeypatch):
    # Once `make leaderboard` writes kvcalib-2 at today's version, its row is shown, not the
    # 2026-12-04 record that stands in for the version-less row of 2026-11-30.
    today = {"table": "same-window", "text": "pydoc", "recipe": "kvcalib-2", "mode": "decode",
             "kld": 0.5, "version": 1, "plan": "0123456789abcdef"}  # fmt: skip
    load = tables._load

    def fake(path):
        return {"rows": [today]} if path.name == "leaderboard.json" else load(path)

    monkeypatch.setattr(tables, "_load", fake)
    row = tables.text_rows("pydoc")[("kvcalib-2", "decode")]
    assert row["kld"] == 0.5 and tables.record(row) == "`leaderboard.json` (v1 · 0123456789abcdef)"
    fake_mode = tables.text_rows("pydoc")[("kvcalib-2", "fake")]  # none today: the dated record
    assert tables.record(fake_mode).endswith("(2026-12-04)")
    # and the sentence that explained the stand-in is gone with it
    assert tables.render_sources().startswith(
        "Every SmolLM2 row was measured by `make leaderboard`"
    )
