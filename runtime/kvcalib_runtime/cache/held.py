"""A quantized cache's bodies kept dequantized between reads (`QuantizedCache(keep_dequantized=
True)`): the reference read of the history (`QuantizedCache.materialize`, a prefill's gather)
dequantizes only the positions committed since the last read, not the whole body again.

A body position never changes once flushed while the cache only grows, so its dequantized copy
stays right until the lengths go back (`reset`, `restore`), which `rewind` follows. A copy is
kept only where it is bit for bit the read of the whole body (`Stream.piecewise`: not a
TurboBody, whose matrix product rounds by how many rows it multiplies) and while the body is
not a ring (a sliding window's slots are overwritten); elsewhere every read dequantizes as
before. The copies are scratch of the reader, not storage: `parts` and `memory` leave them out.
"""

import torch

from kvcalib_runtime.cache.kvstream import Stream


class HeldBodies:
    """Per (side: 0 keys / 1 values, layer, row of the cache): a dtype buffer [Hkv, slots, D]
    and how many of its first positions are the body's, dequantized."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._held: dict[tuple[int, int, int], list] = {}

    def read(self, stream: Stream, key: tuple[int, int, int], b: int, nb: int):
        """`stream.read(b, nb, dtype)` (sequence b of the stream is row key[2] of the cache):
        (first position, [Hkv, nb - first, D])."""
        if stream.spec is None or not stream.piecewise or nb > stream.slots:
            return stream.read(b, nb, self.dtype)
        held = self._held.get(key)
        if held is None:
            _, hkv, _, d = stream.tail.shape
            buf = torch.empty(hkv, stream.slots, d, dtype=self.dtype, device=stream.tail.device)
            held = self._held[key] = [buf, 0]
        buf, done = held
        if nb > done:
            start = done - done % stream.token_group
            buf[:, start:nb] = stream.read(b, nb, self.dtype, start)[1]
            held[1] = nb
        return 0, buf[:, :nb]

    def rewind(self, lengths: dict[int, int], streams) -> None:
        """The rows in `lengths` ({row: tokens stored}) went back: each copy keeps the positions
        still in its body. streams: (keys, values), each a list by layer."""
        for (side, layer, row), held in self._held.items():
            if row in lengths:
                held[1] = min(held[1], streams[side][layer].host_body(lengths[row]))
