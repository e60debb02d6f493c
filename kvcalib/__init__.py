"""kvcalib: offline calibration and model conversion for low-bit KV-cache quantization.

The public names load on first use, so `import kvcalib` (and `kvcalib --help`) stays fast:

    kvcalib.calibrate, kvcalib.convert, kvcalib.evaluate     the pipeline (kvcalib.calibration,
                                                             kvcalib.api)
    kvcalib.load_model, kvcalib.load_recipe, kvcalib.Profile, kvcalib.KvcalibError, ...
    kvcalib.QuantizedKVCache                                 a recipe's cache for transformers'
                                                             generate(past_key_values=...)
"""

from kvcalib_runtime.lazy import lazy

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "kvcalib.api": ("convert", "evaluate"),
        "kvcalib.calibration": ("calibrate",),
        "kvcalib.core.models": ("DEFAULT_MODEL", "load_model"),
        "kvcalib.core.profile": ("Profile",),
        "kvcalib.core.recipe": ("load_recipe",),
        "kvcalib.core.data": ("calibration_windows", "eval_windows"),
        "kvcalib.errors": ("KvcalibError",),
        "kvcalib.sim.cache": ("QuantizedKVCache",),
    },
)
