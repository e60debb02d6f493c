"""Kernels compiled for a GPU and executed on the CPU by support.ptx_cta, in a process of their
own (the tests' process sets TRITON_INTERPRET=1, under which no kernel compiles): each command
prints one JSON object, what the tests assert on.

    python tests/support/ptx_runs.py anchor           Triton's own tl.dot lowering against torch
    python tests/support/ptx_runs.py decode ARCH      decode_attention on every DECODE_CASES case
    python tests/support/ptx_runs.py gluon ARCH       the same with kernels.decode_gluon's tiles
    python tests/support/ptx_runs.py skeleton         benchmarks/kernel_floor.py's Gluon loops
"""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS.parent / "benchmarks")]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from support import ptx_cta  # noqa: E402


def executed(*command: str) -> dict:
    """This script's JSON for `command`, run in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "runtime"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, *command], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@triton.jit
def _attention(Q, K, V, OUT, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    m, n, d = tl.arange(0, M), tl.arange(0, N), tl.arange(0, D)
    q = tl.load(Q + m[:, None] * D + d[None, :])
    k = tl.load(K + n[:, None] * D + d[None, :])
    v = tl.load(V + n[:, None] * D + d[None, :])
    s = tl.dot(q, tl.trans(k))
    p = tl.exp2(s - tl.max(s, axis=1)[:, None])
    tl.store(OUT + m[:, None] * D + d[None, :], tl.dot(p.to(tl.float16), v) / tl.sum(p, 1)[:, None])


def anchor() -> dict:
    """Attention of 16 queries over 64 keys of 32 channels by Triton's own lowering (mma.sync,
    ldmatrix and its transpose, stmatrix, warp shuffles), on 1 and 4 warps for sm_80 and
    sm_90: the largest error against torch in fp32 on the same fp16 operands, and the
    reference's scale."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, 32, generator=gen).half() for s in (16, 64, 64))
    s = q.float() @ k.float().T
    p = torch.exp2(s - s.max(1, keepdim=True).values)
    ref = (p.half().float() @ v.float()) / p.sum(1, keepdim=True)
    out = {}
    for arch in (80, 90):
        for warps in (1, 4):
            got = torch.zeros(16, 32)
            with ptx_cta.launches_executed(arch):
                _attention[(1,)](q, k, v, got, M=16, N=64, D=32, num_warps=warps)
            out[f"sm_{arch}, {warps} warps"] = float((got - ref).abs().max())
    return {"errors": out, "scale": float(ref.abs().max())}


def decode(arch: int, prmt_reversed: bool = False) -> dict:
    """decode_attention through the executor on each case: its error against the reference in
    float64 and the bound (twice the reference's own error in fp16). `prmt_reversed`: an
    executor whose byte permute reads its two sources the wrong way round (what the tests use
    to show the comparison sees the packed lookups)."""
    from kvcalib_runtime.kernels import decode_attention as dec
    from support.decode_cases import DECODE_CASES, decode_inputs, reference

    if prmt_reversed:
        prmt = ptx_cta.Cta._prmt
        ptx_cta.Cta._prmt = lambda self, op, ops, active: prmt(
            self, op, [ops[0], ops[2], ops[1], ops[3]], active
        )
    out = {}
    for case in DECODE_CASES if not prmt_reversed else ["kvcalib-2 G4 D128"]:
        args, options = decode_inputs(case, torch.Generator().manual_seed(1))
        exact = reference(args, options, dtype=torch.float64)
        bound = 2 * (reference(args, options).double() - exact).abs().max()
        with ptx_cta.launches_executed(arch):
            ours = dec.decode_attention(*args, **options)
        out[case] = {"error": float((ours.double() - exact).abs().max()), "bound": float(bound)}
    return out


