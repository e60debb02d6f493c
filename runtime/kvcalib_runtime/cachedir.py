"""Where kvcalib keeps what it builds once per machine (the toolkit: dequantized models and
default profiles; the runtime: its compiled CPU kernel)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """$KVCALIB_CACHE_DIR, else $XDG_CACHE_HOME/kvcalib, else ~/.cache/kvcalib."""
    if os.environ.get("KVCALIB_CACHE_DIR"):
        return Path(os.environ["KVCALIB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcalib"
