"""kvcalib: offline calibration and model conversion for low-bit KV-cache quantization."""

from kvcalib.calibration import calibrate
from kvcalib.conversion import convert
from kvcalib.data import calibration_windows, eval_windows
from kvcalib.errors import KvcalibError
from kvcalib.evaluation import evaluate
from kvcalib.models import DEFAULT_MODEL, load_model
from kvcalib.profile import Profile
from kvcalib.recipe import load_recipe

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "KvcalibError",
    "Profile",
    "calibrate",
    "calibration_windows",
    "convert",
    "eval_windows",
    "evaluate",
    "load_model",
    "load_recipe",
]
