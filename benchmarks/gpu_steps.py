"""Two steps of `make gpu-check` (benchmarks/gpu_check.py runs each in a process of its own):

    python benchmarks/gpu_steps.py registers [--dry-run]
    python benchmarks/gpu_steps.py e2e [--dry-run]

registers  the decode kernel's `n_regs` / `n_spills` as the driver reports them, for the
           configuration the launcher picks untuned (stream capture reported: no tuning, as in
           the budget's `chosen` rows; ~5 s of compile each) for the kernel budget's quick set
           (kvcalib-2, the full-precision stream, kvcalib-4, -3 and -1.5 at 32/8/128, keys
           pre- and post-RoPE, 32K x 16: `kernel_budget.inputs`, allocated on the GPU), beside
           the CPU compile's registers in benchmarks/kernel_budget/budget.json (sm_90 rows)
e2e        greedy decode steps, tokens/s, of a random-weight Qwen2.5-0.5B (24 layers, 14/2 heads
           of 64) at 16K context and batch 16: the runtime over a kvcalib-2 cache (its first
           layer's recipe in every layer, filled synthetically, replayed from a CUDA graph)
           against transformers' Qwen2 with SDPA over an fp16 DynamicCache of the same length

--dry-run (no GPU needed): registers intercepts the launches (`budget_read.pretend_gpu`) and
matches each configuration to its budget row; e2e builds both models and caches on the meta
device. Both print what they would measure. Without CUDA and without --dry-run: exit 2.
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_read as read
import budget_report as report
import kernel_budget as kb

BUDGET = Path(__file__).resolve().parent / "kernel_budget" / "budget.json"
# Qwen2.5-0.5B's architecture (the embedded qwen2.5-0.5b, Qwen2.5-Coder-0.5B-Instruct, has it)
QWEN = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
            rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
            tie_word_embeddings=True, hidden_act="silu")  # fmt: skip
CONTEXT, BATCH, STEPS, REPS = 16384, 16, 8, 5


def budget_rows() -> dict[tuple, dict]:
    """The committed sm_90 rows by (recipe, shape, keys, paged, kernel, BLOCK_N, warps,
    stages)."""
    rows = json.loads(BUDGET.read_text())["rows"]
    fields = ("recipe", "shape", "keys", "paged", "kernel", "block_n", "num_warps", "num_stages")
    return {tuple(r[f] for f in fields): r for r in rows
            if r["arch"] == "sm_90" and "registers" in r}  # fmt: skip


def _launched(v: kb.Variant, dec, dry_run: bool) -> list[tuple]:
    """(fn, kwargs, CompiledKernel or None) of every launch of one decode step of variant v,
    untuned: on the GPU, or intercepted (`budget_read.pretend_gpu`) for a dry run."""
    from triton.runtime.jit import JITFunction

    if dry_run:
        args, options = kb.inputs(v, *kb.COMPILED_AT)
        launched = []
        with read.pretend_gpu(kb.GPUS[90][1], True, launched) as mode:
            fake = read.to_fake(mode, (args, options))
            dec.decode_attention(*fake[0], **fake[1])
        return [(fn, kw, None) for fn, _args, kw, _grid in launched]
    found, original = [], JITFunction.run
    capturing = torch.cuda.is_current_stream_capturing

    def run(self, *a, grid, warmup, **kw):
        kernel = original(self, *a, grid=grid, warmup=warmup, **kw)
        found.append((self, kw, kernel))
        return kernel

    JITFunction.run = run
    torch.cuda.is_current_stream_capturing = lambda: True  # the untuned configuration
    try:
        args, options = kb.inputs(v, *kb.COMPILED_AT, device="cuda")
        dec.decode_attention(*args, **options)
        torch.cuda.synchronize()
    finally:
        JITFunction.run = original
        torch.cuda.is_current_stream_capturing = capturing
    return found


def registers(dry_run: bool) -> list[str]:
    """Table rows: each compiled configuration's CPU and GPU registers."""
    from kvcalib_runtime.kernels import decode_attention as dec
    from kvcalib_runtime.kernels import decode_config

    budget, lines = budget_rows(), []
    for v in kb.variants(quick=True):
        importlib.reload(decode_config)  # no tuning remembered
        seen = {}
        for fn, kw, kernel in _launched(v, dec, dry_run):
            if read.marker(fn) is not None:  # the decode kernels (Triton, Gluon), not the combine
                config = (read.block_n(kw), read.num_warps(kw), read.num_stages(kw))
                seen[fn.__name__, config] = kernel
        for (name, config), kernel in seen.items():
            cpu = budget.get((v.recipe, v.shape, v.keys, v.paged, name, *config))
            gpu = "dry run" if kernel is None else f"{kernel.n_regs} / {kernel.n_spills}"
            cpu_regs = "not in budget.json" if cpu is None else cpu["registers"]
            diff = ""
            if kernel is not None and cpu is not None:
                diff = f"{kernel.n_regs - cpu['registers']:+d}"
            lines.append(f"| {v.recipe} | {v.shape} | {v.keys} | {report.KERNELS[name]} | "
                         f"{', '.join(map(str, config))} "
                         f"| {cpu_regs} | {gpu} | {diff} |")  # fmt: skip
            print(lines[-1], flush=True)
    return lines


