"""The decode loop's floor in each formulation, read on a CPU (issue 51): the least a whole-tile
loop of kvcalib-2's value and key reads costs per (position x KV head), before the kernel's own
features (exact slots, sink masks, metadata loads, the cp.async pipeline) are added.

    python benchmarks/kernel_floor.py --out benchmarks/kernel_budget/floor.json

Both skeletons do the same work per tile of 64 positions at 32/8/128 (G = 4 query heads a KV
head, D = 128, fp16): 2-bit key and value words decoded to fp16 levels by the byte-permute
table (kernels.packed), scores q . k, an online softmax over the tile whose probabilities are
scaled per position (a "token" value scale) with a rank-1 offset term, and p . v.

  triton  the decode kernel's formulation in Triton: `packed.levels` tiles [BN, D/2] (a thread
          holds a word's 16 channels), K q^T and V^T p with positions as the products' M rows
          (the kernel's orientation), 4 warps sharing one softmax state. Triton converts each
          decoded tile to the dot's operand layout through shared memory (STS, LDSM) and repacks
          the table's 16-bit outputs (PRMT), and re-stores q for wgmma every tile.
  gluon   the same work in Gluon with the layouts written out: each warp an independent split
          of 16 positions (its own softmax state, merged once after the loop), mma.sync with q
          as the A operand; every thread decodes exactly the words its B-operand fragments hold
          (keys: words 2i, 2i+1 of its position, the channels relabeled to the fragment's order
          and q read in that order once; values: word n of positions 2i, 2i+1, 2i+8, 2i+9, two
          positions' codes interleaved into one selector so that each permute gives the
          (position, position + 1) pair the fragment holds); the probabilities stay in registers
          as the A operand of p . v. No shared memory in the loop.

Per position = the SASS loop's instructions x warps / 64 (kernel_budget's rule). Triton
internals are read, so its version is pinned as kernel_budget pins it.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_read as read
import kernel_budget

from kvcalib_runtime.kernels import packed

G, D, BN, WARPS = 4, 128, 64, 4


@triton.jit
def _triton_loop(Q, KC, VC, W, B, OUT, n, T, G: tl.constexpr, D: tl.constexpr,
                 BN: tl.constexpr):  # fmt: skip
    C: tl.constexpr = D // 2
    BG: tl.constexpr = 8
    ch = tl.arange(0, C)
    j = tl.arange(0, BN)
    g = tl.arange(0, BG)
    lo, hi = tl.load(T), tl.load(T + 1)
    live = j >= 0
    q_lo = tl.load(Q + g[:, None] * D + ch[None, :], mask=(g < G)[:, None], other=0.0)
    q_hi = tl.load(Q + g[:, None] * D + C + ch[None, :], mask=(g < G)[:, None], other=0.0)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_w = tl.zeros([BN, BG], tl.float32)
    o_w = tl.zeros([BN, BG], tl.float32)
    acc_lo = tl.zeros([C, BG], tl.float32)
    acc_hi = tl.zeros([C, BG], tl.float32)
    for start in tl.range(0, n, BN, num_stages=2):
        row = (start + j).to(tl.int64) * (D // 16)
        k_lo = packed.levels(KC, row, 0, live, lo, hi, BN, C, C, tl.float16, True)
        k_hi = packed.levels(KC, row, C, live, lo, hi, BN, C, C, tl.float16, True)
        s = tl.dot(k_lo, tl.trans(q_lo)) + tl.dot(k_hi, tl.trans(q_hi))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp2(s - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        w = tl.load(W + start + j)
        b = tl.load(B + start + j)
        l_w = l_w * alpha[None, :] + p
        o_w = o_w * alpha[None, :] + p * b[:, None]
        pw = (p * w[:, None]).to(tl.float16)
        v_lo = packed.levels(VC, row, 0, live, lo, hi, BN, C, C, tl.float16, True)
        v_hi = packed.levels(VC, row, C, live, lo, hi, BN, C, C, tl.float16, True)
        acc_lo = acc_lo * alpha[None, :] + tl.dot(tl.trans(v_lo), pw)
        acc_hi = acc_hi * alpha[None, :] + tl.dot(tl.trans(v_hi), pw)
        m_i = m_new
    total, offset = tl.sum(l_w, axis=0), tl.sum(o_w, axis=0)
    out = OUT + g[None, :] * D + ch[:, None]
    tl.store(out, (acc_lo + offset[None, :]) / total[None, :], mask=(g < G)[None, :])
    tl.store(out + C, (acc_hi + offset[None, :]) / total[None, :], mask=(g < G)[None, :])


# -- Gluon: [warp, query head, position] products, each warp its own split --------------------

MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
A_OP = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
B_OP = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
# B_OP of keys [4, D, 16]: register bits (k + 1, k + 8, k + 16, k + 32, k + 64, n + 8), lanes
# (k + 2, k + 4, n + 1, n + 2, n + 4): thread (i, n) holds channels 2i + {0, 1, 8, 9} + 16 kappa of
# positions n, n + 8. Its words [warp, position, word]: 2i + e of positions n, n + 8
KEY_WORDS = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 8, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, 8])  # fmt: skip
# B_OP of values [4, 16, D]: thread (i, n) holds positions 2i + {0, 1, 8, 9} of channels n + 8 nu:
# word n of those four positions
VALUE_WORDS = gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 8, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, 8])  # fmt: skip


@gluon.constexpr_function
def _key_asm(outputs, inputs):
    """Each key word (register e + 2h) to B_OP registers 4k + 16e + 32h + {0, 1} (codes k, k + 4)
    and + {2, 3} (codes k + 8, k + 12): packed.LUT16_ASM's permutes, written in place."""
    (out,), (words, lo, hi) = outputs, inputs
    lines = ["{ .reg .b32 s, t, u, p, q;"]
    for reg, word in enumerate(words):
        for k in range(4):
            src = word
            if k:
                lines.append(f"shr.u32 u, {word}, {2 * k};")
                src = "u"
            r = 4 * k + 16 * (reg & 1) + 32 * (reg >> 1)
            lines += [f"and.b32 s, {src}, 0x03030303;", "mad.lo.u32 s, s, 34, 0x10101010;",
                      f"prmt.b32 p, {lo[0]}, {hi[0]}, s;", "shr.u32 t, s, 16;",
                      f"prmt.b32 q, {lo[0]}, {hi[0]}, t;",
                      f"mov.b32 {{{out[r]}, {out[r + 1]}}}, p;",
                      f"mov.b32 {{{out[r + 2]}, {out[r + 3]}}}, q;"]  # fmt: skip
    return "\n".join(lines) + " }"


