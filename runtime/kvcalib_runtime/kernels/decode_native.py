"""One sequence's decode attention on the CPU in C (`decode_cpu.c`), for bodies a byte table
reads (decode_torch's `_window_table`): the scores of every position it holds (RoPE moved onto the
query), then torch's softmax, then the probabilities' sum of the values, each pass reading the
packed rows TILE at a time into L1 and using them there. decode_torch's torch ops instead write
every key and value out in float32, and read them again for RoPE and each matmul.

The source is compiled once per machine with the system's C compiler (`cc`, or $CC; 12-14 s of
CPU at -O3) into cache_dir()/native/, named by the source, the flags, the compiler and the
CPU's features (-march=native), and loaded with ctypes: the runtime needs nothing else. With no
compiler, a build that fails (a warning says so) or KVCALIB_NATIVE=0, `library()` is None and
decode_torch keeps its torch ops. tests/runtime/test_decode_native.py holds the kernel to the
reference as the Triton kernel is held. Every shape, dtype and stride the C code indexes by is
checked before a call.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from kvcalib_runtime.cachedir import cache_dir

SOURCE = Path(__file__).with_name("decode_cpu.c")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=gnu11", "-shared", "-fPIC")
LIBS = ("-lm",)
MAX_ROW = 1024  # decode_cpu.c's MAX_ROW: floats a read row may take


class _Body(ctypes.Structure):
    _fields_ = [
        ("table", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("rows_per_head", ctypes.c_int32),
        ("codes", ctypes.c_void_p),
        ("head_stride", ctypes.c_int64),
        ("nbytes", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("per", ctypes.c_int32),
        ("width", ctypes.c_int32),
        ("meta", ctypes.c_int32),
        ("groups", ctypes.c_int32),
        ("scale", ctypes.c_void_p),
        ("offset", ctypes.c_void_p),
        ("meta_stride", ctypes.c_int64),
        ("scale_table", ctypes.c_void_p),
        ("zero_step", ctypes.c_float),
        ("slots", ctypes.c_int32),
        ("index_bytes", ctypes.c_int32),
        ("slot_code", ctypes.c_int32),
        ("slot_index", ctypes.c_void_p),
        ("slot_delta", ctypes.c_void_p),
        ("slot_stride", ctypes.c_int64),
        ("fp8_table", ctypes.c_void_p),
        ("step", ctypes.c_void_p),
    ]


_LOCK = threading.Lock()
_LOADED: dict = {}


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _build(compiler: str) -> Path:
    """The compiled library in the cache, built there (atomically) when missing; OSError when
    it cannot be."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [SOURCE.read_text(), *FLAGS, *LIBS, version, platform.machine(), _cpu_features()]
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "native" / f"decode_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), *LIBS],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            raise OSError(done.stderr.strip().splitlines()[-1] if done.stderr else "no output")
        built.replace(target)
    return target


def library():
    """The loaded kernel library, or None (no compiler, a build that failed, KVCALIB_NATIVE=0):
    built on first use, once per process."""
    if os.environ.get("KVCALIB_NATIVE", "1") == "0":
        return None
    with _LOCK:
        if "lib" not in _LOADED:
            _LOADED["lib"] = None
            compiler = shutil.which(os.environ.get("CC", "cc"))
            if compiler is not None:
                try:
                    lib = ctypes.CDLL(str(_build(compiler)))
                except OSError as e:
                    warnings.warn(f"kvcalib_runtime: the CPU decode kernel did not build ({e}); "
                                  "decoding with torch ops", stacklevel=2)  # fmt: skip
                else:
                    for name in ("kvcalib_scores", "kvcalib_sum"):
                        getattr(lib, name).argtypes = [ctypes.POINTER(_Attend), ctypes.c_void_p]
                        getattr(lib, name).restype = None
                    _LOADED["lib"] = lib
        return _LOADED["lib"]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_of(t: torch.Tensor, name: str, heads: int, n: int, last: int, dtypes) -> int:
    """The head stride of `t` [heads, >= n, last] (rows contiguous, in one of `dtypes`)."""
    if t.dtype not in dtypes or t.dim() != 3 or t.shape[0] != heads or t.shape[1] < n:
        raise ValueError(f"{name}: {dtypes} [{heads}, >= {n}, {last}], got {t.dtype} "
                         f"{tuple(t.shape)}")  # fmt: skip
    if t.shape[2] != last or t.stride(2) != 1 or t.stride(1) != last:
        raise ValueError(f"{name}: rows of {last} contiguous, got strides {t.stride()}")
    return t.stride(0)


def _f32(t: torch.Tensor | None, shape) -> torch.Tensor:
    if t is None:
        raise ValueError(f"expected contiguous float32 {tuple(shape)}, got None")
    if t.dtype != torch.float32 or tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"expected contiguous float32 {tuple(shape)}, got {t.dtype} "
                         f"{tuple(t.shape)}")  # fmt: skip
    return t


