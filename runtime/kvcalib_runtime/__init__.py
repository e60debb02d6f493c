"""kvcalib_runtime: load a kvcalib-converted checkpoint and serve it with a low-bit KV cache.

Depends only on torch, safetensors, triton and tokenizers. Owns the quantization numerics
(`quant`, `packing`, `hadamard`), the checkpoint format, the quantized KV cache and the kernels.

    model = kvcalib_runtime.load("converted/")       # a RuntimeModel; see `loader`
    [ids] = model.generate("Hello", max_new_tokens=16)

`import kvcalib_runtime` does not import triton: the kernels load with the first quantized cache
(`kvcalib_runtime.kvcache.QuantizedCache`).
"""

from kvcalib_runtime.errors import CapacityError, FormatError, KvcalibRuntimeError
from kvcalib_runtime.fpcache import FullPrecisionCache
from kvcalib_runtime.loader import RuntimeModel, load
from kvcalib_runtime.quant import QTensor, QuantSpec, dequantize, fake_quantize, quantize

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "FormatError",
    "FullPrecisionCache",
    "KvcalibRuntimeError",
    "QTensor",
    "QuantSpec",
    "RuntimeModel",
    "dequantize",
    "fake_quantize",
    "load",
    "quantize",
]
