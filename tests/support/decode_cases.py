"""The decode attention cases the kernels' tests share: every preset's layouts (and the
corners: head_dim 80 and 96, windows, exact sides, 5/6-bit codes) as a cache's worth of random
stored bits, and the reference's result on them."""

import torch

from kvcalib_runtime.kernels.decode_reference import decode_attention_reference
from kvcalib_runtime.kernels.operands import Sinks, Stored
from kvcalib_runtime.layouts.quant import QuantSpec
from support.bodies import random_body

S = QuantSpec

DECODE_CASES = {
    # name: (key spec, value spec, query heads, KV heads, head_dim, pre-RoPE, window)
    "kvcalib-2 G4 D128": (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1,
                            slot_rule="error"), S(2, symmetric=True, codebook=True), 8, 2, 128,
                          True, None),
    "kvcalib-3 G3 D64": (S(3, "static", codebook=True, outliers=0.01, outlier_slots=2,
                           slot_rule="error"), S(3, symmetric=True, codebook=True), 9, 3, 64,
                         True, None),
    "kvcalib-4 G8 D256 one KV head": (S(4, "static", codebook=True, outliers=0.01,
                                        outlier_slots=1), S(4, symmetric=True, codebook=True),
                                      8, 1, 256, True, None),
    "kvcalib-2 fp8 slots G4 D64": (S(2, "static", codebook=True, outliers=0.01, outlier_slots=2,
                                     slot_rule="error", slot_code="fp8"),
                                   S(3, "static", outliers=0.01, outlier_slots=1,
                                     slot_code="fp8"), 8, 2, 64, True, None),
    "kvcalib-2 byte values G4 D128": (S(2, "static", codebook=True, outliers=0.01,
                                        outlier_slots=1, slot_rule="error", slot_code="fp8"),
                                      S(2, metadata_code="byte"), 8, 2, 128, True, None),
    "kvcalib-2 post-RoPE G4 D128": (S(2, "static", codebook=True, outliers=0.01,
                                      outlier_slots=1, slot_rule="error"),
                                    S(2, metadata_code="byte"), 8, 2, 128, False, None),
    "byte metadata groups, slots, codebook G2 D64": (
        S(4, group_size=16, outliers=0.1, slot_rule="error", metadata_code="byte"),
        S(3, group_size=32, symmetric=True, codebook=True, metadata_code="byte"), 4, 2, 64,
        False, None),
    "kivi-2 G1 D128": (S(2, "channel", 32), S(2, group_size=32), 2, 2, 128, False, None),
    "kivi-4 G3 D64": (S(4, "channel", 16), S(4, group_size=16), 6, 2, 64, False, None),
    "per-token-3 G4 D64": (S(3), S(3), 8, 2, 64, False, None),
    "quarot-kv4 G8 D128": (S(4), S(4), 8, 1, 128, False, None),
    "kvquant-3 G4 D128": (S(3, "static", codebook=True, outliers=0.01, outlier_slots=1),
                          S(3, codebook=True, outliers=0.01), 8, 2, 128, True, None),
    "vector values G3 D64": (S(2, "static"), S(3, "vector", outliers=0.01), 9, 3, 64, True,
                             None),
    "head_dim 80": (S(2), S(3, symmetric=True), 4, 2, 80, True, None),
    "head_dim 96, groups across halves": (S(2, group_size=32), S(4, group_size=32), 4, 2, 96,
                                          False, None),
    "window pre-RoPE ring": (S(2, "static"), S(2, group_size=16), 8, 2, 64, True, 50),
    "window exact keys": (None, S(4, "channel", 16), 2, 1, 64, False, 37),
    "8-bit keys exact values D256": (S(8), None, 4, 1, 256, True, None),
    "5/6-bit": (S(6, "static"), S(5, symmetric=True), 2, 2, 64, True, None),
}  # fmt: skip

