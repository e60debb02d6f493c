"""kvcalib: offline calibration and model conversion for low-bit KV-cache quantization.

The public names load on first use, so `import kvcalib` (and `kvcalib --help`) stays fast:

    kvcalib.calibrate, kvcalib.convert, kvcalib.evaluate     the pipeline (kvcalib.api)
    kvcalib.load_model, kvcalib.load_recipe, kvcalib.Profile, kvcalib.KvcalibError, ...
"""

import importlib

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


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvcalib' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
