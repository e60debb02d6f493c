"""Exact slots on vector codes ("vq" with outlier_slots, kvcalib-1.5s; layouts.vq's docstring):
the slot keeps what the codes get most wrong, the cache body stores and reads what the reference
computes, the walked bits count the slots, and the CPU decode path and the Triton kernel
(TRITON_INTERPRET=1) read them as the decode reference does. The paged kernel's case is in
test_paged_decode, the cache's against the simulation in tests/integration/test_kvcache."""

import dataclasses

import pytest
import torch
from support.bodies import to_device

from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels import decode_config as cfg
from kvcalib_runtime.kernels import decode_torch
from kvcalib_runtime.kernels.decode_reference import decode_attention_reference
from kvcalib_runtime.kernels.operands import Sinks, Stored
from kvcalib_runtime.layouts import fp8
from kvcalib_runtime.layouts.quant import QuantSpec, dequantize, quantize
from kvcalib_runtime.layouts.vq import CodeBody


def S(bits=5, slots=1, code="fp8", pairing="rope", w=4):
    return QuantSpec(bits, "static", w, codebook=True, method="vq", pairing=pairing,
                     outlier_slots=slots, slot_rule="error" if slots else "outside",
                     slot_code=code if slots else "exact")  # fmt: skip


def _inputs(spec, heads, d, t, gen, dtype=torch.float32):
    """x [2, heads, t, D] with channel scales 100x apart, its (lo, hi) [heads, D] and a codebook
    [heads, 2**bits, w] of random entries in the normalized domain."""
    spread = torch.logspace(-1, 1, d)[torch.randperm(d, generator=gen)]
    x = (torch.randn(2, heads, t, d, generator=gen) * spread).to(dtype)
    lo, hi = x.float().amin((0, 2)), x.float().amax((0, 2))
    return x, (lo, hi), torch.rand(heads, spec.levels, spec.group_size, generator=gen)


@pytest.mark.parametrize(("slots", "code"), [(1, "fp8"), (1, "exact"), (3, "exact")])
def test_the_slots_keep_what_the_codes_get_most_wrong(slots, code):
    # Against the same codes without slots: each row's K largest errors (the lower channel on
    # ties) are its slots, "exact" gives them back to fp32 rounding and "fp8" within 1/16 of
    # the error (E4M3's rounding; 2**-10 steps near zero), and every other element is the
    # slotless reconstruction bit for bit.
    gen = torch.Generator().manual_seed(1)
    spec, plain = S(5, slots, code), S(5, 0)
    x, rng, book = _inputs(spec, 3, 64, 41, gen)
    q = quantize(x, spec, static_range=rng, codebook=book)
    q0 = quantize(x, plain, static_range=rng, codebook=book)
    assert torch.equal(q.codes, q0.codes)  # the slots leave the codes alone
    ours, base = dequantize(q, spec, codebook=book), dequantize(q0, plain, codebook=book)
    err = (x - base).abs()
    worst = err.sort(dim=-1, descending=True, stable=True).indices[..., :slots]
    assert torch.equal(q.slot_index.long(), worst)
    at = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, worst, True)
    assert torch.equal(ours[~at], base[~at])
    left = (x - ours).abs()[at]
    if code == "exact":
        assert left.max() <= 1e-6 * x.abs().max()
    else:
        steps = fp8.step((rng[1] - rng[0])[:, None].expand_as(x))[at]
        assert (left <= err[at] / 16 + 2**-10 * steps).all()
    assert (left < err[at] / 8).all()  # what the slot exists for: the worst error is gone


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("slots", "code", "pairing"), [(1, "fp8", "rope"), (2, "exact", "adjacent")]
)
def test_the_bodys_rows_are_the_reference_bit_for_bit(slots, code, pairing, dtype):
    # What the cache stores and the decode path reads (CodeBody.write, .dequantize) must be the
    # reference's quantize + dequantize exactly, slots included, whatever the span read.
    spec = S(5, slots, code, pairing)
    gen = torch.Generator().manual_seed(5)
    x, rng, book = _inputs(spec, 3, 64, 37, gen, dtype)
    body = CodeBody.allocate(spec, (2, 3, 64, 64), "cpu", dtype, rng, book)
    body.write(x, torch.tensor([0, 1]), torch.tensor([0, 20]))
    q = quantize(x, spec, static_range=rng, codebook=book)
    want = dequantize(q, spec, codebook=book).to(dtype)
    assert torch.equal(body.slot_index[1, :, 20:57], q.slot_index[1])
    assert torch.equal(body.slot_delta[1, :, 20:57], q.slot_delta[1])
    assert torch.equal(body.dequantize(dtype, 0, 37), want[0])
    assert torch.equal(body.dequantize(dtype)[1, :, 20:57], want[1])
    assert torch.equal(body.dequantize(dtype, 1, 57, 30), want[1, :, 10:])
    assert not body.slot_delta[1, :, :20].any()  # the block wrote its own slots only
    one = body.view(1)
    assert torch.equal(one.dequantize(dtype, 0, 57), body.dequantize(dtype, 1, 57))


