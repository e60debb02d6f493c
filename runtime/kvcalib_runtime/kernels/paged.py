"""Decode attention over paged bodies (vLLM's pages), and its reference: gather, then the spec.

A paged body is a layer's keys or values for a pool of blocks: a PackedBody (a "vq" CodeBody,
or an exact tensor) with B = blocks and N = block_size, whose per-token buffers may be any
strided views (vLLM's page interleaves every field of a token in one row). Sequence b's
position p lies at slot p % N of block block_table[b, p // N]:

    block_table  int32 [B, m] on the device: the blocks of each sequence, in position order
                 (entries past a sequence's length are never read)

`decode_attention(..., block_table=...)` (kernels.decode_attention: the same kernel, its
PAGED switch) reads the blocks in place. `paged_decode_attention_reference` is its spec: each
sequence's blocks copied into a contiguous body of m * N slots (`gather`), then
`decode_attention_reference`.
"""

import dataclasses

import torch

from kvcalib_runtime.kernels.decode_reference import decode_attention_reference
from kvcalib_runtime.kernels.layout import Sinks, Stored
from kvcalib_runtime.layouts import Kind
from kvcalib_runtime.layouts.affine import PackedBody
from kvcalib_runtime.layouts.vq import CodeBody

PER_TOKEN = ("codes", "scale", "offset", "slot_index", "slot_delta")


def per_token(body: PackedBody | CodeBody) -> dict[str, torch.Tensor]:
    """The buffers of `body` that hold one row per (block, head, slot), by field name: codes and
    exact slots, and the scale and offset of a per-token layout ("static" and vector codes keep
    theirs per layer). A "channel" body's metadata is per group of tokens: not paged."""
    if isinstance(body, CodeBody):
        return {"codes": body.codes}
    if body.layout.kind == Kind.CHANNEL:
        raise ValueError("a 'channel' body keeps metadata per group of tokens: it is not paged")
    static = body.layout.kind == Kind.STATIC
    return {
        name: getattr(body, name)
        for name in PER_TOKEN
        if getattr(body, name) is not None and not (static and name in ("scale", "offset"))
    }


def _rows(t: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """t [blocks, heads, N, ...] -> [B, heads, m * N, ...]: each sequence's m blocks in order,
    contiguous."""
    g = t[block_table.long()]  # [B, m, heads, N, ...]
    b, m, heads, n = g.shape[:4]
    return g.movedim(1, 2).reshape(b, heads, m * n, *g.shape[4:]).contiguous()


def gather(body: PackedBody | CodeBody | torch.Tensor, block_table: torch.Tensor):
    """A paged body as a contiguous one: B = sequences, N = m * block_size (copies)."""
    if isinstance(body, torch.Tensor):
        return _rows(body, block_table)
    rows = {name: _rows(t, block_table) for name, t in per_token(body).items()}
    return dataclasses.replace(body, **rows)


def paged_decode_attention_reference(q, k_new, v_new, keys: Stored, values: Stored,
                                     sinks: Sinks, lengths, block_table, *, inv_freq=None,
                                     dtype=None):  # fmt: skip
    """`decode_attention(..., block_table=block_table)` in plain torch: the sequences' blocks
    gathered, then `decode_attention_reference` (same arguments; no sliding window)."""
    keys = keys._replace(body=gather(keys.body, block_table))
    values = values._replace(body=gather(values.body, block_table))
    return decode_attention_reference(
        q, k_new, v_new, keys, values, sinks, lengths, inv_freq=inv_freq, dtype=dtype
    )
