"""Triton kernels of the quantized KV cache, each beside its plain-torch reference.

    operands          what they take of the cache: Stored (one layer's body, residual ring
                      and body sizes), Sinks
    quant_pack        quantize blocks of tokens and pack them into the body: a prefill's
                      blocks, or a decode step's flush straight from the residual ring
    tiles             how the decode kernel reads a tile of keys or values (unpack, levels,
                      metadata, exact slots, RoPE)
    decode_attention  attention of one new token per sequence over the quantized cache;
                      decode_reference is its spec in plain torch
    decode_gluon      its whole tiles for kvcalib-2's, -3's, -4's and -1.5's layouts at 128
                      channels a head, in Gluon (on a GPU; the Triton kernel reads the rest);
                      gluon_layouts its registers' layouts, gluon_streams its tables, code
                      rows and metadata copies, gluon_ptx its inline PTX (gluon_rows that of
                      the code rows read by address: 3-bit codebooks, kvcalib-1.5's vectors)
    paged             the same kernel over vLLM-style pages, read through a block table, and
                      its reference (gather, then decode_attention's)

`use_triton(device)` says where they run: CUDA, or anywhere under TRITON_INTERPRET=1.
"""

import os

import torch


def use_triton(device: torch.device | str) -> bool:
    """True where the Triton kernels can run: CUDA tensors, or any tensor with TRITON_INTERPRET=1
    (Triton's CPU interpreter, which the tests use)."""
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
