"""CPU decode and prefill speed of kvcalib_runtime against transformers, in one run: the same
model, prompt, thread count and greedy tokens for every row.

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_decode.py [--contexts 1024 4096] [--tokens 16]
        [--threads 1] [--recipe fp16 --recipe kvcalib-2] [--repeats 3] [--torch-ops] [--save]

Rows: transformers' `generate` with its own dynamic cache (fp32 on CPU: the weights' dtype), and
kvcalib_runtime loading a conversion of each recipe (made here into a temporary folder with the
default profile); with `--torch-ops` each quantized recipe again with the CPU path's C kernels
off (KVCALIB_NATIVE=0: the torch ops that read the bodies and write the cache instead). A prompt
is the first `context` tokens of the built-in evaluation text. Prefill is the time to the first
new token; decode is `--tokens` more greedy tokens (EOS ignored), timed token by token
(transformers' streamer, the runtime's callback), as tokens per second; each cell is the fastest
of `--repeats` runs, which lessens what other work on the machine adds. `--save` appends the
table with its setup to benchmarks/RESULTS.md.
"""

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


class _Stamps:
    """Times of each new token: transformers' streamer protocol (put, end), and the runtime's
    callback(step, tokens)."""

    def __init__(self):
        self.start, self.times, self.prompt_seen = time.perf_counter(), [], False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True  # generate puts the prompt first

    def end(self) -> None:
        pass

    def __call__(self, step, tokens) -> None:
        self.times.append(time.perf_counter())

    def result(self) -> tuple[float, float]:
        """(seconds to the first new token, seconds per later token)."""
        later = (self.times[-1] - self.times[0]) / (len(self.times) - 1)
        return self.times[0] - self.start, later


def _transformers(model, ids: list[int], tokens: int) -> tuple[float, float]:
    stamps = _Stamps()
    model.generate(
        torch.tensor([ids]), max_new_tokens=1 + tokens, min_new_tokens=1 + tokens,
        do_sample=False, streamer=stamps,
    )  # fmt: skip
    return stamps.result()


def _runtime(model, ids: list[int], tokens: int) -> tuple[float, float]:
    stamps = _Stamps()
    model.generate([ids], 1 + tokens, eos_token_id=[], callback=stamps)
    return stamps.result()


def _best(run, repeats: int) -> tuple[float, float]:
    runs = [run() for _ in range(repeats)]
    return min(p for p, _ in runs), min(d for _, d in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--recipe", action="append", help="Conversions (default: fp16, kvcalib-2).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save", action="store_true")
    parser.add_argument(
        "--torch-ops", action="store_true",
        help="Also each quantized recipe with the C kernel off (KVCALIB_NATIVE=0).",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    import kvcalib
    import kvcalib_runtime
    from kvcalib.core.data import read_text
    from kvcalib_runtime.kernels import native

    recipes = args.recipe or ["fp16", "kvcalib-2"]
    hf, tokenizer = kvcalib.load_model(args.model, dtype=torch.float32)
    text = read_text(None, "evaluation")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        runtimes = {}
        for r in recipes:
            out = Path(tmp) / r
            kvcalib.convert(args.model, recipe=r, output=out)
            runtimes[r] = kvcalib_runtime.load(out, device="cpu", use_kernels=False)
        for n in args.contexts:
            prompt = ids[:n]
            rows["transformers (dynamic cache)", n] = _best(
                lambda p=prompt: _transformers(hf, p, args.tokens), args.repeats
            )
            for r, m in runtimes.items():
                rows[f"kvcalib_runtime {r}", n] = _best(
                    lambda p=prompt, m=m: _runtime(m, p, args.tokens), args.repeats
                )
                if args.torch_ops and r != "fp16" and native.library() is not None:
                    os.environ["KVCALIB_NATIVE"] = "0"
                    rows[f"kvcalib_runtime {r}, torch ops", n] = _best(
                        lambda p=prompt, m=m: _runtime(m, p, args.tokens), args.repeats
                    )
                    del os.environ["KVCALIB_NATIVE"]
    names = list(dict.fromkeys(name for name, _ in rows))
    head = "| | " + " | ".join(
        f"prefill {n} (s) | decode at {n} (tok/s) | x transformers" for n in args.contexts
    )
    lines = [head + " |", "|---|" + "---:|---:|---:|" * len(args.contexts)]
    for name in names:
        cells = []
        for n in args.contexts:
            prefill, decode = rows[name, n]
            base = rows["transformers (dynamic cache)", n][1]
            cells += [f"{prefill:.2f}", f"{1 / decode:.2f}", f"{base / decode:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    setup = (
        f"{args.model}, fp32, CPU ({platform.processor() or platform.machine()}), "
        f"{args.threads} thread(s), {args.tokens} greedy tokens after the prefill, fastest of "
        f"{args.repeats}; kvcalib_runtime without Triton (its CPU path: kernels.decode_torch and "
        f"the cache's writes, with their C kernels "
        f"{'built' if native.library() else 'off: torch ops'}), "
        f"torch {torch.__version__}"
    )
    table = "\n".join(lines)
    print(f"{setup}\n\n{table}")
    if args.save:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write(f"\n## CPU decode, {time.strftime('%Y-%m-%d')}\n\n{setup}.\n\n{table}\n")


if __name__ == "__main__":
    main()