def test_walked_bits_count_the_slots_and_stay_within_1_6():
    # SmolLM2-135M's heads (3 x 64) at 1024 tokens, kvcalib eval's context: 5-bit indices of 16
    # quads (10 bytes a row), one slot (a channel byte and an E4M3 byte), scale and offset (fp16
    # [Hkv, D]) and the per-head codebook (fp16 [Hkv, 32, 4]) — counted by hand here, walked
    # from the meta-device buffers there. Issue 26's budget is 1.6.
    hkv, d, t = 3, 64, 1024
    by_hand = (t * hkv * (10 + 2) + 2 * hkv * d * 2 + hkv * 32 * 4 * 2) * 8 / (t * hkv * d)
    walked = S(5, 1, "fp8").layout.bits_per_element(d, t, hkv)
    assert walked == by_hand == 1.5625
    assert S(5, 1, "exact").layout.bits_per_element(d, t, hkv) == by_hand + 8 * 8 / (8 * d)
    body = S(5, 0).layout.meta_body(hkv, d, t, torch.float16)  # no slot: the old four buffers
    assert len(body.tensors()) == 4 and list(body.per_token()) == ["codes"]


def _decode_inputs(specs, gen, dtype=torch.float16):
    """Random stored codes and slots for 3 sequences (lengths 150, 61, 0), key and value bodies
    that end at different positions, a ring of 16, 3 sink slots, pre-RoPE keys (D 64, Hkv 3,
    H 9), a codebook per KV head; slot deltas of any E4M3 byte but NaN's, or N(0, 10**2)."""
    B, P, R, hkv, D, H = 3, 151, 16, 3, 64, 9
    bodies = []
    for spec in specs:
        _, rng, book = _inputs(spec, hkv, D, 4, gen, dtype)
        body = CodeBody.allocate(spec, (B, hkv, P, D), "cpu", dtype, rng, book)
        body.codes.copy_(torch.randint(0, 256, body.codes.shape, generator=gen))
        body.slot_index.copy_(torch.randint(0, D, body.slot_index.shape, generator=gen))
        if spec.slot_code == "fp8":
            shape = body.slot_delta.shape
            sign = torch.randint(0, 2, shape, generator=gen) * 128
            body.slot_delta.copy_(torch.randint(0, 127, shape, generator=gen) + sign)
        else:
            body.slot_delta.copy_(torch.randn(body.slot_delta.shape, generator=gen) * 10)
        bodies.append(body)
    lengths = torch.tensor([150, 61, 0])
    keys, values = (
        Stored(b, torch.randn(B, hkv, R, D, generator=gen).to(dtype), (lengths - r).clamp(min=0))
        for b, r in zip(bodies, (9, 14), strict=True)
    )
    sink_pos = torch.tensor([[0, 37, 140], [0, -1, -1], [-1, -1, -1]])
    is_sink = torch.zeros(B, P, dtype=torch.bool)
    for b, row in enumerate(sink_pos.tolist()):
        is_sink[b, [p for p in row if p >= 0]] = True
    sink_kv = (torch.randn(B, hkv, 3, D, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(B, H, 1, D, generator=gen).to(dtype)
    new = (torch.randn(B, hkv, 1, D, generator=gen).to(dtype) for _ in range(2))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    args = (q, *new, keys, values, Sinks(*sink_kv, sink_pos, is_sink), lengths)
    return args, dict(inv_freq=inv_freq, window=None)


KERNEL_SPECS = (S(5, 1, "fp8", "rope"), S(5, 2, "exact", "adjacent"))


def _without_slots(args, which):
    """args with the slots' deltas of the key (which = 3) or value (4) body zeroed."""
    stored = args[which]
    body = dataclasses.replace(stored.body, slot_delta=torch.zeros_like(stored.body.slot_delta))
    return (*args[:which], stored._replace(body=body), *args[which + 1 :])


def test_cpu_decode_path_reads_the_slots():
    # decode_torch reads a vq body through its own reference read: in float64 it must give
    # decode_attention_reference's result to rounding (1e-9). The slots are read on both sides:
    # zeroing either body's deltas moves the exact output by more than 1e-4.
    args, options = _decode_inputs(KERNEL_SPECS, torch.Generator().manual_seed(11))
    exact = decode_attention_reference(*args, **options, dtype=torch.float64)
    ours = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float64)
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-9)
    for which in (3, 4):
        moved = decode_torch.decode_attention_torch(*_without_slots(args, which), **options,
                                                    dtype=torch.float64)  # fmt: skip
        assert (moved - exact).abs().max() > 1e-4, which


