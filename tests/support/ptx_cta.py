"""A CPU executor of a compiled kernel's PTX, one CTA at a time: the kernels only a GPU runs
(Gluon has no interpreter; Triton's interpreter runs the Python, not the inline assembly)
executed instruction by instruction for every thread, so that their results can be compared
with a reference on a machine without a GPU (tests/runtime/kernels/test_ptx_cta.py).

The threads of a CTA run in lockstep: an instruction for every thread waiting at it, then the
next. Threads that branch apart wait at their own instructions and the smallest one runs first,
so paths meet again where they join (structured code, as Triton emits it); barriers, shuffles,
reductions and the warp-wide matrix instructions refuse to run unless their warps have met.
Registers hold raw bits (uint64, one element a thread), read as each opcode's type says.
Global memory is the arguments' tensors at their own host addresses, read and written in place;
shared and local memory are byte arrays. An asynchronous copy (cp.async) reads its source when
issued and lands in shared memory only at the wait_group that completes its group, so that a
kernel reading a buffer before its copy lands reads what was there (lockstep threads cannot
show a missing barrier between warps, only a missing wait). Arithmetic rounds as the PTX ISA
says where NumPy does (fp32 and fp16 to nearest even); `ex2.approx`, `sin.approx`,
`cos.approx` and `div.full` are computed exactly, `fma` in fp64 then rounded, `mma.sync`
accumulates in fp64: the tests' tolerances cover the hardware's approximations. Only the
opcodes the project's kernels emit are defined (not wgmma, which sm_90's Triton kernels use:
they are executed compiled for sm_80); any other is refused by name, never guessed.
"""

import contextlib
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

U64 = np.uint64
MASKS = {1: 1, 8: 0xFF, 16: 0xFFFF, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}
WIDTH = {"pred": 1, "b8": 8, "u8": 8, "s8": 8, "b16": 16, "u16": 16, "s16": 16, "f16": 16,
         "b32": 32, "u32": 32, "s32": 32, "f32": 32, "f16x2": 32, "b64": 64, "u64": 64,
         "s64": 64, "f64": 64}  # fmt: skip
FLOAT = {"f16": np.float16, "f32": np.float32, "f64": np.float64}
FLOAT_BITS = {"f16": np.uint16, "f32": np.uint32, "f64": np.uint64}
SIGNED = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
TYPES = re.compile(r"^(pred|[busf](8|16|32|64)|f16x2)$")
ADDRESS = re.compile(r"\[\s*([^\]+\s]+)\s*(?:\+\s*(-?\w+))?\s*\]")


class PTXError(AssertionError):
    """The executor met what it does not define (an opcode, a divergent branch, an address
    outside memory)."""


def _int(token: str) -> int:
    """An immediate's bits: 0f3F800000 (fp32) and 0d... (fp64) by their hex, 0x7701U (PTX's
    unsigned suffix) and decimal as integers."""
    if token.startswith(("0f", "0F", "0d", "0D")):
        return int(token[2:], 16)
    return int(token.rstrip("Uu"), 0)


