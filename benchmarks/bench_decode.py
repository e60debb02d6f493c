"""Decode speed of the quantized KV cache: the attention kernel, and tokens/s end to end.

    python benchmarks/bench_decode.py                      # GPU: the full grid, saved
    python benchmarks/bench_decode.py --contexts 4096 --batches 1 16 --no-save

Scheme (kvcalib-2-like): keys 2-bit "static" pre-RoPE (calibrated per-channel range, RoPE in
the kernel), values 2-bit per token in groups of 32 channels, residual window 128, token 0
kept exact. Attention, per (context, batch), one decode step of 32 query / 8 KV heads of 128
channels over a full cache, against two baselines:

  fp16 sdpa      torch SDPA over an fp16 cache (what the quantized cache replaces)
  dequant+sdpa   dequantize the packed cache to fp16 in torch, then SDPA (no fused kernel)

Bandwidth is the bytes each method must move divided by its time: the packed codes, metadata,
ring and sink flags for the kernel; the fp16 keys and values for SDPA; the codes read plus the
fp16 copy written and read again for dequant+sdpa. End to end: a random-weight Llama of 1B-class
width (hidden 2048, 16 layers, 32/8 heads of 64, intermediate 8192), prefill then timed greedy
decode steps, quantized against fp16 cache. GPU timing: CUDA events after warm-up, median.

Without CUDA it runs a tiny smoke configuration through Triton's interpreter (the kernels'
CPU path) in well under 30 s and says so: the numbers then only show that the script works.
Results are appended, with the device and setup, to benchmarks/RESULTS.md (GPU runs only,
unless --no-save).
"""

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the kernels' CPU path; must be set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F
import triton

from kvcalib_runtime.fpcache import FullPrecisionCache
from kvcalib_runtime.kernels.decode_attention import decode_attention
from kvcalib_runtime.kernels.layout import Sinks
from kvcalib_runtime.kvcache import QuantizedCache
from kvcalib_runtime.model import Transformer
from kvcalib_runtime.quant import QuantSpec
from kvcalib_runtime.rope import Rope
from kvcalib_runtime.scheme import KVParams, KVScheme, LayerScheme

RESULTS = Path(__file__).with_name("RESULTS.md")
RESIDUAL, GROUP = 128, 32
GPU = dict(
    heads=32,
    kv_heads=8,
    head_dim=128,
    contexts=[1024, 4096, 16384, 32768, 65536, 131072],
    batches=[1, 4, 16],
    e2e_batches=[1, 16],
    prompt=1024,
    steps=64,
    warmup=5,
    repeats=20,
)
SMOKE = dict(
    heads=4,
    kv_heads=2,
    head_dim=64,
    contexts=[150],
    batches=[2],
    e2e_batches=[2],
    prompt=16,
    steps=2,
    warmup=1,
    repeats=1,
)
LLAMA_1B = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=32000,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)
TINY = dict(
    LLAMA_1B,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
)


def scheme_for(layers: int, kv_heads: int, head_dim: int, gen) -> tuple[KVScheme, KVParams]:
    layer = LayerScheme(
        QuantSpec(2, "static"),
        QuantSpec(2, group_size=GROUP),
        key_position="pre_rope",
        key_flush=RESIDUAL,
        value_flush=RESIDUAL,
    )
    ranges = {
        i: (
            -torch.rand(kv_heads, head_dim, generator=gen) * 4,
            torch.rand(kv_heads, head_dim, generator=gen) * 4,
        )
        for i in range(layers)
    }
    scheme = KVScheme((layer,) * layers, residual=RESIDUAL, sinks_first=1)
    return scheme, KVParams(key_range=ranges)


def timer(device: torch.device, warmup: int, repeats: int):
    """Median seconds of fn() after `warmup` calls (CUDA events on a GPU)."""

    def run(fn) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def filled_cache(batch, context, cfg, device, dtype, gen) -> tuple[QuantizedCache, Rope]:
    """A one-layer cache holding `context` tokens per sequence: random codes and metadata
    written straight into the buffers (speed does not depend on the values), the rule's body
    size, the residual ring and token 0 in its sink slot."""
    h, d = cfg["kv_heads"], cfg["head_dim"]
    scheme, params = scheme_for(1, h, d, gen)
    cache = QuantizedCache(
        scheme,
        params,
        num_layers=1,
        batch=batch,
        kv_heads=h,
        head_dim=d,
        max_len=context + 1,
        device=device,
        dtype=dtype,
    )
    for stream in cache.keys + cache.values:
        body = stream.body
        body.codes.random_(0, 256)
        if stream.spec.granularity == "token":
            body.scale.uniform_(0, 0.1)
            body.offset.uniform_(-1, 0)
        stream.tail.normal_()
        stream.n_body.fill_(stream.targets(torch.tensor(context)).item())
    cache.lengths.fill_(context)
    cache.sink_pos[:, 0] = 0
    cache.is_sink[:, 0] = True
    cache.sink_k.normal_()
    cache.sink_v.normal_()
    rope = Rope({"rope_theta": 500000.0}, d)
    return cache, rope


