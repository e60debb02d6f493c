"""`make gpu-check`: everything only a GPU can confirm, in one run of under 8 minutes.

    python benchmarks/gpu_check.py [--logs DIR]    # DIR: the full test and benchmark output
    python benchmarks/gpu_check.py --dry-run       # any machine: steps 3-4 built, not timed

`make gpu-check` runs it in the project's venv. On a machine that cannot install (a lent GPU
whose image already holds torch, Triton and transformers), from the repository's root:
`PYTHONPATH=$PWD:$PWD/runtime python3 benchmarks/gpu_check.py --logs DIR`, with `gguf`
importable (the integration tests import the toolkit): how it ran on 2026-12-04.

1. the `gpu`-marked tests (tests/runtime and tests/integration): the kernels at fp16/bf16 against
   their references at real sizes, bit-exact packing on the GPU, a decode step under
   torch.cuda.set_sync_debug_mode("error"), generation replayed from a CUDA graph, the CUDA
   allocator against the cache's walked bytes, the paged decode kernel reading vLLM-style
   pages through a block table (tests/runtime/kernels/test_paged_decode.py), the Gluon
   skeleton of benchmarks/kernel_floor.py against the attention it computes
   (tests/runtime/kernels/test_kernel_floor.py: the next kernel's design, first run here);
   at most TEST_SECONDS
2. benchmarks/bench_decode.py at 4K and 32K contexts, batch 1 and 16, the 32/8/128 shape in
   fp16, every layout and key position (12 rows, ~10 s each on an H200), FlashAttention
   (torch SDPA's flash backend) and the full-precision stream beside each row, and the
   registers table; at most BENCH_SECONDS (rows print as they finish, so a run cut short still
   reports what it measured). The whole grid (three shapes, bf16, 131K) is `bench_decode.py`
   alone: ~72 rows at 4K and 32K, over 10 minutes
3. `gpu_steps.py registers`: the decode kernel's n_regs / n_spills on this GPU for every
   configuration it compiles (kvcalib-2, the full-precision stream and, time allowing,
   kvcalib-4, -3 and -1.5 at 32/8/128, keys pre- and post-RoPE) beside the CPU compile's registers
   (benchmarks/kernel_budget/budget.json); at most STEP_SECONDS["registers"]
4. `gpu_steps.py e2e`: tokens/s of the runtime (kvcalib-2 cache, CUDA graph) on a
   random-weight Qwen2.5-0.5B at 16K context, batch 16, against transformers' SDPA over an
   fp16 cache; at most STEP_SECONDS["e2e"]

It appends one section to benchmarks/RESULTS.md: device, versions, the test summary and the
tables. Without a CUDA device it says so and exits 2; --dry-run instead runs steps 3 and 4's
CPU side (launches intercepted and matched to budget.json rows; models and caches built on the
meta device) and appends nothing.
"""

import argparse
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# the tests took 173 s on an H200 (2026-12-04); in all under 8 minutes
TEST_SECONDS, BENCH_SECONDS = 200, 150
STEP_SECONDS = {"registers": 40, "e2e": 80}  # e2e: transformers' import, the kernels' tuning
BENCH = ["benchmarks/bench_decode.py", "--contexts", "4096", "32768", "--batches", "1", "16",
         "--shapes", "32/8/128", "--dtypes", "float16", "--no-e2e", "--no-save"]  # fmt: skip


def _run(command: list[str], seconds: int) -> tuple[str, str]:
    """(output, status) of command, cut off after `seconds`."""
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
        return done.stdout + done.stderr, f"exit {done.returncode}"
    except subprocess.TimeoutExpired as cut:
        out = (cut.stdout or b"").decode() + (cut.stderr or b"").decode()
        return out, f"cut off after {seconds} s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logs", type=Path, help="write tests.log and bench.log here")
    parser.add_argument("--test-seconds", type=int, default=TEST_SECONDS)
    parser.add_argument("--bench-seconds", type=int, default=BENCH_SECONDS)
    parser.add_argument("--dry-run", action="store_true", help="steps 3-4's CPU side only")
    args = parser.parse_args(argv)
    import torch

    if args.dry_run:
        print("would run: pytest -m gpu tests/runtime tests/integration")
        print("would run:", " ".join(BENCH))
        failed = 0
        for step in ("registers", "e2e"):
            out, status = _run([sys.executable, "benchmarks/gpu_steps.py", step, "--dry-run"],
                               600)  # fmt: skip
            print(out)
            failed += status != "exit 0"
        return 1 if failed else 0
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing to check", file=sys.stderr)
        return 2
    import triton

    start = time.monotonic()
    tests, test_status = _run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
         "tests/runtime", "tests/integration"], args.test_seconds,
    )  # fmt: skip
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / "tests.log").write_text(tests)
    summary = [line for line in tests.splitlines() if line.strip()][-15:]
    print("\n".join(summary))
    bench, bench_status = _run([sys.executable, *BENCH], args.bench_seconds)
    print(bench)
    steps = {step: _run([sys.executable, "benchmarks/gpu_steps.py", step], seconds)
             for step, seconds in STEP_SECONDS.items()}  # fmt: skip
    for step, (out, _status) in steps.items():
        print(out)
        if args.logs:
            (args.logs / f"{step}.log").write_text(out)
    if args.logs:
        (args.logs / "bench.log").write_text(bench)
    tables = bench[bench.find("## Decode") :] if "## Decode" in bench else bench
    if "## Decode" not in bench:  # cut off: keep the rows it printed
        tables = "\n".join(line for line in bench.splitlines() if line.startswith("|"))
    props = torch.cuda.get_device_properties(0)
    section = [
        f"## gpu-check, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; "
        f"torch {torch.__version__}, triton {triton.__version__}; "
        f"{time.monotonic() - start:.0f} s in all",
        "",
        f"gpu-marked tests ({test_status}):",
        "",
        "```",
        *summary,
        "```",
        "",
        f"{' '.join(BENCH[:-1])} ({bench_status}):",
        "",
        tables,
    ]
    for step, (out, status) in steps.items():
        rows = [line for line in out.splitlines() if line.startswith(("|", "note:"))]
        section += ["", f"gpu_steps.py {step} ({status}):", "", *rows]
    with RESULTS.open("a") as f:
        f.write("\n" + "\n".join(section) + "\n")
    print(f"appended to {RESULTS}")
    statuses = {test_status, bench_status, *(status for _out, status in steps.values())}
    return 0 if statuses == {"exit 0"} else 1


if __name__ == "__main__":
    sys.exit(main())
