"""Decode speed of the quantized KV cache, in one run: is the decode kernel bandwidth-bound on
the bytes it must read, and how far ahead of FlashAttention over an fp16 cache is it?

    python benchmarks/bench_decode.py                        # GPU: the whole grid, saved
    python benchmarks/bench_decode.py --contexts 4096 32768 --batches 1 16   # make gpu-check
    python benchmarks/bench_decode.py --smoke                # CPU: tiny shapes, interpreted

Layouts: kvcalib-2's (keys 2-bit "static" codebook with one exact slot per (token, KV head)
stored in one byte, pre-RoPE (rotated in the kernel) or post-RoPE; values 2-bit per token,
asymmetric, with a one-byte scale and zero point: the preset's since 2026-12-04, whose whole
tiles at 128 channels a head kernels.decode_gluon reads) and
kvcalib-1.5's (6-bit indices of 4-channel vectors into a 64-entry codebook per KV head, keys
pre-RoPE as RoPE-pair quads, values as adjacent quads: the lookup in the kernel's tile); a
residual window of 128, token 0 and 8 predicted sinks exact. Grid: contexts x batches x shapes
(query heads, KV heads, head_dim) x layout and key position x dtype; each row is one decode step
of one layer over a cache filled synthetically to the context (speed does not depend on the
values).

    ours graph / eager   decode_attention replayed from a CUDA graph / launched eagerly (us)
    flash                FlashAttention over an fp16/bf16 cache of the same shape, forced
                         (SDPBackend.FLASH_ATTENTION only: a fallback is an error); the G query
                         heads of a KV head are its G query rows
    dequant+sdpa         the body dequantized in torch (codes, codebook, scales, slots, RoPE),
                         then the same flash call: the unfused way
    exact stream         the same kernel over a cache left in full precision (its efficiency
                         without dequantization)
    probe                a read-only Triton pass over the body's buffers: what this access
                         pattern can stream on this device

Bytes are what the kernel must read: codes, metadata (per-token scales, static ranges,
codebooks, is-sink flags), exact slots (index + delta), exact rows (ring, sink slots, the new
token) and partials (written and read back by the combine). GB/s and % of the device's peak
(spec sheet) count those bytes; "x flash" etc. are speed-ups. L2 is flushed before every timed
repetition (a 256 MB write). Registers and spills of every compiled decode variant follow. The
end-to-end rows time greedy decode steps of a random-weight 8B-class Llama (32 layers, 32/8
heads of 128) over caches filled synthetically to 32K: the fp16 runtime cache (eager: it is
not capturable) against the quantized one, eager and replayed from a CUDA graph.

--smoke runs the same code on tiny shapes through Triton's interpreter in well under a minute:
its numbers only show that the script works.
"""

import argparse
import itertools
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE or not torch.cuda.is_available():  # the kernels' CPU path; set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvcalib_runtime.cache.kvcache import QuantizedCache  # noqa: E402
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme  # noqa: E402
from kvcalib_runtime.generate import DecodeStep  # noqa: E402
from kvcalib_runtime.kernels import decode_attention as dec  # noqa: E402
from kvcalib_runtime.kernels import decode_config  # noqa: E402
from kvcalib_runtime.kernels.operands import Sinks  # noqa: E402
from kvcalib_runtime.layouts import Kind  # noqa: E402
from kvcalib_runtime.layouts.body import Body  # noqa: E402
from kvcalib_runtime.layouts.quant import QuantSpec  # noqa: E402
from kvcalib_runtime.model.forward import Transformer  # noqa: E402
from kvcalib_runtime.model.rope import Rope  # noqa: E402
from kvcalib_runtime.model.transforms import Transforms  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS.md")
RESIDUAL, SINKS_FIRST, SINK_BUDGET = 128, 1, 8
KEY = QuantSpec(
    2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error", slot_code="fp8"
)
VALUE = QuantSpec(2, metadata_code="byte")
VQ_KEY = QuantSpec(6, "static", 4, codebook=True, method="vq", pairing="rope")
VQ_VALUE = QuantSpec(6, "static", 4, codebook=True, method="vq")
# (layout, key position) pairs the grid times: kvcalib-1.5 stores keys before RoPE only
LAYOUTS = {"kvcalib-2": (KEY, VALUE), "kvcalib-1.5": (VQ_KEY, VQ_VALUE)}
ROWS = (("kvcalib-2", True), ("kvcalib-2", False), ("kvcalib-1.5", True))
PEAK_GBPS = {"H200": 4800, "H100": 3350, "H800": 3350, "A100": 2039, "L40S": 864, "A10G": 600}
GRID = dict(contexts=[4096, 32768, 131072], batches=[1, 16],
            shapes=[(9, 3, 64), (32, 8, 128), (8, 4, 256)], dtypes=["float16", "bfloat16"],
            reps=20, warmup=3, e2e=dict(layers=32, hidden=4096, heads=32, kv_heads=8,
                                         intermediate=14336, vocab=128256, context=32768,
                                         batches=[1, 16], steps=8))  # fmt: skip