def gluon(arch: int, copies_late: bool = False) -> dict:
    """decode_attention with kernels.decode_gluon's whole tiles (as on a GPU) on each of
    GLUON_CASES, three sequences of 1,090, 700 and 130 positions: its error against the
    reference in float64, the bound, and the error of the same launch without the Gluon
    kernel's splits (their rows left empty: what its tiles add). `copies_late`: an executor
    whose cp.async.wait_group leaves one group more in flight than it says (what the tests use
    to show the comparison sees the kernel read its tiles after their copies land)."""
    from kvcalib_runtime.kernels import decode_attention as dec
    from kvcalib_runtime.kernels import decode_gluon
    from support.decode_cases import GLUON_CASES, decode_inputs, reference

    if copies_late:
        cp = ptx_cta.Cta._cp
        ptx_cta.Cta._cp = lambda self, op, ops, active: cp(
            self, op, [str(int(ops[0], 0) + 1)] if op[2] == "wait_group" else ops, active
        )

    def skipped(q, ks, vs, k_layout, v_layout, sinks, inv_freq, part, stats, splits, first, *_):
        part[:, :, first:] = 0
        stats[:, :, first:, 0] = float("-inf")
        stats[:, :, first:, 1] = 0

    decode_gluon.runs_on = lambda device: True
    launch = decode_gluon.launch
    out = {}
    for case in GLUON_CASES:
        args, options = decode_inputs(f"gluon: {case}", torch.Generator().manual_seed(3),
                                      lengths=(1090, 700, 130))  # fmt: skip
        exact = reference(args, options, dtype=torch.float64)
        bound = 2 * (reference(args, options).double() - exact).abs().max()
        errors = []
        for body in (launch, skipped):
            decode_gluon.launch = body
            with ptx_cta.launches_executed(arch):
                ours = dec.decode_attention(*args, **options)
            errors.append(float((ours.double() - exact).abs().max()))
        out[case] = {"error": errors[0], "without": errors[1], "bound": float(bound)}
    return out


def skeleton() -> dict:
    """kernel_floor's Gluon loops (with and without kvcalib-2's features, keys after and before
    RoPE, and 4-bit codebooks) over 256 positions: each one's error against the attention it
    computes, and the scale."""
    import kernel_floor as kf
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon

    from support.floor_cases import skeleton_args, skeleton_inputs, skeleton_reference

    out = {}
    for name in kf.FORMULATIONS[1:]:
        signature = {k: v for k, v in kf.SIGNATURE.items() if v != "constexpr"}
        signature.update(kf.FEATURE_ARGS, **dict.fromkeys(kf.CONSTANTS, "constexpr"))
        constants = kf.constants(name)
        src = gluon.GluonASTSource(kf._gluon_loop, signature, constants,
                                   {**kf.ALIGNED, (13,): [["tt.divisibility", 16]]})  # fmt: skip
        with knobs.compilation.scope():
            knobs.compilation.always_compile = True
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": kf.WARPS})  # fmt: skip
        gen = torch.Generator().manual_seed(2)
        n = 256
        (q, kc, vc, table), meta, keys, values = skeleton_inputs(gen, n, kf.D, kf.G,
                                                                 constants["BITS"])  # fmt: skip
        expected = skeleton_reference(q, keys, values, meta, constants["FEATURES"],
                                      constants["PRE_ROPE"])  # fmt: skip
        got = torch.zeros(kf.G, kf.D)
        ptx_cta.run_kernel(kernel, skeleton_args(q, kc, vc, table, meta, got, n))
        out[name] = {"error": float((got - expected).abs().max()),
                     "scale": float(expected.abs().max())}  # fmt: skip
    return out


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "anchor":
        result = anchor()
    elif command == "decode":
        result = decode(int(sys.argv[2]), prmt_reversed="--prmt-reversed" in sys.argv)
    elif command == "gluon":
        result = gluon(int(sys.argv[2]), copies_late="--copies-late" in sys.argv)
    else:
        result = skeleton()
    print(json.dumps(result))
