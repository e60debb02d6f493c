"""The session benchmark at the issue's sizes, resumable: long chat sessions (a ~1.5K-token
system prompt with facts, dozens of user turns, greedy answers kept in the cache), every recipe
running each session itself through its cache, scored against full precision on its own
history and paired against fp16's session of the same seed (`kvcalib.evaluation.session`).

    OMP_NUM_THREADS=1 python benchmarks/session.py --model qwen2.5-0.5b --sessions 10 \
        [--recipe NAME ...] [--turns 24] [--threads 1] [--processes 1] [--report-only]

One JSON per (session seed, recipe) under --out/cells/s<seed>/<recipe>.json (the session's
token ids' sha256, the recipe's plan digest as the long-context runner computes it, the
record, the seconds it took), written as it finishes and skipped when present with the same
session and plan: a run stopped at any point resumes where it was. Seeds run in order, every
recipe of a seed before the next seed (fp16 first: each score is paired against it). The model,
its default profile and the plans are the long-context runner's (`benchmarks/long_context.py`
`_setup`): every recipe on the original weights at residual 128.
At the end (or with --report-only) every cell present is tabulated into --out/NAME.md and .json
(per turn, n and 95% intervals; `kvcalib.evaluation.sessionreport`) and plotted to NAME.png.
"""

import argparse
import hashlib
import importlib.util
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

from kvcalib.evaluation import session as sess
from kvcalib.evaluation import sessionreport

HERE = Path(__file__).resolve().parent
RECIPES = ("fp16", "kivi-2", "turboquant-2.5", "kvcalib-2")