SMOKE_GRID = dict(contexts=[150], batches=[2], shapes=[(4, 2, 64)], dtypes=["float16"], reps=1,
                  warmup=0, e2e=dict(layers=2, hidden=128, heads=4, kv_heads=2,
                                     intermediate=256, vocab=512, context=150, batches=[2],
                                     steps=1))  # fmt: skip


def scheme_for(layers: int, pre_rope: bool, layout: str | None = "kvcalib-2") -> KVScheme:
    """A layout of LAYOUTS in every layer (None: left in full precision)."""
    key, value = LAYOUTS[layout] if layout else (None, None)
    position = "pre_rope" if pre_rope else "post_rope"
    layer = LayerScheme(key, value, key_position=position)
    return KVScheme((layer,) * layers, residual=RESIDUAL, sinks_first=SINKS_FIRST,
                    sink_budget=SINK_BUDGET)  # fmt: skip


def params_for(layers: int, kv_heads: int, head_dim: int, layout: str = "kvcalib-2") -> KVParams:
    """Random calibrated tensors of the right shapes for a layout of LAYOUTS."""
    gen = torch.Generator().manual_seed(0)

    def ranges():
        one = (kv_heads, head_dim)
        return {i: (-torch.rand(one, generator=gen) * 4, torch.rand(one, generator=gen) * 4)
                for i in range(layers)}  # fmt: skip

    if layout == "kvcalib-1.5":
        entries = (kv_heads, VQ_KEY.levels, VQ_KEY.group_size)
        books = [{i: torch.rand(entries, generator=gen) for i in range(layers)} for _ in "kv"]
        return KVParams(key_range=ranges(), value_range=ranges(), key_codebook=books[0],
                        value_codebook=books[1])  # fmt: skip
    return KVParams(
        key_range=ranges(),
        key_codebook={i: torch.rand(4, generator=gen).sort().values for i in range(layers)},
        value_codebook={i: torch.rand(4, generator=gen).sort().values * 2 - 1
                        for i in range(layers)},
    )  # fmt: skip


def _uniform(t: torch.Tensor, low: float, high: float) -> None:
    """t uniform in [low, high), or random bytes below 0x7F where it holds codes (one-byte
    metadata, fp8 deltas: finite, positive)."""
    if t.dtype.is_floating_point:
        t.uniform_(low, high)
    else:
        t.random_(0, 0x7F)


def fill(cache: QuantizedCache, length: int) -> None:
    """Every sequence `length` tokens long, written straight into the buffers: random codes,
    scales and slots, the decode rule's body sizes, the ring, token 0 and 8 later sinks (the
    benchmark sets the host's mirror of the lengths itself, as a prefill would)."""
    for stream in cache.keys + cache.values:
        if stream.body is not None:
            body = stream.body
            body.codes.random_(0, 256)
            if not stream.spec.layout.calibrated_range:
                _uniform(body.scale, 0.01, 0.1)
            if getattr(body, "slot_index", None) is not None:
                body.slot_index.random_(0, body.width)
                _uniform(body.slot_delta, -1.0, 1.0)
        else:
            stream.exact.normal_()
        stream.tail.normal_()
        stream.n_body.fill_(stream.host_body(length))
    cache.lengths.fill_(length)
    cache._filled[:] = [length] * len(cache._filled)
    sinks = [0, *range(length // 9, length - RESIDUAL, max(length // 9, 1))][
        : cache.sink_pos.shape[1]
    ]
    cache.sink_pos[:, : len(sinks)] = torch.tensor(sinks, device=cache.sink_pos.device)
    cache.is_sink[:, sinks] = True
    cache.sink_k.normal_()
    cache.sink_v.normal_()


def timer(device: torch.device, reps: int, warmup: int):
    """Median microseconds of fn() after `warmup` calls, L2 flushed before each (on a GPU)."""
    scrub = None
    if device.type == "cuda":
        scrub = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)

    def run(fn) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if scrub is None:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
                continue
            scrub.zero_()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    return run


