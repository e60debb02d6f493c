"""What a running sequence keeps outside vLLM's pages: its residual window and its sinks.

The decode rule (`kvcalib_runtime.cache.scheme`) keeps the last R tokens of a sequence exact
and its sink tokens in exact slots; both are per sequence, not per position, so they do not
belong in pages that vLLM counts per token. Each sequence has a `Row` (L layers, Hkv heads of D
channels), allocated when a sequence first needs one and reused after it finishes:

    tail_k, tail_v   dtype [L, Hkv, max(R, 1), D]  the residual ring: position t at t % R
    sink_k, sink_v   dtype [L, Hkv, S', D]         S' = max(sinks_first + sink_budget, 1)
    sink_pos         int64 [S']                    the position a slot holds, -1 while empty
    is_sink          bool [P]                      P = max_model_len: positions in a slot
    length           int                           positions stored

A sequence is known by the first block of its block table: vLLM gives every running request
its own blocks (prefix caching is refused at load, so no block is shared), and a request whose
first position is 0 in a step starts afresh (a new request, or one recomputed after
preemption). A request that continues must find its row at the length it left it; anything
else raises instead of reading another sequence's state.
"""

from dataclasses import dataclass

import torch

from kvcalib_runtime.cache.scheme import KVScheme


class SequenceStateError(RuntimeError):
    """A continuing request has no row, or its row does not hold what the step assumes."""


@dataclass(eq=False)
class Row:
    """One sequence's state (shapes in the module docstring)."""

    tail_k: torch.Tensor
    tail_v: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_pos: torch.Tensor
    is_sink: torch.Tensor
    length: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.tail_k, self.tail_v, self.sink_k, self.sink_v, self.sink_pos, self.is_sink]

    def reset(self) -> None:
        self.length = 0
        self.sink_pos.fill_(-1)
        self.is_sink.zero_()


class Sequences:
    """At most `rows` rows, made on demand; see the module docstring."""

    def __init__(self, scheme: KVScheme, *, num_layers: int, rows: int, kv_heads: int,
                 head_dim: int, max_len: int, dtype: torch.dtype):  # fmt: skip
        ring, slots = max(scheme.residual, 1), max(scheme.num_sink_slots, 1)
        self._shapes = dict(
            tail=(num_layers, kv_heads, ring, head_dim),
            sink=(num_layers, kv_heads, slots, head_dim),
            slots=slots,
            max_len=max_len,
        )
        self.dtype, self.capacity = dtype, rows
        self._rows: list[Row] = []
        self._owner: list[int] = []  # first block id of each row's sequence
        self._last_step: list[int] = []
        self._step = 0

    def new_row(self) -> Row:
        s, dtype = self._shapes, self.dtype
        row = Row(
            torch.zeros(s["tail"], dtype=dtype),
            torch.zeros(s["tail"], dtype=dtype),
            torch.zeros(s["sink"], dtype=dtype),
            torch.zeros(s["sink"], dtype=dtype),
            torch.full((s["slots"],), -1, dtype=torch.long),
            torch.zeros(s["max_len"], dtype=torch.bool),
        )
        return row

    def bytes_per_sequence(self) -> int:
        """What one row holds, walked over the buffers of a new one."""
        return sum(t.nbytes for t in self.new_row().tensors())

    def begin_step(self) -> None:
        self._step += 1

    def row(self, first_block: int, start: int) -> Row:
        """The row of the sequence whose block table starts with `first_block` and whose new
        tokens start at position `start` this step: a fresh row when start == 0 (the row a
        finished sequence left on the same block, else a new one while fewer than `capacity`
        exist, else the one unused longest), else the row it has."""
        i = self._owner.index(first_block) if first_block in self._owner else None
        if start == 0:
            if i is None:
                i = self._take()
            self._owner[i] = first_block
            self._rows[i].reset()
        elif i is None or self._rows[i].length != start:
            held = None if i is None else self._rows[i].length
            raise SequenceStateError(
                f"kvcalib: a request on block {first_block} continues at position {start} "
                f"but its state holds {held}: refusing to attend to the wrong cache"
            )
        self._last_step[i] = self._step
        return self._rows[i]

    def _take(self) -> int:
        if len(self._rows) < self.capacity:
            self._rows.append(self.new_row())
            self._owner.append(-1)
            self._last_step.append(-1)
            return len(self._rows) - 1
        i = min(range(len(self._rows)), key=self._last_step.__getitem__)
        if self._last_step[i] == self._step:
            raise SequenceStateError(
                f"kvcalib: more than {self.capacity} sequences in one step (the plugin keeps "
                "2 x max_num_seqs rows)"
            )
        return i