class Body:
    """The first n rows of one sequence's packed body as decode_cpu.c reads them.

    table fp32 [R, per], rows int32 [heads, windows or 1]   decode_torch's window table
    codes uint8 [heads, >= n, nbytes]                        rows contiguous; window 8 or 6
    scale, offset [heads, >= n, groups]                      per-token metadata: float32, or
                                                             uint8 codes with scale_table (fp32
                                                             [256]) and zero_step (byte
                                                             metadata, layouts.metabyte); None:
                                                             static (folded into the table)
    slot_index uint8/int16, slot_delta [heads, >= n, K]      exact slots: float32 deltas, or
                                                             E4M3 bytes with fp8_table (fp32
                                                             [256]) and step (fp32 [heads, D])

    Every shape, dtype and stride the C code indexes by is checked here. The reader keeps the
    tensors alive, or with keep=False leaves that to the caller (who drops it when they die)."""

    def __init__(self, table, rows, codes, window, per, width, n, *, scale=None, offset=None,
                 scale_table=None, zero_step=0.0, slot_index=None, slot_delta=None,
                 fp8_table=None, step=None, keep=True):  # fmt: skip
        heads, _, nbytes = codes.shape
        count = nbytes * 8 // window
        if window not in (6, 8) or (window == 6 and nbytes % 3) or count * per > MAX_ROW:
            raise ValueError(f"rows of {nbytes} bytes in {window}-bit windows of {per}")
        _rows_of(codes, "codes", heads, n, nbytes, (torch.uint8,))
        if not 0 < width <= count * per:
            raise ValueError(f"rows of width {width} from {count} windows of {per}")
        if rows.dtype != torch.int32 or rows.dim() != 2 or rows.shape[0] != heads:
            raise ValueError(f"rows: int32 [{heads}, W], got {rows.dtype} {tuple(rows.shape)}")
        if rows.shape[1] not in (1, count) or not rows.is_contiguous():
            raise ValueError(f"rows: one per head or per window ({count}), contiguous")
        _f32(table, (table.shape[0], per))
        if rows.min() < 0 or rows.max() + (1 << window) > table.shape[0]:
            raise ValueError("the rows index past the table")
        meta, groups, meta_stride = 0, 1, 0
        if scale is not None:
            meta, groups = (2 if scale.dtype == torch.uint8 else 1), scale.shape[-1]
            kinds = (scale.dtype,) if scale.dtype in (torch.uint8, torch.float32) else ()
            meta_stride = _rows_of(scale, "scale", heads, n, groups, kinds)
            if offset is not None and _rows_of(offset, "offset", heads, n, groups, kinds) != (
                meta_stride
            ):
                raise ValueError("offset: laid out as scale")
            if width % groups:
                raise ValueError(f"{groups} groups in rows of {width}")
            if meta == 2:
                _f32(scale_table, (256,))
        slots = index_bytes = slot_code = slot_stride = 0
        if slot_index is not None:
            slots = slot_index.shape[-1]
            index_bytes = slot_index.element_size()
            slot_stride = _rows_of(slot_index, "slot_index", heads, n, slots,
                                   (torch.uint8, torch.int16))  # fmt: skip
            slot_code = int(slot_delta.dtype == torch.uint8)
            if _rows_of(slot_delta, "slot_delta", heads, n, slots,
                        (torch.uint8, torch.float32)) != slot_stride:  # fmt: skip
                raise ValueError("slot_delta: laid out as slot_index")
            if slot_code:
                _f32(fp8_table, (256,))
                _f32(step, (heads, width))
        self.heads, self.width, self.n = heads, width, n
        tensors = (table, rows, codes, scale, offset, scale_table, slot_index, slot_delta,
                   fp8_table, step)  # fmt: skip
        self._keep = tensors if keep else ()  # alive while the struct points at them
        p = {name: _ptr(t) for name, t in zip(
            ("table", "rows", "codes", "scale", "offset", "scale_table", "slot_index",
             "slot_delta", "fp8_table", "step"), tensors, strict=True)}  # fmt: skip
        self._struct = _Body(
            **p, rows_per_head=rows.shape[1], head_stride=codes.stride(0), nbytes=nbytes,
            window=window, per=per, width=width, meta=meta, groups=groups,
            meta_stride=meta_stride, zero_step=zero_step, slots=slots, index_bytes=index_bytes,
            slot_code=slot_code, slot_stride=slot_stride,
        )  # fmt: skip

    def first(self, n: int) -> "Body":
        """The same body, read to its first n rows (at most those it was checked for)."""
        if not 0 <= n <= self.n:
            raise ValueError(f"{n} rows of a body checked for {self.n}")
        out = object.__new__(Body)
        out.__dict__.update(self.__dict__, n=n)
        return out


