"""One sequence's decode attention on the CPU in C (`decode_cpu.c`), for bodies a byte table
reads (decode_torch's `_window_table`): the scores of every position it holds (RoPE moved onto the
query), then torch's softmax, then the probabilities' sum of the values, each pass reading the
packed rows TILE at a time into L1 and using them there. decode_torch's torch ops instead write
every key and value out in float32, and read them again for RoPE and each matmul.

The source is part of the runtime's C library (`native`: built once per machine, loaded with
ctypes); where there is none (`native.library()` is None), decode_torch keeps its torch ops.
tests/runtime/kernels/test_decode_native.py holds the kernel to the reference as the Triton
kernel is held. Every shape, dtype and stride the C code indexes by is checked before a call.
"""

import ctypes

import torch

from kvcalib_runtime.kernels import native

MAX_ROW = 1024  # decode_cpu.c's MAX_ROW: floats a read row may take
MAX_Q = 8192  # decode_cpu.c's MAX_Q: floats of a sequence's queries


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
        ("exact", ctypes.c_void_p),
    ]


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
    tables alive, and the body's own tensors too unless keep=False (the caller then drops the
    reader when they die)."""

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
        body = (codes, scale, offset, slot_index, slot_delta) if keep else ()
        self._keep = (table, rows, scale_table, fp8_table, step, *body)  # what the struct reads
        p = {name: _ptr(t) for name, t in zip(
            ("table", "rows", "codes", "scale", "offset", "scale_table", "slot_index",
             "slot_delta", "fp8_table", "step"), tensors, strict=True)}  # fmt: skip
        self._struct = _Body(
            **p, rows_per_head=rows.shape[1], head_stride=codes.stride(0), nbytes=nbytes,
            window=window, per=per, width=width, meta=meta, groups=groups,
            meta_stride=meta_stride, zero_step=zero_step, slots=slots, index_bytes=index_bytes,
            slot_code=slot_code, slot_stride=slot_stride,
        )  # fmt: skip

    @classmethod
    def exact(cls, x: torch.Tensor, n: int) -> "Body":
        """The first n rows of one sequence's body left in full precision, float32 [heads, >= n,
        D] with rows contiguous, read as it lies (kept alive by the reader)."""
        heads, _, d = x.shape
        stride = _rows_of(x, "exact", heads, n, d, (torch.float32,))
        if d > MAX_ROW:
            raise ValueError(f"rows of {d} channels: at most {MAX_ROW}")
        out = object.__new__(cls)
        out.heads, out.width, out.n, out._keep = heads, d, n, (x,)
        out._struct = _Body(head_stride=stride, nbytes=d, window=8, per=1, width=d,
                            exact=x.data_ptr())  # fmt: skip
        return out

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
        ("scale", ctypes.c_float),
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


class Sequence:
    """One sequence's decode attention with what stays from step to step checked once and kept:
    the bodies' readers, the rings (tails: keys and values [Hkv, R, D], position t at t % R), the
    sink slots (sinks: keys, values [Hkv, S, D] and positions int64 [S], -1 empty) and the
    is-sink map (bool [P]). Each `attend` is one step; the buffers may change in place between
    steps (the C code reads them as they are then)."""

    def __init__(self, keys: Body, values: Body, tails, sinks, is_sink):
        heads, d = keys.heads, keys.width
        if values.heads != heads or values.width != d:
            raise ValueError(f"bodies of {keys.heads}/{values.heads} heads of {keys.width}/"
                             f"{values.width}")  # fmt: skip
        ring = tails[0].shape[1]
        for t in tails:
            _f32(t, (heads, ring, d))
        count = sinks[2].shape[0]
        for t in sinks[:2]:
            _f32(t, (heads, count, d))
        if sinks[2].dtype != torch.int64 or sinks[2].dim() != 1 or not sinks[2].is_contiguous():
            raise ValueError(f"sink positions: contiguous int64 [{count}]")
        if is_sink.dtype != torch.bool or is_sink.dim() != 1 or not is_sink.is_contiguous():
            raise ValueError("is_sink: contiguous bool [positions]")
        self.keys, self.values, self.heads, self.width = keys, values, heads, d
        self.ring, self.count, self.positions = ring, count, is_sink.shape[0]
        self._keep = (*tails, *sinks, is_sink)  # alive while the struct points at them
        self._struct = _Attend(
            ctypes.pointer(keys._struct), ctypes.pointer(values._struct), heads=heads,
            sinks=count, tail_keys=_ptr(tails[0]), tail_values=_ptr(tails[1]), ring=ring,
            sink_keys=_ptr(sinks[0]), sink_values=_ptr(sinks[1]), sink_pos=_ptr(sinks[2]),
            is_sink=_ptr(is_sink),
        )  # fmt: skip
        self._ref = ctypes.byref(self._struct)

    def attend(self, n: int, nb_keys: int, nb_values: int, q, scale: float, rope, new,
               window: int, scratch) -> torch.Tensor:  # fmt: skip
        """One step, as decode_torch's torch ops compute it: the queries q [Hkv, G, D] times
        `scale` against positions [0, nb_keys) of the key body and [0, nb_values) of the value
        body, the others below n in the ring, the sink slots and the new token (new: key and
        value [Hkv, D], position n); RoPE where rope is (cos, sin) [>= n + 1, D]; positions the
        is-sink map marks and, with a window, those <= n - window unseen; one softmax over all
        of them. scratch: contiguous fp32 of >= Hkv * G * (n + S + 1) elements. Returns fp32
        [Hkv, G, D]."""
        heads, d = self.heads, self.width
        groups = q.shape[1] if q.dim() == 3 else 0
        _f32(q, (heads, groups, d))
        if heads * groups * d > MAX_Q:
            raise ValueError(f"queries of {heads * groups * d} floats: at most {MAX_Q}")
        if not (0 <= nb_keys <= self.keys.n and 0 <= nb_values <= self.values.n):
            raise ValueError(f"bodies read to {nb_keys}/{nb_values} rows of {self.keys.n}/"
                             f"{self.values.n} checked")  # fmt: skip
        if not max(nb_keys, nb_values) <= n <= self.positions or window < 0:
            raise ValueError(f"length {n}: bodies of {nb_keys}/{nb_values} rows, "
                             f"{self.positions} positions, window {window}")  # fmt: skip
        if self.ring < 1 and min(nb_keys, nb_values) < n:
            raise ValueError(f"positions {min(nb_keys, nb_values)}..{n - 1} in an empty ring")
        for t in rope:
            if t.shape[0] < n + 1:
                raise ValueError(f"RoPE tables of {t.shape[0]} positions for {n + 1}")
            _f32(t, (t.shape[0], d))
        if rope and d % 2:
            raise ValueError(f"RoPE over heads of an odd {d} channels")
        for t in new:
            _f32(t, (heads, d))
        length = n + self.count + 1
        if (
            scratch.dtype != torch.float32
            or scratch.numel() < heads * groups * length
            or (not scratch.is_contiguous())
        ):
            raise ValueError(f"scratch: float32 of {heads * groups * length} elements")
        out = torch.empty(heads, groups, d, dtype=torch.float32)
        a = self._struct
        a.n, a.nb_keys, a.nb_values, a.groups, a.window = n, nb_keys, nb_values, groups, window
        a.q, a.scale, a.out = _ptr(q), scale, _ptr(out)
        a.cos, a.sin = (_ptr(t) for t in rope) if rope else (None, None)
        a.new_key, a.new_value = _ptr(new[0]), _ptr(new[1])
        lib = native.library()
        lib.kvcalib_scores(self._ref, _ptr(scratch))
        # torch's softmax: vectorized, and fast where exp underflows (an in-place exp_ of the
        # shifted scores slows 15x on subnormal results, most far positions' at 4K)
        p = torch.softmax(scratch[: heads * groups * length].view(heads * groups, length), -1)
        lib.kvcalib_sum(self._ref, _ptr(p))
        return out


def attend(keys: Body, values: Body, n: int, q, scale: float, rope, tails, sinks, new, is_sink,
           window: int, scratch) -> torch.Tensor:  # fmt: skip
    """One step of `Sequence`, the bodies read to their first keys.n / values.n rows."""
    return Sequence(keys, values, tails, sinks, is_sink).attend(
        n, keys.n, values.n, q, scale, rope, new, window, scratch
    )
