"""The Triton kernels against their plain-torch references (TRITON_INTERPRET=1 on CPU).

quant_pack is index and rounding math: its codes and metadata must be bit-identical to
quant.quantize + packing.pack (torch.equal), every other byte of the body left alone.

decode_attention is float math: it must match the cache's reference path (`_gather` +
`_attention`) computed in fp32 from the same stored bits within 1e-5 of max |out|. The two
differ only in summation order (split and online softmax against one softmax), exp2 against exp
and the RoPE angle reduction (< 1 ulp of pi): each moves the output by ~1e-7 relative, while
any real defect (a wrong code, scale, position, mask, or a sink read from the body) moves it by
a quantization step, > 1e-3 — which the tests check is visible, so the bound is not vacuous.
"""

import copy
from typing import NamedTuple

import pytest
import torch

from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels.layout import PackedBody
from kvcalib_runtime.kernels.quant_pack import quant_pack, quant_pack_reference
from kvcalib_runtime.kvcache import QuantizedCache
from kvcalib_runtime.quant import QuantSpec
from kvcalib_runtime.rope import Rope
from kvcalib_runtime.scheme import KVParams, KVScheme, LayerScheme, SinkPredictor
from kvcalib_runtime.transforms import Transforms

RTOL = 1e-5


def _data(shape, gen, dtype=torch.float32):
    """Key-like data: channels of very different ranges and offsets, some huge outliers."""
    d = shape[-1]
    spread = torch.exp(torch.randn(d, generator=gen))
    x = torch.randn(shape, generator=gen) * spread + torch.randn(d, generator=gen)
    x.view(-1, d)[::7, 3] *= 20
    return x.to(dtype)


def _codebook(spec, heads, gen):
    """Sorted levels in [0, 1] (asymmetric) or [-1, 1]; per head when `heads`, else per layer."""
    lv = torch.rand(heads or 1, spec.levels, generator=gen).sort(-1).values
    lv = lv * 2 - 1 if spec.symmetric else lv
    return lv if heads else lv[0]


def _bodies(spec, shape, dtype, gen, per_head_codebook=False):
    """Two identical bodies, pre-filled with the same garbage so stray writes show."""
    static = None
    if spec.granularity == "static":
        static = (
            -torch.rand(shape[1], shape[3], generator=gen) * 3,
            torch.rand(shape[1], shape[3], generator=gen) * 3,
        )
    cb = _codebook(spec, shape[1] if per_head_codebook else 0, gen) if spec.codebook else None
    body = PackedBody.allocate(spec, shape, "cpu", dtype, static, cb)
    body.codes.copy_(torch.randint(0, 256, body.codes.shape, generator=gen))
    if spec.granularity != "static":
        for t in (body.scale, body.offset):
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=gen))
    return body, copy.deepcopy(body)


QUANT_PACK_CASES = [
    # (spec, head_dim, tokens per block, dtype)
    (QuantSpec(2), 64, 33, torch.float32),
    (QuantSpec(3), 128, 97, torch.float32),
    (QuantSpec(4, group_size=32), 128, 1, torch.float16),
    (QuantSpec(8, symmetric=True), 64, 33, torch.float32),
    (QuantSpec(2, group_size=16, symmetric=True), 80, 33, torch.float16),
    (QuantSpec(3, symmetric=True, clip=0.9), 64, 97, torch.float16),
    (QuantSpec(4, group_size=16, clip=0.85), 64, 33, torch.float32),
    (QuantSpec(2, codebook=True), 64, 33, torch.float32),
    (QuantSpec(3, codebook=True, symmetric=True), 128, 33, torch.float16),
    (QuantSpec(4, group_size=32, codebook=True), 64, 1, torch.float32),
    (QuantSpec(2, "channel", 32), 128, 64, torch.float16),
    (QuantSpec(3, "channel", 4, symmetric=True), 64, 8, torch.float32),
    (QuantSpec(4, "channel", 8, clip=0.9), 80, 16, torch.float16),
    (QuantSpec(8, "channel", 16), 64, 32, torch.float32),
    (QuantSpec(2, "channel", 4, codebook=True, symmetric=True), 64, 12, torch.float32),
    (QuantSpec(2, "static"), 128, 97, torch.float16),
    (QuantSpec(3, "static", symmetric=True, clip=0.9), 64, 33, torch.float32),
    (QuantSpec(4, "static", codebook=True), 64, 1, torch.float32),
    (QuantSpec(8, "static"), 80, 33, torch.float16),
]


