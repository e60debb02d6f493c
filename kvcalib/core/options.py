"""Options checked at the edge, before any work: every public entry point (calibrate, convert,
evaluate, generate) calls these first, so the API and the CLI refuse the same bad value with the
same one-line OptionError (a ValueError too) that names the option and its range.

    count("--seq-len", seq_len, minimum=2)            # an integer (never a bool) in range
    number("--temperature", t, low=0.0)               # a finite number in range
    device("--device", "cuda:7", auto=True)           # a device this machine has -> str
    dtype("--dtype", "float16")                       # "float16" or torch.float16 -> torch dtype
    input_path("--data", path)                        # a regular file (never a FIFO: no hang)
"""

import math
import os
import stat
from pathlib import Path

import torch

from kvcalib.errors import OptionError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_COUNT = 1 << 31  # no count kvcalib takes is larger: a larger one is a typo or an overflow


def count(name: str, value, *, minimum: int = 1, maximum: int = MAX_COUNT) -> int:
    """`value` if it is an integer in [minimum, maximum], else OptionError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise OptionError(f"{name} {value!r}: use an integer >= {minimum}")
    if value > maximum:
        raise OptionError(f"{name} {value}: use an integer <= {maximum}")
    return value


def number(
    name: str, value, *, low: float = -math.inf, high: float = math.inf, open_low: bool = False
) -> float:
    """`value` if it is a finite number in [low, high] ((low, high] when `open_low`)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > low if open_low else value >= low) and value <= high:
        return value
    if math.isinf(high):
        where = f"{'>' if open_low else '>='} {low:g}"
    else:
        where = f"in {'(' if open_low else '['}{low:g}, {high:g}]"
    raise OptionError(f"{name} {value!r}: use a finite number {where}")


def device(name: str, value, *, auto: bool = False) -> str:
    """The device as a string, when this machine has it: cpu, cuda, cuda:N (N below the number
    of visible GPUs), and "auto" when `auto` (spread over the GPUs)."""
    text = str(value)
    if auto and text == "auto":
        return text
    try:
        parsed = torch.device(text)
    except (RuntimeError, TypeError):
        parsed = None
    use = "cpu, cuda, cuda:N" + (" or auto" if auto else "")
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise OptionError(f"{name} {text}: not a device kvcalib runs on; use {use}")
    if parsed.type == "cpu" and parsed.index not in (None, 0):
        raise OptionError(f"{name} {text}: there is one CPU device; use cpu")
    if parsed.type == "cpu":
        return "cpu"  # cpu:0 too, which safetensors does not take
    if parsed.type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= have:
            raise OptionError(f"{name} {text}: this machine has {have} CUDA device(s); use {use}")
    return text


def dtype(name: str, value) -> torch.dtype:
    """A floating dtype given as its name ("float16") or as the torch dtype."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise OptionError(f"{name} {value!r}: use one of {', '.join(DTYPES)}")


def input_path(name: str, path) -> Path:
    """`path` if it names a regular file or a folder; a FIFO, socket or device (which a read
    would block on or never finish) is refused, as is a path that does not exist."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise OptionError(f"{name} {path}: no such file or folder") from None
    except OSError as e:
        raise OptionError(f"{name} {path}: cannot be read ({e.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise OptionError(f"{name} {path}: a FIFO, socket or device, not a file; pass a file")
    return path
