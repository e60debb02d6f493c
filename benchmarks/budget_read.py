"""How `kernel_budget.py` reads one launch of the decode kernel without a GPU: the host side of
a CUDA device pretended (FakeTensors on "cuda", the SM count, stream capture, events) while the
runtime's own launcher runs and its launches are intercepted; each compiled through Triton's
own binder for sm_90 or sm_80 with Triton's bundled ptxas and cuobjdump; then registers, spills,
shared memory, occupancy, the SASS of the steady-state loop and the TTGIR's loads."""

import contextlib
import dataclasses
import inspect
import io
import math
import os
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
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    target, options, signature, constexprs, attrs, _spec = _bound(fn, args, kwargs, arch)
    log = io.StringIO()
    with knobs.compilation.scope(), knobs.nvidia.scope(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            source = (GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource)(
                fn, signature, constexprs, attrs
            )
            kernel = triton.compile(source, target=target, options=options.__dict__)
    return kernel, log.getvalue()


# -- the launch, intercepted ------------------------------------------------------------------


class _Event:  # torch.cuda.Event while tuning: every candidate times the same
    def __init__(self, **_):
        pass

    def record(self, *_):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, _other) -> float:
        return 1.0


_COMPILED: dict = {}  # (source, arch, specialization, options) -> (CompiledKernel, ptxas log)


def compiled(fn, args, kwargs, arch: int):
    """(CompiledKernel, ptxas log) of a launch, compiled once per specialization (as Triton's
    own cache: a reloaded launcher's kernels are the same source)."""
    key = (fn.cache_key, arch, specialization(fn, args, kwargs, arch))
    if key not in _COMPILED:
        _COMPILED[key] = compile_launch(fn, args, kwargs, arch)
    return _COMPILED[key]


class _Launched:
    """What `JITFunction.run` returns, compiled only if the launcher reads it (a launcher may
    size its grid from the kernel's registers): `n_regs` and `n_spills` as ptxas reports them
    (the driver's, on a GPU), the rest the CompiledKernel's."""

    def __init__(self, fn, args, kwargs, arch: int):
        self._launch = (fn, args, kwargs, arch)

    def __getattr__(self, name):
        kernel, log = compiled(*self._launch)
        if name in ("n_regs", "n_spills"):
            regs, spills = ptxas_report(log)
            return regs if name == "n_regs" else spills
        return getattr(kernel, name)


@contextlib.contextmanager
def pretend_gpu(sms: int, capturing: bool, launches: list, arch: int = 90):
    """The host side of a CUDA device with `sms` SMs, sm_{arch}: device properties and
    capability, stream capture, events, synchronization, indexing (`index`); every
    `JITFunction.run` appended to `launches` as (fn, args, kwargs, grid) instead of launched,
    and answered with the kernel compiled for sm_{arch} should the launcher read it
    (`_Launched`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.runtime.jit import JITFunction

    props = type("Props", (), {"multi_processor_count": sms, "name": "pretend"})()
    saved = [(torch.cuda, n, getattr(torch.cuda, n)) for n in
             ("get_device_properties", "get_device_capability", "is_current_stream_capturing",
              "Event", "synchronize", "current_device")]  # fmt: skip
    saved.append((JITFunction, "run", JITFunction.run))
    getitem = torch.Tensor.__getitem__  # torch._C.TensorBase's: shadowed here, then unshadowed
    torch.Tensor.__getitem__ = lambda t, key: (
        index(t, key) if t.device.type == "cuda" else getitem(t, key)
    )
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: divmod(arch, 10)
    torch.cuda.is_current_stream_capturing = lambda: capturing
    torch.cuda.Event = _Event
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.current_device = lambda: 0

    def run(self, *args, grid, warmup, **kwargs):
        if callable(grid):  # as JITFunction.run calls it: with every argument by name
            named = {k: v for k, v in kwargs.items() if k in self.arg_names}
            grid = grid(self.signature.bind(*args, **named).arguments)
        args, kwargs = to_meta(args), to_meta(kwargs)
        launches.append((self, args, kwargs, tuple(grid)))
        return _Launched(self, args, kwargs, arch)

    JITFunction.run = run
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            yield mode
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        del torch.Tensor.__getitem__


# -- reading it -------------------------------------------------------------------------------

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")
BRANCH = re.compile(r"\bBRA(?:\.\S+)?\s+(?:`\()?(0x[0-9a-f]+|\.L_x_\d+)")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
WHERE = re.compile(r'"([^"]+)", line (\d+)')  # nvdisasm -g: //## File "f", line n [inlined at ..]
STEADY = "budget: steady loop"  # the comment tagging a line of a kernel's steady-state loop
ASYNC = ("async_copy_global_to_local", "async_tma_copy_global_to_local")  # cp.async, TMA
ASYNC_DEST = re.compile(r"-> (?:!ttg\.memdesc)?<((?:\d+x)+)(\w+)[,>]")
SYNC = (" tt.load ", " tt.descriptor_load ")
SIZES = {"i8": 1, "i16": 2, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8}


def _cubin_text(cubin: bytes, tool_name: str, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([tool(tool_name), *flags, f.name], capture_output=True,
                              text=True, check=True)  # fmt: skip
    return done.stdout


def resources(cubin: bytes) -> dict[str, int]:
    """cuobjdump --dump-resource-usage of the cubin's one function: REG, STACK, SHARED, LOCAL."""
    text = _cubin_text(cubin, "cuobjdump", "--dump-resource-usage")
    line = next(x for x in text.splitlines() if "REG:" in x)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


