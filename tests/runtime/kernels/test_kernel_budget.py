"""The decode kernel held to its budget on a CPU (issue 51).

`make kernel-budget` compiles every decode-kernel variant for sm_90 (Triton's own binder, its
bundled ptxas and cuobjdump) and commits benchmarks/kernel_budget/budget.json. Here the quick set
(kvcalib-2, the full-precision stream, kvcalib-4, -3 and -1.5 at 32/8/128, keys pre- and
post-RoPE, the configuration the launcher picks untuned) is compiled again and compared with
it: registers and loop warp-instructions per position may not grow by more than 3%, spills,
stack, local-memory accesses and synchronous loads in the loop not at all, resident warps may
not drop. A gain
beyond the same tolerances fails too, until `make kernel-budget` is run and its table
committed: so each improvement of the kernel tightens the budget this test holds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BUDGET = ROOT / "benchmarks" / "kernel_budget" / "budget.json"
sys.path.insert(0, str(ROOT / "benchmarks"))

import budget_read as read  # noqa: E402
import budget_report as report  # noqa: E402
import kernel_budget as kb  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;              /* 0x000 */
        /*0010*/                   LDL R2, [R1] ;                      /* 0x000 */
        /*0020*/                   FFMA R2, R2, R2, R2 ;               /* 0x000 */
        /*0030*/               @P0 BRA 0x10 ;                          /* 0x000 */
        /*0040*/                   STL [R1], R2 ;                      /* 0x000 */
        /*0050*/              @!P1 BRA 0x40 ;                          /* 0x000 */
        /*0060*/                   BRA 0x80 ;                          /* 0x000 */
        /*0070*/                   EXIT ;                              /* 0x000 */
"""


def test_without_a_tag_the_steady_loop_is_the_largest_backward_branch():
    """Backward branches only (the forward BRA 0x80 is not a loop), the largest first, its body
    from the target to the branch, predicates stripped."""
    loops = read.sass_loops(SASS)
    assert [len(x.instructions) for x in loops] == [3, 2]
    assert read.steady_loop(loops, None).instructions == (
        "LDL R2, [R1]", "FFMA R2, R2, R2, R2", "BRA 0x10",
    )  # fmt: skip


KERNEL = "/k/decode_attention.py"
NVDISASM = f"""
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
\t//## File "{KERNEL}", line 210
        /*0010*/                   LDG.E.U8 R2, desc[UR4][R4.64] ;
\t//## File "/k/tiles.py", line 148 inlined at "{KERNEL}", line 220
        /*0020*/                   FFMA R3, R2, R2, R3 ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
\t//## File "{KERNEL}", line 213
        /*0040*/                   LDG.E.U8 R2, desc[UR4][R4.64] ;
        /*0050*/                   STL [R1], R2 ;
\t//## File "/k/tiles.py", line 148 inlined at "{KERNEL}", line 220
        /*0060*/                   FFMA R3, R2, R2, R3 ;
        /*0070*/              @!P1 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_the_steady_loop_is_the_loop_holding_the_tagged_line():
    """nvdisasm's labels and line comments (inlined call sites included): the whole-tile loop
    (tagged line 210) is the steady one though the mixed loop (line 213) is larger; a tag no
    loop holds falls back to the largest loop."""
    loops = read.sass_loops(NVDISASM)
    assert [len(x.instructions) for x in loops] == [4, 3]
    steady = read.steady_loop(loops, (KERNEL, 210))
    assert steady.instructions[0] == "LDG.E.U8 R2, desc[UR4][R4.64]"
    assert len(steady.instructions) == 3 and (KERNEL, 220) in steady.lines
    assert read.steady_loop(loops, (KERNEL, 999)) is loops[0]


def test_the_decode_kernel_tags_its_whole_tile_loop():
    """One line of `_decode_split_kernel` carries the tag: the unmasked is-sink load that only
    the whole-tile loop (phase 0) runs."""
    from kvcalib_runtime.kernels import decode_kernel

    path, line = read.marker(decode_kernel._decode_split_kernel)
    assert Path(path).name == "decode_kernel.py"
    text = Path(path).read_text().splitlines()[line - 1]
    assert read.STEADY in text and "tl.load(SINKS.is_sink" in text and "mask" not in text


def test_the_gluon_whole_tiles_tag_their_loop():
    """kernels.decode_gluon's kernel tags the copy of the next tile's key codes: only its
    loop over whole tiles runs it."""
    from kvcalib_runtime.kernels import decode_gluon

    if not decode_gluon.available():
        pytest.skip("kernels.decode_gluon is written for another Triton's Gluon")
    path, line = read.marker(decode_gluon._body_kernel)
    text = Path(path).read_text().splitlines()[line - 1]
    assert read.STEADY in text and "async_copy.async_load(next_k, k_at" in text


TTGIR = """
    %a = tt.load %p : !tt.ptr<i64>
    %r:2 = scf.for %i = %lo to %hi step %c64 iter_args(%x = %y) -> (i32) {
      %w = ttg.async_copy_global_to_local %q, %b mask %m : tensor<64x4x!tt.ptr<i32>, #b> \
-> <64x4xi32, #s, #smem, mutable>
      %s = tt.load %k : tensor<64x!tt.ptr<i8>, #b1>
      %t = tt.load %k2 : !tt.ptr<f32>
      scf.yield %x
    }
    %z = tt.load %p2 : tensor<4x!tt.ptr<f16>, #b2>
