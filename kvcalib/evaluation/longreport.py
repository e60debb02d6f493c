"""Tables and plots of the long-context suite (`kvcalib.evaluation.longcontext`).

A result here is anything with `.recipe` and `.long_context` ({task: {length: cell}}, cells as
`longcontext.cells` builds them): `kvcalib eval`'s Results, or the benchmark's rows.

    format_table    a row per task and length, a column per recipe: accuracy and its Wilson 95%
                    interval, the cell's n
    format_paired   a row per task, length and recipe against full precision on the same
                    prompts: the paired accuracy difference with its bootstrap 95% interval and
                    exact McNemar p, the teacher-forced answer NLL and its paired increase, the
                    multikey ranking, and what the failed prompts' first answer step shows
    plot            accuracy against length with the intervals, a panel per task and the mean
    plot_probe      per layer: attention on the needles and on token 0 at the answer's first
                    step, and the needle keys' relative error over the haystack's median
"""

import math
from collections.abc import Sequence
from pathlib import Path

from kvcalib.io.figures import figure, save_png


def _with(results) -> list:
    return [r for r in results if r.long_context]


def mean_accuracy(cells: dict, lengths: Sequence[str] | None = None) -> float:
    """The accuracy averaged over tasks and lengths (or only `lengths`), each cell weighing
    the same."""
    accs = [
        cell["accuracy"]
        for by_length in cells.values()
        for n, cell in by_length.items()
        if lengths is None or n in lengths
    ]
    return sum(accs) / len(accs)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}"


def format_table(results) -> str:
    """Markdown: a row per task and length, a column per recipe: "accuracy% [low, high]"."""
    rows_of = _with(results)
    first = rows_of[0].long_context
    rows = ["| task | tokens | n | " + " | ".join(r.recipe for r in rows_of) + " |"]
    rows.append("|---|---:|---:|" + "---:|" * len(rows_of))
    for task, by_length in first.items():
        for n, cell in by_length.items():
            accs = [r.long_context[task][n] for r in rows_of]
            shown = [f"{_pct(a['accuracy'])}% [{_pct(a['low'])}, {_pct(a['high'])}]" for a in accs]
            rows.append(f"| {task} | {n} | {cell['samples']} | " + " | ".join(shown) + " |")
    means = [f"{mean_accuracy(r.long_context):.1%}" for r in rows_of]
    rows.append("| **mean** | | | " + " | ".join(means) + " |")
    return "\n".join(rows)


def _failures(cell: dict) -> str:
    found = cell.get("failures")
    if not found:
        return "-"
    return ", ".join(f"{k} x{v}" for k, v in sorted(found.items(), key=lambda kv: -kv[1]))


def format_paired(results, reference: str = "fp16") -> str:
    """Markdown: a row per task, length and recipe paired against `reference` (recipes without
    paired cells are left out; an empty string when none has them)."""
    rows_of = [r for r in _with(results) if r.recipe != reference]
    head = (
        "| task | tokens | n | recipe | accuracy | Δ vs " + reference + " [95% CI] | McNemar p "
        "| answer NLL | ΔNLL [95% CI] | outranks | failures: first step shows |"
    )
    rows = [head, "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for task, by_length in rows_of[0].long_context.items() if rows_of else ():
        for n in by_length:
            for r in rows_of:
                c = r.long_context[task][n]
                if "diff" not in c:
                    continue
                ranked = f"{c['outranks']:.0%}" if "outranks" in c else "-"
                rows.append(
                    f"| {task} | {n} | {c['samples']} | {r.recipe} | {c['accuracy']:.0%} "
                    f"| {100 * c['diff']:+.0f} [{100 * c['diff_low']:+.0f}, "
                    f"{100 * c['diff_high']:+.0f}] | {c['mcnemar_p']:.2g} | {c['nll']:.3f} "
                    f"| {c['nll_diff']:+.3f} [{c['nll_diff_low']:+.3f}, {c['nll_diff_high']:+.3f}] "
                    f"| {ranked} | {_failures(c)} |"
                )
    return "\n".join(rows) if len(rows) > 2 else ""


def plot(results, path: str | Path) -> Path:
    """Accuracy against length, a panel per task and one for the mean, a line per recipe
    (error bars: the Wilson 95% interval)."""
    rows_of = _with(results)
    tasks = list(rows_of[0].long_context)
    cols = math.ceil((len(tasks) + 1) / 2)
    fig = figure(3.2 * cols, 6.4)
    axes = fig.subplots(2, cols, sharey=True).flatten()[: len(tasks) + 1]
    for r in rows_of:
        lengths = list(r.long_context[tasks[0]])
        x = [int(n) for n in lengths]
        for ax, task in zip(axes, tasks, strict=False):
            cells = [r.long_context[task][n] for n in lengths]
            acc = [c["accuracy"] for c in cells]
            err = [  # at 0 or n the bound is the accuracy itself, up to rounding
                [max(a - c["low"], 0.0) for a, c in zip(acc, cells, strict=True)],
                [max(c["high"] - a, 0.0) for a, c in zip(acc, cells, strict=True)],
            ]
            ax.errorbar(x, acc, yerr=err, marker="o", capsize=3)
            ax.set_title(task)
        mean = [mean_accuracy(r.long_context, [n]) for n in lengths]
        axes[-1].plot(x, mean, marker="o", label=r.recipe)
        axes[-1].set_title("mean over tasks")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{n / 1024:g}K" for n in x])
        ax.minorticks_off()
        ax.set_xlabel("tokens")
        ax.set_ylim(-0.05, 1.05)
    for ax in axes[::cols]:
        ax.set_ylabel("exact-match accuracy")
    axes[-1].legend(fontsize="small")
    return save_png(fig, Path(path), dpi=110)


def _over_cells(r, key: str) -> list[float | None]:
    """Per layer, the mean of a probe array over the recipe's cells."""
    rows = [c["probe"][key] for by_length in r.long_context.values() for c in by_length.values()]
    cols = [[x for x in col if x is not None] for col in zip(*rows, strict=True)]
    return [sum(xs) / len(xs) if xs else None for xs in cols]


def plot_probe(results, path: str | Path) -> Path:
    """Three panels against the layer, a line per recipe, averaged over every prompt: attention
    mass on the needle tokens and on token 0 at the answer's first step, and the needle keys'
    relative error over the haystack's median (1: coded like any token)."""
    rows_of = _with(results)
    fig = figure(12.0, 3.6)
    axes = fig.subplots(1, 3)
    titles = {
        "needle_mass": "attention on the needles",
        "sink_mass": "attention on token 0",
        "key_error": "needle key error / haystack median",
    }
    for k, r in enumerate(rows_of):
        for ax, key in zip(axes, titles, strict=True):
            ys = _over_cells(r, key)
            xs = [i for i, y in enumerate(ys) if y is not None]
            # one colour per recipe in every panel, drawn or not (fp16 has no key error)
            ax.plot(xs, [ys[i] for i in xs], marker=".", color=f"C{k}", label=r.recipe)
    for ax, title in zip(axes, titles.values(), strict=True):
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("layer")
    axes[2].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[0].legend(fontsize="small")
    return save_png(fig, Path(path), dpi=110)
