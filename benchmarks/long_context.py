"""The long-context suite at the README's sizes, resumable: every recipe at the same residual
window, one full-precision prefill per prompt shared by all of them, greedy answers and the
expected answer's teacher-forced likelihood through each recipe's cache, paired against fp16.

    OMP_NUM_THREADS=1 python benchmarks/long_context.py --model qwen2.5-0.5b --lengths 4096 \
        --prompts 30 [--tasks passkey,...] [--recipe NAME ...] [--split NAME ...] [--threads 1] \
        [--processes 2]

--split NAME adds NAME:keys and NAME:values, NAME's plan (allocation included) with only its
keys, or only its values, quantized and the other kept exact in every layer: which of the two
loses what NAME loses.

One JSON per prompt under --out/cells/<task>-<length>/ (the prompt's token ids' sha256, every
recipe's record, the seconds it took), written as it finishes and skipped when present with the
same prompt and recipes: a run stopped at any point resumes where it was, in this session or the
next. Every record carries the digest of what its recipe's plan resolved (scheme, and a calibrated
recipe's tensors from the profile: "plan"): scored under another plan (a changed preset, another
calibration), it is scored again. Records of profile-free recipes written before they carried one
(plan None) stand where --out/legacy-plans.json names today's plan as the one they were scored
under (no such preset changed before: CHANGELOG.md).
--against NAME:PROFILE pairs every recipe with NAME's records scored under another profile (a
cheaper calibration's allocation against the one it would replace): the cells whose NAME record
carries that profile's plan digest, reported beside the rest, never scored here. --pair A:B
pairs recipe A against recipe B of the same run on the same prompts (repeat; default kvcalib-2
against turboquant-2.5 where both ran).

At the end (or with --report-only) every prompt present for the grid is tabulated into
--out/NAME.md and .json (--name, default long_context: another recipe set's table beside it;
accuracy with Wilson 95% intervals; paired differences to fp16 with bootstrap intervals and
exact McNemar p; answer NLL; what failed prompts' first answer step shows) and --out/NAME.png,
NAME_probe.png. The prompts are
`kvcalib.evaluation.longcontext.grid`'s: passkey cycles over 5 depths, the others a seed each.
"""

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from kvcalib.evaluation import longcontext
from kvcalib_runtime.cache.scheme import LATER_FIELDS

HERE = Path(__file__).resolve().parent
RESIDUAL = 128
LEGACY = "legacy-plans.json"
RECIPES = ("fp16", "kivi-2", "turboquant-2.5", "kvcalib-2", "kvcalib-3")
VERSUS, VERSUS_PEER = "kvcalib-2", "turboquant-2.5"  # --pair's default
SIDES = ("keys", "values")


def cell_file(out: Path, task, n, seed, depth) -> Path:
    name = f"{seed}" if depth is None else f"{seed}-d{depth}"
    return out / "cells" / f"{task}-{n}" / f"{name}.json"


def _sha(ids) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _setup(args, recipes: list[str]):
    """The model, its tokenizer, every recipe planned (a missing default profile is calibrated
    here, once) and each recipe's tag: the sha256 of what its plan resolved (scheme and
    calibrated tensors)."""
    from kvcalib import load_model
    from kvcalib.api import default_profile
    from kvcalib.core.models import resolve
    from kvcalib.evaluation.score import candidates

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    profile = default_profile(resolve(args.model), args.profile)
    every = candidates(model, recipes, profile, residual=RESIDUAL)
    split = [c for r, c in zip(recipes, every, strict=True) if r in args.split]
    every += [coded_alone(c, side) for c in split for side in SIDES]
    tags = {c.name: _digest(c) for c in every}
    if getattr(args, "against", None):  # benchmarks/session.py shares this setup
        name, path = args.against.split(":", 1)
        other_profile = default_profile(resolve(args.model), path)
        (other,) = candidates(model, [name], other_profile, residual=RESIDUAL)
        args.against_tag = (name, _digest(other))
    return model, tokenizer, every, tags


def coded_alone(candidate, side: str):
    """`candidate` with only its keys (side "keys") or only its values ("values") quantized, the
    other left exact in every layer; named NAME:side."""
    exact = {"keys": "value", "values": "key"}[side]
    scheme = candidate.scheme
    layers = tuple(dataclasses.replace(layer, **{exact: None}) for layer in scheme.layers)
    return dataclasses.replace(
        candidate,
        name=f"{candidate.name}:{side}",
        scheme=dataclasses.replace(scheme, layers=layers),
    )