@pytest.mark.parametrize(("spec", "d", "n", "dtype"), QUANT_PACK_CASES, ids=str)
def test_quant_pack_is_bit_exact(spec, d, n, dtype):
    gen = torch.Generator().manual_seed(n * d + spec.bits)
    heads, batch, slots = 3, 2, 128
    ours, ref = _bodies(spec, (batch, heads, slots, d), dtype, gen, per_head_codebook=d == 128)
    x = _data((2, heads, n, d), gen, dtype)
    g = spec.group_size if spec.granularity == "channel" else 1
    seq, start = torch.tensor([1, 0]), torch.tensor([g * 2, 0])  # two blocks, two sequences
    exclude = torch.rand(batch, slots, generator=gen) < 0.15  # kept sinks
    exclude[0, :4] = True  # a whole channel group excluded
    quant_pack(x, ours, seq, start, exclude)
    quant_pack_reference(x, ref, seq, start, exclude)
    assert torch.equal(ours.codes, ref.codes)
    if spec.granularity != "static":
        assert torch.equal(ours.scale, ref.scale)
        assert ours.offset is None or torch.equal(ours.offset, ref.offset)
    # not vacuous: the written codes use the whole grid
    assert len(ours.codes[1, :, g * 2 : g * 2 + n].unique()) > spec.levels // 2


def test_quant_pack_rounds_half_to_even_and_handles_flat_groups():
    # 2 bits over [0, 3]: scale 1, so x itself is the code before rounding; ties go to even
    x = torch.tensor([[0.0, 0.5, 1.5, 2.5, 3.0, 1.0, 2.0, 0.0], [4.0] * 8]).view(1, 1, 2, 8)
    ours, ref = _bodies(QuantSpec(2), (1, 1, 4, 8), torch.float32, torch.Generator())
    where = (torch.tensor([0]), torch.tensor([1]))
    quant_pack(x, ours, *where)
    quant_pack_reference(x, ref, *where)
    assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scale, ref.scale)
    from kvcalib_runtime.packing import unpack

    assert unpack(ours.codes[0, 0, 1], 2, 8).tolist() == [0, 0, 2, 2, 3, 1, 2, 0]
    assert unpack(ours.codes[0, 0, 2], 2, 8).tolist() == [0] * 8  # flat group: scale 0


def test_quant_pack_refuses_what_it_does_not_handle():
    outliers = QuantSpec(2, outliers=0.01)
    body = PackedBody.allocate(outliers, (1, 1, 8, 16), "cpu", torch.float32)
    with pytest.raises(ValueError, match="reference"):
        quant_pack(torch.zeros(1, 1, 1, 16), body, torch.tensor([0]), torch.tensor([0]))
    kivi = QuantSpec(2, "channel", 4)
    body = PackedBody.allocate(kivi, (1, 1, 8, 16), "cpu", torch.float32)
    with pytest.raises(ValueError, match="whole groups"):
        quant_pack(torch.zeros(1, 1, 3, 16), body, torch.tensor([0]), torch.tensor([0]))


# -- decode attention ---------------------------------------------------------------------------


class Case(NamedTuple):
    key: QuantSpec | None
    value: QuantSpec | None
    layer: dict  # LayerScheme options
    scheme: dict  # KVScheme options
    lengths: tuple  # tokens stored per sequence before the decoded one
    heads: int
    kv_heads: int
    d: int


