"""benchmarks/leaderboard.py resumes per cell: a (table, text, recipe) cell kept with today's
recipe and setup is read back, not scored again; one kept under another recipe or setup is."""

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import leaderboard as lb  # noqa: E402

from kvcalib.core.plan import plan  # noqa: E402
from kvcalib.core.profile import Profile  # noqa: E402
from kvcalib.evaluation.score import Result  # noqa: E402


def peer(recipe: str):
    """A candidate as the cells see an external peer's: no scheme, tagged by its recipe."""
    return SimpleNamespace(name="kvcalib-2 - all sinks", scheme=None, recipe=recipe)


def test_a_resumed_run_reads_its_kept_cells(tmp_path):
    runs = []

    def run(value):
        runs.append(value)
        return {"kld": value}

    first = lb.Cells(tmp_path, "setup")
    assert first.get("same-window", "pydoc", peer("A"), lambda: run(1)) == {"kld": 1}
    again = lb.Cells(tmp_path, "setup")  # the next run, after a stop
    assert again.get("same-window", "pydoc", peer("A"), lambda: run(2)) == {"kld": 1}
    assert again.get("fake", "pydoc", peer("A"), lambda: run(3)) == {"kld": 3}  # another cell
    assert runs == [1, 3]


def test_a_cell_of_another_recipe_or_setup_is_scored_again(tmp_path):
    lb.Cells(tmp_path, "setup").get("ablation", "pydoc", peer("A"), lambda: {"kld": 1})
    changed = lb.Cells(tmp_path, "setup").get("ablation", "pydoc", peer("B"), lambda: {"kld": 2})
    other = lb.Cells(tmp_path, "4 windows").get("ablation", "pydoc", peer("B"), lambda: {"kld": 3})
    assert (changed, other) == ({"kld": 2}, {"kld": 3})
    assert [p.name for p in tmp_path.iterdir()] == ["ablation-pydoc-kvcalib-2_-_all_sinks.json"]


def test_a_kept_result_reads_back_as_it_was_scored():
    r = Result("kivi-2", "decode", 15.4, 12.5, 0.18, 0.79, 3.0, {"4096": 3.5}, 128, 9.0)
    assert lb._result(r.to_json()) == r


def test_clear_removes_the_cells_of_this_run_only(tmp_path):
    # A quick check (`--recipe kivi-2 --no-extras`) must not drop what a full run has kept.
    lb.Cells(tmp_path, "setup").get("same-window", "pydoc", peer("A"), lambda: {"kld": 1})
    quick = lb.Cells(tmp_path, "setup")
    quick.get("fake", "pydoc", peer("A"), lambda: {"kld": 2})
    quick.clear()
    assert [p.name for p in tmp_path.iterdir()] == ["same-window-pydoc-kvcalib-2_-_all_sinks.json"]
    full = lb.Cells(tmp_path, "setup")
    full.get("same-window", "pydoc", peer("A"), lambda: {"kld": 3})
    full.clear()
    assert not tmp_path.exists()


def test_every_ablation_plans_on_the_committed_profile():
    """The ablation table is the run's last: a variant the recipe schema refuses (an exact
    slot's one-byte code left on a variant with no slot) would stop a run of ~90 min at its
    end. Each variant is one ingredient off kvcalib-2 (or kvcalib-3), so each plans to another
    scheme than its base's."""
    profile = Profile.load(ROOT / "benchmarks/long_context/smollm2-135m/profile")
    m = profile.meta["model"]
    schemes = {
        r.name: plan(r, num_layers=m["num_layers"], head_dim=m["head_dim"], profile=profile)[0]
        for r in lb.ablations()
    }
    assert len(schemes) == len(lb.ablations())
    for name, scheme in schemes.items():
        base = "kvcalib-3" if name.startswith("kvcalib-3") else "kvcalib-2"
        assert name == base or scheme != schemes[base], name