def _long_context():
    """benchmarks/long_context.py (a script beside this one): its setup, digests, reading."""
    spec = importlib.util.spec_from_file_location("long_context_bench", HERE / "long_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LC = _long_context()


def cell_file(out: Path, seed: int, recipe: str) -> Path:
    return out / "cells" / f"s{seed:03d}" / f"{recipe.replace(':', '_')}.json"


def session_sha(tokenizer, session, max_new: int) -> str:
    ids = [sess.pieces(tokenizer, session, t) for t in range(len(session.users))]
    return hashlib.sha256(json.dumps([ids, max_new]).encode()).hexdigest()[:16]


def _session(args, tokenizer, seed: int):
    sizes = dict(system_tokens=args.system_tokens, user_tokens=tuple(args.user_tokens))
    return sess.generate(tokenizer, seed, turns=args.turns, **sizes)


def _done(known: dict | None, sha: str, name: str, tag: str, old: dict) -> bool:
    """Whether a cell stands: this session's, scored under today's plan (LC.stands)."""
    return (
        known is not None
        and known.get("sha") == sha
        and LC.stands(known.get("plan"), name, tag, old)
    )


def _worker(args, seeds: list[int], recipes: list[str], setup=None) -> None:
    """Run every pending (seed, recipe) cell of `seeds` (one process, its own model)."""
    model, tokenizer, every, tags = setup or LC._setup(args, recipes)
    out = Path(args.out)
    old = LC.legacy(out)
    for seed in seeds:
        s = _session(args, tokenizer, seed)
        sha = session_sha(tokenizer, s, args.max_new)
        for c in every:
            path = cell_file(out, seed, c.name)
            if _done(LC._read(path), sha, c.name, tags[c.name], old):
                continue
            start = time.perf_counter()
            record = sess.run_session(model, tokenizer, c, s, max_new=args.max_new)
            known = {
                "sha": sha,
                "plan": tags[c.name],
                "recipe": c.name,
                "session": {
                    "seed": seed,
                    "turns": args.turns,
                    "system_tokens": args.system_tokens,
                    "user_tokens": args.user_tokens,
                    "max_new": args.max_new,
                    "facts": s.facts,
                    "probes": s.probes,
                },
                "record": record,
                "threads": args.threads,
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(known) + "\n")
            tmp.replace(path)
            print(f"session {seed} {c.name}: {time.perf_counter() - start:.0f} s", flush=True)


def collect(args, tokenizer, tags: dict) -> dict:
    """{seed: {recipe: record}} of every current cell present (any session size: the sha is
    checked against the size asked for). Cells of these sessions scored under another plan are
    left out, and said so: a report run with another --profile than the cells' would otherwise
    read as a recipe with no session done."""
    records, other, old = {}, {}, LC.legacy(args.out)
    for seed in range(args.sessions):
        sha = session_sha(tokenizer, _session(args, tokenizer, seed), args.max_new)
        for recipe, tag in tags.items():
            known = LC._read(cell_file(Path(args.out), seed, recipe))
            if _done(known, sha, recipe, tag, old):
                records.setdefault(seed, {})[recipe] = known["record"]
            elif known is not None and known.get("sha") == sha:
                other[recipe] = other.get(recipe, 0) + 1
    for recipe, n in other.items():
        print(f"{recipe}: {n} cells scored under another plan left out (the cells' --profile?)",
              file=sys.stderr)  # fmt: skip
    return records


def report(args, tokenizer, tags: dict, hours: float) -> str:
    out, recipes = Path(args.out), list(tags)
    records = collect(args, tokenizer, tags)
    if not records:
        return "no cell is done yet"
    by_recipe = {r: sessionreport.scores(records, r) for r in recipes}
    cells = [rec for by in records.values() for rec in by.values()]
    seconds = sum(rec["seconds"] for rec in cells)
    done = {r: sum(r in by for by in records.values()) for r in recipes}
    setup = (
        f"{args.model}, fp32, CPU, {args.threads} thread(s); residual {LC.RESIDUAL} for every "
        f"recipe, each on the original weights; sessions of {args.turns} turns (seeded "
        f"`session.generate`), answers up to {args.max_new} tokens; sessions done per recipe: "
        + ", ".join(f"{r} {n}" for r, n in done.items())
        + f"; {seconds / len(cells):.0f} s per cell, {seconds / 3600:.2f} hours in all"
        + (f", this run {hours:.2f} h" if hours >= 0.005 else "")
    )
    text = f"Setup: {setup}.\n\n" + sessionreport.report(by_recipe)
    out.joinpath(f"{args.name}.md").write_text(text)
    doc = {"setup": setup, "recipes": by_recipe}
    out.joinpath(f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    sessionreport.plot(by_recipe, out / f"{args.name}.png")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", default=None, help="Profile folder (default: cached).")
    parser.add_argument("--sessions", type=int, default=10, help="Session seeds 0..N-1.")
    parser.add_argument("--turns", type=int, default=sess.TURNS, help="User turns per session.")
    parser.add_argument(
        "--system-tokens", type=int, default=sess.SYSTEM_TOKENS, help="System prompt size."
    )
    parser.add_argument(
        "--user-tokens",
        type=int,
        nargs=2,
        default=list(sess.USER_TOKENS),
        help="A user turn's size range in tokens: MIN MAX.",
    )
    parser.add_argument("--max-new", type=int, default=sess.MAX_NEW, help="Answer token cap.")
    parser.add_argument("--recipe", action="append", help="Recipes (repeat; default: 4).")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per process.")
    parser.add_argument("--processes", type=int, default=1, help="Processes, each its model.")
    parser.add_argument("--out", default=None, help="Default: benchmarks/sessions/MODEL.")
    parser.add_argument("--report-only", action="store_true", help="Tabulate what is done.")
    parser.add_argument("--name", default="sessions", help="The report's file stem under --out.")
    args = parser.parse_args()
    args.split = []  # the long-context runner's setup reads it
    args.out = args.out or str(HERE / "sessions" / args.model)
    recipes = args.recipe or list(RECIPES)
    if "fp16" not in recipes:
        recipes = ["fp16", *recipes]  # every score is paired against it
    start = time.perf_counter()
    setup = LC._setup(args, recipes)
    tokenizer, tags = setup[1], setup[-1]
    if not args.report_only:
        seeds = list(range(args.sessions))
        k = max(1, min(args.processes, len(seeds)))
        if k == 1:
            _worker(args, seeds, recipes, setup)
        else:
            del setup
            ctx = multiprocessing.get_context("spawn")
            procs = [
                ctx.Process(target=_worker, args=(args, seeds[i::k], recipes)) for i in range(k)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
    hours = (time.perf_counter() - start) / 3600
    print(report(args, tokenizer, tags, hours))


if __name__ == "__main__":
    main()