def graphed(fn, device):
    """fn replayed from a CUDA graph (eager off a GPU)."""
    if device.type != "cuda":
        return fn
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@triton.jit
def _probe_kernel(X, OUT, n, BLOCK: tl.constexpr):
    """Read n int32 words, BLOCK per program, and write one sum per program."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + pid, tl.sum(tl.load(X + i, mask=i < n, other=0), axis=0))


def probe(buffers: list[torch.Tensor]):
    """A read of every byte of `buffers` (as int32 words), the way a streaming kernel reads."""
    words = [b.view(torch.uint8).flatten() for b in buffers]
    words = [w[: w.numel() // 4 * 4].view(torch.int32) for w in words]
    outs = [torch.empty(triton.cdiv(w.numel(), 4096), dtype=torch.int32, device=w.device)
            for w in words]  # fmt: skip

    def run():
        for w, out in zip(words, outs, strict=True):
            _probe_kernel[(out.numel(),)](w, out, w.numel(), BLOCK=4096, num_warps=8)

    return run


def dequantized(body: Body, nb: int, dtype, rope: Rope | None):
    """The unfused baseline's first half: positions [0, nb) of every sequence in dtype, by the
    body's own torch read (codes, levels, metadata, exact slots), then RoPE."""
    return _rotated(body.dequantize(torch.float32, n=nb), rope).to(dtype)


