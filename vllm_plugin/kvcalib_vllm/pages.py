"""kvcalib's packed layout inside vLLM's pages: what one token of every layer occupies.

vLLM hands an attention backend one page per block of `block_size` tokens. Here one page holds
every layer (layer 0 owns the cache, the others share it: `model`), laid out per token:

    page [block_size, C] uint8   per token, the fields of every layer's keys and values;
                                 C = their bytes, padded to `ALIGN`
    a field is one per-token buffer of a tensor's layout body (`kvcalib_runtime.layouts`),
    every head of the token:
        codes        uint8 [heads, ceil(width * bits / 8)]  ("vq": [heads, ceil(D / w * bits / 8)],
                                                    one index per vector of w channels)
        scale/offset dtype [heads, width / g]      (per-token groups, uint8 with one-byte
                                                    metadata; per-layer metadata, as
                                                    "static" and "vq" keep it, is not in the page)
        slot_index   uint8/int16 [heads, K]         exact slots
        slot_delta   dtype or uint8 [heads, K]
        exact        dtype [Hkv, D]                 a tensor the scheme leaves in full precision

A field's bytes are those of the body the layout allocates for one token (walked on the meta
device), so the page is what the runtime's cache stores per position, no formula. Fields are
placed by element size (largest first, whatever their layer) so every view is aligned. What a
sequence keeps besides its positions (the residual ring, the sink slots) is per sequence, not
per token: it lives in `sequences.Sequences`, outside the pages.

`TensorPages.body(raw)` views the whole cache as the runtime's PackedBody (a "vq" CodeBody)
with B = blocks and N = block_size (slot t of block b holds position j * block_size + t of the
sequence whose block table has b at j): the runtime's paged body (`kernels.paged`). The
runtime's reference writer (`quant_pack_reference`; a CodeBody's own `write`) stores into pages,
its decode kernel reads them in place through the block table, and its CPU readers read a
sequence's blocks gathered in block-table order (`gather`).
"""

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvcalib_runtime.cache.scheme import KVParams, LayerScheme
from kvcalib_runtime.kernels import paged
from kvcalib_runtime.layouts.body import Body

ALIGN = 8  # bytes: a row is a multiple of every element size it holds (and of the model dtype)


@dataclass(frozen=True)
class Field:
    """One per-token buffer of a tensor: `shape` = (heads, ...) per token, at `offset` bytes
    from the start of the token's row in the page."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class TensorPages:
    """Layer `layer`'s keys or values (`kind`) in the pages, for Hkv heads of D channels.

    const: the layout's body for zero positions, holding what is per layer (static ranges and
    their metadata, codebooks), or None for a tensor left in full precision.
    fields: the per-token buffers (their offsets set by `PageLayout`).
    """

    def __init__(self, kind: str, layer: int, ls: LayerScheme, params: KVParams, kv_heads: int,
                 head_dim: int, dtype: torch.dtype):  # fmt: skip
        self.kind, self.layer = kind, layer
        self.spec = getattr(ls, kind)
        self.flush = getattr(ls, f"{kind}_flush")
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        if self.spec is None:
            self.const = None
            self.fields = [Field("exact", dtype, (kv_heads, head_dim))]
            return
        layout = self.spec.layout
        calibrated = dict(
            static_range=getattr(params, f"{kind}_range").get(layer),
            codebook=getattr(params, f"{kind}_codebook").get(layer),
            split=getattr(params, f"{kind}_split").get(layer),
        )
        one = layout.allocate((1, kv_heads, 1, head_dim), torch.device("meta"), dtype, **calibrated)
        self.const = layout.allocate((1, kv_heads, 0, head_dim), "cpu", dtype, **calibrated)
        self.fields = []
        for name, t in one.per_token().items():
            assert t.shape[0] == 1 and t.shape[2] == 1, (name, t.shape)
            self.fields.append(Field(name, t.dtype, (t.shape[1], *t.shape[3:])))

    @property
    def nbytes(self) -> int:
        """Bytes of one token of this tensor in a page."""
        return sum(f.nbytes for f in self.fields)

    def body(self, raw: torch.Tensor) -> Body | torch.Tensor:
        """The whole cache as this tensor's storage: raw uint8 [blocks, block_size, C] (a view
        of vLLM's page buffer) -> PackedBody or CodeBody with B = blocks, N = block_size (views,
        no copy), or an exact dtype [blocks, Hkv, block_size, D] view."""
        views = {f.name: _view(raw, f) for f in self.fields}
        if self.const is None:
            return views["exact"]
        return self.const.with_rows(views)

    def gather(self, body, blocks: torch.Tensor):
        """A sequence's storage in position order: blocks LongTensor [m] (its block table) ->
        the body with B = 1 and N = m * block_size (copies of its blocks)."""
        return paged.gather(body, blocks[None])


def _view(raw: torch.Tensor, f: Field) -> torch.Tensor:
    """raw uint8 [blocks, bs, C] -> field f as [blocks, heads, bs, ...] (a strided view)."""
    blocks, bs, _ = raw.shape
    t = raw[:, :, f.offset : f.offset + f.nbytes].view(f.dtype)
    return t.view(blocks, bs, *f.shape).movedim(2, 1)


class PageLayout:
    """Every layer's keys and values in one page row per token (see the module docstring).

    tensors: per layer, (keys, values) TensorPages; row_bytes: C, the bytes of one token of
    every layer in the page (the per-token content vLLM's block manager counts).
    """

    def __init__(self, scheme, params: KVParams, *, kv_heads: int, head_dim: int, dtype):
        self.tensors = [
            tuple(TensorPages(kind, i, ls, params, kv_heads, head_dim, dtype)
                  for kind in ("key", "value"))
            for i, ls in enumerate(scheme.layers)
        ]  # fmt: skip
        # fields of all tensors, largest element first: each field starts aligned
        order = sorted(
            ((t, f) for pair in self.tensors for t in pair for f in t.fields),
            key=lambda tf: -tf[1].dtype.itemsize,
        )
        at, placed = 0, {}
        for t, f in order:
            placed.setdefault(id(t), []).append(dataclasses.replace(f, offset=at))
            at += f.nbytes
        for pair in self.tensors:
            for t in pair:
                t.fields = placed[id(t)]
        self.row_bytes = -(-at // ALIGN) * ALIGN

    def fp_row_bytes(self, dtype: torch.dtype) -> int:
        """C of vLLM's own cache in `dtype`: keys and values of every layer in full precision."""
        t = self.tensors[0][0]
        return len(self.tensors) * 2 * t.kv_heads * t.head_dim * dtype.itemsize
