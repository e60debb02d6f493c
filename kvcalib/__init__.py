"""kvcalib: offline calibration and model conversion for low-bit KV-cache quantization.

The public names load on first use, so `import kvcalib` (and `kvcalib --help`) stays fast:

    kvcalib.calibrate, kvcalib.convert, kvcalib.evaluate     the pipeline (kvcalib.api)
    kvcalib.load_model, kvcalib.load_recipe, kvcalib.Profile, kvcalib.KvcalibError, ...
"""

from kvcalib_runtime.exports import lazy

__version__ = "0.1.0"

_EXPORTS = {
    "calibrate": "kvcalib.api",
    "convert": "kvcalib.api",
    "evaluate": "kvcalib.api",
    "DEFAULT_MODEL": "kvcalib.core.models",
    "load_model": "kvcalib.core.models",
    "Profile": "kvcalib.core.profile",
    "load_recipe": "kvcalib.core.recipe",
    "calibration_windows": "kvcalib.core.data",
    "eval_windows": "kvcalib.core.data",
    "KvcalibError": "kvcalib.errors",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
