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
quantizer's do.

What is loaded is checked first: the build writes the library's sha256 beside it (atomically,
after the library), and a library whose bytes no longer match (truncated, overwritten) is built
again, never opened; an opened library must export every function of SIGNATURES. The compiler
runs in its own process group under a time limit (VERSION_SECONDS, BUILD_SECONDS) and is killed
with its children, and the build's temporary folder removed, on any way out: an error, Ctrl-C,
SIGTERM or SIGHUP (which then end the process as they would have; held back while a compiler
starts, so that it is never left running without a handle). A build holds a lock on its
folder; one that SIGKILL left behind (no lock held, older than a build may take) is removed by
the next process that opens the library. $CC is split as a shell splits it (`ccache gcc`), as make
and setuptools read it. With no compiler, one that
cannot run, fails or hangs, a library that does not check out, or KVCALIB_NATIVE off
(`enabled`), `library()` is None (with one warning where something failed) and the callers keep
their torch ops.
"""

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # no flock (Windows): a stale build folder is told by its age alone
    fcntl = None

from kvcalib_runtime.cachedir import cache_dir
from kvcalib_runtime.errors import KvcalibRuntimeError

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
VERSION_SECONDS = 10.0  # `cc --version`: a compiler silent this long is not used
BUILD_SECONDS = 300.0  # each compile or link step (the -O3 one takes 10-15 s of CPU)
LOCK = "build.lock"  # in a build's temporary folder, locked (flock) while the build runs
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")  # KVCALIB_NATIVE, any case

_LOCK = threading.Lock()
_LOADED: dict = {}  # "lib": the library or None, once tried; "version": {compiler: its --version}


def enabled() -> bool:
    """Whether KVCALIB_NATIVE leaves the C kernels on: unset, empty or 1/true/yes/on (any case)
    is on, 0/false/no/off is off; anything else is a KvcalibRuntimeError."""
    raw = os.environ.get("KVCALIB_NATIVE", "")
    value = raw.strip().lower()
    if value in ("", *ON):
        return True
    if value in OFF:
        return False
    raise KvcalibRuntimeError(
        f"KVCALIB_NATIVE={raw!r} is neither on nor off: set it to 0/false/no/off to run torch "
        "ops instead of the C kernels, or 1/true/yes/on (or unset it) to use them"
    )


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


@contextlib.contextmanager
def _signals_held():
    """SIGINT, SIGTERM and SIGHUP held back while the block runs, then handled as they would
    have been: a signal inside `Popen`, after the compiler started but before its handle was
    returned, left the compiler running with nothing to kill it by."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    saved = {s: h for s, h in saved.items() if h is not None}  # None: set outside Python
    for s in saved:
        signal.signal(s, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        for s in held:
            signal.raise_signal(s)


def _run(step: list[str], seconds: float) -> str:
    """The stdout of `step`, run in a process group of its own that is killed, children and
    all, when it outlives `seconds` or the caller leaves early (an exception, a signal, even
    one that came while it started); OSError when it cannot be executed, fails or runs out of
    time."""
    proc, done = None, False
    try:
        with _signals_held():
            proc = subprocess.Popen(step, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)  # fmt: skip
        out, err = proc.communicate(timeout=seconds)
        done = True
    except subprocess.TimeoutExpired:
        raise OSError(f"{Path(step[0]).name} gave no answer in {seconds:g} s") from None
    finally:
        if not done and proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
    if proc.returncode:
        raise OSError(err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}")
    return out


def _target(compiler: tuple[str, ...]) -> Path:
    """Where the library built by `compiler` (its command line) from today's sources lies in
    the cache; OSError when the compiler cannot tell its version."""
    versions = _LOADED.setdefault("version", {})
    if compiler not in versions:
        try:
            versions[compiler] = _run([*compiler, "--version"], VERSION_SECONDS)
        except OSError as e:
            versions[compiler] = OSError(f"{shlex.join(compiler)} --version: {e.strerror or e}")
    if isinstance(versions[compiler], OSError):
        raise versions[compiler]
    sources = [part for p, flags in SOURCES.items() for part in (p.read_text(), *flags)]
    key = hashlib.sha256(
        "\0".join(
            [*sources, *FLAGS, *LIBS, versions[compiler], platform.machine(), _cpu_features()]
        ).encode()
    ).hexdigest()[:16]
    return cache_dir() / "native" / f"kvcalib-{key}.so"


def _digest_of(target: Path) -> Path:
    return target.with_suffix(".sha256")


def _intact(target: Path) -> bool | None:
    """True when the library and its digest are both there and agree; None when either is
    missing (never built, or a build that ended before its digest); False when they disagree
    or cannot be read."""
    digest = _digest_of(target)
    if not (target.is_file() and digest.is_file()):
        return None
    try:
        return hashlib.sha256(target.read_bytes()).hexdigest() == digest.read_text().strip()
    except OSError:
        return False


class _Signalled(BaseException):
    """SIGTERM or SIGHUP during the build, raised so that every cleanup on the way out runs."""


def _raise(signum, _frame):
    raise _Signalled(signum)


@contextlib.contextmanager
def _signals_unwind():
    """SIGTERM and SIGHUP, where nothing else handles them (their default: end the process at
    once), raise inside the block instead; once it has unwound, the signal ends the process as
    it would have."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mine = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) == signal.SIG_DFL]
    for s in mine:
        signal.signal(s, _raise)
    caught = None
    try:
        yield
    except _Signalled as e:
        caught = e.args[0]
    finally:
        for s in mine:
            signal.signal(s, signal.SIG_DFL)
    if caught is not None:
        signal.raise_signal(caught)


def _lock(fd: int, wait: bool) -> bool:
    """Take the build lock open at `fd` (flock), waiting for it or not; False when a live build
    holds it. Without flock every folder counts as unlocked."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


def _sweep(native: Path) -> None:
    """Remove the temporary folders of builds that ended without cleaning up (SIGKILL, a
    power cut): those older than every step of a build may take together, whose lock no live
    build holds. A younger folder or a locked one is a build under way (or about to take its
    lock), and is left."""
    oldest = time.time() - (len(SOURCES) + 1) * BUILD_SECONDS
    for folder in native.glob("tmp*"):
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.stat().st_mtime > oldest:
                continue
            fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # gone meanwhile, or not ours to open: left as it is
            continue
        try:
            if _lock(fd, wait=False):
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)


