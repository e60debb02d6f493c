"""The long-context suite (`kvcalib eval --long-context`) for the leaderboard's README table, with
its size as options: every recipe at the same residual window, one full-precision prefill per
prompt shared by all of them, greedy answers decoded through each recipe's cache.

    OMP_NUM_THREADS=1 python benchmarks/long_context.py [--lengths 2048,4096] [--seeds 0]
        [--tasks passkey,...] [--recipe NAME ...] [--out DIR]

Writes long_context.md (the per-task table and the mean per length) and long_context.json into
--out (default: benchmarks/), and long_context.png. Cells hold one sample per seed (passkey: per
seed and each of 5 depths); the table gives each cell's count and binomial spread. On CPU, give
each process one thread when other jobs share the cores (one 2K sample took 173 s with two threads
among three busy processes and 15.5 s with one thread beside one other: oversubscription is the
likely cause, not isolated further).
"""

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from kvcalib import load_model
from kvcalib.api import default_profile
from kvcalib.core.models import DEFAULT_MODEL, resolve
from kvcalib.evaluation import longcontext
from kvcalib.evaluation.score import candidates

HERE = Path(__file__).resolve().parent
RESIDUAL = 128
RECIPES = ("fp16", "kivi-2", "turboquant-2.5", "kvcalib-2", "kvcalib-3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--profile", default=None, help="Profile folder (default: cached).")
    parser.add_argument("--lengths", default="2048,4096", help="Comma-separated token counts.")
    parser.add_argument("--seeds", default="0", help="Comma-separated seeds (a sample each).")
    parser.add_argument("--tasks", default=",".join(longcontext.TASKS), help="Comma-separated.")
    parser.add_argument("--recipe", action="append", help="Recipes (repeat; default: 5).")
    parser.add_argument("--out", default=str(HERE))
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.recipe or list(RECIPES)
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    profile = default_profile(resolve(args.model), args.profile)
    cands = candidates(model, names, profile, residual=RESIDUAL)
    start = time.perf_counter()
    tasks = args.tasks.split(",")
    cells = longcontext.run(
        model, tokenizer, cands, lengths=lengths, seeds=seeds, tasks=tasks, progress=True
    )
    minutes = (time.perf_counter() - start) / 60
    pairs = zip(cands, cells, strict=True)
    rows = [SimpleNamespace(recipe=c.name, long_context=x) for c, x in pairs]
    out = Path(args.out)
    setup = (
        f"{args.model}, fp32, CPU; residual {RESIDUAL} for every recipe; tasks {', '.join(tasks)}; "
        f"lengths {lengths}; seeds {seeds} (passkey: x 5 depths); {minutes:.0f} minutes"
    )
    means = ["| recipe | " + " | ".join(f"mean at {n}" for n in lengths) + " |"]
    means.append("|---|" + "---:|" * len(lengths))
    for r in rows:
        accs = [longcontext.mean_accuracy(r.long_context, [str(n)]) for n in lengths]
        means.append(f"| {r.recipe} | " + " | ".join(f"{a:.0%}" for a in accs) + " |")
    text = [f"Setup: {setup}.", "", longcontext.format_table(rows), "", "\n".join(means), ""]
    out.joinpath("long_context.md").write_text("\n".join(text))
    doc = {"setup": setup, "rows": [vars(r) for r in rows]}
    out.joinpath("long_context.json").write_text(json.dumps(doc, indent=1) + "\n")
    longcontext.plot(rows, out / "long_context.png")
    print("\n".join(text))


if __name__ == "__main__":
    main()
