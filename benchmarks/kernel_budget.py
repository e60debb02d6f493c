"""The decode kernel's budget read on a CPU: registers, spills, occupancy and the steady-state
loop's instructions per (position x KV head) of every variant the presets launch, for sm_90
(and sm_80), without a GPU (issue 51).

    python benchmarks/kernel_budget.py --out benchmarks/kernel_budget    # make kernel-budget
    python benchmarks/kernel_budget.py --out DIR --quick                 # the budget test's set

It compiles whatever `kvcalib_runtime` is first on the path. Each variant's inputs are the
runtime's own: one layer of the preset's scheme (its first layer's recipe, keys pre- or
post-RoPE) as a `QuantizedCache` on the meta device (the paged variant: vLLM's page layout,
`kvcalib_vllm.pages`), handed to `decode_attention` as FakeTensors on "cuda" while the host
believes it is an H100 (132 SMs; an A100's 108 for sm_80). Every kernel launch is intercepted
and compiled through Triton's own binder (`create_function_from_signature` ->
`JITFunction._pack_args` -> `triton.compile`), so the alignment attributes are a real launch's.
The launcher tunes (BLOCK_N, warps, stages) by timing on a GPU at first use: every candidate it
times is compiled at 32/8/128 and 14/2/64 (heads of 128 and of 64 channels) on sm_90
(`chosen` marks the one it launches under CUDA-graph capture before tuning, the only choice
made without a GPU, `decode_config.UNTUNED`); elsewhere only that one.

A row is one kernel's: the Triton decode kernel's, and where kvcalib-2's layout at 128 channels
a head lets the launcher hand the body's whole tiles to kernels.decode_gluon, the Gluon
kernel's as well (`kernel`; the Triton kernel then reads only what follows those tiles, and its
row there describes that remainder's launch). The combine tags no loop and has no row.

Per launch: registers and stack (`cuobjdump --dump-resource-usage`), spills (the ptxas log),
shared memory (`metadata.shared` + static), occupancy (warps and CTAs per SM from registers,
shared memory and the SM's limits), programs per SM of the grid the launcher picks at 4K and 32K
x batch 1 and 16, the steady-state loop (its instructions and opcode histogram), per_position
= loop instructions x warps / BLOCK_N, LDL/STL in any loop, and from the TTGIR the per-tile
loads inside loops: `ttg.async_copy_global_to_local` (pipelined) against synchronous tensor
`tt.load`s; bytes in flight per SM = CTAs/SM x stages x the async bytes of one iteration of
that loop. It writes DIR/budget.json, DIR/budget.md and each variant's cubin (not committed:
~0.5 MB each). A sweep stopped anywhere resumes: until the table is whole, each variant's rows
are kept under DIR/rows/ (committed as they come, as the long benchmarks' cells are) with the
digest of the sources they were read from (`source_digest`), and a row whose sources changed is
read again.

The steady-state loop is the SASS loop (a backward branch of `nvdisasm -g`) holding an
instruction of the kernel's source line tagged `# budget: steady loop` (`budget_read.STEADY`):
the decode kernel tags a line only its whole-tile loop runs, the loop whose trip count grows
with the context. The first budget (2026-12-05) took the largest backward branch instead; since
the masked tail became a loop of its own (16-row tiles where the body meets the ring, once per
program), that rule counts the tail. Both are written: per_position (the tagged loop) and
per_position_largest_loop (the old rule, instructions x warps / BLOCK_N of the largest loop);
the change of rule is a change of measurement, not of the kernel. A kernel with no tagged
line, or whose tagged line no loop holds, is read by the old rule (steady_loop: "largest").

Triton internals are read, so the version is pinned (TRITON): another one is refused.
"""

import argparse
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_read as read
import budget_report as report

TRITON = "3.9.0"
# (name, SMs, registers/SM, warps/SM, CTAs/SM, shared bytes/SM) of the GPU each arch is read for
GPUS = {90: ("H100 SXM", 132, 65536, 64, 32, 228 * 1024),
        80: ("A100", 108, 65536, 64, 32, 164 * 1024)}  # fmt: skip