DECODE_CASES = {
    # KIVI: channel keys flushed 8 at a time, sliding token values; GQA 3, ragged batch
    "kivi": Case(QuantSpec(2, "channel", 4), QuantSpec(2, "token", 16),
                 dict(key_flush=8, value_flush=1), dict(residual=8), (1, 33, 97), 6, 2, 64),
    # no residual window: every token quantized at once; MHA
    "per-token": Case(QuantSpec(3), QuantSpec(3, symmetric=True), {}, {}, (300,), 2, 2, 128),
    # kvcalib's own: static pre-RoPE keys (RoPE in the kernel), first + predicted sinks; GQA 8
    "pre-rope-static-sinks": Case(QuantSpec(2, "static"), QuantSpec(2, "token", 32),
                                  dict(key_position="pre_rope", key_flush=16, value_flush=16),
                                  dict(residual=16, sinks_first=1, sink_budget=3), (97, 300),
                                  8, 1, 128),
    # QuaRot: rotated post-RoPE keys, 8-bit values; a sequence shorter than the window
    "rotated": Case(QuantSpec(4, symmetric=True), QuantSpec(8),
                    dict(key_rotation=True, key_flush=2, value_flush=2),
                    dict(residual=4, sinks_first=2, rotation_seed=5), (33, 2), 6, 2, 64),
    # per-head codebook keys, values left exact; head_dim 80
    "codebook-exact-values": Case(QuantSpec(3, codebook=True, symmetric=True), None,
                                  dict(key_flush=4), dict(residual=4), (1, 97), 6, 2, 80),
}  # fmt: skip


def _filled_cache(case, gen):
    key, value, layer, options, lengths, heads, kv_heads, d = DECODE_CASES[case]
    scheme = KVScheme((LayerScheme(key, value, **layer),), **options)
    params = KVParams()
    if key.granularity == "static":
        params.key_range[0] = (
            -torch.rand(kv_heads, d, generator=gen) * 2,
            torch.rand(kv_heads, d, generator=gen) * 2,
        )
    if key.codebook:
        params.key_codebook[0] = _codebook(key, kv_heads, gen)
    if scheme.sink_budget:
        params.sink_predictor = SinkPredictor(layer=0, dims=(0,), threshold=0.5)
    cache = QuantizedCache(
        scheme,
        params,
        Transforms.online(scheme, params),
        num_layers=1,
        batch=len(lengths),
        kv_heads=kv_heads,
        head_dim=d,
        max_len=max(lengths) + 1,
        device="cpu",
        dtype=torch.float32,
        use_kernels=True,
    )
    rope = Rope({}, d)
    history = []
    for b, n in enumerate(lengths):
        view = cache.view(b)
        k, v = _data((1, kv_heads, n, d), gen), torch.randn(1, kv_heads, n, d, generator=gen)
        view.stage(0, k, v, rope, view.positions(n))
        flags = torch.zeros(1, n, heads * d)
        flags[0, 5::40, 0] = 1.0  # predicted sinks (when the scheme has a budget)
        view.observe_hidden(0, flags)
        view.commit(n)
        history.append((k, v))
    return cache, rope, history


