"""The runtime's C library for the CPU: decode attention over quantized bodies (`decode_cpu.c`,
called by decode_native) and a decode step's writes into the cache (`commit_cpu.c`, called by
commit_native).

The sources are compiled once per machine with the system's C compiler (`cc`, or $CC) into
cache_dir()/native/, named by the sources, the flags, the compiler and the CPU's features
(-march=native), and loaded with ctypes: the runtime needs nothing else. The build takes 15-17 s
of CPU, nearly all of it -O3 on decode_cpu.c's specialized loops (-O2 builds in a third of the
time and attends 18-28% slower). `kvcalib_runtime.load` onto the CPU builds it, so that no
decode step pays for it; `pending()` tells beforehand whether that build is still to come. The
writer is compiled without FMA contraction, so its fp32 operations round as the reference
quantizer's do. With no compiler, a build that fails (a warning says so) or KVCALIB_NATIVE=0,
`library()` is None and the callers keep their torch ops.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from kvcalib_runtime.cachedir import cache_dir

HERE = Path(__file__).parent
SOURCES = {  # each source and its own flags: the writer rounds as the reference, without FMA
    HERE / "decode_cpu.c": (),
    HERE / "commit_cpu.c": ("-ffp-contract=off",),
}
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=gnu11", "-fPIC")
LIBS = ("-lm",)
SIGNATURES = {  # every exported function: its argument types (it returns nothing)
    "kvcalib_scores": (ctypes.c_void_p, ctypes.c_void_p),
    "kvcalib_sum": (ctypes.c_void_p, ctypes.c_void_p),
    "kvcalib_commit": (
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p
    ),
}  # fmt: skip

_LOCK = threading.Lock()
_LOADED: dict = {}


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _target(compiler: str) -> Path:
    """Where the library built by `compiler` from today's sources lies in the cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    sources = [part for p, flags in SOURCES.items() for part in (p.read_text(), *flags)]
    key = hashlib.sha256(
        "\0".join([*sources, *FLAGS, *LIBS, version, platform.machine(), _cpu_features()]).encode()
    ).hexdigest()[:16]
    return cache_dir() / "native" / f"kvcalib-{key}.so"


def _build(compiler: str) -> Path:
    """The compiled library in the cache, built there (atomically) when missing; OSError when
    it cannot be."""
    target = _target(compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{p.stem}.o") for p in SOURCES]
        built = Path(tmp) / target.name
        steps = [[compiler, *FLAGS, *flags, "-c", str(p), "-o", o]
                 for (p, flags), o in zip(SOURCES.items(), objects, strict=True)]  # fmt: skip
        for step in [*steps, [compiler, "-shared", *objects, "-o", str(built), *LIBS]]:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode:
                raise OSError(done.stderr.strip().splitlines()[-1] if done.stderr else "no output")
        built.replace(target)
    return target


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def pending() -> bool:
    """True when `library()` would compile now: enabled, a compiler found, not yet built."""
    if os.environ.get("KVCALIB_NATIVE", "1") == "0" or "lib" in _LOADED:
        return False
    compiler = _compiler()
    return compiler is not None and not _target(compiler).exists()


def library():
    """The loaded library, or None (no compiler, a build that failed, KVCALIB_NATIVE=0): built on
    first use, once per process."""
    if os.environ.get("KVCALIB_NATIVE", "1") == "0":
        return None
    with _LOCK:
        if "lib" not in _LOADED:
            _LOADED["lib"] = None
            compiler = _compiler()
            if compiler is not None:
                try:
                    lib = ctypes.CDLL(str(_build(compiler)))
                except OSError as e:
                    warnings.warn(f"kvcalib_runtime: the CPU kernels did not build ({e}); "
                                  "running torch ops instead", stacklevel=2)  # fmt: skip
                else:
                    for name, types in SIGNATURES.items():
                        getattr(lib, name).argtypes = list(types)
                        getattr(lib, name).restype = None
                    _LOADED["lib"] = lib
        return _LOADED["lib"]