SHAPES = {"32/8/128": "Llama-3-8B", "14/2/64": "Qwen2.5-0.5B", "9/3/64": "SmolLM2-135M"}
RECIPES = ("kvcalib-2", "kvcalib-3", "kvcalib-4", "kvcalib-1.5", "full-precision")
LOADS = ((4096, 1), (4096, 16), (32768, 1), (32768, 16))  # (context, batch): programs_per_sm
COMPILED_AT = (32768, 16)  # the load whose launch is compiled
PAGE = 16  # vLLM's default block_size
ROPE_THETA = 500000.0  # Llama-3's (what is compiled does not depend on it)


class BudgetError(Exception):
    """A setup the budget cannot be read under (one line)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    arch: int
    recipe: str
    shape: str
    pre_rope: bool
    paged: bool
    candidates: bool  # every config the launcher times, or only the one it launches untuned

    @property
    def keys(self) -> str:
        return "pre-RoPE" if self.pre_rope else "post-RoPE"

    @property
    def name(self) -> str:
        """The file stem of its rows kept under DIR/rows/ while a sweep is under way."""
        where = f"{'pre' if self.pre_rope else 'post'}{'-paged' if self.paged else ''}"
        spread = "-candidates" if self.candidates else ""
        return f"sm{self.arch}-{self.recipe}-{self.shape.replace('/', '_')}-{where}{spread}"


def variants(quick: bool) -> list[Variant]:
    """The quick set (the test's): kvcalib-2, the full-precision stream, kvcalib-4, -3 and -1.5
    at 32/8/128 on sm_90 (the last three last: `make gpu-check` reads their registers if time
    is left).
    The sweep: every recipe, shape and key position, contiguous and paged, sm_90 and sm_80."""
    if quick:
        return [Variant(90, r, "32/8/128", pre, False, False)
                for r in ("kvcalib-2", "full-precision", "kvcalib-4", "kvcalib-3", "kvcalib-1.5")
                for pre in (True, False)]  # fmt: skip
    out = []
    for arch in GPUS:
        for shape in SHAPES:
            for recipe in RECIPES:
                for pre in (True, False):
                    spread = arch == 90 and shape in ("32/8/128", "14/2/64")
                    out.append(Variant(arch, recipe, shape, pre, False, spread))
                    if arch == 90:
                        out.append(Variant(arch, recipe, shape, pre, True, False))
    return out


def check_triton() -> None:
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    if triton.__version__ != TRITON:
        raise BudgetError(
            f"kernel_budget reads Triton {TRITON}'s internals; this is {triton.__version__}: "
            f"install triton=={TRITON} to read the budget"
        )
    bundled = Path(triton.__file__).resolve().parent
    for arch in GPUS:
        ptxas = Path(get_ptxas(arch).path).resolve()
        if bundled not in ptxas.parents:
            raise BudgetError(f"ptxas for sm_{arch} is {ptxas}, not Triton's bundled one: unset "
                              "TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH")  # fmt: skip
    for name in ("cuobjdump", "nvdisasm"):
        found = Path(read.tool(name)).resolve()
        if bundled not in found.parents:
            raise BudgetError(f"{name} is {found}, not Triton's bundled one: unset "
                              f"TRITON_{name.upper()}_PATH")  # fmt: skip


def source_digest() -> str:
    """sha256 of everything a row depends on: the runtime and the vLLM plugin first on the path
    (their kernels, caches and layouts), the toolkit's recipe code and the presets (a variant's
    scheme), this script and its SASS reader, and Triton's version. A sweep stopped anywhere
    resumes from the rows kept under DIR/rows/ whose digest is this one; any change to those
    sources measures every row again."""
    import triton

    import kvcalib_runtime

    here = Path(__file__).resolve().parent
    runtime = Path(kvcalib_runtime.__file__).resolve().parent
    toolkit = Path(importlib.util.find_spec("kvcalib.core").origin).parent
    roots = [runtime, runtime.parents[1] / "vllm_plugin" / "kvcalib_vllm", toolkit]
    files = [f for r in roots for f in sorted(r.rglob("*.py"))]
    files += sorted((here.parent / "recipes").glob("*.toml"))
    files += [here / "kernel_budget.py", here / "budget_read.py"]
    digest = hashlib.sha256(triton.__version__.encode())
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- the launcher's inputs ----------------------------------------------------------------------


def layer_scheme(recipe: str, pre_rope: bool):
    """(LayerScheme, Recipe) of the preset's first layer, keys moved to the asked position;
    "full-precision": kvcalib-2's cache rules with both tensors left exact."""
    from kvcalib.core.recipe import TensorRecipe, load_recipe
    from kvcalib.core.recipe import layer_scheme as scheme_of

    r = load_recipe("kvcalib-2" if recipe == "full-precision" else recipe)
    position = "pre_rope" if pre_rope else "post_rope"
    key, value = (
        (TensorRecipe(), TensorRecipe()) if recipe == "full-precision" else (r.key, r.value)
    )
    key = dataclasses.replace(key, position=position)
    return scheme_of(key, value, r.residual), r


