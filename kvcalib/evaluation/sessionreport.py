"""Scores of the session benchmark (`kvcalib.evaluation.session`) by turn, tables and the plot.

`records`: {seed: {recipe: run_session's result}}. Every score of a recipe at a turn is over the
sessions (seeds) where both it and the reference (fp16) ran, so each is paired:

    recall      probe turns: exact-match fact recall with its Wilson 95% interval, the paired
                difference to fp16 with its bootstrap interval and exact McNemar p, the fact's
                teacher-forced NLL and its paired increase (`longstats.cell`)
    kl          drift: mean per-token KL(full precision || recipe) on the recipe's own history
                (0 for fp16 up to float noise), bootstrap interval over sessions
    first_agree full precision's first answer token given the recipe's history is the recipe's:
                rate, Wilson interval
    repeat4, repeat3  the share of an answer's n-grams repeating earlier answers, and its paired
                difference to fp16's session of the same seed (bootstrap interval)
    sink, system      attention at the answer's first step on token 0 and on the system prompt,
                the recipe's cache minus full precision on the same history (bootstrap interval)
"""

import math
from pathlib import Path

from kvcalib.evaluation import longstats
from kvcalib.io.figures import figure, save_png

REFERENCE = "fp16"
SCORES = {  # key: (title, how the value is drawn)
    "recall": "fact recall (exact match)",
    "kl": "drift: KL(fp || recipe) per answer token",
    "first_agree": "fp picks the recipe's first token",
    "repeat4": "4-grams repeating earlier answers",
    "sink": "attention on token 0, recipe - fp",
    "system": "attention on the system prompt, recipe - fp",
}


def _turns(records: dict, recipe: str) -> list[list[tuple[dict, dict | None]]]:
    """Per turn (0-based), (recipe's turn record, reference's or None) over the sessions where
    both ran (only the recipe's where it is the reference)."""
    out = []
    for by_recipe in records.values():
        if recipe not in by_recipe or REFERENCE not in by_recipe:
            continue
        ref = by_recipe[REFERENCE]["turns"]
        for t, rec in enumerate(by_recipe[recipe]["turns"]):
            while len(out) <= t:
                out.append([])
            out[t].append((rec, ref[t] if t < len(ref) else None))
    return out


def _mean_row(turn: int, xs: list[float]) -> dict:
    low, high = longstats.paired_interval(xs)
    mean = sum(xs) / len(xs) if xs else math.nan
    return {"turn": turn, "n": len(xs), "mean": mean, "low": low, "high": high}


def _rate_row(turn: int, flags: list[bool]) -> dict:
    low, high = longstats.wilson(sum(flags), len(flags))
    rate = sum(flags) / len(flags) if flags else math.nan
    return {"turn": turn, "n": len(flags), "mean": rate, "low": low, "high": high}


def scores(records: dict, recipe: str) -> dict:
    """{score: [row per turn]} of one recipe (see the module docstring); a row has "turn", "n",
    "mean", "low", "high" (recall rows: `longstats.cell`'s fields besides)."""
    out = {k: [] for k in SCORES}
    out["repeat3"], out["repeat4_diff"] = [], []
    for t, pairs in enumerate(_turns(records, recipe)):
        turn = t + 1
        mine = [m for m, _ in pairs]
        if any("fact" in m for m in mine):
            cell = longstats.cell(
                [_recall(m) for m in mine],
                None if recipe == REFERENCE else [_recall(r) for _, r in pairs],
            )
            cell.update(turn=turn, n=cell["samples"], mean=cell["accuracy"])
            out["recall"].append(cell)
        out["kl"].append(_mean_row(turn, [m["kl"] for m in mine]))
        out["first_agree"].append(_rate_row(turn, [m["first_agree"] for m in mine]))
        for n in (3, 4):
            key = f"repeat{n}"
            out[key].append(_mean_row(turn, [m[key] for m in mine if m[key] is not None]))
        known = [(m["repeat4"], r["repeat4"]) for m, r in pairs if r is not None]
        both = [a - b for a, b in known if a is not None and b is not None]
        out["repeat4_diff"].append(_mean_row(turn, both))
        for key in ("sink", "system"):
            known = [m for m in mine if m.get(f"fp_{key}_mass") is not None]
            diffs = [m[f"{key}_mass"] - m[f"fp_{key}_mass"] for m in known]
            out[key].append(_mean_row(turn, diffs))
    return out


def _recall(rec: dict) -> dict:
    return {"correct": rec["correct"], "nll": rec["fact_nll"], "seconds": 0.0}


def _num(x: float, digits: int = 3) -> str:
    """x at `digits` decimals; what rounds to zero shows as 0, not -0 (fp16's KL to itself)."""
    return "-" if x is None or math.isnan(x) else f"{round(x, digits) + 0.0:.{digits}f}"


