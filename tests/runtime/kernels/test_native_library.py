"""What the runtime loads as its C library, and what a bad compiler costs (kernels/native.py):
a cached library is opened only when its bytes match the sha256 written at its build, and only
kept when it exports every kvcalib_* function; a compiler that cannot run, hangs or is signalled
mid-build leaves the torch ops, one warning, no temporary folder and no process behind.

The library is built once per machine in the default cache (what a CPU load does); every case
works on a copy in its own cache folder, and the stand-in compilers (tests/support/native_cases.py)
only copy or fail, so nothing here compiles kvcalib's sources again. Cases that a damaged library
could crash run `native.library()` in a child process.
"""

import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
from support.native_cases import (
    CC,
    EMPTY,
    FAILING,
    HANG_BUILD,
    HANG_VERSION,
    LIBRARY,
    RELINK,
    alive,
    built,
    cache_with,
    compiler,
    forget,
    run_library,
    warnings_in,
)

from kvcalib_runtime.errors import KvcalibRuntimeError
from kvcalib_runtime.kernels import native

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler: the CPU path runs torch ops")


@pytest.fixture(scope="module")
def good():
    return built()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """This process as if it had not tried the library yet, with an empty cache of its own."""
    forget(monkeypatch, tmp_path / "cache")
    return tmp_path


def test_a_truncated_library_is_built_again_not_opened(good, tmp_path):
    # the red team's SIGBUS: the cached library cut to 10,000 bytes, then a load. The digest
    # tells, the library is linked again (here: copied back by the stand-in), one warning
    cache = cache_with(tmp_path / "cache", good)
    library = cache / "native" / good[0].name
    os.truncate(library, 10_000)
    cc = compiler(tmp_path / "cc", RELINK, good=good[0])
    done = run_library({"CC": cc, "KVCALIB_CACHE_DIR": cache})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["pending", "loaded"]  # generate announces the build
    [warning] = warnings_in(done.stderr)
    assert "did not match its sha256" in warning and "built it again" in warning
    assert library.read_bytes() == good[0].read_bytes()


def test_overwritten_code_falls_back_when_the_rebuild_fails(good, tmp_path):
    # the red team's SIGILL: the library's code overwritten in place (same size, 0xCC = int3),
    # and a compiler that cannot build it again: torch ops, one warning naming both
    cache = cache_with(tmp_path / "cache", good)
    library = cache / "native" / good[0].name
    data = bytearray(library.read_bytes())
    data[4096:-4096] = b"\xcc" * (len(data) - 8192)
    library.write_bytes(bytes(data))
    done = run_library({"CC": compiler(tmp_path / "cc", FAILING), "KVCALIB_CACHE_DIR": cache})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["pending", "torch"]
    [warning] = warnings_in(done.stderr)
    assert "did not match its sha256" in warning and "this compiler fails" in warning
    assert "running torch ops instead" in warning


def test_a_library_without_a_digest_is_built_again(good, fresh):
    # a build that ended between the library and its digest, or a cache from before digests
    cache = cache_with(fresh / "cache", good)
    (cache / "native" / good[1].name).unlink()
    assert native.pending()


def test_a_library_without_the_kvcalib_functions_is_not_kept(fresh, monkeypatch):
    # a compiler that links an empty library (or any .so at that name): its digest matches,
    # it opens, but it is not the runtime's: torch ops and one warning, not an AttributeError
    monkeypatch.setenv("CC", str(compiler(fresh / "cc", EMPTY)))
    with pytest.warns(UserWarning, match="does not export kvcalib_scores, kvcalib_sum"):
        assert native.library() is None