def unpack_levels(codes: torch.Tensor, bits: int, dtype) -> torch.Tensor:
    """Torch unpacking of whole-byte codes (bits 2, 4, 8): [..., PB] uint8 -> [..., PB*8/bits]."""
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    return ((codes[..., None] >> shifts) & (2**bits - 1)).flatten(-2).to(dtype)


def dequantize_then_sdpa(cache: QuantizedCache, q, k_new, v_new, rope: Rope):
    """The unfused baseline: the whole body dequantized to fp16 in torch, then SDPA (sinks and
    ring overlaid exactly as the cache holds them)."""
    kb, vb = cache.keys[0].body, cache.values[0].body
    B, _, _, d = cache.keys[0].tail.shape
    n, ring = int(cache.lengths[0]), cache.keys[0].tail.shape[2]
    nb = int(cache.keys[0].n_body[0])
    keys = unpack_levels(kb.codes[:, :, :nb], 2, q.dtype) * kb.scale[:, None] + kb.offset[:, None]
    v = unpack_levels(vb.codes[:, :, :nb], 2, q.dtype).unflatten(-1, (d // GROUP, GROUP))
    values = (v * vb.scale[:, :, :nb, :, None] + vb.offset[:, :, :nb, :, None]).flatten(-2)
    ring_slots = torch.arange(nb, n, device=q.device) % ring
    keys = torch.cat([keys, cache.keys[0].tail[:, :, ring_slots], k_new], 2)
    values = torch.cat([values, cache.values[0].tail[:, :, ring_slots], v_new], 2)
    keys[:, :, 0], values[:, :, 0] = cache.sink_k[0, :, :, 0], cache.sink_v[0, :, :, 0]
    positions = torch.arange(n + 1, device=q.device).expand(B, n + 1)
    keys = rope.apply(keys, positions)
    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


def bench_attention(batch, context, cfg, device, dtype, run) -> dict:
    gen = torch.Generator().manual_seed(context + batch)
    cache, rope = filled_cache(batch, context, cfg, device, dtype, gen)
    hkv, d, H = cfg["kv_heads"], cfg["head_dim"], cfg["heads"]
    q = torch.randn(batch, H, 1, d, device=device, dtype=dtype)
    k_new = torch.randn(batch, hkv, 1, d, device=device, dtype=dtype)
    v_new = torch.randn_like(k_new)
    lengths = cache.lengths.to(device=device, dtype=torch.int32)
    nb = cache.keys[0].n_body.to(device=device, dtype=torch.int32)
    sinks = Sinks(
        cache.sink_k[0], cache.sink_v[0], cache.sink_pos.to(device, torch.int32), cache.is_sink
    )
    inv_freq = rope.inv_freq.to(device)
    keys, values = cache.keys[0].stored(nb), cache.values[0].stored(nb)

    def ours():
        return decode_attention(
            q, k_new, v_new, keys, values, sinks, lengths, context, inv_freq=inv_freq
        )

    fp16_k = torch.randn(batch, hkv, context + 1, d, device=device, dtype=dtype)
    fp16_v = torch.randn_like(fp16_k)
    row = batch * hkv * d  # elements of one position across the batch's KV heads
    packed = 2 * batch * hkv * cache.keys[0].body.codes.shape[-1] * int(nb[0])  # K and V codes
    meta = cache.values[0].body.scale[:, :, : int(nb[0])].numel() * 2 * 2  # value scale, offset
    exact = 2 * row * (context - int(nb[0]) + 2) * 2  # ring, sink slot and new token, K and V
    moved = {
        "ours": packed + meta + exact + batch * context,
        "fp16 sdpa": 2 * row * (context + 1) * 2,
        "dequant+sdpa": packed + meta + 2 * (2 * row * (context + 1) * 2),
    }
    out = {"ours": run(ours)}
    out["fp16 sdpa"] = run(
        lambda: F.scaled_dot_product_attention(q, fp16_k, fp16_v, enable_gqa=True)
    )
    out["dequant+sdpa"] = run(lambda: dequantize_then_sdpa(cache, q, k_new, v_new, rope))
    err = (ours() - dequantize_then_sdpa(cache, q, k_new, v_new, rope)).abs().max().item()
    return {"times": out, "gbps": {k: moved[k] / t / 1e9 for k, t in out.items()}, "err": err}


def bench_end_to_end(batch, cfg, config, device, dtype, run) -> dict:
    """Greedy decode tokens/s (all sequences) after a prefill of cfg['prompt'] tokens."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(config).to(dtype).eval()
    attn = model.model.layers[0].self_attn
    max_len = cfg["prompt"] + cfg["steps"] * (cfg["warmup"] + cfg["repeats"] + 1) + 1
    gen = torch.Generator().manual_seed(1)
    scheme, params = scheme_for(len(model.model.layers), attn.num_kv_heads, attn.head_dim, gen)
    caches = {
        "fp16": model.new_cache(batch, max_len),
        "quantized": model.new_cache(batch, max_len, scheme, params),
    }
    ids = torch.randint(0, config["vocab_size"], (batch, cfg["prompt"]), device=device)
    out = {}
    for name, cache in caches.items():
        with torch.inference_mode():
            cache.reset()
            logits = model(ids, cache, last_only=True)
            tokens = logits[:, -1].argmax(-1)

            def steps(cache=cache):
                nonlocal tokens
                for _ in range(cfg["steps"]):
                    tokens = model(tokens[:, None], cache, last_only=True)[:, -1].argmax(-1)

            out[name] = batch * cfg["steps"] / run(steps)
    out["cache bytes/token"] = {
        name: (
            c.bytes_per_token()
            if isinstance(c, FullPrecisionCache)
            else c.bytes_per_token(cfg["prompt"])
        )
        for name, c in caches.items()
    }
    return out


def attention_table(rows) -> str:
    lines = [
        "| context | batch | ours ms | fp16 sdpa ms | dequant+sdpa ms | ours GB/s | "
        "fp16 sdpa GB/s | dequant+sdpa GB/s | speed-up vs fp16 | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (context, batch), r in rows:
        t, g = r["times"], r["gbps"]
        lines.append(
            f"| {context} | {batch} | {t['ours'] * 1e3:.3f} | {t['fp16 sdpa'] * 1e3:.3f} | "
            f"{t['dequant+sdpa'] * 1e3:.3f} | {g['ours']:.0f} | {g['fp16 sdpa']:.0f} | "
            f"{g['dequant+sdpa']:.0f} | {t['fp16 sdpa'] / t['ours']:.2f}x | {r['err']:.1e} |"
        )
    return "\n".join(lines)


def e2e_table(rows) -> str:
    lines = [
        "| batch | fp16 cache tok/s | quantized tok/s | fp16 bytes/token | quantized bytes/token |",
        "|---:|---:|---:|---:|---:|",
    ]
    for batch, r in rows:
        size = r["cache bytes/token"]
        lines.append(
            f"| {batch} | {r['fp16']:.1f} | {r['quantized']:.1f} | {size['fp16']:.0f} | "
            f"{size['quantized']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--no-save", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    cfg = dict(GPU if gpu else SMOKE)
    cfg["contexts"] = args.contexts or cfg["contexts"]
    cfg["batches"] = args.batches or cfg["batches"]
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.float16 if gpu else torch.float32  # the interpreter computes in fp32
    name = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter smoke run)"
    run = timer(device, cfg["warmup"], cfg["repeats"])
    if not gpu:
        print(
            "No CUDA device: a tiny smoke configuration through Triton's interpreter; the "
            "numbers only show that the benchmark runs, they are not performance."
        )
    rows = []
    for context in cfg["contexts"]:
        for batch in cfg["batches"]:
            try:
                rows.append(
                    ((context, batch), bench_attention(batch, context, cfg, device, dtype, run))
                )
            except torch.OutOfMemoryError:
                print(f"context {context}, batch {batch}: out of memory, skipped")
            torch.cuda.empty_cache() if gpu else None
    e2e = [
        (b, bench_end_to_end(b, cfg, LLAMA_1B if gpu else TINY, device, dtype, run))
        for b in cfg["e2e_batches"]
    ]
    setup = (
        f"{name}; torch {torch.__version__}, triton {triton.__version__}; {dtype}; scheme: "
        f"2-bit static pre-RoPE keys, 2-bit values per {GROUP} channels, residual {RESIDUAL}, "
        f"1 sink; attention {cfg['heads']} query / {cfg['kv_heads']} KV heads x "
        f"{cfg['head_dim']}; end to end: {'Llama 1B-class' if gpu else 'tiny'} random weights, "
        f"prompt {cfg['prompt']}, {cfg['steps']} decode steps per timing; median of "
        f"{cfg['repeats']} after {cfg['warmup']} warm-up"
    )
    report = (
        f"## Decode, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n\n{setup}\n\n"
        f"### Attention, one decode step\n\n{attention_table(rows)}\n\n"
        f"### End to end\n\n{e2e_table(e2e)}\n"
    )
    print(report)
    if gpu and not args.no_save:
        with RESULTS.open("a") as f:
            f.write("\n" + report)
        print(f"appended to {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