def _param(value) -> int:
    """An argument's bits: a tensor's address, a float as fp32, an int (or bool) as itself,
    None as a null pointer."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, float):
        return int(np.float32(value).view(np.uint32))
    return int(value or 0) & MASKS[64]


def as_float(bits: np.ndarray, t: str) -> np.ndarray:
    return (bits & U64(MASKS[WIDTH[t]])).astype(FLOAT_BITS[t]).view(FLOAT[t])


def from_float(x: np.ndarray, t: str) -> np.ndarray:
    return np.asarray(x, FLOAT[t]).view(FLOAT_BITS[t]).astype(U64)


def as_int(bits: np.ndarray, t: str) -> np.ndarray:
    """Integer bits as int64 (signed types sign-extended); 64-bit unsigned ones stay uint64."""
    w = WIDTH[t]
    raw = bits & U64(MASKS[w])
    if t.startswith("s"):
        return raw.astype(UNSIGNED[w]).view(SIGNED[w]).astype(np.int64)
    return raw if w == 64 else raw.astype(np.int64)


def from_int(x: np.ndarray, w: int) -> np.ndarray:
    return np.asarray(x).astype(U64) & U64(MASKS[w])


class Space:
    """A byte-addressed space (shared memory, or one thread's local memory): loads and stores
    of `size` bytes a thread at per-thread addresses, little-endian."""

    def __init__(self, data: np.ndarray, base: int):
        self.data, self.base = data, base

    def _at(self, addr: np.ndarray, size: int):
        offset = addr.astype(np.int64) - self.base
        if (offset < 0).any() or (offset + size > len(self.data)).any() or (offset % size).any():
            raise PTXError(f"an access of {size} bytes outside memory or misaligned")
        return offset[:, None] + np.arange(size)

    def load(self, addr: np.ndarray, size: int) -> np.ndarray:
        b = self.data[self._at(addr, size)].astype(U64)
        return (b << (U64(8) * np.arange(size, dtype=U64))).sum(1, dtype=U64)

    def store(self, addr: np.ndarray, size: int, value: np.ndarray, active: np.ndarray):
        at = self._at(addr, size)
        shifts = U64(8) * np.arange(size, dtype=U64)
        at = tuple(x[active] for x in at) if isinstance(at, tuple) else at[active]
        self.data[at] = ((value[active][:, None] >> shifts) & U64(0xFF)).astype(np.uint8)


class Global(Space):
    """Global memory: the storages of the arguments' tensors, at their own host addresses (a
    pointer argument is its tensor's data_ptr, views and offsets included), read and written in
    place."""

    def __init__(self, tensors: list):
        regions = {}
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes():
                raw = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
                regions[st.data_ptr()] = raw.numpy()
        self.bases = np.array(sorted(regions), np.int64)
        self.regions = [regions[b] for b in sorted(regions)]

    def _region(self, addr: np.ndarray, size: int):
        addr = addr.astype(np.int64)
        which = np.searchsorted(self.bases, addr, side="right") - 1
        offset = addr - self.bases[np.maximum(which, 0)]
        sizes = np.array([len(r) for r in self.regions])[np.maximum(which, 0)]
        if (which < 0).any() or (offset + size > sizes).any() or (offset % size).any():
            raise PTXError(f"a global access of {size} bytes outside the arguments or misaligned")
        return which, offset

    def load(self, addr: np.ndarray, size: int) -> np.ndarray:
        which, offset = self._region(addr, size)
        out = np.zeros(len(addr), U64)
        for w in np.unique(which):
            at = which == w
            b = self.regions[w][offset[at][:, None] + np.arange(size)].astype(U64)
            out[at] = (b << (U64(8) * np.arange(size, dtype=U64))).sum(1, dtype=U64)
        return out

    def word(self, addr: np.ndarray) -> np.ndarray:
        """Bytes at addr, where each is a tensor's or in the 4-byte word of one (as a GPU
        reads: memory is mapped in pages, far coarser); those outside read as 0."""
        addr = addr.astype(np.int64)
        near = np.stack([self._holds(addr - addr % 4 + k) for k in range(4)]).any(0)
        if not near.all():
            raise PTXError("a cp.async reads a word none of whose bytes is an argument's")
        out = np.zeros(len(addr), U64)
        held = self._holds(addr)
        out[held] = self.load(addr[held], 1)
        return out

    def _holds(self, addr: np.ndarray) -> np.ndarray:
        which = np.searchsorted(self.bases, addr, side="right") - 1
        sizes = np.array([len(r) for r in self.regions])[np.maximum(which, 0)]
        return (which >= 0) & (addr - self.bases[np.maximum(which, 0)] < sizes)

    def store(self, addr: np.ndarray, size: int, value: np.ndarray, active: np.ndarray):
        addr, value = addr[active], value[active]
        which, offset = self._region(addr, size)
        shifts = U64(8) * np.arange(size, dtype=U64)
        for w in np.unique(which):
            at = which == w
            self.regions[w][offset[at][:, None] + np.arange(size)] = (
                (value[at][:, None] >> shifts) & U64(0xFF)
            ).astype(np.uint8)


class Local(Space):
    """Each thread's own local memory (a spill or a libdevice function's array), at addresses
    from 0."""

    def __init__(self, threads: int, size: int):
        super().__init__(np.zeros((threads, max(size, 16)), np.uint8), 0)

    def _at(self, addr: np.ndarray, size: int):
        offset = addr.astype(np.int64)
        outside = (offset < 0) | (offset + size > self.data.shape[1])
        if outside.any() or (offset % size).any():
            raise PTXError(f"a local access of {size} bytes outside the frame or misaligned")
        return np.arange(len(offset))[:, None], offset[:, None] + np.arange(size)


def _body(ptx: str) -> tuple[list[str], str]:
    """The entry's parameter names and the text of its body, comments removed."""
    text = re.sub(r"//[^\n]*|^\s*\.(loc|file)\b[^\n]*", "", ptx, flags=re.M)
    entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", text, re.S)
    params = re.findall(r"\.param\s+[^,]*?(\w+)\s*(?:,|$)", entry.group(1))
    start = text.index("{", entry.end())
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return params, text[start + 1 : i]
    raise PTXError("unbalanced braces")


