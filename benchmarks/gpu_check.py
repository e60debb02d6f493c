"""`make gpu-check`: everything only a GPU can confirm, in one run of under 8 minutes.

    python benchmarks/gpu_check.py [--logs DIR]    # DIR: the full test and benchmark output

`make gpu-check` runs it in the project's venv. On a machine that cannot install (a lent GPU
whose image already holds torch, Triton and transformers), from the repository's root:
`PYTHONPATH=$PWD:$PWD/runtime python3 benchmarks/gpu_check.py --logs DIR`, with `gguf`
importable (the integration tests import the toolkit): how it ran on 2026-12-04.

1. the `gpu`-marked tests (tests/runtime and tests/integration): the kernels at fp16/bf16 against
   their references at real sizes, bit-exact packing on the GPU, a decode step under
   torch.cuda.set_sync_debug_mode("error"), generation replayed from a CUDA graph, the CUDA
   allocator against the cache's walked bytes, the paged decode kernel reading vLLM-style
   pages through a block table (tests/runtime/test_paged_decode.py);
   at most TEST_SECONDS
2. benchmarks/bench_decode.py at 4K and 32K contexts, batch 1 and 16, the 32/8/128 shape in
   fp16, every layout and key position (12 rows, ~10 s each on an H200), the registers table
   and the end-to-end rows; at most BENCH_SECONDS (rows print as they finish, so a run cut
   short still reports what it measured). The whole grid (three shapes, bf16, 131K) is
   `bench_decode.py` alone: ~72 rows at 4K and 32K, over 10 minutes

It appends one section to benchmarks/RESULTS.md: device, versions, the test summary and the
benchmark's tables. Without a CUDA device it says so and exits 2.
"""

import argparse
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
TEST_SECONDS, BENCH_SECONDS = 210, 250  # the tests took 173 s on an H200 (2026-12-04)


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
    args = parser.parse_args(argv)
    import torch

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
    bench, bench_status = _run(
        [sys.executable, "benchmarks/bench_decode.py", "--contexts", "4096", "32768",
         "--batches", "1", "16", "--shapes", "32/8/128", "--dtypes", "float16",
         "--no-save"], args.bench_seconds,
    )  # fmt: skip
    print(bench)
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
        f"bench_decode.py --contexts 4096 32768 --batches 1 16 --shapes 32/8/128 --dtypes float16 "
        f"({bench_status}):",
        "",
        tables,
    ]
    with RESULTS.open("a") as f:
        f.write("\n" + "\n".join(section) + "\n")
    print(f"appended to {RESULTS}")
    return 0 if test_status == bench_status == "exit 0" else 1


if __name__ == "__main__":
    sys.exit(main())
