"""Decode attention over paged bodies (vLLM's pages), and its reference: gather, then the spec.

A paged body is a layer's keys or values for a pool of blocks: a body (layouts.body; an exact
tensor) with B = blocks and N = block_size, whose per-token buffers (`Body.per_token`) may be any
strided views (vLLM's page interleaves every field of a token in one row). Sequence b's
position p lies at slot p % N of block block_table[b, p // N]:

    block_table  int32 [B, m] on the device: the blocks of each sequence, in position order
                 (entries past a sequence's length are never read)

`decode_attention(..., block_table=...)` (kernels.decode_attention: the same kernel, its
PAGED switch) reads the blocks in place. `paged_decode_attention_reference` is its spec: each
sequence's blocks copied into a contiguous body of m * N slots (`gather`), then
`decode_attention_reference`.
"""

import torch

from kvcalib_runtime.kernels.decode_reference import decode_attention_reference
from kvcalib_runtime.kernels.operands import Sinks, Stored
from kvcalib_runtime.layouts.body import Body, as_body


def _rows(t: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """t [blocks, heads, N, ...] -> [B, heads, m * N, ...]: each sequence's m blocks in order,
    contiguous."""
    g = t[block_table.long()]  # [B, m, heads, N, ...]
    b, m, heads, n = g.shape[:4]
    return g.movedim(1, 2).reshape(b, heads, m * n, *g.shape[4:]).contiguous()


def gather(body: Body | torch.Tensor, block_table: torch.Tensor) -> Body:
    """A paged body as a contiguous one: B = sequences, N = m * block_size (copies of its
    per-token buffers, `Body.per_token`)."""
    body = as_body(body)
    return body.with_rows({name: _rows(t, block_table) for name, t in body.per_token().items()})


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