class _Attend(ctypes.Structure):
    _fields_ = [
        ("keys", ctypes.POINTER(_Body)),
        ("values", ctypes.POINTER(_Body)),
        ("n", ctypes.c_int64),
        ("nb_keys", ctypes.c_int64),
        ("nb_values", ctypes.c_int64),
        ("heads", ctypes.c_int32),
        ("groups", ctypes.c_int32),
        ("sinks", ctypes.c_int32),
        ("q", ctypes.c_void_p),
        ("turned", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("tail_keys", ctypes.c_void_p),
        ("tail_values", ctypes.c_void_p),
        ("ring", ctypes.c_int64),
        ("sink_keys", ctypes.c_void_p),
        ("sink_values", ctypes.c_void_p),
        ("sink_pos", ctypes.c_void_p),
        ("new_key", ctypes.c_void_p),
        ("new_value", ctypes.c_void_p),
        ("is_sink", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("out", ctypes.c_void_p),
    ]


def attend(keys: Body, values: Body, n: int, q, rope, tails, sinks, new, is_sink, window: int,
           scratch) -> torch.Tensor:  # fmt: skip
    """One sequence's decode attention, as decode_torch's torch ops compute it: q [Hkv, G, D]
    (scaled) against positions [0, keys.n) of the key body and [0, values.n) of the value body,
    the others below n in the ring (tails: keys and values [Hkv, R, D], position t at t % R), the
    sink slots (sinks: keys, values [Hkv, S, D] and positions int64 [S], -1 empty) and the new
    token (new: key and value [Hkv, D], position n); RoPE where rope is (cos, sin) [>= n + 1, D];
    positions is_sink [>= n] marks and, with a window, those <= n - window unseen; one softmax
    over all of them. scratch: contiguous fp32 of >= Hkv * G * (n + S + 1) elements. Returns fp32
    [Hkv, G, D]."""
    heads, groups, d = q.shape
    if keys.heads != heads or values.heads != heads or {keys.width, values.width} != {d}:
        raise ValueError(f"bodies of {keys.heads}/{values.heads} heads of {keys.width}/"
                         f"{values.width} for q {tuple(q.shape)}")  # fmt: skip
    if not max(keys.n, values.n) <= n <= is_sink.shape[0] or window < 0:
        raise ValueError(f"length {n}: bodies of {keys.n}/{values.n} rows, {is_sink.shape[0]} "
                         f"positions, window {window}")  # fmt: skip
    _f32(q, (heads, groups, d))
    q1, q2 = q.chunk(2, -1)
    turned = torch.cat([q2, -q1], -1)
    for t in rope:
        if t.shape[0] < n + 1:
            raise ValueError(f"RoPE tables of {t.shape[0]} positions for {n + 1}")
        _f32(t, (t.shape[0], d))
    ring = tails[0].shape[1]
    for t in tails:
        _f32(t, (heads, ring, d))
    if ring < 1 and min(keys.n, values.n) < n:
        raise ValueError(f"positions {min(keys.n, values.n)}..{n - 1} in an empty ring")
    count = sinks[2].shape[0]
    for t in sinks[:2]:
        _f32(t, (heads, count, d))
    for t in new:
        _f32(t, (heads, d))
    if sinks[2].dtype != torch.int64 or sinks[2].dim() != 1 or not sinks[2].is_contiguous():
        raise ValueError(f"sink positions: contiguous int64 [{count}]")
    if is_sink.dtype != torch.bool or is_sink.dim() != 1 or not is_sink.is_contiguous():
        raise ValueError("is_sink: contiguous bool [positions]")
    length = n + count + 1
    if (
        scratch.dtype != torch.float32
        or scratch.numel() < heads * groups * length
        or (not scratch.is_contiguous())
    ):
        raise ValueError(f"scratch: float32 of {heads * groups * length} elements")
    out = torch.empty(heads, groups, d, dtype=torch.float32)
    cos, sin = rope or (None, None)
    spec = _Attend(
        ctypes.pointer(keys._struct), ctypes.pointer(values._struct), n, keys.n, values.n, heads,
        groups, count, _ptr(q), _ptr(turned), _ptr(cos), _ptr(sin), *map(_ptr, tails), ring,
        _ptr(sinks[0]), _ptr(sinks[1]), _ptr(sinks[2]), *map(_ptr, new), _ptr(is_sink), window,
        _ptr(out),
    )  # fmt: skip
    lib = library()
    lib.kvcalib_scores(ctypes.byref(spec), _ptr(scratch))
    # torch's softmax: vectorized, and fast where exp underflows (an in-place exp_ of the
    # shifted scores slows 15x on subnormal results, most far positions' at 4K)
    p = torch.softmax(scratch[: heads * groups * length].view(heads * groups, length), -1)
    lib.kvcalib_sum(ctypes.byref(spec), _ptr(p))
    return out