def _split_operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse(ptx: str):
    """(parameter names, instructions, labels): an instruction is (guard, opcode, operands);
    guard None or (predicate register, negated)."""
    params, body = _body(ptx)
    program, labels = [], {}
    for chunk in body.split(";"):
        chunk = chunk.strip()
        while True:
            chunk = chunk.lstrip("{} \t\n")
            m = re.match(r"^([$\w]+):", chunk)
            if not m:
                break
            labels[m.group(1)] = len(program)
            chunk = chunk[m.end() :]
        chunk = chunk.strip()
        if not chunk or chunk.startswith("."):
            continue
        guard = None
        if chunk.startswith("@"):
            g, chunk = chunk.split(None, 1)
            guard = (g[2:], True) if g.startswith("@!") else (g[1:], False)
        parts = chunk.split(None, 1)
        ops = _split_operands(parts[1]) if len(parts) > 1 else []
        program.append((guard, parts[0], ops))
    return params, program, labels


class Cta:
    """One CTA of `threads` threads executing `ptx` (the entry Triton compiled), its arguments
    in the order of its parameters (`_param`)."""

    def __init__(self, ptx: str, threads: int, shared: int):
        self.params, self.program, self.labels = parse(ptx)
        self.threads, self.shared_size = threads, shared
        self.lane = np.arange(threads) % 32
        depot = re.search(r"\.local\s+\.align\s+\d+\s+\.b8\s+__local_depot0\[(\d+)\]", ptx)
        self.local_size = int(depot.group(1)) if depot else 0

    def run(self, args: list, ctaid=(0, 0, 0), grid=(1, 1, 1)):
        if len(args) != len(self.params):
            raise PTXError(f"{len(args)} arguments for {len(self.params)} parameters")
        self.param = dict(zip(self.params, map(_param, args), strict=True))
        self.global_ = Global([a for a in args if isinstance(a, torch.Tensor)])
        self.shared = Space(np.zeros(max(self.shared_size, 16), np.uint8), 0)
        self.local = Local(self.threads, self.local_size)
        self.carry = np.zeros(self.threads, U64)
        self.copies, self.groups = [], []  # cp.async: the open group, the committed ones
        self.special = {"%tid.x": np.arange(self.threads), "%tid.y": 0, "%tid.z": 0,
                        "%ctaid.x": ctaid[0], "%ctaid.y": ctaid[1], "%ctaid.z": ctaid[2],
                        "%nctaid.x": grid[0], "%nctaid.y": grid[1], "%nctaid.z": grid[2],
                        "%ntid.x": self.threads, "%laneid": self.lane}  # fmt: skip
        self.regs: dict[str, np.ndarray] = {}
        waiting = {0: np.ones(self.threads, bool)}  # pc -> the threads that wait there
        while waiting:
            pc = min(waiting)  # the smallest pc first: diverged paths meet again where they join
            mask = waiting.pop(pc)
            if pc >= len(self.program):
                continue
            guard, op, ops = self.program[pc]
            active = mask
            if guard is not None:
                active = mask & (self.regs[guard[0]].astype(bool) ^ guard[1])
            base = op.split(".")[0]
            after = mask
            if base == "bra":
                self._wait(waiting, self.labels[ops[0]], active)
                after = mask & ~active
            elif base == "ret":
                after = mask & ~active
            elif active.any():
                handler = getattr(self, "_" + base, None)
                if handler is None:
                    raise PTXError(f"unsupported PTX opcode {op}")
                handler(op.split("."), ops, active)
            self._wait(waiting, pc + 1, after)

    @staticmethod
    def _wait(waiting: dict, pc: int, mask: np.ndarray):
        if mask.any():
            waiting[pc] = waiting[pc] | mask if pc in waiting else mask

    # -- operands ---------------------------------------------------------------------------

    def read(self, token: str, t: str = "b32") -> np.ndarray:
        token = token.strip()
        neg = token.startswith("!")
        if neg:
            token = token[1:]
        if token in self.regs:
            v = self.regs[token]
        elif token in self.special:
            v = np.broadcast_to(np.asarray(self.special[token], np.int64), (self.threads,))
            v = v.astype(U64)
        elif token in ("global_smem", "__local_depot0"):  # each space's base address
            v = np.zeros(self.threads, U64)
        elif token in self.param:  # a parameter's address: 8 x its index in the param space
            v = np.full(self.threads, 8 * self.params.index(token), U64)
        elif not re.match(r"^-?\d", token):
            raise PTXError(f"an operand never written: {token}")
        elif t in FLOAT and not token.startswith(("0f", "0F", "0d", "0D")):
            v = from_float(np.full(self.threads, float(token)), t)
        else:
            v = np.full(self.threads, _int(token) & MASKS[64], U64)
        v = v & U64(MASKS[WIDTH[t]])
        return (v ^ U64(1)) if neg else v

    def write(self, token: str, value: np.ndarray, active: np.ndarray, t: str = "b32"):
        value = np.broadcast_to(np.asarray(value).astype(U64), (self.threads,)) & U64(
            MASKS[WIDTH[t]]
        )
        old = self.regs.get(token, np.zeros(self.threads, U64))
        self.regs[token] = np.where(active, value, old)

    def vector(self, token: str) -> list[str]:
        return [x.strip() for x in token.strip("{} ").split(",")]

    def address(self, token: str, space: str = "global") -> tuple[np.ndarray, str]:
        """A [base + offset] operand's addresses; shared and local addresses are 32-bit."""
        m = ADDRESS.fullmatch(token.strip())
        base, offset = m.group(1), int(m.group(2) or "0", 0)
        at = self.read(base, "b64").astype(np.int64) + offset
        return (at & MASKS[32] if space in ("shared", "local") else at), base

    # -- moves and memory -------------------------------------------------------------------

    def _mov(self, op, ops, active):
        t = op[-1]
        dst, src = ops
        if dst.startswith("{"):  # unpack the halves (or words) of src
            parts = self.vector(dst)
            w = WIDTH[t] // len(parts)
            v = self.read(src, t)
            for i, p in enumerate(parts):
                self.write(p, v >> U64(w * i), active, f"b{w}")
        elif src.startswith("{"):  # pack
            parts = self.vector(src)
            w = WIDTH[t] // len(parts)
            v = np.zeros(self.threads, U64)
            for i, p in enumerate(parts):
                v |= self.read(p, f"b{w}") << U64(w * i)
            self.write(dst, v, active, t)
        else:
            self.write(dst, self.read(src, t), active, t)

    def _ld(self, op, ops, active):
        space, t = op[1], op[-1]
        dst, addr = ops
        if space == "param":
            name = addr.strip("[] ")
            if name in self.param:
                value = np.full(self.threads, self.param[name], U64)
            else:  # at an address taken by mov (`read`)
                at = np.where(active, self.address(addr, space)[0], 0)
                value = np.array([self.param[self.params[i // 8]] for i in at], U64)
            self.write(dst, value, active, t)
            return
        parts = self.vector(dst) if dst.startswith("{") else [dst]
        size = WIDTH[t] // 8
        at, _ = self.address(addr, space)
        mem = self._space(space)
        for i, p in enumerate(parts):
            where = np.where(active, at + size * i, (at + size * i)[active][0])
            self.write(p, mem.load(where, size), active, t)

    def _st(self, op, ops, active):
        space, t = op[1], op[-1]
        addr, src = ops
        parts = self.vector(src) if src.startswith("{") else [src]
        size = WIDTH[t] // 8
        at, _ = self.address(addr, space)
        mem = self._space(space)
        for i, p in enumerate(parts):
            mem.store(at + size * i, size, self.read(p, t), active)

    def _cp(self, op, ops, active):
        """cp.async: a copy is read when issued and lands in shared memory only at the
        wait_group that completes its group (a read of its destination before that wait
        reads what was there), per thread; src-size bytes of the source (the rest zeros),
        each byte of a tensor or of a 4-byte word holding one of its bytes (`Global.word`)."""
        if op[2] == "commit_group":
            self.groups.append(self.copies)
            self.copies = []
        elif op[2] == "wait_group":
            keep = int(ops[0], 0)
            done = self.groups[: max(len(self.groups) - keep, 0)]
            for group in done:
                for mask, at, data in group:
                    now = mask & active
                    for i in range(data.shape[1]):
                        self.shared.store(at + i, 1, data[:, i], now)
                    mask &= ~active
            self.groups = [g for g in self.groups if any(m.any() for m, _, _ in g)]
        else:
            dst, src, size, *rest = ops
            size = _int(size)
            given = self.read(rest[0]).astype(np.int64) if rest else np.full(self.threads, size)
            at, _ = self.address(dst, "shared")
            source, _ = self.address(src)
            if (at[active] % size).any() or (source[active] % size).any():
                raise PTXError(f"a cp.async of {size} bytes at a misaligned address")
            data = np.zeros((self.threads, size), U64)
            for i in range(size):
                reads = active & (given > i)
                if reads.any():
                    data[reads, i] = self.global_.word(source[reads] + i)
            self.copies.append((active.copy(), at, data))

    def _space(self, space: str) -> Space:
        if space == "global":
            return self.global_
        if space == "shared":
            return self.shared
        if space == "local":
            return self.local
        raise PTXError(f"unsupported state space {space}")

    # -- integer and bit arithmetic ---------------------------------------------------------

    def _pairs(self, ops, active, fn):
        """An f16x2 operation: fn over the fp16 values of the same half of each b32 source
        (low half, then high), each result rounded to fp16 once."""
        d, *sources = ops
        words = [self.read(r, "b32") for r in sources]
        out = np.zeros(self.threads, U64)
        for shift in (U64(0), U64(16)):
            halves = [as_float((w >> shift) & U64(0xFFFF), "f16").astype(np.float64) for w in words]
            with np.errstate(all="ignore"):
                out |= from_float(fn(*halves).astype(np.float16), "f16") << shift
        self.write(d, out, active, "b32")

    def _binary(self, op, ops, active, fn):
        t = op[-1]
        d, a, b = ops
        if t == "f16x2":
            self._pairs(ops, active, fn)
        elif t in FLOAT:
            x, y = as_float(self.read(a, t), t), as_float(self.read(b, t), t)
            with np.errstate(all="ignore"):
                self.write(d, from_float(fn(x, y), t), active, t)
        else:
            x, y = as_int(self.read(a, t), t), as_int(self.read(b, t), t)
            self.write(d, from_int(fn(x, y), WIDTH[t]), active, t)

    def _add(self, op, ops, active):
        self._binary(op, ops, active, lambda x, y: x + y)

    def _sub(self, op, ops, active):
        self._binary(op, ops, active, lambda x, y: x - y)

    def _max(self, op, ops, active):
        self._binary(op, ops, active, np.fmax)

    def _min(self, op, ops, active):
        self._binary(op, ops, active, np.fmin)

    def _mul(self, op, ops, active):
        t = op[-1]
        if "wide" in op:  # a full product in twice the width
            d, a, b = ops
            x, y = as_int(self.read(a, t), t), as_int(self.read(b, t), t)
            self.write(d, from_int(x * y, 2 * WIDTH[t]), active, f"b{2 * WIDTH[t]}")
        elif "hi" in op:
            d, a, b = ops
            x, y = as_int(self.read(a, t), t), as_int(self.read(b, t), t)
            self.write(d, from_int((x * y) >> WIDTH[t], WIDTH[t]), active, t)
        else:
            self._binary(op, ops, active, lambda x, y: x * y)

    def _mad(self, op, ops, active):
        t = op[-1]
        d, a, b, c = ops
        x, y = as_int(self.read(a, t), t), as_int(self.read(b, t), t)
        if "wide" in op:
            w = 2 * WIDTH[t]
            z = self.read(c, f"b{w}")
            self.write(d, (from_int(x * y, w) + z) & U64(MASKS[w]), active, f"b{w}")
        elif "cc" in op:  # mad.lo.cc.u32: the low word plus c, its carry out kept
            z = self.read(c, t)
            total = from_int(x * y, WIDTH[t]) + z
            self.write(d, total, active, t)
            self.carry = np.where(active, total >> U64(WIDTH[t]), self.carry)
        else:
            z = as_int(self.read(c, t), t)
            self.write(d, from_int(x * y + z, WIDTH[t]), active, t)

    def _madc(self, op, ops, active):  # madc.hi.u32: the high word plus c plus the carry in
        t = op[-1]
        if op[1] != "hi" or "cc" in op or t != "u32":
            raise PTXError(f"unsupported PTX opcode {'.'.join(op)}")
        d, a, b, c = ops
        x, y = as_int(self.read(a, t), t), as_int(self.read(b, t), t)
        hi = from_int(x, 64) * from_int(y, 64) >> U64(32)
        self.write(d, hi + self.read(c, t) + self.carry, active, t)

    def _fma(self, op, ops, active):
        t = op[-1]
        if t == "f16x2":
            self._pairs(ops, active, lambda x, y, z: x * y + z)
            return
        d, a, b, c = ops
        x, y, z = (as_float(self.read(r, t), t).astype(np.float64) for r in (a, b, c))
        self.write(d, from_float(x * y + z, t), active, t)

    def _div(self, op, ops, active):  # integers: truncated toward zero, as C
        if op[-1] in FLOAT:
            self._binary(op, ops, active, lambda x, y: x / y)
        else:
            self._binary(op, ops, active, lambda x, y: np.trunc(x / np.where(y == 0, 1, y)))

    def _rem(self, op, ops, active):  # the sign of the dividend, as C
        self._binary(op, ops, active, lambda x, y: np.fmod(x, np.where(y == 0, 1, y)))

    def _neg(self, op, ops, active):
        t = op[-1]
        d, a = ops
        if t == "f16x2":
            self._pairs(ops, active, lambda x: -x)
        elif t in FLOAT:
            self.write(d, from_float(-as_float(self.read(a, t), t), t), active, t)
        else:
            self.write(d, from_int(-as_int(self.read(a, t), t), WIDTH[t]), active, t)

    def _abs(self, op, ops, active):
        t = op[-1]
        d, a = ops
        self.write(d, from_float(np.abs(as_float(self.read(a, t), t)), t), active, t)

    def _approx(self, op, ops, active, fn):
        t = op[-1]
        d, a = ops
        with np.errstate(all="ignore"):
            x = as_float(self.read(a, t), t).astype(np.float64)
            self.write(d, from_float(fn(x), t), active, t)

    def _ex2(self, op, ops, active):
        self._approx(op, ops, active, np.exp2)

    def _cos(self, op, ops, active):
        self._approx(op, ops, active, np.cos)

    def _sin(self, op, ops, active):
        self._approx(op, ops, active, np.sin)

    def _logic(self, op, ops, active, fn):
        t = op[-1]
        d, a, b = ops
        self.write(d, fn(self.read(a, t), self.read(b, t)), active, t)

    def _and(self, op, ops, active):
        self._logic(op, ops, active, np.bitwise_and)

    def _or(self, op, ops, active):
        self._logic(op, ops, active, np.bitwise_or)

    def _xor(self, op, ops, active):
        self._logic(op, ops, active, np.bitwise_xor)

    def _not(self, op, ops, active):
        t = op[-1]
        d, a = ops
        self.write(d, ~self.read(a, t), active, t)

    def _shl(self, op, ops, active):
        t = op[-1]
        d, a, b = ops
        n = self.read(b, "u32")
        v = np.where(n >= WIDTH[t], U64(0), self.read(a, t) << np.minimum(n, U64(63)))
        self.write(d, v, active, t)

    def _shr(self, op, ops, active):
        t = op[-1]
        d, a, b = ops
        n = np.minimum(self.read(b, "u32"), U64(WIDTH[t] - 1 if t.startswith("s") else 63))
        if t.startswith("s"):
            self.write(d, from_int(as_int(self.read(a, t), t) >> n.astype(np.int64), WIDTH[t]),
                       active, t)  # fmt: skip
        else:
            v = self.read(a, t) >> n
            self.write(d, np.where(self.read(b, "u32") >= WIDTH[t], U64(0), v), active, t)

    def _shf(self, op, ops, active):  # funnel shift: shf.l.wrap.b32 d, a, b, c
        d, a, b, c = ops
        n = self.read(c, "u32") & U64(31)
        both = (self.read(b, "b32") << U64(32)) | self.read(a, "b32")
        self.write(d, (both << n) >> U64(32) if op[1] == "l" else both >> n, active, "b32")

    def _bfe(self, op, ops, active):
        t = op[-1]
        d, a, b, c = ops
        w = WIDTH[t]
        pos, length = self.read(b, "u32") & U64(0xFF), self.read(c, "u32") & U64(0xFF)
        x = self.read(a, t)
        v = np.where(pos >= w, U64(0), x >> np.minimum(pos, U64(w - 1)))
        ones = (U64(1) << np.minimum(length, U64(63))) - U64(1)
        v &= np.where(length >= 64, U64(MASKS[64]), ones)
        if t.startswith("s"):  # the field's top bit (or the value's, past its end) extended
            top = np.minimum(pos + length - U64(1), U64(w - 1))
            sign = np.where(length == 0, U64(0), (x >> top) & U64(1))
            v |= np.where(sign == 1, U64(MASKS[64]) << np.minimum(length, U64(63)), U64(0))
            v = np.where(length == 0, U64(0), v)
        self.write(d, v, active, t)

    def _prmt(self, op, ops, active):
        if len(op) > 2:
            raise PTXError(f"unsupported PTX opcode {'.'.join(op)}")
        d, a, b, c = ops
        pool = (self.read(b, "b32") << U64(32)) | self.read(a, "b32")
        sel = self.read(c, "b32")
        out = np.zeros(self.threads, U64)
        for i in range(4):
            nib = (sel >> U64(4 * i)) & U64(0xF)
            byte = (pool >> (U64(8) * (nib & U64(7)))) & U64(0xFF)
            sign = np.where((byte >> U64(7)) & U64(1), U64(0xFF), U64(0))
            out |= np.where(nib & U64(8), sign, byte) << U64(8 * i)
        self.write(d, out, active, "b32")

    def _selp(self, op, ops, active):
        t = op[-1]
        d, a, b, p = ops
        self.write(d, np.where(self.read(p, "pred").astype(bool), self.read(a, t),
                               self.read(b, t)), active, t)  # fmt: skip

    def _setp(self, op, ops, active):
        cmp, t = op[1], op[-1]
        d, a, b = ops
        if t in FLOAT:
            x, y = as_float(self.read(a, t), t), as_float(self.read(b, t), t)
        elif t.startswith("b") and cmp in ("eq", "ne"):
            x, y = self.read(a, t), self.read(b, t)
        else:
            x, y = as_int(self.read(a, t), t), as_int(self.read(b, t), t)
        unordered = np.isnan(x) | np.isnan(y) if t in FLOAT else np.zeros(self.threads, bool)
        with np.errstate(all="ignore"):
            base = {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y,
                    "ge": x >= y, "lo": x < y, "ls": x <= y, "hi": x > y, "hs": x >= y}  # fmt: skip
        name = cmp[:-1] if cmp.endswith("u") and cmp[:-1] in base and t in FLOAT else cmp
        result = base[name] & ~unordered
        if name != cmp:  # the unordered forms: true where either is NaN
            result = base[name] | unordered
        elif cmp == "ne" and t in FLOAT:
            result = (x != y) & ~unordered
        self.write(d, result, active, "pred")

    def _cvt(self, op, ops, active):
        types = [x for x in op[1:] if TYPES.match(x)]
        modes = [x for x in op[1:] if not TYPES.match(x)]
        dt, st = types
        if dt == "f16x2":  # cvt.rn.f16x2.f32 d, hi, lo
            d, hi, lo = ops
            h = from_float(as_float(self.read(hi, st), st).astype(np.float16), "f16")
            lo_ = from_float(as_float(self.read(lo, st), st).astype(np.float16), "f16")
            self.write(d, (h << U64(16)) | lo_, active, "b32")
            return
        d, a = ops
        if st in FLOAT:
            x = as_float(self.read(a, st), st)
            if dt in FLOAT:
                y = from_float(x.astype(np.float64).astype(FLOAT[dt]), dt)
            else:
                if "rni" in modes:
                    x = np.rint(x)
                elif "rzi" in modes or not modes or "rz" in modes:
                    x = np.trunc(x)
                elif "rmi" in modes:
                    x = np.floor(x)
                else:
                    raise PTXError(f"unsupported PTX opcode {'.'.join(op)}")
                y = from_int(x.astype(np.int64), WIDTH[dt])
        else:
            x = as_int(self.read(a, st), st)
            if dt in FLOAT:
                y = from_float(x.astype(np.float64).astype(FLOAT[dt]), dt)
            else:
                y = from_int(as_int(from_int(x, WIDTH[dt]), dt) if WIDTH[dt] < WIDTH[st]
                             else x, WIDTH[dt])  # fmt: skip
        self.write(d, y, active, dt)

    # -- warp-level -------------------------------------------------------------------------

    def _warp(self, v: np.ndarray, source_lane: np.ndarray) -> np.ndarray:
        warp_base = np.arange(self.threads) - self.lane
        return v[warp_base + source_lane]

    def _shfl(self, op, ops, active):
        self._whole_warps(active, "shfl.sync")
        mode = op[2]
        d, a, b = ops[:3]  # then the clamp and the member mask: whole warps here
        lane, v = self.lane.astype(np.int64), self.read(a, "b32")
        bb = self.read(b, "u32").astype(np.int64)
        if mode == "bfly":
            src = lane ^ bb
        elif mode == "idx":
            src = bb
        else:
            raise PTXError(f"unsupported PTX opcode {'.'.join(op)}")
        self.write(d.split("|")[0], self._warp(v, src & 31), active, "b32")

    def _redux(self, op, ops, active):  # redux.sync.add.s32 d, a, membermask
        self._whole_warps(active, "redux.sync")
        kind, t = op[2], op[-1]
        d, a = ops[:2]
        x = as_int(self.read(a, t), t).reshape(-1, 32)
        fn = {"add": np.sum, "min": np.min, "max": np.max, "and": np.bitwise_and.reduce,
              "or": np.bitwise_or.reduce, "xor": np.bitwise_xor.reduce}[kind]  # fmt: skip
        self.write(d, from_int(np.repeat(fn(x, axis=1), 32), WIDTH[t]), active, t)

    def _bar(self, op, ops, active):
        self._whole_warps(active, "bar.sync")

    def _whole_warps(self, active: np.ndarray, what: str):
        if not active.all():
            raise PTXError(f"{what} with threads not converged")

    def _halves(self, reg: str) -> tuple[np.ndarray, np.ndarray]:
        v = self.read(reg, "b32")
        return v & U64(0xFFFF), v >> U64(16)

    def _fragments(self, regs: list[str]) -> np.ndarray:
        """The m8n8 b16 matrices of `regs` ([warps, matrix, 8, 8] bits): lane t holds row t // 4,
        columns 2 (t % 4) and + 1 of each."""
        warps = self.threads // 32
        out = np.zeros((warps, len(regs), 8, 8), U64)
        row, col = self.lane // 4, 2 * (self.lane % 4)
        w = np.arange(self.threads) // 32
        for i, r in enumerate(regs):
            lo, hi = self._halves(r)
            out[w, i, row, col], out[w, i, row, col + 1] = lo, hi
        return out

    def _write_fragments(self, regs: list[str], m: np.ndarray, active):
        row, col = self.lane // 4, 2 * (self.lane % 4)
        w = np.arange(self.threads) // 32
        for i, r in enumerate(regs):
            self.write(r, m[w, i, row, col] | (m[w, i, row, col + 1] << U64(16)), active)

    def _movmatrix(self, op, ops, active):
        self._whole_warps(active, "movmatrix")
        d, a = ops
        m = self._fragments([a]).transpose(0, 1, 3, 2)
        self._write_fragments([d], m, active)

    def _ldmatrix(self, op, ops, active):
        self._whole_warps(active, "ldmatrix")
        dst, addr = ops
        regs = self.vector(dst)
        at, _ = self.address(addr, "shared")
        rows = np.zeros((self.threads // 32, len(regs), 8, 8), U64)
        for w in range(self.threads // 32):
            for i in range(len(regs)):
                for r in range(8):
                    start = at[32 * w + 8 * i + r]
                    line = self.shared.load(start + 2 * np.arange(8), 2)
                    rows[w, i, r] = line
        if "trans" in op:
            rows = rows.transpose(0, 1, 3, 2)
        self._write_fragments(regs, rows, active)

    def _stmatrix(self, op, ops, active):
        self._whole_warps(active, "stmatrix")
        addr, src = ops
        regs = self.vector(src)
        at, _ = self.address(addr, "shared")
        m = self._fragments(regs)
        if "trans" in op:
            m = m.transpose(0, 1, 3, 2)
        for w in range(self.threads // 32):
            for i in range(len(regs)):
                for r in range(8):
                    start = at[32 * w + 8 * i + r]
                    self.shared.store(start + 2 * np.arange(8), 2, m[w, i, r], np.ones(8, bool))

    def _mma(self, op, ops, active):
        self._whole_warps(active, "mma")
        if ".".join(op) != "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32":
            raise PTXError(f"unsupported PTX opcode {'.'.join(op)}")
        d, a, b, c = (self.vector(x) for x in ops)
        w = np.arange(self.threads) // 32
        g, t = self.lane // 4, self.lane % 4
        warps = self.threads // 32
        A = np.zeros((warps, 16, 16))
        B = np.zeros((warps, 16, 8))
        C = np.zeros((warps, 16, 8))

        def f16(bits):
            return as_float(bits, "f16").astype(np.float64)

        for i, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            lo, hi = self._halves(a[i])
            A[w, g + dr, 2 * t + dc], A[w, g + dr, 2 * t + dc + 1] = f16(lo), f16(hi)
        for i in range(2):
            lo, hi = self._halves(b[i])
            B[w, 2 * t + 8 * i, g], B[w, 2 * t + 8 * i + 1, g] = f16(lo), f16(hi)
        for i in range(4):
            C[w, g + 8 * (i // 2), 2 * t + i % 2] = as_float(self.read(c[i], "f32"), "f32")
        D = A @ B + C
        for i in range(4):
            self.write(d[i], from_float(D[w, g + 8 * (i // 2), 2 * t + i % 2], "f32"), active)


def run_kernel(kernel, args: list, grid=(1, 1, 1)):
    """Execute a compiled Triton/Gluon kernel (`triton.compile`'s result, any target: only its
    PTX is read) on CPU tensors, every CTA of `grid` in turn; tensors the kernel stores to are
    updated in place."""
    md = kernel.metadata
    if md.global_scratch_size or md.profile_scratch_size:
        raise PTXError("a kernel with global or profile scratch memory")
    cta = Cta(kernel.asm["ptx"], 32 * md.num_warps, md.shared)
    args = [*args, *[0] * (len(cta.params) - len(args))]  # the scratch pointers, unused
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                cta.run(args, (x, y, z), grid)


def _flatten(value, kind, out: list):
    """The leaves of an argument as Triton passes them: tuples depth first, constexprs left
    out."""
    if kind == "constexpr":
        return
    if isinstance(kind, tuple):
        for v, k in zip(value, kind, strict=True):
            _flatten(v, k, out)
    else:
        out.append(value)


@contextlib.contextmanager
def launches_executed(arch: int = 90):
    """Every Triton launch in the block compiled for sm_{arch} (what a GPU launch compiles: a
    `PACKED` kernel takes its inline-PTX path) and executed here by `run_kernel` on the CPU
    tensors it is given, through Triton's own binder (benchmarks/budget_read.py): the
    kernel as a GPU runs it, checked without one."""
    import budget_read as read
    from triton.runtime.jit import JITFunction

    saved = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if "PACKED" in kwargs:
            kwargs["PACKED"] = True
        named = {k: v for k, v in kwargs.items() if k in self.arg_names}
        bound = self.signature.bind(*args, **named)
        bound.apply_defaults()
        if callable(grid):
            grid = grid(bound.arguments)
        kernel, _log = read.compiled(self, args, kwargs, arch)
        signature = read._bound(self, args, kwargs, arch)[2]
        flat = []
        for name, kind in signature.items():
            _flatten(bound.arguments[name], kind, flat)
        run_kernel(kernel, flat, (*grid, 1, 1)[:3])
        return kernel

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = saved