def params_for(layer, recipe, hkv: int, d: int, params=None, index: int = 0):
    """Calibrated tensors of the right shapes for layer `index` (added to `params`): the
    kernel's speed does not depend on them."""
    from kvcalib_runtime.cache.scheme import KVParams

    params = KVParams() if params is None else params
    for name, spec, t in (("key", layer.key, recipe.key), ("value", layer.value, recipe.value)):
        if spec is None:
            continue
        if spec.layout.calibrated_range:
            getattr(params, f"{name}_range")[index] = (-torch.ones(hkv, d), torch.ones(hkv, d))
        if spec.codebook:
            heads = hkv if t.codebook_scope == "head" else 0
            if spec.layout.vectors:
                book = torch.rand(heads or 1, spec.levels, spec.group_size)
            else:
                book = torch.linspace(-1 if spec.symmetric else 0, 1, spec.levels)
                book = book.expand(heads, -1).contiguous() if heads else book
            getattr(params, f"{name}_codebook")[index] = book
    return params


def inputs(v: Variant, context: int, batch: int, device="meta"):
    """decode_attention's (args, kwargs) on `device` (meta: nothing allocated), as
    `QuantizedCache._decode` (or, paged, the vLLM plugin's `_decode`) passes them, for a cache
    of `context` positions (lengths 0: what is read does not change what is compiled)."""
    from kvcalib_runtime.cache.kvcache import QuantizedCache
    from kvcalib_runtime.cache.scheme import KVScheme
    from kvcalib_runtime.kernels.operands import Sinks
    from kvcalib_runtime.model.rope import Rope
    from kvcalib_runtime.model.transforms import Transforms

    heads, hkv, d = map(int, v.shape.split("/"))
    layer, recipe = layer_scheme(v.recipe, v.pre_rope)
    scheme = KVScheme((layer,), residual=recipe.residual, sinks_first=recipe.sinks_first,
                      sink_budget=recipe.sink_budget)  # fmt: skip
    params = params_for(layer, recipe, hkv, d)
    cache = QuantizedCache(scheme, params, Transforms.online(scheme, params), num_layers=1,
                           batch=batch, kv_heads=hkv, head_dim=d, max_len=context + 1,
                           device=device, dtype=torch.float16, use_kernels=False)  # fmt: skip
    keys, values = cache.keys[0].stored(), cache.values[0].stored()
    sinks = Sinks(cache.sink_k[0], cache.sink_v[0], cache.sink_pos, cache.is_sink)
    options = {}
    if v.pre_rope:
        options["inv_freq"] = Rope({"rope_theta": ROPE_THETA}, d).inv_freq.to(device)
    if v.paged:
        keys, values, options["block_table"] = pages(scheme, params, keys, values, batch, context)
    q = torch.zeros(batch, heads, 1, d, device=device, dtype=torch.float16)
    new = torch.zeros(batch, hkv, 1, d, device=device, dtype=torch.float16)
    return (q, new, new, keys, values, sinks, cache.lengths), options


