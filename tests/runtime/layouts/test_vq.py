"""Vector codes ("vq", kvcalib_runtime.layouts.vq): the reference numerics against oracles, the
cache body's lookup against the reference, the walked bits, the CPU decode path against the
decode reference, and the refusal of malformed specs and codebooks."""

import dataclasses

import pytest
import torch
from support.bodies import to_device

from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.checkpoint import checks
from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels import decode_config as cfg
from kvcalib_runtime.kernels import decode_torch
from kvcalib_runtime.kernels.decode_reference import decode_attention_reference
from kvcalib_runtime.kernels.operands import Sinks, Stored
from kvcalib_runtime.layouts.quant import QuantSpec, dequantize, quantize
from kvcalib_runtime.layouts.vq import CodeBody, channel_order
from kvcalib_runtime.model.geometry import Geometry


def S(bits=6, w=4, pairing="adjacent"):
    return QuantSpec(bits, "static", w, codebook=True, method="vq", pairing=pairing)


def _inputs(spec, heads, d, t, gen, per_head=True, dtype=torch.float32):
    """x [2, heads, t, D] with per-channel scales that differ by 100x, its (lo, hi) [heads, D]
    and a codebook [heads or 1, 2**bits, w] in the normalized domain."""
    spread = torch.logspace(-1, 1, d)[torch.randperm(d, generator=gen)]
    x = (torch.randn(2, heads, t, d, generator=gen) * spread).to(dtype)
    lo, hi = x.float().amin((0, 2)), x.float().amax((0, 2))
    rows = heads if per_head else 1
    book = torch.rand(rows, spec.levels, spec.group_size, generator=gen)
    return x, (lo, hi), book


def _x_units(spec, book, lo, hi, dtype):
    """Every entry in x's units, float64 [H, V, E, w], from metadata rounded as quantize does."""
    d = lo.shape[-1]
    order = channel_order(d, spec.group_size, spec.pairing)
    scale, offset = ((hi - lo).to(dtype).double(), lo.to(dtype).double())
    s, o = (t[:, order].view(t.shape[0], -1, 1, spec.group_size) for t in (scale, offset))
    return o + s * book.to(dtype).double()[:, None], order


def test_rope_pairing_groups_the_channels_rope_rotates_together():
    # rotate_half pairs channel c with c + D/2: a "rope" vector must hold whole pairs (exact).
    assert torch.equal(channel_order(8, 2, "rope"), torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]))
    assert torch.equal(channel_order(8, 4, "rope"), torch.tensor([0, 1, 4, 5, 2, 3, 6, 7]))
    assert torch.equal(channel_order(8, 4, "adjacent"), torch.arange(8))
    for d in (64, 80, 128):  # SmolLM2 / Qwen / Llama head dims: a permutation every time
        assert torch.equal(channel_order(d, 4, "rope").sort().values, torch.arange(d))


