"""kvcalib_runtime: load a kvcalib-converted checkpoint and serve it with a low-bit KV cache.

Depends only on torch, safetensors, triton and tokenizers. Owns the quantization numerics
(`quant`, `packing`, `hadamard`), the checkpoint format, the quantized KV cache and the kernels.
"""

from kvcalib_runtime.errors import CapacityError, FormatError, KvcalibRuntimeError
from kvcalib_runtime.quant import QTensor, QuantSpec, dequantize, fake_quantize, quantize

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "FormatError",
    "KvcalibRuntimeError",
    "QTensor",
    "QuantSpec",
    "dequantize",
    "fake_quantize",
    "quantize",
]