"""


def test_loads_in_loops_are_read_from_the_ttgir():
    """An async copy of 64x4 int32 words (1 KB a tile) and one synchronous tensor load in the
    loop; scalar loads and loads outside the loop are not counted."""
    assert read.ttgir_loops(TTGIR) == [dict(async_copies=1, async_bytes=1024, sync_loads=1)]


@pytest.mark.parametrize(("regs", "warps", "shared", "ctas"),
                         [(208, 8, 14848, 1), (128, 4, 14848, 4), (102, 8, 34 * 1024, 2),
                          (64, 4, 100 * 1024, 2), (32, 1, 0, 32)])  # fmt: skip
def test_occupancy_counts_registers_shared_memory_and_slots(regs, warps, shared, ctas):
    """H100: 65,536 registers (256 a warp at a time), 228 KB shared, 64 warps, 32 CTAs."""
    assert read.occupancy(regs, warps, shared, kb.GPUS[90]) == ctas


@pytest.mark.parametrize(("shape", "wide"), [("32/8/128", True), ("14/2/64", False)])
@pytest.mark.parametrize("pre", [True, False])
def test_the_untuned_launch_is_the_budgets_rule(shape, wide, pre):
    """decode_config.UNTUNED (what a CUDA graph captured before any eager step launches, by key
    position and head size) follows the rule its comment states, held to the committed budget
    (every candidate compiled for every preset at that shape on sm_90): of the candidates whose
    largest spill over the presets is smallest, the fewest kvcalib-2 warp-instructions per
    position."""
    from kvcalib_runtime.kernels import decode_config as cfg

    keys = "pre-RoPE" if pre else "post-RoPE"
    rows = [r for r in json.loads(BUDGET.read_text())["rows"]
            if (r["arch"], r["shape"], r["keys"], r["paged"]) == ("sm_90", shape, keys, False)
            and "skipped" not in r and r["kernel"] == "_decode_split_kernel"]  # fmt: skip
    by_config = {}
    for r in rows:
        by_config.setdefault((r["block_n"], r["num_warps"], r["num_stages"]), []).append(r)
    assert sorted(by_config) == sorted(cfg.CONFIGS)  # every candidate compiled
    assert all(len(found) == len(kb.RECIPES) for found in by_config.values())
    spill = {c: max(r["spill_bytes"] for r in found) for c, found in by_config.items()}
    ours = {c: next(r["per_position"] for r in found if r["recipe"] == "kvcalib-2")
            for c, found in by_config.items()}  # fmt: skip
    least = min(spill.values())
    best = min((c for c in by_config if spill[c] == least), key=ours.get)
    assert best == cfg.UNTUNED[pre, wide]


def test_held_fails_a_regression_and_a_gain_left_uncommitted():
    row = dict(arch="sm_90", recipe="kvcalib-2", shape="32/8/128", keys="post-RoPE", paged=False,
               kernel="_decode_split_kernel", chosen=True, registers=200, per_position=100.0,
               per_position_largest_loop=110.0, spill_bytes=0, stack=0, loop_local=0,
               loop_sync_loads=5, warps_per_sm=8)  # fmt: skip
    assert kb.held([row], [row]) == ([], [])
    assert kb.held([{**row, "registers": 205}], [row]) == ([], [])  # within 3%
    worse, _ = kb.held([{**row, "registers": 210, "loop_local": 2}], [row])
    assert len(worse) == 2 and "registers 210 (budget 200)" in worse[0]
    _, better = kb.held([{**row, "per_position": 30.0, "warps_per_sm": 16}], [row])
    assert len(better) == 2
    assert kb.held([row], [{**row, "keys": "pre-RoPE"}])[0] == [
        "sm_90 kvcalib-2 32/8/128 post-RoPE (Triton): not in the committed budget"
    ]


def test_a_stopped_sweep_resumes_from_the_rows_it_kept(tmp_path, monkeypatch):
    """A sweep takes an hour or more of one core: a variant whose rows were kept from today's
    sources is not compiled again, one kept from other sources is, and the whole table holds
    both; the kept rows go once the table is written."""
    pytest.importorskip("kvcalib.core.recipe", reason="the sources' digest reads the toolkit's")
    import triton

    if triton.__version__ != kb.TRITON:
        pytest.skip(f"the sweep refuses Triton {triton.__version__}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the sweep drops it: restored after
    two = kb.variants(True)[:2]
    compiled = []

    def measure(v, out):
        compiled.append(v.name)
        return [dict(arch=f"sm_{v.arch}", recipe=v.recipe, shape=v.shape, keys=v.keys,
                     paged=v.paged, skipped=f"measured {v.name}")]  # fmt: skip

    monkeypatch.setattr(kb, "measure", measure)
    monkeypatch.setattr(kb, "variants", lambda quick: two)
    rows = tmp_path / "rows"
    rows.mkdir()
    for v, source in zip(two, (kb.source_digest(), "another"), strict=True):
        row = dict(arch=f"sm_{v.arch}", recipe=v.recipe, shape=v.shape, keys=v.keys,
                   paged=v.paged, skipped=f"kept {v.name}")  # fmt: skip
        (rows / f"{v.name}.json").write_text(json.dumps(dict(source=source, rows=[row])))
    assert kb.main(["--out", str(tmp_path)]) == 0
    assert compiled == [two[1].name]
    table = [r["skipped"] for r in json.loads((tmp_path / "budget.json").read_text())["rows"]]
    assert table == [f"kept {two[0].name}", f"measured {two[1].name}"]
    assert not rows.exists()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> list[dict]:
    """The quick set compiled now, in a process of its own: the kernels must compile for
    sm_90, not run in the interpreter the other tests set up. Its 18 rows took 347 s on this
    project's 2-core machine alone, and over 600 s beside a concurrent sweep: the limit is a
    hang's, not a speed's."""
    pytest.importorskip("kvcalib.core.recipe", reason="the presets are read by the toolkit")
    import triton

    committed = json.loads(BUDGET.read_text())
    if triton.__version__ != committed["triton"]:
        pytest.skip(f"the budget was read with Triton {committed['triton']}, this is "
                    f"{triton.__version__}: registers differ across compilers")  # fmt: skip
    out = tmp_path_factory.mktemp("budget")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "runtime"),
                                         env.get("PYTHONPATH", "")])  # fmt: skip
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_budget.py"),
                           "--quick", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "budget.json").read_text())["rows"]


@pytest.mark.parametrize(("keys", "most", "gathers"),
                         [("post-RoPE", 30.0, 1), ("pre-RoPE", 36.0, 3)])  # fmt: skip
def test_kvcalib2s_whole_tiles_meet_issue_51s_targets(keys, most, gathers):
    """The committed budget (which the next test holds the compiled kernel to) meets the
    issue's targets for kvcalib-2 at 32/8/128 on sm_90, the Gluon tiles as launched: at most
    30 loop warp-instructions a position after RoPE and 36 before, at most 128 registers (four
    programs of 4 warps an SM, 16 warps), no spill, no local memory in the loop, and every
    per-position stream through the pipeline: three copies a tile (codes of keys and values,
    the one-byte streams), the loop's only other loads the gathers by the slot's index (its
    q_c s_c, and before RoPE its partner's and its frequency)."""
    rows = json.loads(BUDGET.read_text())["rows"]
    (row,) = [r for r in rows if r.get("kernel") == "_body_kernel" and r["arch"] == "sm_90"
              and r["recipe"] == "kvcalib-2" and r["shape"] == "32/8/128" and r["keys"] == keys
              and r["chosen"]]  # fmt: skip
    assert row["per_position"] <= most
    assert row["registers"] <= 128 and row["warps_per_sm"] >= 16
    assert row["spill_bytes"] == 0 and row["loop_local"] == 0
    assert row["loop_async_loads"] == 3 and row["loop_sync_loads"] == gathers


@pytest.mark.parametrize("recipe", ["kvcalib-3", "kvcalib-4", "kvcalib-1.5"])
@pytest.mark.parametrize("keys", ["post-RoPE", "pre-RoPE"])
def test_the_other_presets_whole_tiles_are_within_issue_51s_bound_of_kvcalib2s(keys, recipe):
    """The committed budget's Gluon tiles for kvcalib-3, kvcalib-4 (3- and 4-bit codebooks
    through tables of level pairs, fp16 slot deltas and value scales) and kvcalib-1.5 (6-bit
    vector indices, one codebook entry a load) at 32/8/128 on sm_90 issue at most 1.5 times
    kvcalib-2's loop warp-instructions a position, with no spill, no local memory in the loop,
    and the same pipeline: three copies a tile, the same gathers by the slot's index (none
    for kvcalib-1.5, which has no slot)."""
    rows = [r for r in json.loads(BUDGET.read_text())["rows"]
            if r.get("kernel") == "_body_kernel" and r["arch"] == "sm_90"
            and r["shape"] == "32/8/128" and r["keys"] == keys and r["chosen"]]  # fmt: skip
    (two,) = [r for r in rows if r["recipe"] == "kvcalib-2"]
    (wide,) = [r for r in rows if r["recipe"] == recipe]
    assert wide["per_position"] <= 1.5 * two["per_position"]
    assert wide["spill_bytes"] == 0 and wide["loop_local"] == 0
    assert wide["loop_async_loads"] == 3
    assert wide["loop_sync_loads"] == (0 if recipe == "kvcalib-1.5" else two["loop_sync_loads"])


def test_the_decode_kernel_holds_its_committed_budget(fresh):
    committed = json.loads(BUDGET.read_text())["rows"]
    # kvcalib-2's, -4's, -3's and -1.5's Triton kernel and Gluon whole tiles, the
    # full-precision stream's Triton kernel
    assert len(fresh) == 18 and all(r["chosen"] for r in fresh)
    worse, better = kb.held(fresh, committed)
    assert not worse, "the decode kernel exceeds its budget:\n" + "\n".join(worse)
    assert not better, (
        "the decode kernel beats its budget: run `make kernel-budget` and "
        "commit benchmarks/kernel_budget/ to hold the gain:\n" + "\n".join(better)
    )


def test_the_budget_is_read_with_tritons_own_tools(fresh):
    """ptxas and cuobjdump from Triton's wheel (a system /usr/local/bin/ptxas would read
    another compiler's registers): `check_triton` refuses anything else before compiling."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    bundled = Path(triton.__file__).resolve().parent
    assert bundled in Path(get_ptxas(90).path).resolve().parents
    assert bundled in Path(read.tool("cuobjdump")).resolve().parents
    assert all(r["registers"] > 0 and r["loop_instructions"] > 0 for r in fresh)


def _script(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "runtime"),
                                         env.get("PYTHONPATH", "")])  # fmt: skip
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_gpu_check_refuses_a_machine_without_cuda_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = _script("benchmarks/gpu_check.py")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr


def test_gpu_check_dry_run_builds_its_gpu_steps():
    """`gpu_check.py --dry-run`: step 3 launches the quick set's decode kernels (intercepted)
    and finds each configuration's CPU registers in the committed budget.json; step 4 builds
    the runtime's Qwen2.5-0.5B with a kvcalib-2 cache and transformers' with an fp16 one (on
    the meta device)."""
    pytest.importorskip("kvcalib.core.recipe", reason="the presets are read by the toolkit")
    pytest.importorskip("transformers", reason="step 4 times transformers' Qwen2")
    done = _script("benchmarks/gpu_check.py", "--dry-run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    budget = {kb.key(r): r for r in json.loads(BUDGET.read_text())["rows"] if r.get("chosen")}
    rows = [
        line.split(" | ") for line in done.stdout.splitlines() if line.endswith("| dry run |  |")
    ]
    # kvcalib-2's, -4's, -3's and -1.5's Triton and Gluon kernels, the stream's Triton kernel
    assert len(rows) == 18, done.stdout
    names = {v: k for k, v in report.KERNELS.items()}
    for cells in rows:
        recipe, shape, keys, kernel, config, cpu = cells[0].strip("| "), *cells[1:6]
        held = budget[("sm_90", recipe, shape, keys, False, names[kernel])]
        assert config == f"{held['block_n']}, {held['num_warps']}, {held['num_stages']}"
        assert int(cpu) == held["registers"]
    assert "| Qwen2.5-0.5B | 16384 | 16 | dry run: runtime cache QuantizedCache" in done.stdout
