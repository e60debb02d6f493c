"""The runtime's C library as a damaged cache, a bad compiler or a signal leaves it
(kernels/native.py): a copy of the real library (built once per machine in the default cache, as
a CPU load builds it) and stand-in compilers, shell scripts that answer `--version` as `cc` does
where the cache key must match the real library's.

    good = built()                           # (library, digest) in the default cache
    cache = cache_with(tmp / "cache", good)  # a cache holding a copy of both
    cc = compiler(tmp / "cc", RELINK, good=good[0])
    run_library({"CC": cc, "KVCALIB_CACHE_DIR": cache})  # native.library() in a fresh process
    forget(monkeypatch, tmp / "cache")       # this process, as if it had not tried the library
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvcalib_runtime.kernels import native

CC = shutil.which("cc")
ARGS = 'out=; prev=; for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done\n'
VERSION = 'case "$1" in --version) exec "{cc}" --version;; esac\n'
# Each stand-in: {cc} the real compiler, {good} a library to link, {pid} a file for a child's pid.
RELINK = (
    VERSION + ARGS + 'case " $* " in *" -shared "*) cp "{good}" "$out";; *) : > "$out";; esac\n'
)
FAILING = VERSION + 'echo "error: this compiler fails" >&2; exit 1\n'
EMPTY = ARGS + (  # links a library of no functions
    'case "$1" in --version) echo "empty-cc 1.0"; exit 0;; esac\n'
    'case " $* " in *" -shared "*) exec "{cc}" -shared -fPIC -x c /dev/null -o "$out";; esac\n'
    ': > "$out"\n'
)
HANG_VERSION = 'sleep 1000 & echo $! > "{pid}"; wait\n'
HANG_BUILD = VERSION + ARGS + ': > "$out"; sleep 1000 & echo $! > "{pid}"; wait\n'
# The signals start at their defaults, as a terminal or a service manager sends them: a suite run
# under nohup (or in the background) would otherwise hand the child SIGHUP (or SIGINT) ignored.
LIBRARY = """
import signal, sys, warnings
for s in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
warnings.simplefilter("always")
from kvcalib_runtime.kernels import native
for name, value in (a.split("=") for a in sys.argv[1:]):
    setattr(native, name, float(value))
print("pending" if native.pending() else "not pending")
print("loaded" if native.library() is not None else "torch")
"""


def forget(monkeypatch, cache: Path) -> None:
    """This process as if it had not tried the library yet (KVCALIB_NATIVE unset), with `cache`
    as its cache folder."""
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.delenv("KVCALIB_NATIVE", raising=False)
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(cache))


def built() -> tuple[Path, Path]:
    """The intact library and its digest in the default cache, built there first if missing."""
    saved = os.environ.pop("KVCALIB_CACHE_DIR", None)
    try:
        target = native._target((CC,))
        if not native._intact(target):
            native._build((CC,), target)
    finally:
        if saved is not None:
            os.environ["KVCALIB_CACHE_DIR"] = saved
    return target, native._digest_of(target)


def cache_with(root: Path, good: tuple[Path, Path]) -> Path:
    """A cache folder at `root` holding a copy of the library and its digest."""
    (root / "native").mkdir(parents=True)
    for path in good:
        shutil.copy(path, root / "native" / path.name)
    return root


def compiler(path: Path, script: str, **names) -> Path:
    """An executable shell script at `path` running `script` (formatted with cc and `names`)."""
    path.write_text("#!/bin/sh\n" + script.format(cc=CC, **{k: str(v) for k, v in names.items()}))
    path.chmod(0o755)
    return path


def run_library(env: dict, *settings: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`native.pending()` then `native.library()` in a fresh process (a library that crashes
    the loader crashes it, not the tests) with `env` added to this one's, KVCALIB_NATIVE unset
    and native's constants set by `settings` ("BUILD_SECONDS=1"): prints "pending" or "not
    pending", then "loaded" or "torch"; warnings on stderr."""
    full = {k: v for k, v in os.environ.items() if k != "KVCALIB_NATIVE"}
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run([sys.executable, "-c", LIBRARY, *settings], env=full,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "Warning:" in line]


def alive(pid: int, wait: float = 0.0) -> bool:
    """Whether process `pid` still runs `wait` seconds from now, or once it has ended before
    that (a killed process takes a moment to end on a busy machine; a zombie awaiting its
    reaper has ended)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False
        if "\nState:\tZ" in status:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
