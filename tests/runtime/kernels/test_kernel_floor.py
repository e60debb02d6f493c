"""The Gluon skeleton of benchmarks/kernel_floor.py and the decode it shares with the kernel
(kernels.decode_gluon): every register the inline PTX decodes holds the element the MMA reads
there (issue 51).

The bookkeeping is proven here one thread at a time: the decode blocks' PTX executed
instruction by instruction (support.ptx) for every lane of a warp, each output register read
through the operand's layout (decode_gluon's constants, which the kernel and the skeleton
assert equal to Gluon's own when they compile), and compared with the plain decode of the
channel the other operand reads at that index (q at `key_channel`, the output store at
`value_channel`). The skeleton runs whole on the CPU (support.ptx_cta) and on a GPU when there
is one; its compile is checked against the committed record.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.floor_cases import skeleton_args, skeleton_inputs, skeleton_reference
from support.ptx import run_ptx
from support.ptx_runs import executed

ROOT = Path(__file__).resolve().parents[3]
FLOOR = ROOT / "benchmarks" / "kernel_budget" / "floor.json"
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_budget as kb  # noqa: E402
import triton  # noqa: E402

if triton.__version__ != kb.TRITON:  # Gluon's API moves between releases
    pytest.skip(f"kernel_floor is written for Triton {kb.TRITON}'s Gluon, this is "
                f"{triton.__version__}", allow_module_level=True)  # fmt: skip

import kernel_floor as kf  # noqa: E402

from kvcalib_runtime.kernels import gluon_layouts as dg  # noqa: E402
from kvcalib_runtime.kernels import gluon_ptx, gluon_rows  # noqa: E402

LANES = range(32)


def coords(layout, reg: int, lane: int) -> list[int]:
    """The element [warp 0, ...] a linear layout puts in register `reg` of `lane`: the XOR of
    the bases of their set bits."""
    out = [0] * len(layout.shape)
    for bases, index in ((layout.reg_bases, reg), (layout.lane_bases, lane)):
        for bit, base in enumerate(bases):
            if index >> bit & 1:
                out = [a ^ b for a, b in zip(out, base, strict=True)]
    return out


def level_table(gen):
    """Four random fp16 levels as packed.LUT16_ASM's table words, and their 16-bit patterns."""
    bits = torch.randn(4, generator=gen).to(torch.float16).view(torch.int16).long() & 0xFFFF
    return bits[0] | bits[1] << 16, bits[2] | bits[3] << 16, bits


def run(asm_fn, outputs: int, words: torch.Tensor, *tables, shared=None) -> torch.Tensor:
    """One thread's asm block (gluon_ptx's constexpr function) on its `words` [n] (samples x
    n as columns) and table words (or a table's shared address, `shared` the words there):
    its `outputs` 16-bit results [samples, outputs]."""
    names = tuple(f"${n}" for n in range(outputs))
    given = tuple(f"${outputs + n}" for n in range(words.shape[1]))
    table = tuple((f"${outputs + len(given) + n}",) for n in range(len(tables)))
    regs = {name: words[:, n] for n, name in enumerate(given)}
    regs.update({name: torch.as_tensor(word) for (name,), word in zip(table, tables, strict=True)})
    regs = run_ptx(asm_fn((names,), (given, *table)), regs, shared)
    return torch.stack([regs[name] for name in names], 1)