@dataclasses.dataclass(frozen=True)
class Loop:
    """A backward branch of the SASS: its body's addresses and instructions (predicates
    stripped) and the source lines (file, line) they come from, call sites of inlined
    functions included."""

    addresses: tuple[int, ...]
    instructions: tuple[str, ...]
    lines: frozenset


def sass_loops(sass: str) -> list[Loop]:
    """Every loop of the SASS (`nvdisasm -g -c`: branches to labels, line comments; or
    `cuobjdump -sass`: branches to addresses, no lines), largest first."""
    found, labels, pending, where = [], {}, [], frozenset()
    for text in sass.splitlines():
        if text.lstrip().startswith("//##"):
            where = frozenset((os.path.realpath(f), int(n)) for f, n in WHERE.findall(text))
        elif label := LABEL.match(text):
            pending.append(label.group(1))
        elif instruction := INSTRUCTION.search(text):
            addr = int(instruction.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending = []
            found.append((addr, instruction.group(2), where))
    loops = []
    for addr, text, _ in found:
        branch = BRANCH.search(text)
        if not branch:
            continue
        target = branch.group(1)
        top = labels.get(target) if target.startswith(".") else int(target, 16)
        if top is not None and top <= addr:
            body = [x for x in found if top <= x[0] <= addr]
            loops.append(Loop(tuple(a for a, _, _ in body),
                              tuple(re.sub(r"^@!?\w+\s+", "", t) for _, t, _ in body),
                              frozenset().union(*(w for _, _, w in body))))  # fmt: skip
    return sorted(loops, key=lambda x: len(x.instructions), reverse=True)


def marker(fn) -> tuple[str, int] | None:
    """(file, line) of the line of a JIT function's source carrying the STEADY comment: a line
    only its steady-state loop executes (the decode kernel's whole-tile loop); None without."""
    lines, first = inspect.getsourcelines(fn.fn)
    tagged = [first + i for i, text in enumerate(lines) if STEADY in text]
    if len(tagged) > 1:
        raise ValueError(f"{fn.__name__} tags {len(tagged)} lines '# {STEADY}': tag one")
    return (os.path.realpath(inspect.getsourcefile(fn.fn)), tagged[0]) if tagged else None


def steady_loop(loops: list[Loop], tag: tuple[str, int] | None) -> Loop | None:
    """The steady-state loop: the innermost loop holding an instruction of the tagged line;
    without a tag, or where no loop holds it, the largest loop (the issue's first rule)."""
    tagged = [x for x in loops if tag in x.lines]
    return min(tagged, key=lambda x: len(x.instructions)) if tagged else (loops or [None])[0]


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


def facts(kernel, log: str, kwargs: dict, gpu, tag: tuple[str, int] | None = None) -> dict:
    """A compiled launch's row fields (everything but where it came from and its grid). The
    steady-state loop is the one tagged (`marker`, `steady_loop`): loop_instructions,
    per_position and the opcode histogram are its; largest_loop_instructions and
    per_position_largest_loop the largest backward branch's (the rule of the first budget,
    which since the kernel split its masked tail out counts the 16-row mixed loop); loop_local
    counts LDL/STL in every loop."""
    use = resources(kernel.asm["cubin"])
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    loops = sass_loops(_cubin_text(kernel.asm["cubin"], "nvdisasm", "-g", "-c"))
    steady = steady_loop(loops, tag)
    loop = list(steady.instructions) if steady else []
    largest = len(loops[0].instructions) if loops else 0
    opcodes = Counter(x.split()[0].split(".")[0] for x in loop)
    local = {}  # address -> opcode, of every instruction inside a loop
    for x in loops:
        local.update(zip(x.addresses, (i.split()[0] for i in x.instructions), strict=True))
    ttgir = ttgir_loops(kernel.asm["ttgir"])
    bn, warps, stages = block_n(kwargs), num_warps(kwargs), num_stages(kwargs)
    shared = kernel.metadata.shared + use["SHARED"]
    ctas = occupancy(use["REG"], warps, shared, gpu)
    return dict(
        block_n=bn, num_warps=warps, num_stages=stages, registers=use["REG"],
        stack=use["STACK"], spill_bytes=int(spills.group(1)), spill_loads=int(spills.group(2)),
        shared_bytes=shared, ctas_per_sm=ctas, warps_per_sm=ctas * warps,
        bytes_in_flight_per_sm=ctas * stages * max((x["async_bytes"] for x in ttgir), default=0),
        steady_loop=f"tagged line {tag[1]}" if steady and tag in steady.lines else "largest",
        loop_instructions=len(loop), per_position=round(len(loop) * warps / bn, 1),
        largest_loop_instructions=largest,
        per_position_largest_loop=round(largest * warps / bn, 1),
        loop_local=sum(op.split(".")[0] in ("LDL", "STL") for op in local.values()),
        loop_async_loads=sum(x["async_copies"] for x in ttgir),
        loop_sync_loads=sum(x["sync_loads"] for x in ttgir),
        loops=[len(x.instructions) for x in loops][:6], loop_opcodes=dict(opcodes.most_common()),
    )  # fmt: skip
