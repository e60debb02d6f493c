"""The paged cache against the runtime's, without a vLLM engine: page bytes against the
runtime's walked buffers, and `Serving` driven step by step as vLLM drives it, against one
runtime `QuantizedCache` per sequence, on kvcalib-2's side-car (SmolLM2, predicted sinks) and
kvcalib-1.5's vector codes (the tiny Qwen2)."""

from types import SimpleNamespace

import pytest
import torch
from kvcalib_vllm import serving as serving_module
from kvcalib_vllm.pages import ALIGN, PageLayout
from kvcalib_vllm.serving import Serving

from kvcalib_runtime.cache.kvcache import QuantizedCache
from kvcalib_runtime.cache.memory import planned_memory
from kvcalib_runtime.checkpoint.format import read_checkpoint
from kvcalib_runtime.kernels import use_triton
from kvcalib_runtime.kernels.decode_attention import decode_attention

BLOCK = 32


def _checkpoint(request, name):
    return read_checkpoint(request.getfixturevalue(name))


# (the fixture of a converted folder, its page row's least compression against fp16): SmolLM2's
# kvcalib-2 rows are 6.6x smaller; kvcalib-1.5's 6 bits per 4 channels of the tiny Qwen2's
# 32-channel heads, 6 bytes against 64, 10.7x; the tiny Qwen2's kvcalib-2 with codebook values,
# one fp16 scale in the two bytes kvcalib-2's one-byte scale and zero point take: 80 bytes
# against 512, 6.4x, what its kvcalib-2 row takes
FOLDERS = {"kvcalib2": 5.9, "tiny_qwen2_vq": 10.6, "tiny_qwen2_codebook": 6.3}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("folder", list(FOLDERS))
def test_row_is_the_runtime_body_per_position(request, folder, dtype):
    """A page row holds what the runtime's cache allocates per position (its walked body
    buffers at two contexts, per-layer constants cancelling), padded to ALIGN."""
    ckpt = _checkpoint(request, folder)
    geo = ckpt.geometry
    sizes = dict(num_layers=geo.layers, kv_heads=geo.kv_heads, head_dim=geo.head_dim,
                 dtype=dtype)  # fmt: skip
    body = [
        planned_memory(ckpt.scheme, ckpt.params, ckpt.transforms, context=n, **sizes)["body"]
        for n in (256, 512)
    ]
    per_position = (body[1] - body[0]) // 256
    pages = PageLayout(ckpt.scheme, ckpt.params, kv_heads=geo.kv_heads, head_dim=geo.head_dim,
                       dtype=dtype)  # fmt: skip
    assert sum(t.nbytes for pair in pages.tensors for t in pair) == per_position
    assert pages.row_bytes == -(-per_position // ALIGN) * ALIGN
    assert pages.fp_row_bytes(dtype) / pages.row_bytes > FOLDERS[folder]


def _step(serving, kv_cache, runtimes, tables, work, gen, geo):
    """One vLLM step: `work` = [(sequence, T)], each sequence's T new tokens batched in that
    order, random q/k/v per layer and a residual stream that flags ~5% of tokens as sinks;
    returns per sequence (ours, the runtime's) outputs of every layer, [T, H, D] each."""
    starts, lens, rows = [0], [], []
    for s, T in work:
        n = runtimes[s].lengths.item()
        starts.append(starts[-1] + T)
        lens.append(n + T)
        rows.append(tables[s])
    md = SimpleNamespace(query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(lens),
                         block_table=torch.stack(rows), num_actual_tokens=starts[-1])  # fmt: skip
    tokens, heads, hkv, d = starts[-1], geo.heads, geo.kv_heads, geo.head_dim
    sp = serving.predictor
    dtype = kv_cache.dtype
    hidden = torch.zeros(tokens, geo.hidden, dtype=dtype)
    if sp is not None:
        hidden[torch.rand(tokens, generator=gen) < 0.05, sp.dims[0]] = sp.threshold + 1  # flagged
    results = {s: ([], []) for s, _ in work}
    for layer in range(len(serving.scheme.layers)):
        q = torch.randn(tokens, heads, d, generator=gen).to(dtype)
        k = (torch.randn(tokens, hkv, d, generator=gen) * 3).to(dtype)
        v = torch.randn(tokens, hkv, d, generator=gen).to(dtype)
        out = torch.zeros(tokens, heads, d, dtype=dtype)
        serving.attend(layer, q, k, v, kv_cache, md, out)
        for i, (s, T) in enumerate(work):
            a, b = starts[i], starts[i + 1]
            cache, rope = runtimes[s], serving.ropes[layer]
            pos = cache.positions(T)
            theirs = cache.attend(layer, rope.apply(q[a:b].transpose(0, 1)[None], pos),
                                  k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
                                  rope, pos)  # fmt: skip
            if sp is not None and layer == sp.layer:
                cache.observe_hidden(layer, hidden[None, a:b])
            results[s][0].append(out[a:b])
            results[s][1].append(theirs[0].transpose(0, 1))
        if sp is not None and layer == sp.layer:
            serving.observe(hidden)
    serving.commit()
    for s, T in work:
        runtimes[s].commit(T)
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("folder", list(FOLDERS))
def test_serving_matches_the_runtime_cache(request, folder, dtype):
    """Two sequences on interleaved, shuffled blocks, batched in every step: each layer's
    output equals (bit for bit) the runtime cache's for the same sequence alone, through a
    prefill of 120 tokens then 13 decode steps (crossing the residual window of 128 on the
    9th) and a prefill of 140 in two chunks (100, then 40 beside the other's first decode
    step: 13 positions flushed into pages at once) then 12 steps, with predicted sinks. Bit
    equality holds because reader, writer and attention are the runtime's own and the pages
    hold the same bytes (vector codes: each token quantized by the body's own `write`, in pages
    as in the runtime's contiguous body)."""
    ckpt = _checkpoint(request, folder)
    geo, gen = ckpt.geometry, torch.Generator().manual_seed(0)
    serving = Serving(ckpt, dtype=dtype, rows=4, max_len=256)
    kv_cache = torch.zeros(24, 1, BLOCK, serving.pages.row_bytes // dtype.itemsize, dtype=dtype)
    shuffled = torch.randperm(24, generator=gen)
    tables = {0: shuffled[0::2][:8], 1: shuffled[1::2][:8]}
    runtimes = {
        s: QuantizedCache(ckpt.scheme, ckpt.params, ckpt.transforms, num_layers=geo.layers,
                          batch=1, kv_heads=geo.kv_heads, head_dim=geo.head_dim, max_len=256,
                          device="cpu", dtype=dtype, use_kernels=False)
        for s in tables
    }  # fmt: skip
    plan = [[(0, 120), (1, 100)], [(1, 40), (0, 1)], *[[(1, 1), (0, 1)]] * 12]
    for step, work in enumerate(plan):
        results = _step(serving, kv_cache, runtimes, tables, work, gen, geo)
        for s, (ours, theirs) in results.items():
            for layer, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                assert torch.equal(a, b), f"step {step}, sequence {s}, layer {layer}"
    for s, cache in runtimes.items():
        assert cache.lengths.item() == (133, 152)[s]
        predicted = (cache.sink_pos[0] >= ckpt.scheme.sinks_first).sum().item()
        assert predicted > 0 or serving.predictor is None  # flagged tokens took slots


def _serve(ckpt, plan, *, kernels: bool, dtype=torch.float32):
    """Every layer's output of every step of `plan` ([[(sequence, T), ...], ...]) served with
    or without the paged kernel: two sequences on interleaved, shuffled blocks, random q/k/v."""
    gen = torch.Generator().manual_seed(0)
    geo = ckpt.geometry
    serving = Serving(ckpt, dtype=dtype, rows=4, max_len=256, kernels=kernels)
    kv_cache = torch.zeros(24, 1, BLOCK, serving.pages.row_bytes // dtype.itemsize, dtype=dtype)
    shuffled = torch.randperm(24, generator=gen)
    tables, lengths, outputs = (shuffled[0::2][:8], shuffled[1::2][:8]), [0, 0], []
    for work in plan:
        starts = [0]
        for _, T in work:
            starts.append(starts[-1] + T)
        md = SimpleNamespace(
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor([lengths[s] + T for s, T in work]),
            block_table=torch.stack([tables[s] for s, _ in work]),
            num_actual_tokens=starts[-1],
        )
        for layer in range(geo.layers):
            q = torch.randn(starts[-1], geo.heads, geo.head_dim, generator=gen).to(dtype)
            k, v = (torch.randn(starts[-1], geo.kv_heads, geo.head_dim, generator=gen).to(dtype)
                    for _ in range(2))  # fmt: skip
            out = torch.zeros_like(q)
            serving.attend(layer, q, k, v, kv_cache, md, out)
            outputs.append(out)
        serving.commit()
        for s, T in work:
            lengths[s] += T
    return outputs


@pytest.mark.skipif(not use_triton("cpu"), reason="set TRITON_INTERPRET=1 (make test-vllm does)")
@pytest.mark.parametrize("folder", ["tiny_qwen2", "tiny_qwen2_vq", "tiny_qwen2_codebook"])
def test_paged_kernel_serves_as_the_cpu_path(request, folder, monkeypatch):
    """The decode kernel reading the pages in place by the block table (`kernels=True`, the CUDA
    default) against the CPU path (pages gathered, `decode_torch`), on the tiny Qwen2's
    kvcalib-2, kvcalib-1.5 and codebook-value side-cars: two sequences decoding side
    by side across the residual window of 128 (one crossing it on its 9th step, the other after
    a 140-token prefill in two chunks). Both read the same stored bits in float32; they differ
    only in summation order and the kernel's exp2 and angle reduction, so every output is within
    torch's float32 tolerance (rtol 1.3e-6, atol 1e-5). (tests/runtime/kernels/test_paged_decode.py
    shows a block table read one block off fails the kernel's bound tenfold.)"""
    ckpt = _checkpoint(request, folder)
    plan = [[(0, 120), (1, 100)], [(1, 40), (0, 1)], *[[(1, 1), (0, 1)]] * 12]
    launches = []

    def counted(*args, **kwargs):
        launches.append(kwargs["block_table"])
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(serving_module, "decode_attention", counted)
    ours = _serve(ckpt, plan, kernels=True)
    assert len(launches) == 25 * ckpt.geometry.layers  # every decode step went through it
    theirs = _serve(ckpt, plan, kernels=False)
    assert len(launches) == 25 * ckpt.geometry.layers
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, msg=f"output {i}")
