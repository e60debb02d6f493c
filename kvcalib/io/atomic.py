"""Atomic output folders: everything is written into a temporary sibling, then renamed.

    check_output(out, force, inputs, kind)   # early: unwritable, exists without force, of
                                             # another kind, overlaps an input
    check_file_output(path, inputs, "--json")  # the same for one output file
    with staging(out, force) as tmp:    # write into tmp; on success tmp becomes out
        ...
    with file_staging(path) as tmp:     # the same for one file (replaced, never half-written)
        tmp.write_text(...)
    with added_files(folder):           # files added to a folder: all of them, or none
        ...

A full disk (ENOSPC, or a quota) while writing is an OutputError naming the output: nothing of it
is left behind.

The temporary folder is ".<name>.kvcalib-tmp-<host>-<pid>-<random>" next to `out` (a rename is
atomic only within one filesystem). Any exception removes it, and so does Ctrl-C (Python's
KeyboardInterrupt) and, inside `stop_signals()` (the CLI runs every command in it), SIGTERM and
SIGHUP, which it turns into a `Stopped` exception. A process killed outright (SIGKILL, OOM)
cannot clean up: the next `staging` of the same output removes the temporary folders of
this host whose process is gone (folders of live processes, or of other hosts on a shared
filesystem, are left alone). With `force`, the old output is first moved into a temporary folder
too, so a crash in between leaves the old output to that cleanup, never a half-written one.
"""

import contextlib
import errno
import glob
import hashlib
import os
import re
import shutil
import signal
import socket
import tempfile
from pathlib import Path

from kvcalib.errors import OutputError

TMP_MARK = ".kvcalib-tmp-"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # what a service manager or a closed terminal sends