def _qwen_runtime(device, dtype):
    """The runtime's Qwen2 (random weights) and a kvcalib-2 cache of CONTEXT + room."""
    from kvcalib_runtime.cache.scheme import KVScheme
    from kvcalib_runtime.model.forward import Transformer
    from kvcalib_runtime.model.transforms import Transforms

    with torch.device("meta"):
        model = Transformer(dict(QWEN))
    if device != "meta":
        model = model.to_empty(device=device).to(dtype).eval()
        for p in model.parameters():
            p.data.normal_(0, 0.02)
    layer, recipe = kb.layer_scheme("kvcalib-2", pre_rope=True)
    layers = QWEN["num_hidden_layers"]
    scheme = KVScheme((layer,) * layers, residual=recipe.residual,
                      sinks_first=recipe.sinks_first, sink_budget=recipe.sink_budget)  # fmt: skip
    params = None
    for i in range(layers):
        params = kb.params_for(layer, recipe, 2, 64, params, i)
    max_len = CONTEXT + STEPS * (REPS + 3) + 2
    cache = model.new_cache(BATCH, max_len, scheme, params, Transforms.none(layers),
                            device=device)  # fmt: skip
    return model, cache


def _qwen_transformers(device, dtype):
    """transformers' Qwen2 (random weights, SDPA) and an fp16 DynamicCache of CONTEXT."""
    import transformers

    config = transformers.Qwen2Config(**{k: v for k, v in QWEN.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    if device != "meta":
        model = model.to_empty(device=device).to(dtype).eval()
        for p in model.parameters():
            p.data.normal_(0, 0.02)
    cache = transformers.DynamicCache(config=config)
    shape = (BATCH, QWEN["num_key_value_heads"], CONTEXT, QWEN["head_dim"])
    for i in range(QWEN["num_hidden_layers"]):
        cache.update(torch.randn(shape, device=device, dtype=dtype),
                     torch.randn(shape, device=device, dtype=dtype), i)  # fmt: skip
    return model, cache


def _tokens_per_s(step) -> float:
    """BATCH x STEPS / the median time of STEPS calls of step(), after one warm-up."""
    step()
    times = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return BATCH * STEPS / statistics.median(times)


def e2e(dry_run: bool) -> list[str]:
    device, dtype = ("meta" if dry_run else "cuda"), torch.float16
    from bench_decode import fill

    model, cache = _qwen_runtime(device, dtype)
    hf, hf_cache = _qwen_transformers(device, dtype)
    fill(cache, CONTEXT)  # on the meta device too: its dtype checks are the GPU's
    if dry_run:
        return [f"| Qwen2.5-0.5B | {CONTEXT} | {BATCH} | dry run: runtime cache "
                f"{type(cache).__name__}, transformers {type(hf_cache).__name__} |"]  # fmt: skip
    from kvcalib_runtime.generate import DecodeStep

    tokens = torch.zeros(BATCH, dtype=torch.long, device=device)
    with torch.inference_mode():
        step = DecodeStep(model, cache, cuda_graph=True)
        ours = _tokens_per_s(lambda: [step(tokens) for _ in range(STEPS)])
        hf_tokens = tokens[:, None]

        def hf_steps():
            for _ in range(STEPS):
                hf(input_ids=hf_tokens, past_key_values=hf_cache, use_cache=True)

        theirs = _tokens_per_s(hf_steps)
    return [f"| Qwen2.5-0.5B | {CONTEXT} | {BATCH} | {ours:.0f} | {theirs:.0f} | "
            f"{ours / theirs:.2f}x |"]  # fmt: skip


HEADERS = {
    "registers": ["| recipe | shape | keys | kernel | BLOCK_N, warps, stages | CPU regs "
                  "(budget.json) | GPU n_regs / n_spills | GPU - CPU |",
                  "|---|---|---|---|---|---:|---:|---:|"],
    "e2e": ["| model (random weights) | context | batch | runtime kvcalib-2 tok/s (graph) | "
            "transformers SDPA fp16 tok/s | ratio |", "|---|---:|---:|---:|---:|---:|"],
}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=sorted(HEADERS))
    parser.add_argument("--dry-run", action="store_true", help="no GPU: build and match only")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, or intercepted launches
    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu_steps {args.step}: no CUDA device on this machine", file=sys.stderr)
        return 2
    if args.step == "registers":
        try:
            kb.check_triton()
        except kb.BudgetError as e:  # another Triton: the GPU's counts are still worth a row
            print(f"note: {e}; the CPU column is Triton {kb.TRITON}'s", flush=True)
    print("\n".join(["", *HEADERS[args.step]]), flush=True)
    if args.step == "registers":
        registers(args.dry_run)  # prints each row as it is measured
    else:
        print("\n".join(e2e(args.dry_run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
