"""The default calibration, eval and convert against plain work on the same data: issue 16's
ratios, measured in one run.

    python benchmarks/bench_calibrate.py                  # calibration and eval ratios (~10 min)
    python benchmarks/bench_calibrate.py --scale          # + convert / copy (2B checkpoint)
    python benchmarks/bench_calibrate.py --keep           # + cache the profile as the default
    python benchmarks/bench_calibrate.py --model qwen2.5-0.5b --eval-windows 0   # another model
    python benchmarks/bench_calibrate.py --eval-windows 0 --json DIR/MODEL.json  # the record

  calibrate / forward  `kvcalib.calibrate` of the default model (smollm2-135m) with the
                       default settings, load and report included, against the model's own
                       forward over the same 16 x 512 calibration windows, one at a time as
                       calibration runs them (the best of one timing before and one after).
                       Target <= 5x. The phases' seconds come from the profile's timings.
  eval / forward       bench_eval.eval_ratios on --eval-windows x 1024 tokens of the evaluation
                       text, for per-token-2, kivi-2 and kvcalib-2/3 (with the profile just
                       written). Target <= 2x in decode mode.
  convert / copy       with --scale: bench_scale.run(["copy", "convert*"]), `kvcalib convert
                       --recipe quarot-kv4` of a 2.0B-parameter bf16 checkpoint against a
                       safetensors load_file + save_file of its shards. Target <= 1.5x.

Every number is printed with the machine's 1-minute load average (other jobs share the cores:
ratios of interleaved runs hold up better than seconds). --json writes the calibration's record
(the committed ones, benchmarks/calibration-cost/, are the tables of docs/models.md).
"""

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_eval
import bench_scale

from kvcalib import calibrate, load_model
from kvcalib.api import default_profile_path
from kvcalib.calibration import Settings
from kvcalib.core.data import calibration_windows, eval_windows
from kvcalib.core.models import resolve


def _load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def _commit() -> str:
    """The checkout's commit (with "+" when the tree differs from it), or "" outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+" if dirty.strip() else "")  # fmt: skip


def plain_forward(model, ids) -> float:
    with torch.no_grad():
        start = time.perf_counter()
        for row in ids:
            model(row[None])
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model spec (default: smollm2-135m)")
    parser.add_argument("--eval-windows", type=int, default=2, help="0: no eval ratios")
    parser.add_argument("--scale", action="store_true", help="also convert / copy (2B model)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the calibration's record")
    parser.add_argument(
        "--machine", default="", help="what else ran on the machine (written into the record)"
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the profile as the default model's default profile (what eval and convert "
        "use without --profile)",
    )
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, {_load()}")
    loads = [os.getloadavg()[0]]
    model, tokenizer = load_model(args.model)
    ids = calibration_windows(tokenizer, None, num_samples=16, seq_len=512, seed=0)
    before = plain_forward(model, ids)
    print(f"plain forward 16 x 512: {before:.1f} s ({_load()})", flush=True)
    loads.append(os.getloadavg()[0])
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        start = time.perf_counter()
        profile = calibrate(args.model, Path(tmp) / "profile", progress=False)
        total = time.perf_counter() - start
        print(f"calibrate: {total:.1f} s ({_load()})", flush=True)
        loads.append(os.getloadavg()[0])
        after = plain_forward(model, ids)
        loads.append(os.getloadavg()[0])
        plain = min(before, after)
        print(f"plain forward 16 x 512: {after:.1f} s ({_load()})\n")
        phases = "  ".join(f"{k} {v:.1f}s" for k, v in profile.meta["timings"].items())
        print(f"calibrate / forward: {total / plain:.2f}x  ({total:.1f} s / {plain:.1f} s)")
        print(f"  phases: {phases}\n", flush=True)
        if args.json:
            record = {
                "model": args.model or "smollm2-135m",
                "date": datetime.date.today().isoformat(),
                "commit": _commit(),
                "settings": dataclasses.asdict(Settings()),
                "machine": args.machine,
                "cpus": os.cpu_count(),
                "threads": torch.get_num_threads(),
                "load": [round(x, 1) for x in loads],
                "forward_seconds": [round(before, 1), round(after, 1)],
                "calibrate_seconds": round(total, 1),
                "ratio": round(total / plain, 2),
                "phases": {k: round(v, 1) for k, v in profile.meta["timings"].items()},
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=1) + "\n")
        if args.eval_windows:
            windows = eval_windows(tokenizer, None, windows=args.eval_windows, seq_len=1024)
            start_load = _load()
            plain_eval, rows = bench_eval.eval_ratios(model, windows, bench_eval.RECIPES, profile)
            print(f"eval, {args.eval_windows} x 1024 tokens ({start_load} before, {_load()} after)")
            print(bench_eval.table(plain_eval, rows) + "\n", flush=True)
        if args.keep:
            kept = default_profile_path(resolve(args.model))
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(Path(tmp) / "profile", kept)
            print(f"kept the profile as {kept}", flush=True)
    if args.scale:
        del model
        runs = bench_scale.run(
            ["copy", "convert*"], {}, layers=40, shard_mb=1024, repeats=2, workdir=args.workdir
        )
        copy = min(r["wall"] for r in runs["copy"])
        convert = min(r["wall"] for r in runs["convert*"])
        loads = [r["load"] for rs in runs.values() for r in rs]
        print(
            f"\nconvert / copy: {convert / copy:.2f}x  ({convert:.1f} s / {copy:.1f} s, best of "
            f"2 rounds; load {min(loads):.1f}-{max(loads):.1f})"
        )


if __name__ == "__main__":
    main()