# kvcalib-2's, -3's, -4's and -1.5's layouts at 128 channels, which kernels.decode_gluon's
# whole tiles read on a GPU
GLUON_CASES = {
    "kvcalib-2 G4 D128": (S(2, "static", codebook=True, outliers=0.01, outlier_slots=1,
                            slot_rule="error", slot_code="fp8"), S(2, metadata_code="byte"), 8,
                          2, 128, True, None),
    "kvcalib-2 post-RoPE G8 D128": (S(2, "static", codebook=True, outliers=0.01,
                                      outlier_slots=1, slot_rule="error", slot_code="fp8"),
                                    S(2, metadata_code="byte"), 8, 1, 128, False, None),
    "kvcalib-3 G4 D128": (S(3, "static", codebook=True, outliers=0.01, outlier_slots=1),
                          S(3, symmetric=True, codebook=True), 8, 2, 128, True, None),
    "kvcalib-3 post-RoPE G8 D128": (S(3, "static", codebook=True, outliers=0.01,
                                      outlier_slots=1), S(3, symmetric=True, codebook=True), 8,
                                    1, 128, False, None),
    "kvcalib-1.5 G4 D128": (S(6, "static", 4, codebook=True, method="vq", pairing="rope"),
                            S(6, "static", 4, codebook=True, method="vq"), 8, 2, 128, True,
                            None),
    "kvcalib-1.5 post-RoPE G8 D128": (S(6, "static", 4, codebook=True, method="vq",
                                        pairing="rope"),
                                      S(6, "static", 4, codebook=True, method="vq"), 8, 1, 128,
                                      False, None),
    "kvcalib-4 G4 D128": (S(4, "static", codebook=True, outliers=0.01, outlier_slots=1),
                          S(4, symmetric=True, codebook=True), 8, 2, 128, True, None),
    "kvcalib-4 post-RoPE G8 D128": (S(4, "static", codebook=True, outliers=0.01,
                                      outlier_slots=1), S(4, symmetric=True, codebook=True), 8,
                                    1, 128, False, None),
}  # fmt: skip


def random_sinks(positions, reach: int, hkv: int, d: int, dtype, gen) -> Sinks:
    """Sink slots holding `positions` (B lists of S, -1 empty) of sequences that reach `reach`
    positions, with random keys and values."""
    sink_pos = torch.tensor(positions)
    is_sink = torch.zeros(len(positions), reach, dtype=torch.bool)
    for b, row in enumerate(positions):
        is_sink[b, [p for p in row if p >= 0]] = True
    shape = (*sink_pos.shape[:1], hkv, sink_pos.shape[1], d)
    sink_kv = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    return Sinks(*sink_kv, sink_pos, is_sink)


def decode_inputs(case, gen, dtype=torch.float16, lengths=(150, 61, 0)):
    """A cache's worth of random stored bits for case (DECODE_CASES, or GLUON_CASES with
    "gluon: " before its name): 3 sequences (lengths 150, 61, 0 unless given), a ring of 16
    (key and value bodies end at different positions), 3 sink slots, fp16."""
    cases = GLUON_CASES if case.startswith("gluon: ") else DECODE_CASES
    key, value, H, hkv, D, pre_rope, window = cases[case.removeprefix("gluon: ")]
    B, P, R = len(lengths), max(lengths) + 1, 16
    slots = P if window is None else 64  # a window's ring body: position p in slot p % 64
    kb, vb = (random_body(s, (B, hkv, slots, D), dtype, gen) for s in (key, value))
    lengths = torch.tensor(lengths)
    k_nb, v_nb = ((lengths - r).clamp(min=0) for r in (9, 14))
    keys = Stored(kb, torch.randn(B, hkv, R, D, generator=gen).to(dtype), k_nb)
    values = Stored(vb, torch.randn(B, hkv, R, D, generator=gen).to(dtype), v_nb)
    sinks = random_sinks([[0, 37, 140], [0, -1, -1], [-1, -1, -1]], P, hkv, D, dtype, gen)
    q = torch.randn(B, H, 1, D, generator=gen).to(dtype)
    new = (torch.randn(B, hkv, 1, D, generator=gen).to(dtype) for _ in range(2))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D) if pre_rope else None
    return (q, *new, keys, values, sinks, lengths), dict(inv_freq=inv_freq, window=window)


def reference(args, options, **changes):
    """decode_attention_reference on `args`, with `changes` to the options."""
    return decode_attention_reference(*args, **{**options, **changes})
