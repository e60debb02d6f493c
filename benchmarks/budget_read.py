"""What `kernel_budget.py` reads from one intercepted launch: the compile through Triton's own
binder (sm_90 or sm_80, Triton's bundled ptxas and cuobjdump), then registers, spills, shared
memory, occupancy, the SASS of the steady-state loop and the TTGIR's loads; and the Markdown
it writes from the rows."""

import contextlib
import dataclasses
import io
import math
import re
import subprocess
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

# -- tensors of nested inputs -------------------------------------------------------------------


def _map(fn, value):
    """value with fn applied to every tensor in it (tuples, named tuples, dataclasses, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        items = [_map(fn, v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _map(fn, getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    return value


def tensors(value) -> list[torch.Tensor]:
    found = []
    _map(found.append, value)
    return found


def to_fake(mode, value):
    """Every tensor as a FakeTensor on "cuda" with its shape, strides and storage offset (a
    CPU tensor among them, such as a page layout's per-layer constants, too)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return _map(lambda t: FakeTensor(mode, t.to("meta"), torch.device("cuda", 0)), value)


def index(t: torch.Tensor, key):
    """t[key] through aten ops, for ints, slices, None, Ellipsis and one tensor: a FakeTensor on
    "cuda" cannot go through `Tensor.__getitem__` (its device guard) where torch has no CUDA."""
    key = key if isinstance(key, tuple) else (key,)
    if Ellipsis in key:
        at = key.index(Ellipsis)
        named = sum(1 for k in key if k is not None and k is not Ellipsis)
        key = key[:at] + (slice(None),) * (t.dim() - named) + key[at + 1 :]
    dim = 0
    for k in key:
        if k is None:
            t = t.unsqueeze(dim)
            dim += 1
        elif isinstance(k, int):
            t = t.select(dim, k)
        elif isinstance(k, slice):
            t = torch.ops.aten.slice.Tensor(t, dim, *k.indices(t.shape[dim]))
            dim += 1
        elif isinstance(k, torch.Tensor) and len(key) == 1:
            return torch.ops.aten.index.Tensor(t, [k])
        else:
            raise TypeError(f"kernel_budget cannot index a fake CUDA tensor with {key!r}")
    return t


def to_meta(value):
    """Every tensor as a meta tensor of its dtype, shape, strides and storage offset: what
    Triton's binder specializes on (a meta tensor's data_ptr is its offset in bytes, and a real
    allocation starts 256-byte aligned)."""

    def meta(t):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            base = torch.empty(t.storage_offset() + 1, dtype=t.dtype, device="meta")
            return base.as_strided(t.shape, t.stride(), t.storage_offset())

    return _map(meta, value)


# -- the compile ----------------------------------------------------------------------------


def tool(name: str) -> str:
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def ptxas_version(arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    found = get_ptxas(arch)
    return f"{Path(found.path).name} {found.version}"


def _bound(fn, args, kwargs, arch: int):
    """Triton's binder and packing for sm_{arch}: (target, backend, options, signature,
    constexprs, attrs, specialization), with what `JITFunction.run` adds before binding."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    packed = fn._pack_args(backend, kwargs, bound, specialization, options)
    return target, *packed, specialization


def specialization(fn, args, kwargs, arch: int) -> str:
    """What Triton keys its compiled kernels on: the arguments' specialization and options."""
    _target, options, _sig, _const, _attrs, spec = _bound(fn, args, kwargs, arch)
    return repr((spec, sorted(options.__dict__.items())))


def ptxas_report(log: str) -> tuple[int, int]:
    """(registers, spill store bytes) from ptxas's -v log."""
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    return regs, int(re.search(r"(\d+) bytes spill stores", log).group(1))


def compile_launch(fn, args, kwargs, arch: int):
    """(CompiledKernel, ptxas log) of fn launched with (args, kwargs), for sm_{arch}: the
    binder and packing of `JITFunction.run`, then `triton.compile` (never from Triton's cache,
    so that ptxas runs and logs)."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    target, options, signature, constexprs, attrs, _spec = _bound(fn, args, kwargs, arch)
    log = io.StringIO()
    with knobs.compilation.scope(), knobs.nvidia.scope(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)  # fmt: skip
    return kernel, log.getvalue()


# -- reading it -------------------------------------------------------------------------------

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")
BRANCH = re.compile(r"\bBRA(?:\.\S+)?\s+(?:`\()?(0x[0-9a-f]+)")
ASYNC = ("async_copy_global_to_local", "async_tma_copy_global_to_local")  # cp.async, TMA
ASYNC_DEST = re.compile(r"-> (?:!ttg\.memdesc)?<((?:\d+x)+)(\w+)[,>]")
SYNC = (" tt.load ", " tt.descriptor_load ")
SIZES = {"i8": 1, "i16": 2, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8}


def _cubin_text(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([tool("cuobjdump"), flag, f.name], capture_output=True,
                              text=True, check=True)  # fmt: skip
    return done.stdout


def resources(cubin: bytes) -> dict[str, int]:
    """cuobjdump --dump-resource-usage of the cubin's one function: REG, STACK, SHARED, LOCAL."""
    text = _cubin_text(cubin, "--dump-resource-usage")
    line = next(x for x in text.splitlines() if "REG:" in x)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


def steady_loop(sass: str) -> tuple[list[str], list[int]]:
    """The body of the largest backward branch of the SASS (its instructions, predicate
    stripped) and the sizes of every loop, largest first."""
    found = [(int(a, 16), text) for a, text in INSTRUCTION.findall(sass)]
    loops = []
    for addr, text in found:
        branch = BRANCH.search(text)
        if branch and int(branch.group(1), 16) <= addr:
            top = int(branch.group(1), 16)
            loops.append([re.sub(r"^@!?\w+\s+", "", t) for a, t in found if top <= a <= addr])
    loops.sort(key=len, reverse=True)
    return (loops[0] if loops else []), [len(x) for x in loops]


def ttgir_loops(ttgir: str) -> list[dict]:
    """Per outermost `scf.for` of the TTGIR: its async copies (cp.async or TMA: count and bytes
    per iteration) and its synchronous tensor loads."""
    lines = ttgir.splitlines()
    out, i = [], 0
    while i < len(lines):
        if " scf.for " not in lines[i]:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        end = next(j for j in range(i + 1, len(lines))
                   if lines[j].startswith(" " * indent + "}"))  # fmt: skip
        body = lines[i + 1 : end]
        copies = [x for x in body if any(op in x for op in ASYNC)]
        nbytes = 0
        for x in copies:
            dims, ty = ASYNC_DEST.search(x).groups()
            nbytes += math.prod(int(d) for d in dims.rstrip("x").split("x")) * SIZES[ty]
        sync = [x for x in body if any(op in x for op in SYNC) and "tensor<" in x.split(" : ")[-1]]
        out.append(dict(async_copies=len(copies), async_bytes=nbytes, sync_loads=len(sync)))
        i = end + 1
    return out


def _parameter(kwargs: dict, names: tuple[str, ...], default=None):
    return next((kwargs[n] for n in names if n in kwargs), default)


def block_n(kwargs: dict) -> int:
    """Positions per tile of the steady loop: the launch's BLOCK_N (or BLOCK_KV, BN)."""
    found = _parameter(kwargs, ("BLOCK_N", "BLOCK_KV", "BN"))
    if found is None:
        raise ValueError(f"no BLOCK_N among the launch's keyword arguments {sorted(kwargs)}")
    return found


def num_warps(kwargs: dict) -> int:
    return _parameter(kwargs, ("num_warps",), 4)


def num_stages(kwargs: dict) -> int:
    """The loop's pipeline depth: the kernel's STAGES constexpr (tl.range's num_stages), else
    the launch option."""
    return _parameter(kwargs, ("STAGES", "NUM_STAGES", "num_stages"), 3)


def occupancy(regs: int, warps: int, shared: int, gpu) -> int:
    """CTAs per SM: registers (allocated per warp in units of 256), shared memory, warp and CTA
    slots."""
    _name, _sms, regs_sm, warps_sm, ctas_sm, shared_sm = gpu
    per_cta = math.ceil(regs * 32 / 256) * 256 * warps
    return min(ctas_sm, warps_sm // warps, regs_sm // per_cta, shared_sm // max(shared, 1))


def facts(kernel, log: str, kwargs: dict, gpu) -> dict:
    """A compiled launch's row fields (everything but where it came from and its grid)."""
    use = resources(kernel.asm["cubin"])
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    loop, sizes = steady_loop(_cubin_text(kernel.asm["cubin"], "-sass"))
    opcodes = Counter(x.split()[0].split(".")[0] for x in loop)
    loops = ttgir_loops(kernel.asm["ttgir"])
    bn, warps, stages = block_n(kwargs), num_warps(kwargs), num_stages(kwargs)
    shared = kernel.metadata.shared + use["SHARED"]
    ctas = occupancy(use["REG"], warps, shared, gpu)
    return dict(
        block_n=bn, num_warps=warps, num_stages=stages, registers=use["REG"],
        stack=use["STACK"], spill_bytes=int(spills.group(1)), spill_loads=int(spills.group(2)),
        shared_bytes=shared, ctas_per_sm=ctas, warps_per_sm=ctas * warps,
        bytes_in_flight_per_sm=ctas * stages * max((x["async_bytes"] for x in loops), default=0),
        loop_instructions=len(loop), per_position=round(len(loop) * warps / bn, 1),
        loop_local=opcodes["LDL"] + opcodes["STL"],
        loop_async_loads=sum(x["async_copies"] for x in loops),
        loop_sync_loads=sum(x["sync_loads"] for x in loops),
        loops=sizes[:6], loop_opcodes=dict(opcodes.most_common()),
    )  # fmt: skip


# -- writing it -------------------------------------------------------------------------------


def summary(row: dict) -> str:
    where = f"{row['arch']} {row['recipe']} {row['shape']} {row['keys']}" + (
        " paged" if row["paged"] else "")  # fmt: skip
    if "registers" not in row:
        why = "skipped" if "skipped" in row else "FAILED"
        return f"{where}: {why} ({row.get('skipped') or row['failed']})"
    return (f"{where} ({row['block_n']}, {row['num_warps']}, {row['num_stages']})"
            f"{' *' if row['chosen'] else ''}: {row['registers']} regs, {row['spill_bytes']} B "
            f"spilled, {row['warps_per_sm']} warps/SM, loop {row['loop_instructions']} -> "
            f"{row['per_position']}/position, {row['compile_s']} s")  # fmt: skip


COLUMNS = ("arch | recipe | shape | keys | paged | BLOCK_N, warps, stages | regs | stack B | "
           "spill B | shared KB | warps/SM | programs/SM 4Kx1, 4Kx16, 32Kx1, 32Kx16 | "
           "in flight KB/SM | loop instr. | per position | LDL+STL in loop | loop loads "
           "async / sync")  # fmt: skip


def table(rows: list[dict]) -> list[str]:
    out = ["| " + COLUMNS + " |", "|" + "---|" * 6 + "---:|" * 12]
    for r in rows:
        if "registers" not in r:
            continue
        programs = ", ".join(
            f"{p:.2f}".rstrip("0").rstrip(".") for p in r["programs_per_sm"].values()
        )
        out.append(
            f"| {r['arch']} | {r['recipe']} | {r['shape']} | {r['keys']} | "
            f"{'yes' if r['paged'] else 'no'} | {r['block_n']}, {r['num_warps']}, "
            f"{r['num_stages']}{' *' if r['chosen'] else ''} | {r['registers']} | {r['stack']} | "
            f"{r['spill_bytes']} | {r['shared_bytes'] / 1024:.1f} | {r['warps_per_sm']} | "
            f"{programs} | {r['bytes_in_flight_per_sm'] / 1024:.1f} | "
            f"{r['loop_instructions']} | {r['per_position']} | {r['loop_local']} | "
            f"{r['loop_async_loads']} / {r['loop_sync_loads']} |"
        )  # fmt: skip
    return out


def markdown(doc: dict) -> str:
    skipped = [summary(r) for r in doc["rows"] if "registers" not in r]
    gpus = "; ".join(f"{a}: {g[0]}, {g[1]} SMs" for a, g in doc["gpus"].items())
    return "\n".join([
        f"# Decode-kernel budget (Triton {doc['triton']}, torch {doc['torch']})",
        "",
        "Compiled on a CPU with Triton's bundled tools: "
        + "; ".join(f"{a}: {p}" for a, p in doc["ptxas"].items()) + ".",
        "",
        f"Launch configurations as the launcher picks them on: {gpus}. `*`: the configuration "
        "it launches without tuning (CUDA-graph capture); the others are the candidates it "
        f"times on a GPU. Compiled at {doc['compiled_at']}; programs/SM at each load. "
        "per position = loop instructions x warps / BLOCK_N (warp-instructions per position x "
        "KV head); loop loads: ttg.async_copy_global_to_local / synchronous tensor tt.load "
        "inside the TTGIR's loops. `benchmarks/kernel_budget.py` says how each is read.",
        "",
        *table(doc["rows"]),
        *(["", "Not compiled:", "", *[f"- {s}" for s in skipped]] if skipped else []),
    ])  # fmt: skip


# -- what the budget predicts (benchmarks/RESULTS.md's section) --------------------------------

# (name, SMs, boost clock GHz, HBM TB/s): spec-sheet numbers (H100 SXM5, H200 SXM)
DEVICES = (("H100 SXM", 132, 1.98, 3.35), ("H200", 132, 1.98, 4.8))
SCHEDULERS = 4  # warp schedulers per SM, one warp-instruction issued per clock each
BEGIN, END = "<!-- kernel-budget: begin -->", "<!-- kernel-budget: end -->"


def h200_measured(results: str) -> dict[str, dict[str, float]]:
    """From RESULTS.md's first H200 run: {keys: {"flash": us, "ours": us, "exact": us}} for
    kvcalib-2 at 32/8/128, 32K x 16, fp16, with the full-precision stream timed beside it (its
    bench_decode table: columns found by their headers)."""
    section = results[results.index("## First GPU run: H200") :]
    section = section[: section.index("\n## ", 1)]
    lines = [x for x in section.splitlines() if x.startswith("|")]
    header = next(x for x in lines if "flash us" in x)
    names = [c.strip() for c in header.strip("|").split("|")]
    out = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:4] == ["32/8/128", "32768", "16", "kvcalib-2"] and cells[5] == "float16":
            out[cells[4]] = {key: float(cells[names.index(column)]) for key, column in
                             (("flash", "flash us"), ("ours", "ours graph us"),
                              ("exact", "exact stream us"))}  # fmt: skip
    return out


def results_section(doc: dict, results: str) -> str:
    """RESULTS.md's budget section, from budget.json: kvcalib-2's rows (and the full-precision
    stream's) at 32/8/128 on sm_90, and the floors they predict at 32K x 16 on an H100 and an
    H200 beside what the H200 measured."""

    def shown(r):
        if "registers" not in r or r["paged"] or (r["arch"], r["shape"]) != ("sm_90", "32/8/128"):
            return False
        return r["recipe"] == "kvcalib-2" or (r["recipe"] == "full-precision" and r["chosen"])

    rows = [r for r in doc["rows"] if shown(r)]
    positions = 32768 * 8 * 16
    measured = h200_measured(results)
    fp16_bytes = 2 * positions * 128 * 2
    lines = [
        BEGIN,
        "## The decode kernel's budget, read on a CPU (issue 51)",
        "",
        f"`make kernel-budget` (Triton {doc['triton']}, {doc['ptxas']['sm_90']}; no GPU): "
        "benchmarks/kernel_budget/budget.md has every variant; generated from its budget.json by "
        "`python benchmarks/kernel_budget.py --results`. kvcalib-2 (the preset's first layer: "
        "2-bit static codebook keys with one fp8 exact slot, 2-bit per-token values with "
        "one-byte metadata) at 32/8/128, sm_90, the launch an H100 gets at 32K x 16 "
        "(`*`: untuned; the others are the candidates the launcher times):",
        "",
        *table(rows),
        "",
        f"What it predicts for one step at 32K x 16 (32,768 positions x 8 KV heads x 16 "
        f"sequences = {positions / 1e6:.2f} M rows). Instruction floor = per position x rows / "
        f"(SMs x {SCHEDULERS} schedulers x boost clock), at perfect issue; byte floor = bytes "
        "the step reads (every buffer the launch is handed: codes, metadata, slots, ring, "
        "sinks, flags) / HBM bandwidth. Constants: "
        + "; ".join(f"{n}: {s} SMs, {c} GHz, {b} TB/s" for n, s, c, b in DEVICES)
        + f". FlashAttention over fp16 reads {fp16_bytes / 1e9:.2f} GB. Measured: the H200 "
        "run of 2026-12-04 (Triton 3.6, the benchmark's own kvcalib-2 layout then: symmetric "
        "codebook values, exact slots; not today's preset; the full-precision stream's time "
        "is its `exact stream` column). Issue 51's target, 4x flash, is "
        + " and ".join(f"{v['flash'] / 4:.0f} us {k}" for k, v in measured.items())
        + " on the H200.",
        "",
        "| keys | config | device | instruction floor us | byte floor us | predicted floor us "
        "| flash byte floor us | flash measured us (H200) | ours measured us (H200) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in (r for r in rows if r["chosen"]):
        for name, sms, clock, tbs in DEVICES:
            issue = r["per_position"] * positions / (sms * SCHEDULERS * clock * 1e9) * 1e6
            byte = r["bytes_read_32k_x16"] / (tbs * 1e12) * 1e6
            at = measured.get(r["keys"], {}) if name == "H200" else {}
            ours = at.get("ours" if r["recipe"] == "kvcalib-2" else "exact", "")
            lines.append(
                f"| {r['recipe']} {r['keys']} | {r['block_n']}, {r['num_warps']}, "
                f"{r['num_stages']} | {name} | {issue:.0f} | {byte:.0f} | {max(issue, byte):.0f} "
                f"| {fp16_bytes / (tbs * 1e12) * 1e6:.0f} | {at.get('flash', '')} | {ours} |"
            )  # fmt: skip
    return "\n".join([*lines, "", END])