def _shown(row: dict, digits: int = 3) -> str:
    if not row["n"]:
        return "-"
    return f"{_num(row['mean'], digits)} [{_num(row['low'], digits)}, {_num(row['high'], digits)}]"


def format_turns(by_recipe: dict, key: str, digits: int = 3) -> str:
    """Markdown: a row per turn, a column per recipe: mean [95% interval], and n (the most
    any recipe has there; a cell over fewer sessions, a recipe still running, says its own)."""
    recipes = list(by_recipe)
    rows_of = {r: {row["turn"]: row for row in by_recipe[r][key]} for r in recipes}
    turns = sorted({t for rows in rows_of.values() for t in rows})
    out = ["| turn | n | " + " | ".join(recipes) + " |", "|---:|---:|" + "---:|" * len(recipes)]
    for t in turns:
        cells = [rows_of[r].get(t) for r in recipes]
        n = max(c["n"] for c in cells if c is not None)
        shown = [
            "-" if c is None else _shown(c, digits) + (f" (n {c['n']})" if c["n"] != n else "")
            for c in cells
        ]
        out.append(f"| {t} | {n} | " + " | ".join(shown) + " |")
    return "\n".join(out)


def format_recall(by_recipe: dict) -> str:
    """Markdown: per probe turn and recipe, recall, its paired difference to fp16 (bootstrap
    interval, McNemar p), the fact's NLL and its paired increase."""
    out = [
        "| turn | recipe | n | recall [95%] | vs fp16 [95%] | McNemar p | fact NLL | ΔNLL [95%] |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for recipe, s in by_recipe.items():
        for row in s["recall"]:
            shown = f"{row['mean']:.0%} [{row['low']:.0%}, {row['high']:.0%}]"
            diff = p = dnll = "-"
            if "diff" in row:
                diff = f"{row['diff']:+.0%} [{row['diff_low']:+.0%}, {row['diff_high']:+.0%}]"
                p = f"{row['mcnemar_p']:.2g}"
                low, high = row["nll_diff_low"], row["nll_diff_high"]
                dnll = f"{row['nll_diff']:+.3f} [{low:+.3f}, {high:+.3f}]"
            out.append(
                f"| {row['turn']} | {recipe} | {row['n']} | {shown} | {diff} | {p} | "
                f"{row['nll']:.3f} | {dnll} |"
            )
    return "\n".join(out)


def report(by_recipe: dict) -> str:
    """Every table of the report, markdown."""
    parts = [
        ("Fact recall at the probe turns, paired against fp16 on the same sessions:", None),
        ("Drift, KL(full precision || recipe) per answer token on the recipe's own history:",
         "kl"),
        ("First-token agreement with full precision on the recipe's own history:",
         "first_agree"),
        ("Repetition, share of the answer's 4-grams found in earlier answers:", "repeat4"),
        ("Repetition (4-grams), paired difference to fp16's session of the same seed:",
         "repeat4_diff"),
        ("Attention on token 0 at the answer's first step, recipe minus full precision on the "
         "same history:", "sink"),
        ("Attention on the system prompt at the answer's first step, recipe minus full "
         "precision on the same history:", "system"),
    ]  # fmt: skip
    text = []
    for title, key in parts:
        table = format_recall(by_recipe) if key is None else format_turns(by_recipe, key, 4)
        text += [title, "", table, ""]
    return "\n".join(text)


def plot(by_recipe: dict, path: str | Path) -> Path:
    """Each score against the turn number, a line per recipe with its 95% interval band."""
    fig = figure(13.5, 7.2)
    axes = fig.subplots(2, 3, sharex=True).flatten()
    for k, (recipe, s) in enumerate(by_recipe.items()):
        for ax, (key, title) in zip(axes, SCORES.items(), strict=True):
            rows = [r for r in s[key] if r["n"]]
            if not rows:
                continue
            x = [r["turn"] for r in rows]
            ax.plot(x, [r["mean"] for r in rows], marker=".", color=f"C{k}", label=recipe)
            low = [r["low"] if not math.isnan(r["low"]) else r["mean"] for r in rows]
            high = [r["high"] if not math.isnan(r["high"]) else r["mean"] for r in rows]
            ax.fill_between(x, low, high, color=f"C{k}", alpha=0.15, lw=0)
            ax.set_title(title, fontsize="medium")
    for ax in axes:
        ax.set_xlabel("turn")
    for ax in axes[[0, 2, 3]]:  # shares
        ax.set_ylim(-0.05, 1.05)
    for ax in axes[4:]:
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
    axes[1].legend(fontsize="small")  # drift: drawn at every turn
    return save_png(fig, Path(path), dpi=110)