def pages(scheme, params, keys, values, batch: int, context: int):
    """Keys' and values' bodies as views of vLLM's pages (every field of a token in one row,
    `kvcalib_vllm.pages`), and a block table int32 [batch, blocks per sequence]."""
    import kvcalib_runtime

    sys.path.insert(0, str(Path(kvcalib_runtime.__file__).resolve().parents[2] / "vllm_plugin"))
    from kvcalib_vllm.pages import PageLayout

    _, hkv, _, d = keys.tail.shape
    layout = PageLayout(scheme, params, kv_heads=hkv, head_dim=d, dtype=torch.float16)
    per_seq = -(-(context + 1) // PAGE)
    device = keys.tail.device
    raw = torch.zeros(batch * per_seq, PAGE, layout.row_bytes, dtype=torch.uint8, device=device)
    k_pages, v_pages = layout.tensors[0]
    table = torch.arange(batch * per_seq, dtype=torch.int32, device=device).view(batch, -1)
    return keys._replace(body=k_pages.body(raw)), values._replace(body=v_pages.body(raw)), table


def bytes_held(value) -> int:
    """Bytes of every distinct storage among the tensors of (nested) inputs: what a step over
    a full cache reads, partials aside."""
    seen = {}
    for t in read.tensors(value):
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


# -- the launch ----------------------------------------------------------------------------


def launch(v: Variant, context: int, batch: int, capturing: bool) -> list:
    """The decode kernels' launches (fn, args, kwargs, grid) for one step at (context, batch):
    those of every JIT function the launcher runs that tags a steady loop (the Triton kernel,
    and kernels.decode_gluon's whole tiles where they apply; not the combine), under a freshly
    loaded launch configuration (no tuning remembered)."""
    from kvcalib_runtime.kernels import decode_attention as dec
    from kvcalib_runtime.kernels import decode_config

    importlib.reload(decode_config)
    args, options = inputs(v, context, batch)
    launches = []
    with read.pretend_gpu(GPUS[v.arch][1], capturing, launches, v.arch) as mode:
        fake = read.to_fake(mode, (args, options))
        dec.decode_attention(*fake[0], **fake[1])
    return [x for x in launches if read.marker(x[0]) is not None]


def config_of(kwargs: dict) -> tuple:
    """A launch's configuration: its scalar keyword arguments (constexprs and options)."""
    return tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, int | str | bool)))


def measure(v: Variant, outdir: Path) -> list[dict]:
    """One row per configuration compiled for variant v."""
    try:
        layer_scheme(v.recipe, v.pre_rope)
    except ValueError as e:
        return [dict(arch=f"sm_{v.arch}", recipe=v.recipe, shape=v.shape, keys=v.keys,
                     paged=v.paged, skipped=str(e).splitlines()[0])]  # fmt: skip
    chosen = {fn.__name__: config_of(kwargs)  # each kernel's last launch under capture
              for fn, _, kwargs, _ in launch(v, *COMPILED_AT, capturing=True)}  # fmt: skip
    grids = {}  # (kernel, config) -> {load: grid}
    at = {}
    for context, batch in LOADS:
        for fn, args, kwargs, grid in launch(v, context, batch, capturing=False):
            config = (fn.__name__, config_of(kwargs))
            grids.setdefault(config, {})[f"{context // 1024}K x {batch}"] = grid
            if (context, batch) == COMPILED_AT:
                at[config] = (fn, args, kwargs)
    rows, bytes_read = [], bytes_held(inputs(v, *COMPILED_AT))
    for config, (fn, args, kwargs) in at.items():
        if not v.candidates and config[1] != chosen[fn.__name__]:
            continue
        config_name = "_".join(map(str, (read.block_n(kwargs), read.num_warps(kwargs),
                                          read.num_stages(kwargs))))  # fmt: skip
        where = f"{'pre' if v.pre_rope else 'post'}{'-paged' if v.paged else ''}"
        name = (f"sm{v.arch}-{v.recipe}-{v.shape.replace('/', '_')}-{where}-{config_name}"
                f"{'-gluon' if fn.__name__ == '_body_kernel' else ''}")  # fmt: skip
        started = time.monotonic()
        kernel, log = read.compiled(fn, args, kwargs, v.arch)
        (outdir / f"{name}.cubin").write_bytes(kernel.asm["cubin"])
        facts = read.facts(kernel, log, kwargs, GPUS[v.arch], read.marker(fn))
        programs = {load: math.prod(g) / GPUS[v.arch][1] for load, g in grids[config].items()}
        rows.append(dict(arch=f"sm_{v.arch}", recipe=v.recipe, shape=v.shape, keys=v.keys,
                         paged=v.paged, chosen=config[1] == chosen[fn.__name__],
                         kernel=fn.__name__,
                         **facts, programs_per_sm=programs, bytes_read_32k_x16=bytes_read,
                         cubin=f"{name}.cubin",
                         compile_s=round(time.monotonic() - started, 1)))  # fmt: skip
    rows.sort(key=lambda r: (r["kernel"], not r["chosen"], r["block_n"], r["num_warps"],
                             r["num_stages"]))  # fmt: skip
    return rows