def _rotated(x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
    """x [B, Hkv, n, D] at positions [0, n), RoPE applied when keys are stored before it."""
    if rope is None:
        return x
    return rope.apply(x, torch.arange(x.shape[2], device=x.device).expand(x.shape[0], -1))


def attention_row(batch, context, shape, layout, pre_rope, dtype, device, run) -> dict:
    heads, hkv, d = shape
    G = heads // hkv
    rope = Rope({"rope_theta": 500000.0}, d)
    caches = {}
    for name, stored in (("ours", layout), ("exact stream", None)):
        caches[name] = cache = QuantizedCache(
            scheme_for(1, pre_rope, stored), params_for(1, hkv, d, layout), Transforms.none(1),
            num_layers=1, batch=batch, kv_heads=hkv, head_dim=d, max_len=context + 1,
            device=device, dtype=dtype,
        )  # fmt: skip
        fill(cache, context)
    q = torch.randn(batch, heads, 1, d, device=device, dtype=dtype)
    new = torch.randn(batch, hkv, 1, d, device=device, dtype=dtype)
    inv_freq = rope.inv_freq.to(device) if pre_rope else None

    def kernel(cache):
        sinks = Sinks(cache.sink_k[0], cache.sink_v[0], cache.sink_pos, cache.is_sink)
        stored = cache.keys[0].stored(), cache.values[0].stored()
        return lambda: dec.decode_attention(q, new, new, *stored, sinks, cache.lengths,
                                            inv_freq=inv_freq)  # fmt: skip

    ours = kernel(caches["ours"])
    ours()  # tunes
    times = {"ours eager": run(ours), "ours graph": run(graphed(ours, device))}
    times["exact stream"] = run(graphed(kernel(caches["exact stream"]), device))
    fp = [torch.randn(batch, hkv, context + 1, d, device=device, dtype=dtype) for _ in range(2)]
    qg = q.view(batch, hkv, G, d)
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(qg, *fp)
    else:

        def flash():
            return F.scaled_dot_product_attention(qg, *fp)

    times["flash"] = run(flash)
    keys, values = caches["ours"].keys[0], caches["ours"].values[0]
    nb = keys.host_body(context)

    def unfused():
        k = dequantized(keys.body, nb, dtype, rope if pre_rope else None)
        v = dequantized(values.body, nb, dtype, None)
        fp[0][:, :, :nb], fp[1][:, :, :nb] = k, v
        return flash()

    try:
        times["dequant+sdpa"] = run(unfused)
    except torch.OutOfMemoryError:
        times["dequant+sdpa"] = float("nan")
    body_buffers = [t for s in (keys, values) for t in s.tensors() if t.dim() == 4]
    times["probe"] = run(probe(body_buffers))
    moved = bytes_read(caches["ours"], batch, heads, d, context, nb)
    return {"times": times, "bytes": moved}


def bytes_read(cache, batch, heads, d, context, nb) -> dict[str, float]:
    """What one decode step must read (and, for partials, write): bytes by kind."""
    keys, values = cache.keys[0], cache.values[0]
    per_slot = {"codes": 0, "metadata": 0, "slots": 0}
    for s in (keys, values):
        body = s.body
        per_slot["codes"] += body.codes[0, :, 0].numel()
        if not body.spec.layout.calibrated_range:
            per_slot["metadata"] += body.scale[0, :, 0].numel() * body.scale.element_size()
        if getattr(body, "slot_index", None) is not None:
            per_slot["slots"] += body.slot_index[0, :, 0].nbytes + body.slot_delta[0, :, 0].nbytes
    out = {k: v * batch * nb for k, v in per_slot.items()}
    constants = sum(t.nbytes for s in (keys, values) for t in s.tensors() if t.dim() < 4)
    out["metadata"] += constants + batch * context  # static ranges, codebooks; is-sink flags
    exact_rows = context - nb + cache.sink_pos.shape[1] + 1  # ring, sink slots, new token
    out["exact"] = 2 * batch * keys.tail.shape[1] * exact_rows * d * keys.tail.element_size()
    splits = decode_config.num_splits(cache.lengths.device, batch * keys.tail.shape[1], context, 64)
    out["partials"] = 2 * batch * heads * splits * (d + 2) * 4
    return out


def registers() -> list[str]:
    """n_regs / n_spills of every compiled decode variant (GPU only; Triton's kernel cache)."""
    rows = []
    for device_cache in dec._decode_split_kernel.device_caches.values():
        for kernel in device_cache[0].values():
            kernel._init_handles()
            names, constants = kernel.src.fn.arg_names, kernel.src.constants
            const = {names[k[0]]: v for k, v in constants.items() if len(k) == 1}
            # a stream's StreamLayout is a tuple argument: its fields keyed (argument, field)
            gran = [constants.get((names.index(s), dec.StreamLayout._fields.index("GRAN")))
                    for s in ("KL", "VL")]  # fmt: skip
            kinds = "/".join(Kind(g).name.lower() if g is not None else "?" for g in gran)
            rows.append(
                f"| {const.get('D')} | {const.get('G')} | {const.get('PRE_ROPE')} | "
                f"{kinds} | {const.get('BLOCK_N')} | "
                f"{kernel.metadata.num_warps} | {const.get('STAGES')} | {kernel.n_regs} | "
                f"{kernel.n_spills} |"
            )
    return rows


def end_to_end(cfg, device, dtype, run) -> list[str]:
    """Greedy decode steps of a random 8B-class Llama over caches filled to the context."""
    e = cfg["e2e"]
    config = dict(model_type="llama", hidden_size=e["hidden"], intermediate_size=e["intermediate"],
                  num_hidden_layers=e["layers"], num_attention_heads=e["heads"],
                  num_key_value_heads=e["kv_heads"], head_dim=e["hidden"] // e["heads"],
                  vocab_size=e["vocab"], rms_norm_eps=1e-5, rope_theta=500000.0)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device).to(dtype).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    geo, rows = model.geometry, []
    for batch in e["batches"]:
        max_len = e["context"] + 2 * e["steps"] * (cfg["warmup"] + cfg["reps"] + 2) + 2
        fp16 = model.new_cache(batch, max_len)
        for t in fp16.keys + fp16.values:
            t.normal_()
        fp16.lengths.fill_(e["context"])
        ours = model.new_cache(batch, max_len, scheme_for(geo.layers, True),
                               params_for(geo.layers, geo.kv_heads, geo.head_dim),
                               Transforms.none(geo.layers))  # fmt: skip
        fill(ours, e["context"])
        tokens = torch.zeros(batch, dtype=torch.long, device=device)
        tok_s = {}
        with torch.inference_mode():
            for name, cache, graph in (("fp16", fp16, False), ("ours eager", ours, False),
                                       ("ours graph", ours, True)):  # fmt: skip
                step = DecodeStep(model, cache, cuda_graph=graph)

                def steps(step=step, tokens=tokens):
                    for _ in range(e["steps"]):
                        step(tokens)

                tok_s[name] = batch * e["steps"] / (run(steps) / 1e6)
        gb = {n: c.allocated_bytes() / 1e9 for n, c in (("fp16", fp16), ("ours", ours))}
        rows.append(
            f"| {e['layers']}L {e['heads']}/{e['kv_heads']}x{geo.head_dim} | {e['context']} | "
            f"{batch} | {tok_s['fp16']:.1f} | {tok_s['ours eager']:.1f} | "
            f"{tok_s['ours graph']:.1f} | {tok_s['ours graph'] / tok_s['fp16']:.2f}x | "
            f"{gb['fp16']:.2f} | {gb['ours']:.2f} |"
        )
        del fp16, ours
    return rows


TIMES = ("ours graph", "ours eager", "flash", "dequant+sdpa", "exact stream", "probe")
BYTES = ("codes", "metadata", "slots", "exact", "partials")


