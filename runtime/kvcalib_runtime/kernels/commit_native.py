"""A decode step's writes into a float32 cache on the CPU in C (`commit_cpu.c`): for every stream
(one layer's keys or values) it takes, the flush of the position leaving the residual ring
(quantized and packed), the new token into the ring and the body's size, in one call a step.
The torch path does the same in a few hundred small ops a step (`Stream.append` /
`append_many`), all overhead at one token a stream. The C writer stores the bits the reference
quantizer does (tests/runtime/kernels/test_commit_native.py holds it to that, bit for bit).

It takes a tensor left in full precision, calibrated per-channel ranges ("static", any codes,
exact slots) and per-token groups of a whole head's channels ("token" without outliers), in
float32 caches; `Plan` leaves every other stream to torch. Every buffer's shape, dtype and
layout is checked once, when a cache's plan is made, and the step's inputs at every call.
"""

import ctypes

import torch

from kvcalib_runtime.kernels import native
from kvcalib_runtime.layouts import Kind, metabyte
from kvcalib_runtime.layouts.base import slot_index_dtype

MAX_WIDTH = 1024  # commit_cpu.c's MAX_WIDTH: channels a row may have
EXACT, STATIC, TOKEN = 0, 1, 2


class _Stream(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("width", ctypes.c_int32),
        ("body_slots", ctypes.c_int32),
        ("ring", ctypes.c_int32),
        ("residual", ctypes.c_int32),
        ("flush", ctypes.c_int32),
        ("tail", ctypes.c_void_p),
        ("tail_seq", ctypes.c_int64),
        ("n_body", ctypes.c_void_p),
        ("n_body_seq", ctypes.c_int64),
        ("exact", ctypes.c_void_p),
        ("exact_seq", ctypes.c_int64),
        ("codes", ctypes.c_void_p),
        ("codes_seq", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("nbytes", ctypes.c_int32),
        ("symmetric", ctypes.c_int32),
        ("codebook", ctypes.c_int32),
        ("levels", ctypes.c_void_p),
        ("mids", ctypes.c_void_p),
        ("static_scale", ctypes.c_void_p),
        ("static_offset", ctypes.c_void_p),
        ("lo", ctypes.c_void_p),
        ("hi", ctypes.c_void_p),
        ("groups", ctypes.c_int32),
        ("byte", ctypes.c_int32),
        ("scale", ctypes.c_void_p),
        ("offset", ctypes.c_void_p),
        ("meta_seq", ctypes.c_int64),
        ("clip", ctypes.c_float),
        ("span", ctypes.c_float),
        ("zero_step", ctypes.c_float),
        ("k", ctypes.c_int32),
        ("error_rule", ctypes.c_int32),
        ("fp8", ctypes.c_int32),
        ("index_bytes", ctypes.c_int32),
        ("slot_index", ctypes.c_void_p),
        ("slot_delta", ctypes.c_void_p),
        ("slot_seq", ctypes.c_int64),
        ("fresh", ctypes.c_int32),
    ]


def _seq(t: torch.Tensor, name: str, shape, dtype) -> int:
    """The sequence stride of t [B, ...shape], each sequence's part contiguous and of `dtype`."""
    if t.dtype != dtype or tuple(t.shape[1:]) != tuple(shape) or not t[0].is_contiguous():
        raise ValueError(f"{name}: {dtype} [B, {', '.join(map(str, shape))}] with each "
                         f"sequence contiguous, got {t.dtype} {tuple(t.shape)}")  # fmt: skip
    return t.stride(0)


def _whole(t: torch.Tensor, name: str, shape, dtype=torch.float32) -> int:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"{name}: contiguous {dtype} {tuple(shape)}, got {t.dtype} "
                         f"{tuple(t.shape)}")  # fmt: skip
    return t.data_ptr()


def takes(stream) -> bool:
    """Whether the C writer stores what `stream` (a kvstream.Stream) holds: see the module
    docstring."""
    if stream.tail.device.type != "cpu" or stream.tail.dtype != torch.float32:
        return False
    if stream.spec is None:
        return True
    body, spec = stream.body, stream.spec
    if not spec.layout.affine or spec.layout.joins_heads:  # affine: a PackedBody
        return False
    if body.width > MAX_WIDTH or not all(
        t is None or t.dtype in (torch.float32, torch.uint8, torch.int16) for t in body.tensors()
    ):
        return False
    kind = spec.layout.kind
    if kind == Kind.STATIC:
        return body.scale.dtype == torch.float32
    return kind == Kind.TOKEN and not spec.outliers


