"""The decode kernel reading vLLM-style pages through a block table (TRITON_INTERPRET=1 on CPU).

Each case stores random bits for 4 sequences in one batch (lengths 77, 40, 5 and 0: key bodies
end 9 positions before the length, value bodies 14, so a sequence's positions cross from its
pages into its residual ring mid-block, and one holds only ring positions; kept sinks in three)
in a pool of 16-slot blocks handed out shuffled (table entries past a length point at other
sequences' blocks), every field of a token interleaved in one page row as the plugin's
`PageLayout` places them, over blocks that first held other bits (what finished sequences
left) and random padding bytes. Two bounds:

- the paged kernel equals the contiguous kernel on the same bits, torch.equal: the tiles, their
  order and every float operation are the same; only the addresses differ (index math);
- against the paged reference (gather + `decode_attention_reference`) in float64 it keeps
  flash-attention's rule, the tolerance tests/runtime/kernels/test_kernels.py holds the contiguous
  kernel to: at most twice the error of the reference run in fp16. The block table rolled by
  one block (each position read from a neighbouring block) fails that bound tenfold.
"""

import dataclasses

import pytest
import torch
from support.bodies import random_body, tensors, to_device
from support.decode_cases import random_sinks

from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels import decode_config as cfg
from kvcalib_runtime.kernels import paged
from kvcalib_runtime.kernels.operands import Stored
from kvcalib_runtime.layouts.body import as_body
from kvcalib_runtime.layouts.quant import QuantSpec as S

PAGE, POOL, R = 16, 16, 16  # slots per block, blocks in the pool, residual ring
LENGTHS = (77, 40, 5, 0)
P = 80  # positions a sequence can reach

CASES = {
    # name: (key spec, value spec, query heads, KV heads, head_dim, pre-RoPE)
    "kvcalib-2 G4 D64": (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1,
                           slot_rule="error", slot_code="fp8"),
                         S(2, symmetric=True, codebook=True), 8, 2, 64, True),
    "kvcalib-3 G3 D64 two slots": (S(3, "static", codebook=True, outliers=0.01, outlier_slots=2,
                                     slot_rule="error"), S(3, symmetric=True, codebook=True),
                                   6, 2, 64, True),
    "per-token-4 groups of 16, D80": (S(4, group_size=16), S(4, group_size=16), 4, 2, 80, False),
    "vector values": (S(2, "static"), S(3, "vector", outliers=0.01), 4, 2, 64, True),
    "fp16 (exact)": (None, None, 4, 2, 64, True),
    "kvcalib-1.5 vector codes": (S(6, "static", 4, codebook=True, method="vq", pairing="rope"),
                                 S(6, "static", 4, codebook=True, method="vq"), 6, 2, 64, True),
    "kvcalib-1.5s vector codes + fp8 slots": (
        S(5, "static", 4, codebook=True, method="vq", pairing="rope", outlier_slots=1,
          slot_rule="error", slot_code="fp8"),
        S(5, "static", 4, codebook=True, method="vq", outlier_slots=2, slot_rule="error"),
        6, 2, 64, True),
}  # fmt: skip


def _fields(body) -> dict[str, torch.Tensor]:
    return as_body(body).per_token()


