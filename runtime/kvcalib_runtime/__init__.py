"""kvcalib_runtime: load a kvcalib-converted checkpoint and serve it with a low-bit KV cache.

Depends only on torch, safetensors, triton and tokenizers. Owns the quantization numerics
(`quant`, `packing`, `hadamard`), the checkpoint format, the quantized KV cache and the kernels.

    model = kvcalib_runtime.load("converted/")       # a RuntimeModel; see `loader`
    [ids] = model.generate("Hello", max_new_tokens=16)

The public names load on first use: `import kvcalib_runtime` imports neither torch nor triton
(the kernels load with the first quantized cache, `kvcalib_runtime.cache.kvcache.QuantizedCache`).
"""

from kvcalib_runtime.lazy import lazy

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "kvcalib_runtime.errors": ("CapacityError", "FormatError", "KvcalibRuntimeError"),
        "kvcalib_runtime.cache.fpcache": ("FullPrecisionCache",),
        "kvcalib_runtime.loader": ("RuntimeModel", "load"),
        "kvcalib_runtime.layouts.quant": (
            "QTensor",
            "QuantSpec",
            "dequantize",
            "fake_quantize",
            "quantize",
        ),
    },
)