@gluon.constexpr_function
def _value_asm(outputs, inputs):
    """Value words of positions (2i + 8c, 2i + 8c + 1) (registers 2c, 2c + 1) to B_OP registers
    2c + 4m + {0, 1}: code m of both positions, their selectors interleaved by one permute."""
    (out,), (words, lo, hi) = outputs, inputs
    lines = ["{ .reg .b32 a, b, s, t;"]
    for c in range(2):
        for k in range(4):
            lines += [
                f"shr.u32 a, {words[2 * c]}, {2 * k};",
                "and.b32 a, a, 0x03030303;",
                f"shr.u32 b, {words[2 * c + 1]}, {2 * k};",
                "and.b32 b, b, 0x03030303;",
            ]
            for sel, m in (("0x5140", k), ("0x7362", k + 8)):
                r, r4 = 2 * c + 4 * m, 2 * c + 4 * (m + 4)
                lines += [f"prmt.b32 s, a, b, {sel};", "mad.lo.u32 s, s, 34, 0x10101010;",
                          f"prmt.b32 t, {lo[0]}, {hi[0]}, s;",
                          f"mov.b32 {{{out[r]}, {out[r + 1]}}}, t;", "shr.u32 s, s, 16;",
                          f"prmt.b32 t, {lo[0]}, {hi[0]}, s;",
                          f"mov.b32 {{{out[r4]}, {out[r4 + 1]}}}, t;"]  # fmt: skip
    return "\n".join(lines) + " }"