@pytest.mark.parametrize(("config", "splits"), [((32, 4, 1), 1), ((16, 4, 1), 3)])
def test_decode_kernel_reads_the_slots(config, splits, monkeypatch):
    # The Triton kernel reads a vq body's slots from the stream arguments its body gives
    # (K, FP8, slot_index, slot_delta) as it reads kvcalib-2's: keys' as score corrections
    # (rotated by RoPE), values' added into the tile. As for every layout (test_kernels):
    # against the reference in float64 on the same stored bits, its error is at most twice the
    # reference's own in fp16; a kernel blind to either stream's slots misses it tenfold.
    monkeypatch.setattr(cfg, "INTERPRETED", config)
    monkeypatch.setattr(cfg, "num_splits", lambda *a: splits)
    args, options = _decode_inputs(KERNEL_SPECS, torch.Generator().manual_seed(3))
    assert [dec._stream_args(s, 64, 151, False)[1].K for s in args[3:5]] == [1, 2]
    ours = dec.decode_attention(*args, **options).double()
    exact = decode_attention_reference(*args, **options, dtype=torch.float64)
    bound = 2 * (decode_attention_reference(*args, **options).double() - exact).abs().max()
    assert (ours - exact).abs().max() <= bound
    for which in (3, 4):
        blind = decode_attention_reference(*_without_slots(args, which), **options,
                                           dtype=torch.float64)  # fmt: skip
        assert (blind - exact).abs().max() > 10 * bound, which


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_kernel_reads_the_slots_on_gpu(dtype, monkeypatch):
    """The same bound on a GPU (`make gpu-check`) at fp16 and bf16, for every tile size the tuner
    may pick."""
    args, options = _decode_inputs(KERNEL_SPECS, torch.Generator().manual_seed(3), dtype)
    args, options = to_device(args), {k: to_device(v) for k, v in options.items()}
    exact = decode_attention_reference(*args, **options, dtype=torch.float64)
    bound = 2 * (decode_attention_reference(*args, **options).double() - exact).abs().max()
    for config in cfg.CONFIGS:
        monkeypatch.setattr(cfg, "choose", lambda key, device, launch, config=config: config)
        ours = dec.decode_attention(*args, **options)
        assert (ours.double() - exact).abs().max() <= bound, config


def test_malformed_slot_specs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="set slot_rule 'error'"):
        QuantSpec(5, "static", 4, codebook=True, method="vq", outlier_slots=1)
    with pytest.raises(ValueError, match="set outlier_slots >= 1"):
        QuantSpec(5, "static", 4, codebook=True, method="vq", slot_code="fp8")
    with pytest.raises(ValueError, match="exceeds head_dim"):
        S(5, 40).layout.check_head(32)