def test_a_compiler_that_cannot_be_executed_leaves_torch(fresh, monkeypatch):
    # an executable file that is no program (no shebang): pending() says no build is coming
    # (generate asks it first) and library() warns once
    cc = fresh / "cc"
    cc.write_text("not a program\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert not native.pending()
    with pytest.warns(UserWarning, match="Exec format error") as caught:
        assert native.library() is None
    assert len(caught) == 1


@pytest.mark.parametrize("script", [HANG_VERSION, HANG_BUILD], ids=["version", "build"])
def test_a_hanging_compiler_is_stopped(script, fresh):
    # `cc --version` or a build step that never ends: killed, children too, at the limit (1 s
    # here), and the load goes on with torch ops; nothing left in the cache folder
    pid = fresh / "pid"
    cc = compiler(fresh / "cc", script, pid=pid)
    env = {"CC": cc, "KVCALIB_CACHE_DIR": fresh / "cache"}
    start = time.perf_counter()
    done = run_library(env, "VERSION_SECONDS=1", "BUILD_SECONDS=1", timeout=60)
    assert time.perf_counter() - start < 30
    assert done.stdout.split()[-1] == "torch", done.stderr[-2000:]
    [warning] = warnings_in(done.stderr)
    assert "gave no answer in 1 s" in warning
    assert not alive(int(pid.read_text()), wait=10)
    assert not list((fresh / "cache").rglob("tmp*"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_the_build_leaves_nothing_behind(signum, fresh):
    # the build's temporary folder removed and the compiler (a child of the stand-in) killed;
    # SIGTERM and SIGHUP then end the process as they would have
    pid = fresh / "pid"
    env = {**os.environ, "CC": str(compiler(fresh / "cc", HANG_BUILD, pid=pid)),
           "KVCALIB_CACHE_DIR": str(fresh / "cache")}  # fmt: skip
    env.pop("KVCALIB_NATIVE", None)
    proc = subprocess.Popen([sys.executable, "-c", LIBRARY], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (pid.exists() and pid.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list((fresh / "cache" / "native").glob("tmp*")), "the build had not started"
    proc.send_signal(signum)
    try:
        proc.wait(timeout=30)
    finally:
        proc.kill()
    if signum != signal.SIGINT:
        assert proc.returncode == -signum
    assert not alive(int(pid.read_text()), wait=10)
    assert not list((fresh / "cache" / "native").glob("tmp*"))


# a signal that comes inside Popen, once the compiler runs but before Popen returns its handle
SIGNAL_IN_POPEN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
for s in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_DFL)
pid, signum = sys.argv[1], int(sys.argv[2])
start = subprocess.Popen.__init__
def started_then_signalled(self, args, *rest, **kwargs):
    start(self, args, *rest, **kwargs)
    if "--version" not in args:
        while not (os.path.exists(pid) and open(pid).read().strip()):
            time.sleep(0.05)
        signal.raise_signal(signum)
subprocess.Popen.__init__ = started_then_signalled
from kvcalib_runtime.kernels import native
native.library()
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_compiler_starts_leaves_nothing_behind(signum, fresh):
    # the compiler had started, Popen had not yet returned it: the signal's exception left
    # nothing to kill the compiler by, and it ran on (a flaky failure of the test above under
    # load). Signals are held while it starts, then handled as they would have been
    pid = fresh / "pid"
    env = {**os.environ, "CC": str(compiler(fresh / "cc", HANG_BUILD, pid=pid)),
           "KVCALIB_CACHE_DIR": str(fresh / "cache")}  # fmt: skip
    env.pop("KVCALIB_NATIVE", None)
    done = subprocess.run([sys.executable, "-c", SIGNAL_IN_POPEN, str(pid), str(int(signum))],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == -signum, done.stderr[-2000:]  # as the signal would have ended it
    assert not alive(int(pid.read_text()), wait=10), done.stderr[-2000:]
    assert not list((fresh / "cache" / "native").glob("tmp*"))


def test_a_build_killed_outright_is_swept_by_a_later_load(good, fresh):
    # SIGKILL runs no cleanup: the build's folder stays (the red team's native/tmpXXXX). The
    # next load removes it once it is older than a build may take (3 steps of BUILD_SECONDS, 1 s
    # here) and no live build holds its lock; a younger folder, or an old one whose lock is
    # held, is a build under way and stays
    native_dir = fresh / "cache" / "native"
    pid = fresh / "pid"
    env = {**os.environ, "CC": str(compiler(fresh / "cc", HANG_BUILD, pid=pid))}
    env.pop("KVCALIB_NATIVE", None)
    proc = subprocess.Popen([sys.executable, "-c", LIBRARY], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (pid.exists() and pid.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=30)
    os.kill(int(pid.read_text()), signal.SIGKILL)  # the orphaned compiler
    [killed] = native_dir.glob("tmp*")
    assert (killed / native.LOCK).is_file()
    young, held = native_dir / "tmpyoung", native_dir / "tmpheld"
    for folder in (young, held):
        folder.mkdir()
        (folder / "decode_cpu.o").write_bytes(b"half-written")
    lock = os.open(held / native.LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        past = time.time() - 10  # beyond 3 x 1 s
        for folder in (killed, held):
            os.utime(folder, (past, past))
        for path in good:
            shutil.copy(path, native_dir / path.name)
        done = run_library({"CC": CC, "KVCALIB_CACHE_DIR": fresh / "cache"}, "BUILD_SECONDS=1")
    finally:
        os.close(lock)
    assert done.stdout.splitlines() == ["not pending", "loaded"], done.stderr[-2000:]
    assert not warnings_in(done.stderr)
    assert sorted(p.name for p in native_dir.glob("tmp*")) == ["tmpheld", "tmpyoung"]


@pytest.mark.parametrize("words", ["env {cc}", "/bin/sh {cc}"], ids=["wrapper", "interpreter"])
def test_a_compiler_command_with_arguments_is_split_as_a_shell_would(words, good, fresh):
    # CC="ccache gcc" counted as no compiler (the whole string looked up as one program); now
    # it is split as make and setuptools split it (shlex), a quoted path with a space kept whole,
    # and the build runs through it
    (fresh / "a compiler").mkdir()
    cc = compiler(fresh / "a compiler" / "cc", RELINK, good=good[0])
    command = words.format(cc=shlex.quote(str(cc)))
    done = run_library({"CC": command, "KVCALIB_CACHE_DIR": fresh / "cache"})
    assert done.stdout.split() == ["pending", "loaded"], done.stderr[-2000:]
    assert not warnings_in(done.stderr)
    assert (fresh / "cache" / "native" / good[0].name).read_bytes() == good[0].read_bytes()


def test_a_compiler_command_that_does_not_parse_warns(fresh, monkeypatch):
    monkeypatch.setenv("CC", 'gcc "unclosed')
    assert not native.pending()
    with pytest.warns(UserWarning, match="does not parse as a command"):
        assert native.library() is None


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "Off", " off "])
def test_kvcalib_native_off_in_every_usual_spelling(value, fresh, monkeypatch):
    monkeypatch.setenv("KVCALIB_NATIVE", value)
    monkeypatch.setenv("CC", str(compiler(fresh / "cc", FAILING)))  # a build would warn
    assert not native.pending()
    assert native.library() is None
    assert "lib" not in native._LOADED  # not tried: turned off


@pytest.mark.parametrize("value", ["1", "true", "Yes", "ON", ""])
def test_kvcalib_native_on(value, fresh, monkeypatch):
    monkeypatch.setenv("KVCALIB_NATIVE", value)
    assert native.enabled()


@pytest.mark.parametrize("value", ["maybe", "2", "disable"])
def test_kvcalib_native_unrecognised_is_refused_in_one_line(value, fresh, monkeypatch):
    monkeypatch.setenv("KVCALIB_NATIVE", value)
    for call in (native.pending, native.library):
        with pytest.raises(KvcalibRuntimeError, match=f"KVCALIB_NATIVE='{value}' is neither") as e:
            call()
        assert "\n" not in str(e.value) and "set it to 0/false/no/off" in str(e.value)