@pytest.mark.parametrize("t", [1, 97, 257])
@pytest.mark.parametrize(("d", "w", "bits", "pairing"), [
    (64, 4, 6, "rope"), (80, 2, 3, "rope"), (128, 4, 6, "adjacent"), (64, 2, 4, "adjacent"),
])  # fmt: skip
def test_quantize_picks_the_nearest_entry(d, w, bits, pairing, t):
    # The oracle: the squared distance of every vector to every entry in float64. The chosen
    # entry must be within fp32 rounding (1e-5 relative) of the nearest one; a wrong channel order
    # or a wrong head's codebook picks entries far from it (checked by shuffling the order).
    spec = S(bits, w, pairing)
    gen = torch.Generator().manual_seed(d + t)
    x, (lo, hi), book = _inputs(spec, 3, d, t, gen)
    q = quantize(x, spec, static_range=(lo, hi), codebook=book)
    assert q.codes.shape == (2, 3, t, d // w) and q.codes.dtype == torch.uint8
    table, order = _x_units(spec, book, lo, hi, x.dtype)
    xv = x.double()[..., order].unflatten(-1, (-1, w))  # [2, H, t, V, w]
    dist = (xv.unsqueeze(-2) - table[:, None]).square().sum(-1)  # [2, H, t, V, E]
    best = dist.amin(-1)
    chosen = dist.gather(-1, q.codes.long().unsqueeze(-1)).squeeze(-1)
    assert ((chosen - best) <= 1e-5 * best.clamp_min(1e-12) + 1e-9).all()
    wrong = dist.gather(-1, q.codes.long().flip(-1).unsqueeze(-1)).squeeze(-1)
    assert (wrong - best).mean() > 10 * (chosen - best).mean() + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_head", [True, False], ids=["head codebooks", "layer codebook"])
def test_round_trip_error_is_bounded_by_the_generating_entry(per_head, dtype):
    # x = an entry (in x's units) + noise: the nearest entry is never farther than the one that
    # generated the vector, so ||x - x_hat|| <= ||noise|| per vector (to rounding); with no
    # noise the round trip gives the entries back (error ~ the dtype's epsilon).
    spec = S(6, 4, "rope")
    gen = torch.Generator().manual_seed(3)
    h, d, t = 3, 64, 97
    _, (lo, hi), book = _inputs(spec, h, d, 8, gen, per_head)
    table, order = _x_units(spec, book, lo, hi, dtype)  # [H, V, E, w] float64
    pick = torch.randint(0, spec.levels, (h, t, d // 4), generator=gen)
    clean = table[torch.arange(h)[:, None, None], torch.arange(d // 4), pick]  # [H, t, V, w]
    noise = 0.01 * torch.randn(clean.shape, generator=gen, dtype=torch.float64)
    for eps, base in ((noise, 1e-3 if dtype == torch.float16 else 1e-5), (0 * noise, None)):
        xv = (clean + eps).flatten(-2)
        x = torch.empty_like(xv).index_copy_(-1, order, xv).to(dtype)
        q = quantize(x, spec, static_range=(lo, hi), codebook=book)
        x_hat = dequantize(q, spec, codebook=book, dtype=torch.float32).double()
        err = (x_hat - x.double())[..., order].unflatten(-1, (-1, 4)).norm(dim=-1)
        scale = x.double().abs().amax()
        if base is None:
            assert err.max() <= (1e-3 if dtype == torch.float16 else 1e-5) * scale
        else:
            assert (err <= eps.norm(dim=-1) + base * scale).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("pairing", ["rope", "adjacent"])
def test_the_bodys_lookup_is_the_reference_bit_for_bit(pairing, dtype):
    # What the cache stores and the decode path reads (CodeBody.write, .dequantize) must be the
    # reference's quantize + dequantize exactly: same codes from the same rounded metadata.
    spec = S(6, 4, pairing)
    gen = torch.Generator().manual_seed(5)
    x, rng, book = _inputs(spec, 3, 64, 37, gen, dtype=dtype)
    body = CodeBody.allocate(spec, (2, 3, 64, 64), "cpu", dtype, rng, book)
    body.write(x, torch.tensor([0, 1]), torch.tensor([0, 20]))
    want = dequantize(quantize(x, spec, static_range=rng, codebook=book), spec, codebook=book)
    assert torch.equal(body.dequantize(dtype, 0, 37), want[0])
    assert torch.equal(body.dequantize(dtype)[1, :, 20:57], want[1])
    assert not body.codes[1, :, :20].any()  # the block wrote its own slots only


@pytest.mark.parametrize(("w", "bits"), [(4, 6), (2, 3)])
def test_walked_bits_are_the_hand_count_and_at_most_1_6(w, bits):
    # SmolLM2-135M's heads (3 x 64) at 1024 tokens, kvcalib eval's context: codes (V indices
    # of `bits` packed per row), scale and offset (fp16 [Hkv, D]) and the per-head codebook
    # (fp16 [Hkv, E, w]) — counted by hand here, walked from the meta-device buffers there.
    spec = S(bits, w, "rope")
    hkv, d, t = 3, 64, 1024
    row = (d // w * bits + 7) // 8
    by_hand = (t * hkv * row + 2 * hkv * d * 2 + hkv * 2**bits * w * 2) * 8 / (t * hkv * d)
    walked = spec.layout.bits_per_element(d, t, hkv)
    assert walked == by_hand
    assert walked <= 1.6  # issue 26's budget: codes 1.5 + constants amortized


def _decode_inputs(spec, gen, dtype=torch.float16, per_head=True):
    """Random stored codes for 3 sequences (lengths 150, 61, 0), key and value bodies that end at
    different positions, a ring of 16, 3 sink slots, pre-RoPE keys (D 64, Hkv 3, H 9); a codebook
    per KV head, or one per layer."""
    B, P, R, hkv, D, H = 3, 151, 16, 3, 64, 9
    bodies = []
    for _ in range(2):
        _, rng, book = _inputs(spec, hkv, D, 4, gen, per_head=per_head, dtype=dtype)
        body = CodeBody.allocate(spec, (B, hkv, P, D), "cpu", dtype, rng, book)
        body.codes.copy_(torch.randint(0, 256, body.codes.shape, generator=gen))
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


@pytest.mark.parametrize("pairing", ["rope", "adjacent"])
def test_cpu_decode_path_matches_the_reference(pairing):
    # decode_torch reads each sequence's vq body through CodeBody's lookup; in float64 it must
    # give decode_attention_reference's result to rounding (1e-9), and in fp16 be no worse than
    # twice the reference's own fp16 error. A no-op cannot pass: zeroing the key codes moves the
    # output by far more than the bound.
    spec = S(6, 4, pairing)
    args, options = _decode_inputs(spec, torch.Generator().manual_seed(11))
    exact = decode_attention_reference(*args, **options, dtype=torch.float64)
    ours = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float64)
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-9)
    low = decode_torch.decode_attention_torch(*args, **options)
    ref_low = decode_attention_reference(*args, **options)
    bound = 2 * (ref_low.double() - exact).abs().max() + 1e-3
    assert (low.double() - exact).abs().max() <= bound
    keys = args[3]
    keys.body.codes.zero_()
    moved = decode_torch.decode_attention_torch(*args, **options, dtype=torch.float64)
    assert (moved - exact).abs().max() > 10 * bound


@pytest.mark.parametrize(("bits", "w", "pairing", "per_head", "config", "splits"), [
    (6, 4, "rope", True, (32, 4, 1), 1),        # kvcalib-1.5: indices straddle bytes
    (6, 4, "adjacent", False, (16, 4, 1), 3),   # one codebook per layer, 3 splits
    (3, 2, "rope", True, (64, 4, 1), 2),        # 3-bit pairs
    (4, 4, "adjacent", True, (32, 4, 1), 1),    # indices on nibbles
    (8, 8, "rope", False, (32, 4, 1), 1),       # one index a byte
])  # fmt: skip
def test_decode_kernel_reads_vector_codes(bits, w, pairing, per_head, config, splits,
                                          monkeypatch):  # fmt: skip
    # The Triton kernel looks each channel's coordinate up in its head's codebook in the tile. As
    # for every layout (test_kernels): against the reference in float64 on the same stored bits,
    # its error is at most twice the reference's own in fp16. The bound can fail: a wrong channel
    # order (pairing swapped), another head's codebook or shifted index bits move the exact result
    # by more than ten times it.
    monkeypatch.setattr(cfg, "INTERPRETED", config)
    monkeypatch.setattr(cfg, "num_splits", lambda *a: splits)
    spec = S(bits, w, pairing)
    assert dec.supports(spec, 64, 3)
    args, options = _decode_inputs(spec, torch.Generator().manual_seed(bits + w), per_head=per_head)
    ours = dec.decode_attention(*args, **options).double()
    exact = decode_attention_reference(*args, **options, dtype=torch.float64)
    bound = 2 * (decode_attention_reference(*args, **options).double() - exact).abs().max()
    assert (ours - exact).abs().max() <= bound
    keys = args[3]
    other = "adjacent" if pairing == "rope" else "rope"
    wrong = [dataclasses.replace(keys.body, spec=S(bits, w, other)),
             dataclasses.replace(keys.body, codes=keys.body.codes.roll(1, -1))]  # fmt: skip
    if per_head:
        wrong.append(dataclasses.replace(keys.body, book=keys.body.book.roll(1, 0)))
    for body in wrong:
        broken = (*args[:3], keys._replace(body=body), *args[4:])
        moved = decode_attention_reference(*broken, **options, dtype=torch.float64)
        assert (moved - exact).abs().max() > 10 * bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pairing", ["rope", "adjacent"])
def test_decode_kernel_reads_vector_codes_on_gpu(pairing, dtype, monkeypatch):
    """The same bound on a GPU (`make gpu-check`) at fp16 and bf16, for every tile size the tuner
    may pick."""
    args, options = _decode_inputs(S(6, 4, pairing), torch.Generator().manual_seed(3), dtype)
    args, options = to_device(args), {k: to_device(v) for k, v in options.items()}
    exact = decode_attention_reference(*args, **options, dtype=torch.float64)
    bound = 2 * (decode_attention_reference(*args, **options).double() - exact).abs().max()
    for config in cfg.CONFIGS:
        monkeypatch.setattr(cfg, "choose", lambda key, device, launch, config=config: config)
        ours = dec.decode_attention(*args, **options)
        assert (ours.double() - exact).abs().max() <= bound, config


def test_malformed_specs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="even group_size"):
        S(6, 3, "rope")
    with pytest.raises(ValueError, match="granularity 'static'"):
        QuantSpec(6, "token", 4, codebook=True, method="vq")
    with pytest.raises(ValueError, match="set codebook"):
        QuantSpec(6, "static", 4, method="vq")
    with pytest.raises(ValueError, match="outliers"):
        QuantSpec(6, "static", 4, codebook=True, method="vq", outliers=0.01, outlier_slots=1)
    with pytest.raises(ValueError, match="set method 'vq'"):
        QuantSpec(2, "static", pairing="rope")
    with pytest.raises(ValueError, match="whole vectors"):
        S(6, 4, "rope").layout.check_head(68)  # 68 channels: 34 pairs, not whole quads of pairs


@pytest.mark.parametrize(
    ("book", "match"),
    [
        (torch.rand(64, 4), "has shape"),  # one codebook without its rows dimension
        (torch.rand(3, 32, 4), "has shape"),  # 5 bits of entries for a 6-bit spec
        (torch.rand(3, 64, 2), "has shape"),  # entries of pairs for vectors of 4
        (torch.rand(2, 64, 4), "has shape"),  # 2 rows for 3 KV heads
        (torch.full((1, 64, 4), float("nan")), "NaN"),
        (torch.randint(0, 9, (3, 64, 4)), "not a floating"),
    ],
)
def test_malformed_codebooks_are_refused(book, match):
    # checks.check_params runs on every side-car the runtime loads and every plan: a codebook
    # the layout cannot index must be refused there, naming the layer.
    spec = S(6, 4, "rope")
    scheme = KVScheme((LayerScheme(spec, None, key_position="pre_rope"),), residual=0)
    geo = Geometry.from_config(
        dict(model_type="llama", num_hidden_layers=1, hidden_size=576, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=100, intermediate_size=64)
    )  # fmt: skip
    lo = torch.zeros(3, 64)
    params = KVParams(key_range={0: (lo, lo + 1)}, key_codebook={0: torch.rand(3, 64, 4)})
    checks.check_params(scheme, params, geo)  # the well-formed one passes
    params.key_codebook[0] = book
    with pytest.raises(ValueError, match=match) as e:
        checks.check_params(scheme, params, geo)
    assert "layer 0 key" in str(e.value)
