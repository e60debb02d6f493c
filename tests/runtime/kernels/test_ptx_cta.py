"""The kernels as a GPU runs them, executed on the CPU (support.ptx_cta): compiled for sm_80 /
sm_90 through Triton's own binder, their PTX run instruction by instruction for every thread of
every CTA, on the CPU tensors. The interpreter (TRITON_INTERPRET=1, every other kernel test)
runs the kernels' Python and takes `PACKED=False`; here the compiled PTX runs, inline assembly
(the packed lookups), layouts, tensor-core fragments and all.

- The executor's semantics are Triton's: its own lowering of tl.dot (mma.sync, ldmatrix and its
  transpose, stmatrix, shuffles) gives what torch gives.
- decode_attention compiled for sm_80 (the same source and inline PTX as sm_90, whose wgmma the
  executor does not define) meets, on every decode case, the rule the interpreter's test holds
  it to (test_kernels.py): its error against the float64 reference at most twice the fp16
  reference's. An executor whose byte permute reads its sources the wrong way round misses it
  by three orders of magnitude: the rule sees the packed lookups.
- With kernels.decode_gluon's whole tiles (kvcalib-2's layout at 128 channels, keys before and
  after RoPE), decode_attention meets the same rule over sequences of 1,090, 700 and 130
  positions (the Gluon kernel reads 1,024, 640 and 64 of them); without the Gluon kernel's
  splits it misses the rule by two orders of magnitude: the tiles it reads are checked. So does
  an executor whose copies land one tile late: the kernel's waits are checked.
"""

import sys
from pathlib import Path

import pytest
from support.decode_cases import DECODE_CASES, GLUON_CASES
from support.ptx_runs import executed

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_budget as kb  # noqa: E402
import triton  # noqa: E402

if triton.__version__ != kb.TRITON:  # the executor binds launches through Triton's internals
    pytest.skip(f"support.ptx_cta binds launches as Triton {kb.TRITON} does, this is "
                f"{triton.__version__}", allow_module_level=True)  # fmt: skip


@pytest.fixture(scope="module")
def decoded():
    return executed("decode", "80")


def test_tritons_own_mma_lowering_computes_what_torch_computes():
    """Attention of 16 queries over 64 keys by Triton's tl.dot on 1 and 4 warps, sm_80 and
    sm_90: within 1e-4 of the largest output (both sides fp32 over the same fp16 operands; the
    executor accumulates in fp64, the tensor cores in fp32)."""
    result = executed("anchor")
    for config, error in result["errors"].items():
        assert error <= 1e-4 * result["scale"], config


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_attention_as_compiled_for_a_gpu_meets_the_flash_rule(case, decoded):
    assert decoded[case]["error"] <= decoded[case]["bound"], decoded[case]


def test_a_wrong_byte_permute_breaks_the_rule():
    broken = executed("decode", "80", "--prmt-reversed")["kvcalib-2 G4 D128"]
    assert broken["error"] > 100 * broken["bound"]


def test_the_gluon_whole_tiles_meet_the_flash_rule():
    result = executed("gluon", "80")
    assert set(result) == set(GLUON_CASES)
    for case, r in result.items():
        assert r["error"] <= r["bound"], (case, r)
        assert r["without"] > 100 * r["bound"], (case, r)


def test_the_gluon_tiles_are_read_after_their_copies_land():
    """An executor whose cp.async.wait_group leaves one group more in flight (each tile read
    before its copy lands: the previous tile's codes, or zeros) misses the rule by two orders
    of magnitude: the rule sees the pipeline's waits."""
    for case, r in executed("gluon", "80", "--copies-late").items():
        assert r["error"] > 100 * r["bound"], (case, r)