def _describe(stream, fresh: int, batch: int) -> _Stream:
    """stream's C description, every buffer checked against the shapes commit_cpu.c indexes."""
    heads, ring, d = stream.tail.shape[1:]
    out = _Stream(heads=heads, width=d, body_slots=stream.slots, ring=ring,
                  residual=stream.residual, flush=stream.flush, fresh=fresh)  # fmt: skip
    if stream.tail.shape[0] != batch or stream.n_body.shape != (batch,):
        raise ValueError(f"a stream of {stream.tail.shape[0]} sequences in a cache of {batch}")
    out.tail, out.tail_seq = stream.tail.data_ptr(), _seq(stream.tail, "tail", (heads, ring, d),
                                                          torch.float32)  # fmt: skip
    if stream.n_body.dtype != torch.int64:
        raise ValueError(f"n_body: int64, got {stream.n_body.dtype}")
    out.n_body, out.n_body_seq = stream.n_body.data_ptr(), stream.n_body.stride(0)
    if stream.spec is None:
        out.kind = EXACT
        out.exact = stream.exact.data_ptr()
        out.exact_seq = _seq(stream.exact, "exact", (heads, stream.slots, d), torch.float32)
        return out
    body, spec = stream.body, stream.spec
    slots = stream.slots
    out.bits, out.nbytes = spec.bits, body.codes.shape[3]
    out.codes = body.codes.data_ptr()
    out.codes_seq = _seq(body.codes, "codes", (heads, slots, (d * spec.bits + 7) // 8),
                         torch.uint8)  # fmt: skip
    out.symmetric, out.codebook = int(spec.symmetric), int(spec.codebook)
    if spec.codebook:
        out.levels = _whole(body.levels, "levels", (heads, spec.levels))
        out.mids = _whole(body.mids, "mids", (heads, spec.levels - 1))
    if spec.layout.kind == Kind.STATIC:
        out.kind = STATIC
        out.static_scale = _whole(body.scale, "scale", (heads, d))
        if not spec.symmetric:
            out.static_offset = _whole(body.offset, "offset", (heads, d))
        k = out.k = spec.layout.slots(d)
        if k:
            out.error_rule, out.fp8 = int(spec.slot_rule == "error"), int(spec.slot_code == "fp8")
            lo, hi = body.static_range
            out.lo, out.hi = (_whole(t, name, (heads, d)) for t, name in ((lo, "lo"), (hi, "hi")))
            index_dtype = slot_index_dtype(d)
            out.index_bytes = index_dtype.itemsize
            out.slot_index = body.slot_index.data_ptr()
            out.slot_seq = _seq(body.slot_index, "slot_index", (heads, slots, k), index_dtype)
            delta_dtype = torch.uint8 if out.fp8 else torch.float32
            if _seq(body.slot_delta, "slot_delta", (heads, slots, k), delta_dtype) != out.slot_seq:
                raise ValueError("slot_delta: laid out as slot_index")
            out.slot_delta = body.slot_delta.data_ptr()
        return out
    out.kind = TOKEN
    out.groups = d // spec.layout.row_group(d)
    out.byte = int(spec.metadata_code == "byte")
    meta = torch.uint8 if out.byte else torch.float32
    out.scale = body.scale.data_ptr()
    out.meta_seq = _seq(body.scale, "scale", (heads, slots, out.groups), meta)
    if not spec.symmetric:
        if _seq(body.offset, "offset", (heads, slots, out.groups), meta) != out.meta_seq:
            raise ValueError("offset: laid out as scale")
        out.offset = body.offset.data_ptr()
    out.clip, out.span = spec.clip, spec.layout.span
    out.zero_step = metabyte.zero_step(spec.layout.span)
    return out


def plan(sides, batch: int) -> "Plan | None":
    """The plan for the streams it takes of `sides` (the keys' and the values' streams, per
    layer) for `batch` sequences; None when it takes none."""
    streams = [
        (j, layer, stream)
        for j, side in enumerate(sides)
        for layer, stream in enumerate(side)
        if takes(stream)
    ]
    return Plan(streams, batch) if streams else None


class Plan:
    """The C writer's description of the streams of one cache it takes (`takes`), in the order
    given; streams: (key, layer, kvstream.Stream) with key 0 for keys, 1 for values. Built once
    per cache, with every buffer checked; `run` is one decode step."""

    def __init__(self, streams, batch: int):
        self.batch = batch
        self.order = [(layer, key) for key, layer, _ in streams]
        self.streams = set(self.order)
        self.layers = {layer for layer, _ in self.order}
        found = [_describe(s, i, batch) for i, (_, _, s) in enumerate(streams)]
        shapes = {(s.heads, s.width) for s in found}
        if len(shapes) > 1:
            raise ValueError(f"streams of different head shapes {sorted(shapes)}")
        self.shape = shapes.pop() if shapes else None
        self._streams = (_Stream * len(found))(*found)
        self._keep = [t for _, _, s in streams for t in _buffers(s)]  # alive while pointed at

    def run(self, pending: dict, lengths: torch.Tensor) -> bool:
        """One decode step's writes, if it can: pending[layer] = (key, value), each float32
        [B, heads, 1, width] (what the cache stages) of the tokens at positions lengths (int64
        [B]). False (nothing written: torch writes) where a layer of the plan is not pending."""
        if not self.layers <= pending.keys():
            return False
        fresh = torch.stack([pending[layer][key][:, :, 0] for layer, key in self.order])
        if fresh.dtype != torch.float32 or fresh.shape[1:] != (self.batch, *self.shape):
            raise ValueError(f"new tokens {fresh.dtype} {tuple(fresh.shape[1:])} for streams of "
                             f"{self.batch} x {self.shape} in float32")  # fmt: skip
        if (
            lengths.dtype != torch.int64
            or lengths.shape != (self.batch,)
            or not lengths.is_contiguous()
        ):
            raise ValueError(f"lengths: contiguous int64 [{self.batch}]")
        native.library().kvcalib_commit(
            self._streams, len(self.order), fresh.data_ptr(), self.batch, lengths.data_ptr()
        )
        return True


def _buffers(stream) -> list[torch.Tensor]:
    found = [stream.tail, stream.n_body, stream.exact]
    if stream.body is not None:
        found += stream.body.tensors()
    return [t for t in found if t is not None]