def table_row(where, row, top: float | None) -> str:
    """One attention row: times (us), bytes (MB), GB/s and speed-ups of the graph replay."""
    shape, context, batch, layout, pre_rope, dtype_name = where
    t, b = row["times"], row["bytes"]
    ours = t["ours graph"]
    gbps = sum(b.values()) / ours / 1e3
    probe_gbps = (b["codes"] + b["metadata"] + b["slots"]) / t["probe"] / 1e3
    cells = ["/".join(map(str, shape)), str(context), str(batch), layout,
             "pre-RoPE" if pre_rope else "post-RoPE", dtype_name]  # fmt: skip
    cells += [f"{t[k]:.1f}" for k in TIMES] + [f"{b[k] / 1e6:.2f}" for k in BYTES]
    cells += [f"{gbps:.0f}", f"{100 * gbps / top:.0f}%" if top else "n/a",
              f"{100 * gbps / probe_gbps:.0f}%"]  # fmt: skip
    cells += [f"{t[k] / ours:.2f}" for k in ("flash", "dequant+sdpa", "exact stream")]
    return "| " + " | ".join(cells) + " |"


def peak(name: str) -> float | None:
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--shapes", nargs="+", help="query heads/KV heads/head_dim, e.g. 32/8/128")
    parser.add_argument("--dtypes", nargs="+", choices=["float16", "bfloat16"])
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end rows")
    parser.add_argument("--no-save", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.smoke
    if not gpu and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
        return 2
    cfg = dict(SMOKE_GRID if args.smoke else GRID)
    cfg["contexts"] = args.contexts or cfg["contexts"]
    cfg["batches"] = args.batches or cfg["batches"]
    cfg["shapes"] = [tuple(map(int, s.split("/"))) for s in args.shapes or ()] or cfg["shapes"]
    cfg["dtypes"] = args.dtypes or cfg["dtypes"]
    device = torch.device("cuda" if gpu else "cpu")
    name = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter smoke run)"
    run = timer(device, cfg["reps"], cfg["warmup"])
    top = peak(name) if gpu else None
    lines = [
        "| shape H/Hkv/D | context | batch | layout | keys | dtype | ours graph us | "
        "ours eager us | flash us | dequant+sdpa us | exact stream us | probe us | codes MB | "
        "metadata MB | slots MB | exact MB | partials MB | GB/s | % peak | % probe | x flash | "
        "x dequant+sdpa | x exact stream |",
        "|" + "---|" * 6 + "---:|" * 17,
    ]
    grid = itertools.product(cfg["shapes"], cfg["dtypes"], ROWS, cfg["contexts"], cfg["batches"])
    for shape, dtype_name, (layout, pre_rope), context, batch in grid:
        where = (shape, context, batch, layout, pre_rope, dtype_name)
        dtype = getattr(torch, dtype_name)
        try:
            row = attention_row(batch, context, shape, layout, pre_rope, dtype, device, run)
        except torch.OutOfMemoryError:
            print(f"{where}: out of memory, skipped", file=sys.stderr)
            continue
        lines.append(table_row(where, row, top))
        print(lines[-1], flush=True)
    e2e = [] if args.no_e2e else end_to_end(cfg, device, torch.float16 if gpu else torch.float32,
                                             run)  # fmt: skip
    setup = (
        f"{name}; torch {torch.__version__}, triton {triton.__version__}; layouts: kvcalib-2 "
        f"(2-bit static codebook keys + 1 exact slot, 2-bit symmetric codebook values; its "
        f"layout end to end) and kvcalib-1.5 (6-bit indices of 4-channel vectors), residual "
        f"{RESIDUAL}, {SINKS_FIRST} + {SINK_BUDGET} sinks; median of {cfg['reps']} after "
        f"{cfg['warmup']} warm-up, L2 flushed before each; peak {top or 'unknown'} GB/s"
    )
    report = [f"## Decode, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC", "", setup, "",
              "### Attention, one decode step of one layer", "", *lines]  # fmt: skip
    if gpu:
        report += ["", "### Registers per compiled decode variant", "",
                   "| D | G | pre-RoPE | K/V gran | BLOCK_N | warps | stages | regs | spills |",
                   "|---:|---:|---|---|---:|---:|---:|---:|---:|", *registers()]  # fmt: skip
    if e2e:
        report += ["", "### End to end, greedy decode over a filled cache", "",
                   "| model | context | batch | fp16 tok/s (eager) | ours tok/s (eager) | "
                   "ours tok/s (graph) | graph x fp16 | fp16 cache GB | ours cache GB |",
                   "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *e2e]  # fmt: skip
    text = "\n".join(report) + "\n"
    print(text)
    if gpu and not args.no_save:
        with RESULTS.open("a") as f:
            f.write("\n" + text)
        print(f"appended to {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
