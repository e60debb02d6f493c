"""What one recipe costs `kvcalib eval`, against a plain full-precision forward of the same windows.

    python benchmarks/bench_eval.py [--windows 4] [--seq-len 1024] [--recipe kivi-2 ...]

For each recipe and mode, the wall time of the simulated forward over the windows divided by that
of the model's own forward (fp32, CPU unless --device). Prints a Markdown table; the target is
at most ~2x per recipe (decode mode computes two score and two value matmuls per layer).
"""

import argparse
import time

import torch

from kvcalib import load_model
from kvcalib.core.data import eval_windows
from kvcalib.evaluation.score import candidates
from kvcalib.sim.simulate import Simulator


def _timed(fn, ids, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for row in ids:
            fn(row[None])
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--recipe", action="append", default=None)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    recipes = args.recipe or ["per-token-2", "kivi-2", "quarot-kv4"]
    model, tokenizer = load_model(None, device=args.device)
    ids = eval_windows(tokenizer, None, windows=args.windows, seq_len=args.seq_len).to(args.device)
    profile = None
    if args.profile:
        from kvcalib.core.profile import Profile

        profile = Profile.load(args.profile)
    with torch.no_grad():
        plain = _timed(lambda x: model(x).logits, ids, args.repeats)
        print(
            f"plain forward: {plain:.2f} s for {args.windows} x {args.seq_len} tokens "
            f"({torch.get_num_threads()} threads, {args.device})\n"
        )
        print("| recipe | mode | seconds | x plain forward |\n|---|---|---|---|")
        for c in candidates(model, recipes, profile):
            for mode in ("fake", "decode"):
                sim = Simulator(model, c.scheme, c.params, mode=mode, fused=c.fused)
                t = _timed(sim, ids, args.repeats)
                print(f"| {c.name} | {mode} | {t:.2f} | {t / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