class Stopped(BaseException):
    """A stop signal (STOP_SIGNALS) received inside `stop_signals()`: raised where the process
    was, as Python raises KeyboardInterrupt for SIGINT, so that every `finally` and `except
    BaseException` on the way out removes what it staged. `signum` is the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_signals():
    """Within the block, SIGTERM and SIGHUP raise `Stopped` (once: a repeat while the way out
    cleans up is ignored). A signal the process ignores stays ignored (`nohup` ignores SIGHUP),
    and outside the main thread, where Python cannot set handlers, nothing changes."""

    def stop(signum, frame):
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    try:
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s, handler in previous.items():
            if handler is signal.SIG_DFL:
                signal.signal(s, stop)
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def full_disk(e: BaseException) -> bool:
    """Whether `e` says the disk or the quota is full: an OSError, or the error safetensors
    raises around one ("os error 28")."""
    if isinstance(e, OSError):
        return e.errno in FULL_DISK
    return type(e).__name__ == "SafetensorError" and "os error 28" in str(e)


def full_disk_error(option: str, path: Path) -> OutputError:
    return OutputError(
        f"{option} {path}: no space left on the device while writing it (nothing of it was "
        "kept); free some space there or pick another path"
    )


# What kvcalib writes, by the file that marks it: --force replaces only an output of its kind.
KINDS = {"profile": "profile.json", "converted checkpoint": "kvcalib.json"}
_MARKS = {**{mark: f"a {kind}" for kind, mark in KINDS.items()}, "config.json": "a model folder"}


def check_output(out: Path, force: bool, inputs: list[Path], kind: str | None = None) -> None:
    """Refuse, before any work, an output folder that cannot be written (a parent that is a
    file or not writable), that is a file or a link, that holds something other than a `kind`
    output (KINDS; even with force), that exists (without force), or that overlaps an input."""
    out = Path(out)
    check_writable(out)
    if out.exists() and (out.is_symlink() or not out.is_dir()):
        raise OutputError(f"output {out} is a file or a link; remove it or pick another output")
    names = {p.name for p in out.iterdir()} if kind is not None and out.is_dir() else set()
    if names and KINDS[kind] not in names:
        what = next((w for m, w in _MARKS.items() if m in names), "a folder of other files")
        raise OutputError(
            f"output {out} is {what}, not a {kind}: pick another output (kvcalib replaces "
            f"only an earlier {kind})"
        )
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputError(f"output {out} exists; pass --force to replace it")
    check_apart(out, inputs, "folder")


def check_file_output(path: Path, inputs: list[Path], option: str) -> None:
    """Refuse, before any work, an output file (`option` names it) whose folder is missing or
    not writable, that is a folder, or that is an input or lies inside one."""
    path = Path(path)
    if not path.parent.is_dir():
        raise OutputError(f"{option} {path}: its folder does not exist; create it first")
    check_writable(path, option)
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise OutputError(f"{option} {path}: a folder or special file is there; name a file")
    check_apart(path, inputs, "file", option)


def check_writable(out: Path, option: str = "output") -> None:
    """OutputError unless the nearest existing folder above `out` is a folder this process can
    write in (`option` names the output in the message)."""
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{option} {out}: {parent} is a file, not a folder; pick another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {out}: cannot write in {parent} (permission denied)")


def check_apart(out: Path, inputs: list[Path], what: str, option: str = "output") -> None:
    """OutputError when the output `what` ("file" or "folder") is an input or lies inside one
    (or, a folder, holds one)."""
    target = Path(out).resolve()
    for p in inputs:
        p = Path(p).resolve()
        if target == p or p in target.parents or (what == "folder" and target in p.parents):
            raise OutputError(
                f"{option} {out} overlaps the input {p}; pick an output {what} outside it "
                "(inputs are never modified)"
            )


def tmp_prefix(out: Path) -> str:
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    return f".{out.name}{TMP_MARK}{host}-"


def _clean_stale(out: Path) -> None:
    """Remove temporary folders that a killed conversion on this host left next to `out`."""
    prefix = tmp_prefix(out)
    for p in out.parent.glob(glob.escape(prefix) + "*"):
        m = re.match(r"(\d+)-", p.name[len(prefix) :])
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def staging(out: Path, force: bool):
    """A temporary sibling of `out` to write into; renamed to `out` when the block succeeds."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"output {out}: cannot create its parent folder ({e.strerror})") from None
    _clean_stale(out)
    prefix = f"{tmp_prefix(out)}{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        try:
            yield tmp
        except Exception as e:
            if full_disk(e):
                raise full_disk_error("output", out) from None
            raise
        _public_modes(tmp)
        if out.exists() or out.is_symlink():
            if not force:
                raise OutputError(f"output {out} exists; pass --force to replace it")
            trash = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
            os.rename(out, trash / out.name)
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                os.rename(tmp, out)
            except OSError:  # another writer renamed its folder into place first
                raise OutputError(
                    f"output {out} was created by another process while this one wrote it; "
                    "its result is complete - pass --force to replace it"
                ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_staging(path: Path, option: str = "output"):
    """A temporary sibling of the file `path` to write; it replaces `path` when the block
    succeeds and is removed when it fails (a full disk: an OutputError naming `option`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        try:
            yield tmp
        except Exception as e:
            if full_disk(e):
                raise full_disk_error(option, path) from None
            raise
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def added_files(folder: Path, option: str = "output"):
    """A folder to add files to, made (with its parents) if missing: when the block fails, the
    files it added are removed, and the folders it made (a full disk: an OutputError naming
    `option`)."""
    folder = Path(folder)
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    before = set(folder.iterdir()) if folder.is_dir() else set()
    try:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            yield folder
        except Exception as e:
            if full_disk(e):
                raise full_disk_error(option, folder) from None
            raise
    except BaseException:
        for p in set(folder.iterdir()) - before if folder.is_dir() else ():
            if p.is_file() and not p.is_symlink():
                p.unlink()
        for p in made:  # innermost first; only the empty ones this call made
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def _public_modes(folder: Path) -> None:
    """mkdtemp makes the folder 0700 and some writers 0600 files: give them the usual modes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)
