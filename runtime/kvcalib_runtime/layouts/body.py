"""What `Layout.allocate` returns: a body, one layer's keys or values as a cache stores them for
B sequences (or vLLM's blocks) of N slots. Code outside layouts/ reads a body through this
protocol only, never by asking its class (tests/toolkit/test_import_rules.py):

    kind          where its metadata lives (base.Kind; EXACT: a tensor left in full precision)
    packed        its rows are kvcalib's packed affine groups (layouts.packed_body.PackedBody): the
                  cache's packed writer (kernels.quant_pack) stores them, and the CPU path reads
                  them by byte tables (kernels.decode_torch, decode_native); otherwise the body
                  writes its own rows (`write`, `flush`) and reads them with `dequantize`
    slots         N, the slots of a row (position t at slot t % N)
    tensors()     every tensor it holds: what its memory is
    view(b)       sequence b alone (B = 1), sharing storage
    dequantize(dtype, b=None, n=None)
                  the reference read: slots [0, n) of sequence b (default all) in plain torch,
                  [B, Hkv, n, D] ([Hkv, n, D] for one sequence)
    per_token()   its buffers of one row per (block, head, slot), by field name: what a vLLM
                  page holds of a token (ValueError where the body is not paged)
    with_rows(rows)  the same body over other per-token buffers (a page view, a gather)
    stream_args(head_dim, unit)  what the decode kernel reads of it (`StreamArgs`)
    write(x, seq, start, active=None), flush(tail, new, lengths, start, end, n)
                  its own writer (bodies that are not `packed`): kernels.quant_pack's contracts

`as_body` is the adapter for a tensor left in full precision, which a cache keeps bare.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

import torch

from kvcalib_runtime.layouts.base import Kind

NONE = (0, 0, 0)  # the strides of a buffer a stream does not read per token


def rows(t: torch.Tensor | None) -> tuple[int, int, int]:
    """Element strides (block or sequence, head row, slot) of t [B, heads, N, ...], or NONE."""
    return NONE if t is None else tuple(t.stride()[:3])


class StreamArgs(NamedTuple):
    """What the decode kernel reads of one body (kernels.decode_attention's StreamBuffers and
    StreamLayout, whose docstrings give every field, less the ring and the sizes it adds).

    buffers    (codes, scale, offset, levels, slot_index, slot_delta): those a layout does not
               use repeat the codes
    strides    rows() of codes, scale (and offset), slot_index, slot_delta
    meta_rows  metadata rows of a "channel" body, else 1
    layout     StreamLayout's fields but RING
    """

    buffers: tuple[torch.Tensor, ...]
    strides: tuple[tuple[int, int, int], ...]
    meta_rows: int
    layout: dict


Unit = Callable[[int, int], int]  # kernels.tiles.unit: the bits of one code load


class Body(Protocol):
    kind: Kind
    packed: bool

    @property
    def slots(self) -> int: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def view(self, b: int) -> "Body": ...

    def dequantize(
        self, dtype, b: int | None = None, n: int | None = None, start: int = 0
    ) -> torch.Tensor:
        """Slots [start, n) (default all) of sequence b (default every one), the reference read;
        each slot reads the same whatever the span (start a multiple of the layout's token
        group)."""

    def per_token(self) -> dict[str, torch.Tensor]: ...

    def with_rows(self, rows: dict[str, torch.Tensor]) -> "Body": ...

    def stream_args(self, head_dim: int, unit: Unit) -> StreamArgs: ...


@dataclass
class ExactBody:
    """A tensor left in full precision as a body: values dtype [B, Hkv, N, D]."""

    values: torch.Tensor
    kind: ClassVar[Kind] = Kind.EXACT
    packed: ClassVar[bool] = False

    @property
    def slots(self) -> int:
        return self.values.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.values]

    def view(self, b: int) -> "ExactBody":
        return ExactBody(self.values[b : b + 1])

    def dequantize(
        self, dtype, b: int | None = None, n: int | None = None, start: int = 0
    ) -> torch.Tensor:
        held = self.values if b is None else self.values[b]
        return held[..., start:n, :].to(dtype)

    def per_token(self) -> dict[str, torch.Tensor]:
        return {"exact": self.values}

    def with_rows(self, rows: dict[str, torch.Tensor]) -> "ExactBody":
        return ExactBody(rows["exact"])

    def stream_args(self, head_dim: int, unit: Unit) -> StreamArgs:
        exact = dict(BITS=16, GRAN=Kind.EXACT.value, GROUP=1, SYM=True, CB=False, K=0, FP8=False,
                     VEC=False, UNIT=8, BOOK=0, PAIRS=False)  # fmt: skip
        return StreamArgs((self.values,) * 6, (rows(self.values), NONE, NONE, NONE), 1, exact)


def as_body(stored) -> Body:
    """A cache's stored body as a Body: a bare full-precision tensor wrapped (ExactBody), any
    layout's body as it is."""
    return ExactBody(stored) if isinstance(stored, torch.Tensor) else stored


def replace_rows(body, rows: dict[str, torch.Tensor]):
    """`with_rows` of a dataclass body whose per-token fields are named as `per_token` names
    them."""
    return dataclasses.replace(body, **rows)


def flush_by_write(body, tail, new, lengths, start, end, n: int) -> None:
    """A decode step's flush (kernels.quant_pack.flush_reference's contract) through a body's
    own `write`: positions [start[b], start[b] + n) where start[b] < end[b], from the ring tail
    [B, Hkv, R, D] below lengths[b] and the new token new [B, Hkv, D] otherwise."""
    seq = torch.arange(len(start), device=start.device)
    pos = start[:, None] + torch.arange(n, device=start.device)  # [B, n]
    old = tail[seq[:, None], :, pos % tail.shape[2]]  # [B, n, Hkv, D]
    x = torch.where((pos < lengths[:, None])[..., None, None], old, new[:, None])
    body.write(x.transpose(1, 2), seq, start, active=start < end)