def _paginate(body, stale, table: torch.Tensor, gen, skip: int, device):
    """The contiguous body's positions copied into a pool of POOL blocks by `table` [B, m]
    over `stale` (a body of POOL sequences of PAGE slots: what finished sequences left): each
    field a strided view of one random uint8 page [POOL, PAGE, C] (fields largest element
    first, as `PageLayout` places them, `skip` random bytes standing for other layers' fields
    before the first byte-sized one; C a multiple of 8)."""
    fields = sorted(_fields(body).items(), key=lambda f: -f[1].dtype.itemsize)
    sizes = [t[0, :, 0].numel() * t.dtype.itemsize for _, t in fields]
    raw = torch.randint(0, 256, (POOL, PAGE, -(-(sum(sizes) + skip) // 8) * 8), generator=gen)
    raw = raw.to(device=device, dtype=torch.uint8)
    views, at = {}, 0
    for (name, t), size in zip(fields, sizes, strict=True):
        if t.dtype.itemsize == 1:
            at, skip = at + skip, 0
        per_token = (t.shape[1], *t.shape[3:])
        view = raw[:, :, at : at + size].view(t.dtype).view(POOL, PAGE, *per_token).movedim(2, 1)
        view.copy_(_fields(stale)[name])
        for b, n in enumerate(LENGTHS):
            for j in range(-(-n // PAGE)):
                view[table[b, j]] = t[b, :, j * PAGE : (j + 1) * PAGE]
        views[name] = view
        at += size
    if isinstance(body, torch.Tensor):
        return views["exact"]
    return to_device(dataclasses.replace(body, **views), device)  # codebooks, ranges too


def _inputs(case, gen, dtype=torch.float16, device="cpu"):
    """(args of decode_attention, contiguous bodies (keys, values), block table, inv_freq), on
    `device`; the pages are built there, the rest made on the CPU and copied."""
    key, value, H, hkv, D, pre_rope = CASES[case]
    B = len(LENGTHS)
    lengths = torch.tensor(LENGTHS)
    m = -(-P // PAGE)
    order = torch.randperm(POOL, generator=gen)  # blocks handed out shuffled
    table = torch.zeros(B, m, dtype=torch.int32)
    used = 0
    for b, n in enumerate(LENGTHS):
        need = -(-n // PAGE)
        table[b, :need] = order[used : used + need].to(torch.int32)
        table[b, need:] = order[torch.randint(0, POOL, (m - need,), generator=gen)].int()
        used += need

    def body(spec, shape):  # codebooks per KV head
        return random_body(spec, shape, dtype, gen, per_head_codebook=True)

    contiguous = [body(s, (B, hkv, m * PAGE, D)) for s in (key, value)]
    # keys' codes start at an odd byte (read as bytes), values' on a word where they can be
    stale = [body(s, (POOL, hkv, PAGE, D)) for s in (key, value)]
    pages = [_paginate(body, old, table, gen, skip, device)
             for body, old, skip in zip(contiguous, stale, (3, 0), strict=True)]  # fmt: skip
    k_nb, v_nb = ((lengths - r).clamp(min=0) for r in (9, 14))
    tails = [torch.randn(B, hkv, R, D, generator=gen).to(dtype) for _ in range(2)]
    tails, k_nb, v_nb = to_device((tails, k_nb, v_nb), device)
    keys, values = Stored(pages[0], tails[0], k_nb), Stored(pages[1], tails[1], v_nb)
    positions = [[0, 37, 70], [0, 33, -1], [0, -1, -1], [-1, -1, -1]]
    sinks = random_sinks(positions, P, hkv, D, dtype, gen)
    q = torch.randn(B, H, 1, D, generator=gen).to(dtype)
    new = [torch.randn(B, hkv, 1, D, generator=gen).to(dtype) for _ in range(2)]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D) if pre_rope else None
    rest = to_device(((q, *new), sinks, lengths, contiguous, table, inv_freq), device)
    (q, *new), sinks, lengths, contiguous, table, inv_freq = rest
    return (q, *new, keys, values, sinks, lengths), contiguous, table, inv_freq


@pytest.mark.parametrize(
    ("config", "splits"),
    [((32, 4, 1), 1), ((16, 4, 1), 3), ((64, 4, 1), 2)],
    ids=["32-token tiles (2 blocks)", "16-token tiles, 3 splits", "64-token tiles, 2 splits"],
)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_decode_matches_contiguous_and_reference(case, config, splits, monkeypatch):
    if config != (32, 4, 1) and case != "kvcalib-2 G4 D64":
        pytest.skip("tile and split variants run on kvcalib-2")
    monkeypatch.setattr(cfg, "INTERPRETED", config)
    monkeypatch.setattr(cfg, "num_splits", lambda *a: splits)
    gen = torch.Generator().manual_seed(len(case))
    args, contiguous, table, inv_freq = _inputs(case, gen)
    keys, values = args[3], args[4]
    if case == "kvcalib-2 G4 D64":  # both code reads compared: bytes for keys, words for values
        units = [dec._stream_args(s, 64, P, paged=True)[1].UNIT for s in (keys, values)]
        assert units == [8, 32]
    # the pages hold each sequence's positions: gathering them back is exact (index math)
    for stored, body in zip((keys, values), contiguous, strict=True):
        gathered = paged.gather(stored.body, table)
        for name, t in _fields(gathered).items():
            for b, n in enumerate(LENGTHS):
                assert torch.equal(t[b, :, :n], _fields(body)[name][b, :, :n]), name
    ours = dec.decode_attention(*args, inv_freq=inv_freq, block_table=table)
    flat = (*args[:3], keys._replace(body=contiguous[0]), values._replace(body=contiguous[1]))
    assert torch.equal(ours, dec.decode_attention(*flat, *args[5:], inv_freq=inv_freq))

    def ref(block_table, dtype=None):
        return paged.paged_decode_attention_reference(
            *args, block_table, inv_freq=inv_freq, dtype=dtype
        ).double()

    exact = ref(table, torch.float64)
    bound = 2 * (ref(table) - exact).abs().max()
    assert (ours.double() - exact).abs().max() <= bound
    # the bound can fail: the blocks read in the order the pool handed them out
    shifted = torch.roll(table, 1, dims=1)
    assert (ref(shifted, torch.float64) - exact).abs().max() > 10 * bound


def test_paged_decode_refuses_what_pages_do_not_hold():
    gen = torch.Generator().manual_seed(0)
    args, _, table, inv_freq = _inputs("per-token-4 groups of 16, D80", gen)
    with pytest.raises(ValueError, match="sliding window"):
        dec.decode_attention(*args, inv_freq=inv_freq, window=32, block_table=table)
    with pytest.raises(ValueError, match=r"block_table \(3, 5\) must be \[B=4"):
        dec.decode_attention(*args, inv_freq=inv_freq, block_table=table[:3])
    kivi = S(2, "channel", 16).layout.allocate((POOL, 2, PAGE, 64), "cpu", torch.float16)
    with pytest.raises(ValueError, match="not paged"):
        paged.gather(kivi, table)


@pytest.mark.parametrize("case", list(CASES))
def test_the_gpu_inputs_live_on_the_device(case):
    """_inputs(device=...) puts every tensor there, codebooks and static ranges of the paged
    bodies too (checked on the meta device; the first GPU run found them left on the CPU)."""
    out = _inputs(case, torch.Generator().manual_seed(1), torch.float16, "meta")
    assert {t.device.type for t in tensors(out)} == {"meta"}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_decode_on_gpu(case, dtype, monkeypatch):
    """On a GPU (`make gpu-check`), at fp16 and bf16, for every tile size the tuner may pick:
    the paged kernel within flash-attention's bound of the paged reference, as the contiguous
    kernel is on the same bits (the float order may differ between compiled variants, so not
    bit for bit)."""
    args, contiguous, table, inv_freq = _inputs(case, torch.Generator().manual_seed(1), dtype,
                                                "cuda")  # fmt: skip

    def ref(dtype=None):
        return paged.paged_decode_attention_reference(
            *args, table, inv_freq=inv_freq, dtype=dtype
        ).double()

    exact = ref(torch.float64)
    bound = 2 * (ref() - exact).abs().max()
    flat = (*args[:3], args[3]._replace(body=contiguous[0]), args[4]._replace(body=contiguous[1]))
    for config in cfg.CONFIGS:
        monkeypatch.setattr(cfg, "choose", lambda key, device, launch, config=config: config)
        ours = dec.decode_attention(*args, inv_freq=inv_freq, block_table=table).double()
        assert (ours - exact).abs().max() <= bound, config
        theirs = dec.decode_attention(*flat, *args[5:], inv_freq=inv_freq).double()
        assert (theirs - exact).abs().max() <= bound, config
