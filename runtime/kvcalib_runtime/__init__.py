"""kvcalib_runtime: load a kvcalib-converted checkpoint and serve it with a low-bit KV cache.

Depends only on torch, safetensors, triton and tokenizers. Owns the quantization numerics
(`quant`, `packing`, `hadamard`), the checkpoint format, the quantized KV cache and the kernels.

    model = kvcalib_runtime.load("converted/")       # a RuntimeModel; see `loader`
    [ids] = model.generate("Hello", max_new_tokens=16)

The public names load on first use: `import kvcalib_runtime` imports neither torch nor triton
(the kernels load with the first quantized cache, `kvcalib_runtime.kvcache.QuantizedCache`).
"""

from kvcalib_runtime.exports import lazy

__version__ = "0.1.0"

_EXPORTS = {
    "CapacityError": "kvcalib_runtime.errors",
    "FormatError": "kvcalib_runtime.errors",
    "KvcalibRuntimeError": "kvcalib_runtime.errors",
    "FullPrecisionCache": "kvcalib_runtime.fpcache",
    "RuntimeModel": "kvcalib_runtime.loader",
    "load": "kvcalib_runtime.loader",
    "QTensor": "kvcalib_runtime.quant",
    "QuantSpec": "kvcalib_runtime.quant",
    "dequantize": "kvcalib_runtime.quant",
    "fake_quantize": "kvcalib_runtime.quant",
    "quantize": "kvcalib_runtime.quant",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