def _exact_attention(q, k_new, v_new, history, rope):
    """Full-precision attention of each sequence's new token over its history and itself (a key
    rotation, being orthogonal, changes no score)."""
    out = []
    for b, (k, v) in enumerate(history):
        keys = torch.cat([k, k_new[b : b + 1]], 2)
        keys = rope.apply(keys, torch.arange(keys.shape[2])[None])
        values = torch.cat([v, v_new[b : b + 1]], 2)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1], keys, values, enable_gqa=True
            )
        )
    return torch.cat(out)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_attention_matches_the_reference_path(case, splits, monkeypatch):
    if splits:
        monkeypatch.setattr(dec, "_num_splits", lambda *args: splits)
    gen = torch.Generator().manual_seed(len(case))
    cache, rope, history = _filled_cache(case, gen)
    lengths, heads, kv_heads, d = DECODE_CASES[case][4:]
    B = len(lengths)
    q = torch.randn(B, heads, 1, d, generator=gen)
    k_new = _data((B, kv_heads, 1, d), gen)
    v_new = torch.randn(B, kv_heads, 1, d, generator=gen)
    positions = cache.positions(1)
    ours = cache.attend(0, q, k_new, v_new, rope, positions)
    cache.kernels = False
    ref = cache.attend(0, q, k_new, v_new, rope, positions)
    scale = ref.abs().max()
    assert (ours - ref).abs().max() <= RTOL * scale
    if max(lengths) > 8:  # quantization is visible, so the bound above can catch defects
        exact = _exact_attention(q, k_new, v_new, history, rope)
        assert (exact - ref).abs().max() > 1e-3 * scale


# -- real sizes on a GPU, and a compile check that needs none ----------------------------------


def _fp32_twin(cache):
    """The same stored bits with every float buffer widened (exactly) to fp32: the reference."""
    twin = copy.deepcopy(cache)
    twin.dtype, twin.kernels = torch.float32, False
    for s in twin.keys + twin.values:
        s.tail = s.tail.float()
        if s.exact is not None:
            s.exact = s.exact.float()
        if s.body is not None:
            s.body.scale = s.body.scale.float()
            if s.body.offset is not None:
                s.body.offset = s.body.offset.float()
    twin.sink_k, twin.sink_v = twin.sink_k.float(), twin.sink_v.float()
    return twin


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("context", "d"), [(4096, 128), (16384, 64), (32768, 128)])
def test_decode_attention_at_real_sizes(context, d, dtype):
    """kvcalib-2-like: static pre-RoPE 2-bit keys, 2-bit values per group of 32 channels, a kept
    first token; 32 query heads over 8 KV heads. Flash-attention's rule: against the fp32
    reference, at most twice the error of the same reference path run in `dtype`."""
    gen = torch.Generator().manual_seed(context)
    layer = LayerScheme(QuantSpec(2, "static"), QuantSpec(2, group_size=32),
                        key_position="pre_rope", key_flush=128, value_flush=128)  # fmt: skip
    scheme = KVScheme((layer,), residual=128, sinks_first=1)
    params = KVParams(key_range={0: (-torch.rand(8, d, generator=gen) * 3,
                                     torch.rand(8, d, generator=gen) * 3)})  # fmt: skip
    lengths = (context, context // 3 + 7)
    cache = QuantizedCache(scheme, params, Transforms.none(1), num_layers=1, batch=2, kv_heads=8,
                           head_dim=d, max_len=context + 1, device="cuda", dtype=dtype)  # fmt: skip
    rope = Rope({}, d)
    for b, n in enumerate(lengths):
        view = cache.view(b)
        k, v = _data((1, 8, n, d), gen).cuda(), torch.randn(1, 8, n, d, generator=gen).cuda()
        view.stage(0, k.to(dtype), v.to(dtype), rope, view.positions(n))
        view.commit(n)
    q = torch.randn(2, 32, 1, d, generator=gen).cuda()
    k_new, v_new = _data((2, 8, 1, d), gen).cuda(), torch.randn(2, 8, 1, d, generator=gen).cuda()
    positions = cache.positions(1)
    args = (q.to(dtype), k_new.to(dtype), v_new.to(dtype), rope, positions)
    ours = cache.attend(0, *args).float()
    cache.kernels = False
    low = cache.attend(0, *args).float()
    ref = _fp32_twin(cache).attend(0, q, *(t.to(dtype).float() for t in (k_new, v_new)), rope,
                                   positions)  # fmt: skip
    assert (ours - ref).abs().max() <= 2 * (low - ref).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", [QuantSpec(2, "static"), QuantSpec(3, group_size=32, clip=0.9),
                                  QuantSpec(4, "channel", 32, symmetric=True),
                                  QuantSpec(2, codebook=True)], ids=str)  # fmt: skip