def key(row: dict) -> tuple:
    """What a row is a budget for: the variant and the kernel (its chosen config is its
    budget)."""
    return row["arch"], row["recipe"], row["shape"], row["keys"], row["paged"], row["kernel"]


# what the budget test holds: (field, larger is worse, tolerance as a fraction of the committed)
HELD = (("registers", True, 0.03), ("per_position", True, 0.03),
        ("per_position_largest_loop", True, 0.03), ("spill_bytes", True, 0), ("stack", True, 0),
        ("loop_local", True, 0), ("loop_sync_loads", True, 0),
        ("warps_per_sm", False, 0))  # fmt: skip


def held(fresh: list[dict], committed: list[dict]) -> tuple[list[str], list[str]]:
    """(regressions, gains) of each fresh chosen row against the committed row of its variant,
    beyond HELD's tolerances; a variant the committed table lacks is a regression."""
    budget = {key(r): r for r in committed if r.get("chosen")}
    worse, better = [], []
    for row in (r for r in fresh if r.get("chosen")):
        where = " ".join(key(row)[:4]) + (" paged" if row["paged"] else "")
        where += f" ({report.KERNELS[row['kernel']]})"
        old = budget.get(key(row))
        if old is None:
            worse.append(f"{where}: not in the committed budget")
            continue
        for field, up_is_worse, tolerance in HELD:
            now, then = row[field], old[field]
            sign = 1 if up_is_worse else -1
            if sign * (now - then) > tolerance * then:
                worse.append(f"{where}: {field} {now} (budget {then})")
            elif sign * (then - now) > tolerance * then:
                better.append(f"{where}: {field} {now} (budget {then})")
    return worse, better


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="budget.json, budget.md, cubins")
    parser.add_argument("--results", action="store_true", help="only rewrite RESULTS.md's "
                        "budget section from DIR/budget.json")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="kvcalib-2, -3, -4, -1.5 and the "
                        "exact stream at 32/8/128, sm_90, the chosen config only")  # fmt: skip
    args = parser.parse_args(argv)
    if args.results:
        report.write_results(json.loads((args.out / "budget.json").read_text()))
        return 0
    os.environ.pop("TRITON_INTERPRET", None)  # the tests' setting: kernels must compile, not run
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # its default: fused
    try:
        check_triton()
    except BudgetError as e:
        print(f"kernel_budget: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    done, source = args.out / "rows", source_digest()
    done.mkdir(exist_ok=True)
    rows = []
    for v in variants(args.quick):
        cell = done / f"{v.name}.json"
        kept = json.loads(cell.read_text()) if cell.exists() else {}
        measured = kept.get("source") != source
        if measured:
            try:
                found = measure(v, args.out)
            except Exception as e:  # reported in the table, and the run exits 1
                failed = f"{type(e).__name__}: {e}".splitlines()[0]
                found = [dict(arch=f"sm_{v.arch}", recipe=v.recipe, shape=v.shape, keys=v.keys,
                              paged=v.paged, failed=failed)]  # fmt: skip
        else:
            found = kept["rows"]
        for row in found:
            print(report.summary(row), flush=True)
            row.pop("compile_s", None)  # this machine's load, not the kernel's
        if measured and not any("failed" in row for row in found):
            write_atomic(cell, json.dumps(dict(source=source, rows=found), indent=1) + "\n")
        rows += found
    import triton

    doc = dict(triton=TRITON, torch=torch.__version__, gpus={f"sm_{a}": g for a, g in GPUS.items()},
               loads=[f"{c // 1024}K x {b}" for c, b in LOADS],
               compiled_at=f"{COMPILED_AT[0] // 1024}K x {COMPILED_AT[1]}",
               ptxas={f"sm_{a}": read.ptxas_version(a) for a in GPUS}, rows=rows)  # fmt: skip
    assert triton.__version__ == TRITON
    (args.out / "budget.json").write_text(report.dumps(doc))
    (args.out / "budget.md").write_text(report.markdown(doc) + "\n")
    shutil.rmtree(done)  # the table is whole: the rows kept for a resumed sweep are in it
    counts = Counter(r["arch"] for r in rows)
    print(f"wrote {args.out}/budget.json and budget.md: {dict(counts)} rows", file=sys.stderr)
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