@gluon.jit
def _offsets(layout: gl.constexpr, d0: gl.constexpr, d1: gl.constexpr, d2: gl.constexpr,
             s0, s1, s2):  # fmt: skip
    """s0 i + s1 j + s2 k over [d0, d1, d2] in `layout` (s* int scalars or [d*] in place)."""
    i = gl.arange(0, d0, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    j = gl.arange(0, d1, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    k = gl.arange(0, d2, layout=gl.SliceLayout(0, gl.SliceLayout(0, layout)))
    along_i = gl.expand_dims(gl.expand_dims(i * s0, 1), 2)
    along_j = gl.expand_dims(gl.expand_dims(j * s1, 0), 2)
    return along_i + along_j + gl.expand_dims(gl.expand_dims(k * s2, 0), 0)


@gluon.jit
def _gluon_loop(Q, KC, VC, W, B, OUT, n, T, G: gl.constexpr, D: gl.constexpr):
    BN: gl.constexpr = 64
    lo, hi = gl.load(T), gl.load(T + 1)
    # q [4, 16, D] as the A operand, channel of K index k as _key_asm places the codes
    k = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(0, A_OP)))
    word = 2 * ((k >> 1) & 3) + ((k >> 6) & 1)  # k = 16 kappa + 8 c + 2 i + b, kappa = 4 e + k'
    chan = 16 * word + ((k >> 4) & 3) + 4 * (k & 1) + 8 * ((k >> 3) & 1)
    rows = _offsets(A_OP, 4, 16, D, 0, D, 0)
    heads = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, A_OP)))
    live = gl.expand_dims(gl.expand_dims(heads < G, 0), 2) & (rows >= 0)
    q = gl.load(Q + rows + gl.expand_dims(gl.expand_dims(chan, 0), 0), mask=live, other=0.0)
    k_at = _offsets(KEY_WORDS, 4, 16, 8, 16 * (D // 16), D // 16, 1)
    v_at = _offsets(VALUE_WORDS, 4, 16, 8, 16 * (D // 16), D // 16, 1)
    warp = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(1, MMA)))
    pos = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
    at = gl.expand_dims(warp * 16, 1) + gl.expand_dims(pos, 0)  # [4, 16] positions in the tile
    m_i = gl.full([4, 16], float("-inf"), gl.float32, layout=gl.SliceLayout(2, MMA))
    l_w = gl.zeros([4, 16, 16], gl.float32, layout=MMA)
    o_w = gl.zeros([4, 16, 16], gl.float32, layout=MMA)
    acc = gl.zeros([4, 16, D], gl.float32, layout=MMA)
    for start in range(0, n, BN):
        words = gl.load(KC + start * (D // 16) + k_at)
        kt = gl.inline_asm(
            _key_asm,
            ("=h", "r", "r", "r"),
            [words, lo, hi],
            gl.distributed_type(gl.float16, [4, D, 16], B_OP),
            is_pure=True,
        )
        s = mma_v2(q, kt, gl.zeros([4, 16, 16], gl.float32, layout=MMA))
        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        p = gl.exp2(s - gl.expand_dims(m_new, 2))
        alpha = gl.expand_dims(gl.exp2(m_i - m_new), 2)
        w, b = gl.load(W + start + at), gl.load(B + start + at)
        l_w = l_w * alpha + p
        o_w = o_w * alpha + p * gl.expand_dims(b, 1)
        pw = gl.convert_layout((p * gl.expand_dims(w, 1)).to(gl.float16), A_OP, assert_trivial=True)
        words = gl.load(VC + start * (D // 16) + v_at)
        v = gl.inline_asm(
            _value_asm,
            ("=h", "r", "r", "r"),
            [words, lo, hi],
            gl.distributed_type(gl.float16, [4, 16, D], B_OP),
            is_pure=True,
        )
        acc = mma_v2(pw, v, acc * alpha)
        m_i = m_new
    scale = gl.exp2(m_i - gl.expand_dims(gl.max(m_i, axis=0), 0))
    ROWS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, MMA))
    total = gl.convert_layout(gl.sum(gl.sum(l_w, axis=2) * scale, axis=0), ROWS)
    offset = gl.convert_layout(gl.sum(gl.sum(o_w, axis=2) * scale, axis=0), ROWS)
    out = gl.sum(acc * gl.expand_dims(scale, 2), axis=0)
    out = (out + gl.expand_dims(offset, 1)) / gl.expand_dims(total, 1)
    head = gl.arange(0, 16, layout=ROWS)
    col = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(0, MMA)))
    channel = 16 * (col & 7) + (col >> 3)  # N index 8 nu + n holds channel 16 n + nu
    gl.store(OUT + gl.expand_dims(head * D, 1) + gl.expand_dims(channel, 0), out,
             mask=gl.expand_dims(head < G, 1) & gl.expand_dims(channel >= 0, 0))  # fmt: skip


SIGNATURE = {"Q": "*fp16", "KC": "*i32", "VC": "*i32", "W": "*fp32", "B": "*fp32", "OUT": "*fp32",
             "n": "i32", "T": "*i32", "G": "constexpr", "D": "constexpr"}  # fmt: skip
ALIGNED = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7)}


def measure(name: str) -> dict:
    """One skeleton compiled for sm_90: registers, stack and its loop's SASS."""
    if name == "triton":
        src = ASTSource(_triton_loop, {**SIGNATURE, "BN": "constexpr"},
                        {"G": G, "D": D, "BN": BN}, ALIGNED)  # fmt: skip
        options = {"num_warps": WARPS, "num_stages": 2}
    else:
        src = gluon.GluonASTSource(_gluon_loop, SIGNATURE, {"G": G, "D": D}, ALIGNED)
        options = {"num_warps": WARPS}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    loop = read.sass_loops(read._cubin_text(kernel.asm["cubin"], "nvdisasm", "-c"))[0]
    opcodes = Counter(x.split()[0].split(".")[0] for x in loop.instructions)
    usage = read.resources(kernel.asm["cubin"])
    return dict(formulation=name, shape="32/8/128", block_n=BN, num_warps=WARPS,
                registers=usage["REG"], stack=usage["STACK"],
                loop_instructions=len(loop.instructions),
                per_position=round(len(loop.instructions) * WARPS / BN, 1),
                loop_opcodes=dict(opcodes.most_common()))  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    try:
        kernel_budget.check_triton()
    except kernel_budget.BudgetError as e:
        print(f"kernel_floor: {e}", file=sys.stderr)
        return 2
    rows = [measure(name) for name in ("triton", "gluon")]
    print("| formulation | registers | loop instr. | per position | top opcodes |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["loop_opcodes"].items())[:8])
        print(f"| {r['formulation']} | {r['registers']} | {r['loop_instructions']} | "
              f"{r['per_position']} | {top} |")  # fmt: skip
    if args.out:
        record = dict(triton=triton.__version__, arch="sm_90", rows=rows)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