def test_quant_pack_is_bit_exact_on_gpu(spec, dtype):
    """On the GPU too (IEEE division, no FMA contraction): the CPU reference's exact bits."""
    gen = torch.Generator().manual_seed(spec.bits)
    ours, ref = _bodies(spec, (4, 8, 4096, 128), dtype, gen)
    ours = PackedBody(*(_cuda(getattr(ours, f)) for f in PackedBody.__dataclass_fields__))
    x = _data((4, 8, 4096, 128), gen, dtype)
    exclude = torch.rand(4, 4096, generator=gen) < 0.01
    seq, start = torch.arange(4), torch.zeros(4, dtype=torch.long)
    quant_pack(x.cuda(), ours, seq.cuda(), start.cuda(), exclude.cuda())
    quant_pack_reference(x, ref, seq, start, exclude)
    assert torch.equal(ours.codes.cpu(), ref.codes)
    if spec.granularity != "static":
        assert torch.equal(ours.scale.cpu(), ref.scale)


def _cuda(value):
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, tuple):
        return tuple(_cuda(v) for v in value)
    return value


COMPILE_SCRIPT = """
import inspect, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

def compile_instead(self, *args, grid, warmup, **kwargs):  # compile for sm_90, launch nothing
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion")
               if k in kwargs}
    bound = inspect.signature(self.fn).bind(*args, **kwargs).arguments
    signature, constants = {}, {}
    for i, (name, value) in enumerate(bound.items()):
        if i in self.constexprs or value is None:
            signature[name], constants[(i,)] = "constexpr", value
        else:
            signature[name] = mangle_type(value)
    source = ASTSource(self, signature, constants)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    print("compiled", self.fn.__name__)

JITFunction.run = compile_instead
from kvcalib_runtime.kernels.decode_attention import decode_attention
from kvcalib_runtime.kernels.layout import PackedBody, Sinks, Stored
from kvcalib_runtime.kernels.quant_pack import quant_pack
from kvcalib_runtime.quant import QuantSpec

B, H, N, D = 2, 8, 256, 128
for dtype, key, value, rope in [
    (torch.bfloat16, QuantSpec(2, "static"), QuantSpec(2, group_size=32), True),
    (torch.float16, QuantSpec(3, "channel", 32, symmetric=True), None, False),
]:
    static = (torch.zeros(H, D), torch.ones(H, D))
    def body(spec):
        if spec is None:
            return torch.zeros(B, H, N, D, dtype=dtype)
        return PackedBody.allocate(spec, (B, H, N, D), "cpu", dtype, static)
    keys, values = body(key), body(value)
    quant_pack(torch.zeros(1, H, 32, D, dtype=dtype), keys, torch.zeros(1, dtype=torch.long),
               torch.zeros(1, dtype=torch.long), torch.zeros(B, N, dtype=torch.bool))
    tail, nb = torch.zeros(B, H, 8, D, dtype=dtype), torch.zeros(B, dtype=torch.int32)
    slots = torch.zeros(B, H, 2, D, dtype=dtype)
    sinks = Sinks(slots, slots, torch.zeros(B, 2, dtype=torch.int32),
                  torch.zeros(B, N, dtype=torch.bool))
    new = torch.zeros(B, H, 1, D, dtype=dtype)
    decode_attention(torch.zeros(B, 4 * H, 1, D, dtype=dtype), new, new, Stored(keys, tail, nb),
                     Stored(values, tail, nb), sinks, nb, N,
                     inv_freq=torch.ones(D // 2) if rope else None)
"""


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter never compiles a kernel, so code that only a GPU compile rejects (a
    non-constexpr global, an op without a lowering, a dtype mismatch in a dot) would pass every
    test above: compile the main variants of both kernels for sm_90 in a fresh process."""
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split().count("compiled") == 6  # quant_pack, split, combine, twice
