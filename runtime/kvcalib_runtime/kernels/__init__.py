"""Triton kernels of the quantized KV cache, each beside its plain-torch reference.

    layout            the buffers they share: PackedBody (codes, scale, offset), Stored, Sinks
    quant_pack        quantize a block of tokens and pack it into the body (the cache's flush)
    decode_attention  attention of one new token per sequence over the quantized cache

`layout.use_triton(device)` says where they run: CUDA, or anywhere under TRITON_INTERPRET=1.
"""