def _digest(candidate) -> str:
    """sha256 of the plan; QuantSpec fields newer than the records (scheme.LATER_FIELDS) at the
    value every older plan had are left out, so a plan they do not change keeps its records."""
    plan = repr((candidate.scheme, candidate.params.sink_predictor))
    for name, value in LATER_FIELDS.items():
        plan = plan.replace(f", {name}={value!r}", "")
    h = hashlib.sha256(plan.encode())
    for name, t in sorted(candidate.params.tensors().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def legacy(out) -> dict:
    """{recipe: plan digest} of the records under `out` written without a plan (LEGACY)."""
    path = Path(out) / LEGACY
    return json.loads(path.read_text()) if path.exists() else {}


def stands(plan, name: str, tag: str, old: dict) -> bool:
    """Whether a record of recipe `name` scored under `plan` stands for today's plan `tag`: the
    same plan, or no plan recorded and `old` (legacy()) naming today's as the one it was."""
    return plan == tag or (plan is None and old.get(name) == tag)


def _current(known: dict, tags: dict, old: dict) -> set[str]:
    """The recipes whose record in `known` stands: present, scored with today's plan."""
    return {
        r
        for r, tag in tags.items()
        if r in known["recipes"] and stands(known["recipes"][r].get("plan"), r, tag, old)
    }


def _worker(args, share: list[tuple], recipes: list[str], setup=None) -> None:
    """Score the prompts in `share` (one process: its own model and threads; `setup` is
    `_setup`'s result when the caller has it)."""
    model, tokenizer, every, tags = setup or _setup(args, recipes)
    haystack = longcontext.haystack(tokenizer)
    sinks, stop = longcontext.sinks_read(every), longcontext.stop_tokens(tokenizer)
    out = Path(args.out)
    old = legacy(out)
    for task, n, seed, depth in share:
        sample = longcontext.build(tokenizer, haystack, task, n, seed, depth)
        path = cell_file(out, task, n, seed, depth)
        known = _read(path)
        if known is None or known["sha"] != _sha(sample.ids):
            known = {"sha": _sha(sample.ids), "recipes": {}, "seconds": 0.0}
        todo = [c for c in every if c.name not in _current(known, tags, old)]
        if not todo:
            continue
        start = time.perf_counter()
        records = longcontext.score_prompt(model, tokenizer, todo, sample, sinks=sinks, stop=stop)
        for name, record in records.items():
            known["recipes"][name] = {**record, "plan": tags[name]}
        known["seconds"] += time.perf_counter() - start
        known["prompt"] = {"task": task, "length": n, "seed": seed, "depth": depth}
        known["threads"] = args.threads
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known) + "\n")
        tmp.replace(path)
        took = time.perf_counter() - start
        print(f"{task} {n} seed {seed} depth {depth}: {took:.0f} s", flush=True)


def _pending(args, tags: dict) -> list[tuple]:
    """The grid's prompts whose file is missing or lacks a current record of a recipe (the
    prompt's hash is checked by the worker, which has the tokenizer)."""
    out, old = [], legacy(args.out)
    for p in longcontext.grid(args.tasks, args.lengths, args.prompts):
        known = _read(cell_file(Path(args.out), *p))
        if known is None or len(_current(known, tags, old)) < len(tags):
            out.append(p)
    return out


