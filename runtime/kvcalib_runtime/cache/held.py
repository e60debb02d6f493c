"""A quantized cache's bodies kept dequantized between reads (`QuantizedCache(keep_dequantized=
True)`): the reference read of the history (`QuantizedCache.materialize`, a prefill's gather)
dequantizes only the positions committed since the last read, not the whole body again.

A body position never changes once flushed while the cache only grows, so what is kept of it
stays right until the lengths go back (`reset`, `restore`), which `rewind` follows. What is kept
is what a slot dequantizes to alone, bit for bit as in a read of the whole body: the dequantized
slot, or what its layout keeps instead (`Layout.kept`): TurboQuant keeps the levels its codes
index, since its inverse rotation is a matrix product whose BLAS rounding depends on how many
rows it multiplies, so it runs over the whole body at every read as before (`Layout.from_kept`).
A sliding window's ring body (slots overwritten) is read whole as before. The kept copies are
the reader's scratch, not storage: `parts` and `memory` leave them out.
"""

import torch

from kvcalib_runtime.cache.kvstream import Stream


class HeldBodies:
    """Per (side: 0 keys / 1 values, layer, row of the cache): buffers [Hkv, slots, w] (the
    dequantized slots, or a TurboBody's levels of each set) and how many of their first slots
    are the body's."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._held: dict[tuple[int, int, int], list] = {}

    def read(self, stream: Stream, key: tuple[int, int, int], b: int, nb: int):
        """`stream.read(b, nb, dtype)` (sequence b of the stream is row key[2] of the cache):
        (first position, [Hkv, nb - first, D])."""
        if stream.spec is None or nb > stream.slots:
            return stream.read(b, nb, self.dtype)
        layout = stream.spec.layout
        held = self._held.get(key)
        if held is None:
            _, hkv, _, d = stream.tail.shape
            device = stream.tail.device
            widths = layout.kept_widths(d, self.dtype)
            bufs = [torch.empty(hkv, stream.slots, w, dtype=t, device=device) for w, t in widths]
            held = self._held[key] = [bufs, 0]
        bufs, done = held
        if nb > done:
            start = done - done % stream.token_group
            new = layout.kept(stream.body, b, nb, start, self.dtype)
            for buf, x in zip(bufs, new, strict=True):
                buf[:, start:nb] = x
            held[1] = nb
        return 0, layout.from_kept(stream.body, [buf[:, :nb] for buf in bufs], b, self.dtype)

    def rewind(self, lengths: dict[int, int], streams) -> None:
        """The rows in `lengths` ({row: tokens stored}) went back: each copy keeps the positions
        still in its body. streams: (keys, values), each a list by layer."""
        for (side, layer, row), held in self._held.items():
            if row in lengths:
                held[1] = min(held[1], streams[side][layer].host_body(lengths[row]))
