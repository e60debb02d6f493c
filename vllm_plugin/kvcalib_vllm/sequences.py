"""What a running sequence keeps outside vLLM's pages: its residual window and its sinks.

The decode rule (`kvcalib_runtime.cache.scheme`) keeps the last R tokens of a sequence exact
and its sink tokens in exact slots; both are per sequence, not per position, so they do not
belong in pages that vLLM counts per token. They live here, in `rows` rows allocated once (one
per sequence vLLM may run at once, `max_num_seqs`), L layers, Hkv heads of D channels:

    tail_k, tail_v   dtype [L, rows, Hkv, max(R, 1), D]  the residual ring: position t at t % R
    sink_k, sink_v   dtype [L, rows, Hkv, S', D]        S' = max(sinks_first + sink_budget, 1)
    sink_pos         int64 [rows, S']                   the position a slot holds, -1 while empty
    is_sink          bool [rows, P]                     P = max_model_len: positions in a slot
    lengths          list[int] per row                  positions stored

A sequence is known by the first block of its block table: vLLM gives every running request
its own blocks (prefix caching is refused at load, so no block is shared), and a request whose
first position is 0 in a step starts afresh (a new request, or one recomputed after
preemption). A request that continues must find its row at the length it left it; anything
else raises instead of reading another sequence's state.
"""

import torch

from kvcalib_runtime.cache.scheme import KVScheme


class SequenceStateError(RuntimeError):
    """A continuing request has no row, or its row does not hold what the step assumes."""


class Sequences:
    """See the module docstring for the buffers."""

    def __init__(self, scheme: KVScheme, *, num_layers: int, rows: int, kv_heads: int,
                 head_dim: int, max_len: int, dtype: torch.dtype):  # fmt: skip
        ring = max(scheme.residual, 1)
        slots = max(scheme.num_sink_slots, 1)
        self.tail_k = torch.zeros(num_layers, rows, kv_heads, ring, head_dim, dtype=dtype)
        self.tail_v = torch.zeros_like(self.tail_k)
        self.sink_k = torch.zeros(num_layers, rows, kv_heads, slots, head_dim, dtype=dtype)
        self.sink_v = torch.zeros_like(self.sink_k)
        self.sink_pos = torch.full((rows, slots), -1, dtype=torch.long)
        self.is_sink = torch.zeros(rows, max_len, dtype=torch.bool)
        self.lengths = [0] * rows
        self._owner: list[int | None] = [None] * rows  # first block id of the row's sequence
        self._row_of: dict[int, int] = {}
        self._last_step = [-1] * rows
        self._step = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.tail_k, self.tail_v, self.sink_k, self.sink_v, self.sink_pos, self.is_sink]

    def bytes_per_sequence(self) -> int:
        """What one row holds, walked over the buffers."""
        return sum(t.nbytes for t in self.tensors()) // len(self.lengths)

    def begin_step(self) -> None:
        self._step += 1

    def row(self, first_block: int, start: int) -> int:
        """The row of the sequence whose block table starts with `first_block` and whose new
        tokens start at position `start` this step: a fresh row when start == 0 (reusing the
        row a finished sequence left on the same block, else a free one, else the one unused
        longest), else the row it has."""
        if start == 0:
            row = self._row_of.get(first_block)
            if row is None:
                row = self._free_row()
            self._reset(row, first_block)
        else:
            row = self._row_of.get(first_block)
            if row is None or self.lengths[row] != start:
                held = None if row is None else self.lengths[row]
                raise SequenceStateError(
                    f"kvcalib: a request on block {first_block} continues at position {start} "
                    f"but its state holds {held}: refusing to attend to the wrong cache"
                )
        self._last_step[row] = self._step
        return row

    def _free_row(self) -> int:
        free = [r for r, owner in enumerate(self._owner) if owner is None]
        if free:
            return free[0]
        row = min(range(len(self._owner)), key=self._last_step.__getitem__)
        if self._last_step[row] == self._step:
            raise SequenceStateError(
                f"kvcalib: more than {len(self._owner)} sequences in one step: raise the "
                "plugin's rows (they follow max_num_seqs)"
            )
        return row

    def _reset(self, row: int, first_block: int) -> None:
        old = self._owner[row]
        if old is not None:
            del self._row_of[old]
        self._owner[row], self._row_of[first_block] = first_block, row
        self.lengths[row] = 0
        self.sink_pos[row] = -1
        self.is_sink[row] = False