def report(args, tags: dict, hours: float) -> str:
    from kvcalib.evaluation import longreport

    out, recipes = Path(args.out), list(tags)
    records, seconds, old = [], 0.0, legacy(out)
    for p in longcontext.grid(args.tasks, args.lengths, args.prompts):
        known = _read(cell_file(out, *p))
        if known is not None and len(_current(known, tags, old)) == len(tags):
            records.append((SimpleNamespace(task=p[0], length=p[1]), known["recipes"]))
            seconds += known["seconds"]
    if not records:
        return "no prompt is done yet"
    rows = [SimpleNamespace(recipe=r, long_context=longcontext.cells(records, r)) for r in recipes]
    counts = sorted({c["samples"] for by_n in rows[0].long_context.values() for c in by_n.values()})
    setup = (
        f"{args.model}, fp32, CPU, {args.threads} thread(s) per process; residual {RESIDUAL} for "
        f"every recipe, each on the original weights; lengths {args.lengths}; up to "
        f"{args.prompts} prompts per task and length ({len(records)} done: n per cell "
        f"{', '.join(map(str, counts))}); {seconds / 3600:.2f} hours of prompt compute in all"
        + (f", this run {hours:.2f} h" if hours >= 0.005 else "")
    )
    means = ["| recipe | " + " | ".join(f"mean at {n}" for n in args.lengths) + " |"]
    means.append("|---|" + "---:|" * len(args.lengths))
    for r in rows:
        accs = []
        for n in args.lengths:
            try:
                accs.append(f"{longreport.mean_accuracy(r.long_context, [str(n)]):.1%}")
            except ZeroDivisionError:
                accs.append("-")
        means.append(f"| {r.recipe} | " + " | ".join(accs) + " |")
    # every prompt of a length as one cell: the suite's mean, paired
    pooled = [(SimpleNamespace(task="all tasks", length=s.length), r) for s, r in records]
    text = [
        f"Setup: {setup}.",
        "",
        longreport.format_table(rows),
        "",
        "\n".join(means),
        "",
        "Paired against fp16 on the same prompts, per task and over every prompt of a length:",
        "",
        longreport.format_paired(rows),
        longreport.format_paired(
            [SimpleNamespace(recipe=r, long_context=longcontext.cells(pooled, r)) for r in recipes]
        ).split("\n", 2)[2],
        "",
    ]
    pairs = []
    for a, b in [p.split(":", 1) for p in args.pair] or [(VERSUS, VERSUS_PEER)]:
        if not {a, b} <= set(recipes):
            continue
        versus = longcontext.cells(records + pooled, a, reference=b)
        pairs.append({"recipe": a, "reference": b, "long_context": versus})
        text += [
            f"{a} paired against {b} on the same prompts:",
            "",
            longreport.format_paired([SimpleNamespace(recipe=a, long_context=versus)], reference=b),
            "",
        ]
    paired = against(args, tags) if args.against else None
    if paired is not None:
        text += paired[0]
    out.joinpath(f"{args.name}.md").write_text("\n".join(text))
    doc = {"setup": setup, "rows": [vars(r) for r in rows]}
    if pairs:
        doc["pairs"] = pairs
    if paired is not None:
        doc["against"] = {"recipe": args.against, "rows": [vars(r) for r in paired[1]]}
    out.joinpath(f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    longreport.plot(rows, out / f"{args.name}.png")
    longreport.plot_probe(rows, out / f"{args.name}_probe.png")
    return "\n".join(text)


def against(args, tags: dict) -> tuple[list[str], list]:
    """The report's lines pairing each recipe with --against's NAME under its own profile, over
    the prompts where both records stand, and their rows (recipe, long_context)."""
    from kvcalib.evaluation import longreport

    name, tag = args.against_tag
    recipes, old = list(tags), legacy(args.out)
    label = f"{name} ({Path(args.against.split(':', 1)[1]).name})"
    records = []
    for p in longcontext.grid(args.tasks, args.lengths, args.prompts):
        known = _read(cell_file(Path(args.out), *p))
        if known is None or known["recipes"].get(name, {}).get("plan") != tag:
            continue
        if len(_current(known, tags, old)) == len(tags):
            mine = {r: known["recipes"][r] for r in recipes}
            records.append(
                (SimpleNamespace(task=p[0], length=p[1]), {**mine, label: known["recipes"][name]})
            )
    if not records:
        return [f"No prompt holds {name}'s record under {args.against.split(':', 1)[1]}.", ""], []
    pooled = [(SimpleNamespace(task="all tasks", length=s.length), r) for s, r in records]
    rows = [
        SimpleNamespace(
            recipe=r, long_context=longcontext.cells(records + pooled, r, reference=label)
        )
        for r in recipes
        if r != name
    ]
    lines = [
        f"Paired against {label}, {name} scored under that profile, on the same prompts:",
        "",
        longreport.format_paired(rows, reference=label),
        "",
    ]
    return lines, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", default=None, help="Profile folder (default: cached).")
    parser.add_argument("--lengths", default="2048", help="Comma-separated token counts.")
    parser.add_argument("--prompts", type=int, default=50, help="Prompts per task and length.")
    parser.add_argument("--tasks", default=",".join(longcontext.TASKS), help="Comma-separated.")
    parser.add_argument("--recipe", action="append", help="Recipes (repeat; default: 5).")
    parser.add_argument(
        "--split",
        action="append",
        default=[],
        help="Also score this recipe with only its keys, and only its values, quantized (repeat).",
    )
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per process.")
    parser.add_argument("--processes", type=int, default=1, help="Processes, each its model.")
    parser.add_argument("--out", default=None, help="Default: benchmarks/long_context/MODEL.")
    parser.add_argument("--report-only", action="store_true", help="Tabulate what is done.")
    parser.add_argument(
        "--against",
        default=None,
        metavar="NAME:PROFILE",
        help="Also pair every recipe with NAME's records scored under PROFILE (not scored here).",
    )
    parser.add_argument(
        "--pair",
        action="append",
        default=[],
        metavar="A:B",
        help="Also pair recipe A against recipe B on the same prompts (repeat; default: "
        f"{VERSUS}:{VERSUS_PEER} where both ran).",
    )
    parser.add_argument(
        "--name",
        default="long_context",
        help="The report's file stem under --out (another recipe set's table beside the default).",
    )
    args = parser.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.tasks = args.tasks.split(",")
    args.out = args.out or str(HERE / "long_context" / args.model)
    recipes = args.recipe or list(RECIPES)
    recipes = recipes + [r for r in args.split if r not in recipes]
    start = time.perf_counter()
    setup = _setup(args, recipes)
    tags = setup[-1]
    pending = [] if args.report_only else _pending(args, tags)
    if pending:
        k = max(1, min(args.processes, len(pending)))
        shares = [pending[i::k] for i in range(k)]
        if k == 1:
            _worker(args, shares[0], recipes, setup)
        else:
            del setup
            ctx = multiprocessing.get_context("spawn")
            procs = [ctx.Process(target=_worker, args=(args, s, recipes)) for s in shares]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
    hours = (time.perf_counter() - start) / 3600
    print(report(args, tags, hours))
    print(f"this run: {hours:.2f} hours, {len(pending)} prompts scored")


if __name__ == "__main__":
    main()