def _build(compiler: tuple[str, ...], target: Path) -> None:
    """Compile the library into `target` (atomically), then its digest beside it, holding its
    temporary folder's lock throughout; OSError when it cannot be."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _signals_unwind(), tempfile.TemporaryDirectory(dir=target.parent) as name:
        tmp = Path(name)
        lock = os.open(tmp / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _lock(lock, wait=True)
            objects = [str(tmp / f"{p.stem}.o") for p in SOURCES]
            built = tmp / target.name
            steps = [[*compiler, *FLAGS, *flags, "-c", str(p), "-o", o]
                     for (p, flags), o in zip(SOURCES.items(), objects, strict=True)]  # fmt: skip
            for step in [*steps, [*compiler, "-shared", *objects, "-o", str(built), *LIBS]]:
                _run(step, BUILD_SECONDS)
            digest = tmp / "digest"
            digest.write_text(hashlib.sha256(built.read_bytes()).hexdigest() + "\n")
            built.replace(target)
            digest.replace(_digest_of(target))
        finally:
            os.close(lock)


def _open(compiler: tuple[str, ...]):
    """The library built by `compiler`, built first where the cache lacks it or holds one that
    does not match its digest, checked for every function of SIGNATURES; OSError when it cannot
    be had. Returns (library, a note on a damaged library rebuilt, or None). Stale build
    folders are swept first (`_sweep`)."""
    target = _target(compiler)
    if target.parent.is_dir():
        _sweep(target.parent)
    state = _intact(target)
    note = None
    if state is False:
        note = f"the cached {target} did not match its sha256 (damaged or changed since its build)"
    if not state:
        try:
            _build(compiler, target)
        except OSError as e:
            raise OSError(f"{note}; rebuilding: {e}" if note else str(e)) from None
    lib = ctypes.CDLL(str(target))
    missing = [name for name in SIGNATURES if not hasattr(lib, name)]
    if missing:
        raise OSError(f"{target.name} does not export {', '.join(missing)}: not the runtime's")
    for name, types in SIGNATURES.items():
        getattr(lib, name).argtypes = list(types)
        getattr(lib, name).restype = None
    return lib, note


def _compiler() -> tuple[str, ...] | None:
    """$CC (or `cc`) split as a shell splits it, its program found on PATH: `ccache gcc` is
    ccache running gcc. None when there is no such program; OSError when $CC does not parse."""
    try:
        argv = shlex.split(os.environ.get("CC", "cc"))
    except ValueError as e:
        raise OSError(f"CC={os.environ['CC']!r} does not parse as a command ({e})") from None
    program = shutil.which(argv[0]) if argv else None
    return None if program is None else (program, *argv[1:])


def pending() -> bool:
    """True when `library()` would compile now: enabled, a compiler that answers, no intact
    library in the cache yet."""
    if not enabled() or "lib" in _LOADED:
        return False
    try:
        compiler = _compiler()
        return compiler is not None and not _intact(_target(compiler))
    except OSError:  # $CC does not parse or does not answer: `library()` says so, builds nothing
        return False


def library():
    """The loaded library, or None (no compiler, a build that failed, a library that does not
    check out, KVCALIB_NATIVE off): built on first use, once per process; one warning where
    something failed."""
    if not enabled():
        return None
    with _LOCK:
        if "lib" not in _LOADED:
            _LOADED["lib"] = None
            try:
                compiler = _compiler()
                lib, note = (None, None) if compiler is None else _open(compiler)
            except OSError as e:
                warnings.warn(f"kvcalib_runtime: the CPU kernels did not build ({e}); "
                              "running torch ops instead", stacklevel=2)  # fmt: skip
            else:
                _LOADED["lib"] = lib
                if note is not None:
                    warnings.warn(f"kvcalib_runtime: {note}; built it again", stacklevel=2)
        return _LOADED["lib"]
