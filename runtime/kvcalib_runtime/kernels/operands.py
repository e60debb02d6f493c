"""The kernels' operands: one layer's stored keys or values (its body, residual ring and body
sizes) and its sink slots.

The quantized cache (kvcalib_runtime.cache.kvcache) owns these buffers; the kernels and their
references take them through the two types below, whose docstrings give every shape.
"""

from typing import NamedTuple

import torch

from kvcalib_runtime.layouts.body import Body


class Stored(NamedTuple):
    """One layer's keys or values as the decode kernel reads them.

    body     what the layout allocated (layouts.body.Body: a kernel reads a PackedBody or a "vq"
             CodeBody), or dtype [B, Hkv, N, D] exact values (a tensor left in full precision,
             read through layouts.body.as_body);
             position t at slot t % N (N < every position: a sliding-window ring)
    tail     dtype [B, Hkv, R, D]  the residual ring: position t at slot t % R
    n_body   int64 [B] on the device: positions [0, n_body) are read from the body, the
             others (up to the sequence's length) from the tail
    """

    body: Body | torch.Tensor
    tail: torch.Tensor
    n_body: torch.Tensor


class Sinks(NamedTuple):
    """One layer's sink slots: S = max(sinks_first + sink_budget, 1) per sequence.

    keys       dtype [B, Hkv, S, D]  exact keys, in the key domain (as the body stores them)
    values     dtype [B, Hkv, S, D]  exact values
    positions  int64 [B, S] on the device: the position each slot holds, -1 while empty
    is_sink    bool [B, P] (P: every position a sequence can reach): positions held in a sink
               slot (their body slots are not read)
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    is_sink: torch.Tensor
