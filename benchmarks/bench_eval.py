"""What one recipe costs `kvcalib eval`, against a plain full-precision forward of the same windows.

    python benchmarks/bench_eval.py [--windows 4] [--seq-len 1024] [--recipe kivi-2 ...]
        [--profile PROFILE_DIR]

For each recipe and mode, the wall time of the simulated forward over the windows divided by
that of the model's own forward (fp32, CPU unless --device), each the best of --repeats, run
in rounds (plain, then every recipe) so that load from other jobs falls on all alike. Prints a
Markdown table with the load average; the target is at most 2x per recipe in decode mode.
Recipes that need calibrated tensors need --profile.
"""

import argparse
import os
import time

import torch

from kvcalib import load_model
from kvcalib.core.data import eval_windows
from kvcalib.evaluation.score import candidates
from kvcalib.sim.simulate import Simulator

RECIPES = ("per-token-2", "kivi-2", "kvcalib-2", "kvcalib-3")


def _timed(fn, ids) -> float:
    start = time.perf_counter()
    for row in ids:
        fn(row[None])
    return time.perf_counter() - start


def eval_ratios(model, ids, recipes, profile=None, modes=("fake", "decode"), repeats: int = 2):
    """(plain seconds, [(recipe, mode, seconds)]) over windows ids [N, T]: best of `repeats`
    rounds, each timing the plain forward and then every recipe and mode."""
    cands = candidates(model, recipes, profile)
    runs = [(c, mode) for c in cands for mode in modes]
    plain, best = float("inf"), [float("inf")] * len(runs)
    with torch.no_grad():
        for _ in range(repeats):
            plain = min(plain, _timed(lambda x: model(x).logits, ids))
            for k, (c, mode) in enumerate(runs):
                sim = Simulator(model, c.scheme, c.params, mode=mode, transforms=c.transforms)
                best[k] = min(best[k], _timed(sim, ids))
    return plain, [(c.name, mode, t) for (c, mode), t in zip(runs, best, strict=True)]


def table(plain: float, rows) -> str:
    lines = ["| recipe | mode | seconds | x plain forward |", "|---|---|---:|---:|"]
    lines += [f"| {name} | {mode} | {t:.2f} | {t / plain:.2f} |" for name, mode, t in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--recipe", action="append", default=None)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model, tokenizer = load_model(None, device=args.device)
    ids = eval_windows(tokenizer, None, windows=args.windows, seq_len=args.seq_len).to(args.device)
    profile = None
    if args.profile:
        from kvcalib.core.profile import Profile

        profile = Profile.load(args.profile)
    recipes = args.recipe or [r for r in RECIPES if profile or not r.startswith("kvcalib")]
    load = os.getloadavg()
    plain, rows = eval_ratios(model, ids, recipes, profile, repeats=args.repeats)
    print(
        f"plain forward: {plain:.2f} s for {args.windows} x {args.seq_len} tokens "
        f"({torch.get_num_threads()} threads, {args.device}); load average "
        f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print(table(plain, rows))


if __name__ == "__main__":
    main()