def pair_table(gen, at: int, levels: int = 16):
    """`levels` random fp16 levels as a table of level pairs at shared address `at` (entry x:
    the levels of codes x % levels and x // levels), the shared words holding it, and the
    levels' 16-bit patterns."""
    bits = torch.randn(levels, generator=gen).to(torch.float16).view(torch.int16).long() & 0xFFFF
    x = torch.arange(levels**2)
    shared = torch.zeros(at // 4 + levels**2, dtype=torch.long)
    shared[at // 4 :] = bits[x % levels] | bits[x // levels] << 16
    return shared, bits


def vq_table(gen, at: int):
    """A random codebook of 64 entries of 4 fp16 coordinates as kvcalib-1.5's table at shared
    address `at` (entry e: word 2e its coordinates 0, 1, word 2e + 1 its 2, 3), the shared
    words holding it, and the coordinates' 16-bit patterns [64, 4]."""
    bits = torch.randn(64, 4, generator=gen).to(torch.float16).view(torch.int16).long() & 0xFFFF
    shared = torch.zeros(at // 4 + 128, dtype=torch.long)
    shared[at // 4 :] = (bits[:, 0::2] | bits[:, 1::2] << 16).flatten()
    return shared, bits


def bit_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., n] packed as one bit string a row (code c at bits c bits ..), in 32-bit
    words [..., n bits / 32] (int64)."""
    stream = ((codes[..., None] >> torch.arange(bits)) & 1).flatten(-2)
    return (stream.unflatten(-1, (-1, 32)) << torch.arange(32)).sum(-1)


def test_the_relabelings_are_permutations():
    """Every channel is read once: q's K index and the output rows relabel channels, never merge
    them."""
    for pairs in (False, True):
        assert sorted(dg.key_channel.fn(torch.arange(128), pairs).tolist()) == list(range(128))
        assert sorted(dg.key_channel4.fn(torch.arange(128), pairs).tolist()) == list(range(128))
        assert sorted(dg.key_channel3.fn(torch.arange(128), pairs).tolist()) == list(range(128))
    assert sorted(dg.value_channel.fn(torch.arange(128)).tolist()) == list(range(128))


@pytest.mark.parametrize("pairs", [False, True])
def test_each_key_register_holds_the_level_of_the_channel_q_reads_at_its_k(pairs):
    """Lane (i, r) decodes words 2i + e (pairs, keys before RoPE: i + 4e) of positions r, r + 8
    (register e + 2h): A-operand register R holds, at its (position, K index), the level of code
    key_channel(k) % 16 of the word holding key_channel(k), for every register of every lane,
    on random codes; with pairs, K index k ^ 64 holds the RoPE partner, channel + D/2."""
    gen = torch.Generator().manual_seed(0)
    lo, hi, bits = level_table(gen)
    for lane in LANES:
        i = lane % 4
        codes = torch.randint(0, 4, (32, 4, 16), generator=gen)  # samples, word (e + 2h), code
        words = (codes << 2 * torch.arange(16)).sum(-1)
        out = run(gluon_ptx.key_asm, 64, words, lo, hi)
        for reg in range(64):
            _, position, k = coords(dg.KEYS, reg, lane)
            channel = int(dg.key_channel.fn(torch.tensor(k), pairs))
            first, step = (i, 4) if pairs else (2 * i, 1)  # the lane's words: first + step e
            (e, other), h = divmod(channel // 16 - first, step), position // 8
            assert e in (0, 1) and other == 0 and position % 8 == lane // 4, (lane, reg)
            if pairs:
                assert int(dg.key_channel.fn(torch.tensor(k ^ 64), pairs)) == channel ^ 64
            assert torch.equal(out[:, reg], bits[codes[:, e + 2 * h, channel % 16]]), (lane, reg)


@pytest.mark.parametrize("pairs", [False, True])
def test_each_4_bit_key_register_holds_the_level_of_the_channel_q_reads_at_its_k(pairs):
    """Lane (i, r) decodes words 4i + e (pairs, keys before RoPE: i + 4e) of positions r, r + 8
    (register e + 4h) by the table of level pairs: A-operand register R holds, at its
    (position, K index), the level of code key_channel4(k) % 8 of the word holding
    key_channel4(k), for every register of every lane, on random codes, every code at every
    place of a word; with pairs, K index k ^ 64 holds the RoPE partner, channel + D/2."""
    gen = torch.Generator().manual_seed(3)
    at = 0x460  # the table's shared address: any word-aligned one
    shared, bits = pair_table(gen, at)
    for lane in LANES:
        codes = torch.randint(0, 16, (32, 8, 8), generator=gen)  # samples, word (e + 4h), code
        codes[:16, 0] = torch.arange(16)[:, None]
        words = (codes << 4 * torch.arange(8)).sum(-1)
        out = run(gluon_ptx.key_asm, 64, words, at, shared=shared)
        for reg in range(64):
            _, position, k = coords(dg.KEYS, reg, lane)
            channel = int(dg.key_channel4.fn(torch.tensor(k), pairs))
            first, step = (lane % 4, 4) if pairs else (4 * (lane % 4), 1)
            (e, other), h = divmod(channel // 8 - first, step), position // 8
            assert e in range(4) and other == 0 and position % 8 == lane // 4, (lane, reg)
            if pairs:
                assert int(dg.key_channel4.fn(torch.tensor(k ^ 64), pairs)) == channel ^ 64
            assert torch.equal(out[:, reg], bits[codes[:, e + 4 * h, channel % 8]]), (lane, reg)


def test_each_4_bit_value_register_holds_the_level_of_its_position_at_the_row_stored_out():
    """Lane (i, r) decodes words 2r + w of positions 2i + b + 8c (register b + 2w + 4c) by the
    table of level pairs: A-operand register R of the transposed values holds, at its (row m,
    position), the level of that position's code of channel value_channel(m), the row stored
    to that channel; every register of every lane, every code at every place."""
    gen = torch.Generator().manual_seed(4)
    at = 0x200
    shared, bits = pair_table(gen, at)
    for lane in LANES:
        i, r = lane % 4, lane // 4
        codes = torch.randint(0, 16, (32, 8, 8), generator=gen)  # samples, b + 2w + 4c, code
        codes[:16, 0] = torch.arange(16)[:, None]
        words = (codes << 4 * torch.arange(8)).sum(-1)
        out = run(gluon_ptx.value_asm, 64, words, at, shared=shared)
        for reg in range(64):
            _, m, position = coords(dg.VALUES, reg, lane)
            channel = int(dg.value_channel.fn(torch.tensor(m)))
            b, c, w = position % 2, position // 8, channel // 8 - 2 * r
            assert (position // 2) % 4 == i and w in (0, 1), (lane, reg)
            level = bits[codes[:, b + 2 * w + 4 * c, channel % 8]]
            assert torch.equal(out[:, reg], level), (lane, reg)


def test_each_3_bit_key_register_holds_the_level_of_the_channel_q_reads_at_its_k():
    """Lane (i, r) reads words 3i .. 3i + 2 of positions r, r + 8 (registers e + 4h, e < 3:
    channels 32i .. 32i + 31, a code's 3 bits across words where they fall so) and decodes
    them by the table of level pairs: A-operand register R holds, at its (position, K index),
    the level of channel key_channel3(k), for every register of every lane, on random codes
    with every code at each of a group's first places."""
    gen = torch.Generator().manual_seed(5)
    at = 0x300
    shared, bits = pair_table(gen, at, 8)
    for lane in LANES:
        i = lane % 4
        codes = torch.randint(0, 8, (32, 2, 32), generator=gen)  # samples, h, channel - 32i
        codes[:8, :, :12] = torch.arange(8)[:, None, None]
        words = torch.randint(0, 2**32, (32, 8), generator=gen)  # register 4h + 3: unread
        for h in range(2):
            words[:, 4 * h : 4 * h + 3] = bit_rows(codes[:, h], 3)
        out = run(gluon_rows.key3_asm, 64, words, at, shared=shared)
        for reg in range(64):
            _, position, k = coords(dg.KEYS, reg, lane)
            channel = int(dg.key_channel3.fn(torch.tensor(k), False)) - 32 * i
            assert channel in range(32) and position % 8 == lane // 4, (lane, reg)
            level = bits[codes[:, position // 8, channel]]
            assert torch.equal(out[:, reg], level), (lane, reg)


def test_each_pre_rope_3_bit_key_register_holds_the_level_of_the_channel_q_reads_at_its_k():
    """Keys before RoPE: lane (i, r) reads the two words holding channels 16i .. 16i + 15 of
    positions r, r + 8 and the two holding their RoPE partners, 6 words on (registers 4h + 2g,
    + 1; shifted by 16 where i is odd): A-operand register R holds, at its (position, K
    index), the level of channel key_channel3(k, pairs), and K index k ^ 64 the RoPE partner,
    channel + D/2; every register of every lane, every code at each of a group's first
    places."""
    gen = torch.Generator().manual_seed(7)
    at = 0x340
    shared, bits = pair_table(gen, at, 8)
    for lane in LANES:
        i = lane % 4
        codes = torch.randint(0, 8, (32, 2, 128), generator=gen)  # samples, h, channel
        codes[:8, :, 16 * i : 16 * i + 12] = torch.arange(8)[:, None, None]
        rows = bit_rows(codes, 3)  # [32, 2, 12]
        first = 3 * i // 2
        words = torch.cat([rows[:, h, [first, first + 1, first + 6, first + 7]]
                           for h in range(2)], 1)  # fmt: skip
        out = run(gluon_rows.key3_pairs_asm, 64, words, 16 * (i % 2), at, shared=shared)
        for reg in range(64):
            _, position, k = coords(dg.KEYS, reg, lane)
            channel = int(dg.key_channel3.fn(torch.tensor(k), True))
            assert channel % 64 // 16 == i and position % 8 == lane // 4, (lane, reg)
            assert int(dg.key_channel3.fn(torch.tensor(k ^ 64), True)) == channel ^ 64
            level = bits[codes[:, position // 8, channel]]
            assert torch.equal(out[:, reg], level), (lane, reg)


def test_each_3_bit_value_register_holds_the_level_of_its_position_at_the_row_stored_out():
    """Lane (i, r) reads the two words holding bits 48r .. 48r + 47 of positions 2i + b + 8c
    (registers 2 (b + 2c) and + 1; channels 16r .. 16r + 15, shifted by 16 where r is odd):
    A-operand register R of the transposed values holds, at its (row m, position), the level
    of that position's code of channel value_channel(m); every register of every lane."""
    gen = torch.Generator().manual_seed(6)
    at = 0x500
    shared, bits = pair_table(gen, at, 8)
    for lane in LANES:
        i, r = lane % 4, lane // 4
        codes = torch.randint(0, 8, (32, 4, 128), generator=gen)  # samples, b + 2c, channel
        codes[:8, 0, 16 * r : 16 * r + 16] = torch.arange(8)[:, None]
        rows = bit_rows(codes, 3)  # [32, 4, 12]
        words = rows[:, :, 3 * r // 2 : 3 * r // 2 + 2].flatten(1)
        out = run(gluon_rows.value3_asm, 64, words, 16 * (r % 2), at, shared=shared)
        for reg in range(64):
            _, m, position = coords(dg.VALUES, reg, lane)
            channel = int(dg.value_channel.fn(torch.tensor(m)))
            b, c = position % 2, position // 8
            assert (position // 2) % 4 == i and channel // 16 == r, (lane, reg)
            level = bits[codes[:, b + 2 * c, channel]]
            assert torch.equal(out[:, reg], level), (lane, reg)


def test_each_vq_key_register_holds_the_coordinates_of_the_channels_q_reads_at_its_k():
    """kvcalib-1.5's keys (6-bit indices of vectors of channels 2V, 2V + 1 and their RoPE
    partners 64 on): lane (i, r) reads the two words holding vectors 8i .. 8i + 7 of
    positions r, r + 8 (registers 2h, 2h + 1; shifted by 16 where i is odd); A-operand
    register R holds, at its (position, K index), the coordinate of channel
    key_channel3(k, pairs) in its vector's entry, and K index k ^ 64 the partner's; every
    register of every lane, every index at each of a lane's first places."""
    gen = torch.Generator().manual_seed(8)
    at = 0x380
    shared, bits = vq_table(gen, at)
    for lane in LANES:
        i = lane % 4
        codes = torch.randint(0, 64, (64, 2, 32), generator=gen)  # samples, h, vector
        codes[:, :, 8 * i] = torch.arange(64)[:, None]
        rows = bit_rows(codes, 6)  # [64, 2, 6]
        first = 3 * i // 2
        words = rows[:, :, first : first + 2].flatten(1)
        out = run(gluon_rows.vq_key_asm, 64, words, 16 * (i % 2), at, shared=shared)
        for reg in range(64):
            _, position, k = coords(dg.KEYS, reg, lane)
            channel = int(dg.key_channel3.fn(torch.tensor(k), True))
            vector, coordinate = channel % 64 // 2, channel % 2 + 2 * (channel // 64)
            assert vector // 8 == i and position % 8 == lane // 4, (lane, reg)
            level = bits[codes[:, position // 8, vector], coordinate]
            assert torch.equal(out[:, reg], level), (lane, reg)


def test_each_vq_value_register_holds_the_coordinate_of_its_position_at_the_row_stored_out():
    """kvcalib-1.5's values (6-bit indices of vectors of channels 4u .. 4u + 3): lane (i, r)
    reads the two words holding vectors 4r .. 4r + 3 of positions 2i + b + 8c (registers
    2 (b + 2c), + 1; shifted by 24r mod 32): A-operand register R of the transposed values
    holds, at its (row m, position), the coordinate of channel value_channel(m) in that
    position's entry; every register of every lane, every index at each of a lane's places."""
    gen = torch.Generator().manual_seed(9)
    at = 0x600
    shared, bits = vq_table(gen, at)
    for lane in LANES:
        i, r = lane % 4, lane // 4
        codes = torch.randint(0, 64, (64, 4, 32), generator=gen)  # samples, b + 2c, vector
        codes[:, 0, 4 * r : 4 * r + 4] = torch.arange(64)[:, None]
        rows = bit_rows(codes, 6)  # [64, 4, 6]: a seventh word past the row, zeros
        rows = torch.cat([rows, torch.zeros_like(rows[:, :, :1])], -1)
        words = rows[:, :, 3 * r // 4 : 3 * r // 4 + 2].flatten(1)
        out = run(gluon_rows.vq_value_asm, 64, words, 24 * r % 32, at, shared=shared)
        for reg in range(64):
            _, m, position = coords(dg.VALUES, reg, lane)
            channel = int(dg.value_channel.fn(torch.tensor(m)))
            b, c = position % 2, position // 8
            assert (position // 2) % 4 == i and channel // 16 == r, (lane, reg)
            level = bits[codes[:, b + 2 * c, channel // 4], channel % 4]
            assert torch.equal(out[:, reg], level), (lane, reg)


def test_each_value_register_holds_the_code_of_its_position_at_the_row_stored_out():
    """Lane (i, r) decodes word r of positions 2i + b + 8c (register b + 2c): A-operand register
    R of the transposed values holds, at its (row m, position), code value_channel(m) % 16 of
    that position's word times 2^value_shift(m), exactly, in fp16, the output row m being
    stored to value_channel(m) (times value_unit(m)); every code at every shift."""
    gen = torch.Generator().manual_seed(1)
    for lane in LANES:
        i, r = lane % 4, lane // 4
        codes = torch.randint(0, 4, (32, 4, 16), generator=gen)  # samples, position (b + 2c), code
        codes[:4, 0] = torch.arange(4)[:, None]  # each code at each of a word's 16 places
        words = (codes << 2 * torch.arange(16)).sum(-1)
        out = run(gluon_ptx.value_asm, 64, words)
        for reg in range(64):
            _, m, position = coords(dg.VALUES, reg, lane)
            channel = int(dg.value_channel.fn(torch.tensor(m)))
            b, c = position % 2, position // 8
            assert (position // 2) % 4 == i and channel // 16 == r, (lane, reg)
            level = codes[:, b + 2 * c, channel % 16] << int(dg.value_shift.fn(torch.tensor(m)))
            bits = level.to(torch.float16).view(torch.int16).long() & 0xFFFF
            assert torch.equal(out[:, reg], bits), (lane, reg)


def test_the_probabilities_reach_the_b_operand_by_one_transpose_per_half():
    """movmatrix.m8n8.trans (the PTX ISA: lane t's fragment is row t // 4, columns 2 (t % 4) and
    + 1, of the 8 x 8 matrix or its transpose) maps the scores' registers 2h, 2h + 1
    (positions 8h + r, heads 2i, 2i + 1) to the B operand's (positions 8h + 2i, + 1; head r)."""
    for lane in LANES:
        row, col = lane // 4, 2 * (lane % 4)
        for h in range(2):
            for s in range(2):
                _, position, head = coords(dg.SCORES, 2 * h + s, lane)
                assert (position - 8 * h, head) == (row, col + s)  # the fragment it reads
                _, position, head = coords(dg.PROBS, 2 * h + s, lane)
                assert (position - 8 * h, head) == (col + s, row)  # the transpose's


def test_the_skeletons_compile_to_their_record(tmp_path):
    """kernel_floor compiled now for sm_90 (its layout asserts pass: the constants above are
    Gluon's) reads within 3% of the committed record's instructions per position."""
    committed = json.loads(FLOOR.read_text())
    if committed["triton"] != triton.__version__:
        pytest.skip(f"the record was read with Triton {committed['triton']}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "runtime"), env.get("PYTHONPATH", "")])
    out = tmp_path / "floor.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_floor.py"),
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = {r["formulation"]: r["per_position"] for r in json.loads(out.read_text())["rows"]}
    for row in committed["rows"]:
        assert abs(fresh[row["formulation"]] - row["per_position"]) <= 0.03 * row["per_position"]


def test_the_gluon_skeleton_is_attention_executed_on_the_cpu():
    """The skeleton compiled for sm_90, its PTX executed for every thread (support.ptx_cta:
    the per-warp splits, the relabeled K index and output rows, the movmatrix transpose, the
    merge after the loop), against the attention it computes in fp32 torch over 256 positions
    of random codes: within 2e-2 of the largest output, the fp16 operands' rounding (the GPU
    test's bound)."""
    result = executed("skeleton")
    assert set(result) == set(kf.FORMULATIONS[1:])
    for name, r in result.items():
        assert r["error"] <= 2e-2 * r["scale"], name


@pytest.mark.gpu
@pytest.mark.parametrize("name", kf.FORMULATIONS[1:])
def test_the_gluon_skeleton_is_attention_on_a_gpu(name):
    """What the CPU cannot run: the skeleton's output (each warp's split merged) against the
    attention it computes, in fp32 torch, within fp16 operand rounding (2e-2 of the largest
    output), over 1,024 positions of random codes, with and without kvcalib-2's features,
    keys before RoPE, and 4-bit codebooks."""
    gen = torch.Generator().manual_seed(2)
    n = 1024
    constants = kf.constants(name)
    (q, kc, vc, table), meta, keys, values = skeleton_inputs(gen, n, kf.D, kf.G,
                                                             constants["BITS"])  # fmt: skip
    expected = skeleton_reference(q, keys, values, meta, constants["FEATURES"],
                                  constants["PRE_ROPE"])  # fmt: skip
    out = torch.zeros(kf.G, kf.D, device="cuda")
    args = [a.cuda() if isinstance(a, torch.Tensor) else a
            for a in skeleton_args(q, kc, vc, table, meta, out, n)]  # fmt: skip
    kf._gluon_loop[(1,)](*args, **constants, num_warps=kf.WARPS)
    assert (out.cpu() - expected).abs().max() <= 2e-2 * expected.abs().max()
