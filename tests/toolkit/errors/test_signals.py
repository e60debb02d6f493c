"""A `kvcalib` process stopped by a signal mid-work leaves nothing behind: SIGTERM (what a
service manager or `kill` sends) and SIGHUP (a closed terminal) remove the staged output as
Ctrl-C does (test_reliability.py), and the process exits 128 + the signal's number, as a shell
reports it, with one line saying which signal stopped it (issue 52: both left the hidden
`.<out>.kvcalib-tmp-*` folder, 121 MB for a 31M-parameter model).

A real process runs, with a hook that waits at a chosen point inside the staging (after the
first weight shard of a conversion, in the report of a calibration), so the signal arrives
mid-work whatever the machine's speed.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.corpus import TEXT
from support.tiny import save_with_tokenizer, tiny_model

from kvcalib.io import atomic

REPO = Path(__file__).resolve().parents[3]

# Stops the command at `target` (module:attribute; a function or a method "Class.method"): the
# original runs, then a marker file appears and the process waits to be signalled. The signals
# start at their defaults, as a terminal or a service manager sends them: a suite run under
# nohup (or in the background) would otherwise hand the child SIGHUP (or SIGINT) ignored.
_HOOKED = """
import importlib, signal, sys, time
from pathlib import Path
for s in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
from kvcalib.cli import main

target, marker, *args = sys.argv[1:]
module, _, attr = target.partition(":")
owner = importlib.import_module(module)
*path, name = attr.split(".")
for part in path:
    owner = getattr(owner, part)
original = getattr(owner, name)

def hooked(*a, **k):
    result = original(*a, **k)
    Path(marker).touch()
    time.sleep(600)
    return result

setattr(owner, name, hooked)
main(args, prog_name="kvcalib")
"""

COMMANDS = {  # command -> (where it waits, its arguments after the model)
    "convert": ("kvcalib.io.shards:ShardWriter.write", ["--recipe", "per-token-4"]),
    "calibrate": (
        "kvcalib.calibration.run:write_report",
        ["--num-samples", "2", "--seq-len", "32", "--data"],
    ),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny llama with its one-character-per-token tokenizer, and a text to calibrate on."""
    root = tmp_path_factory.mktemp("signals")
    (root / "text.txt").write_text(TEXT)
    return save_with_tokenizer(tiny_model("llama"), root / "source")


def _strays(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if atomic.TMP_MARK in p.name)


@pytest.mark.parametrize(
    "command, sig",
    [
        ("convert", signal.SIGTERM),
        ("convert", signal.SIGHUP),
        ("calibrate", signal.SIGTERM),
        ("calibrate", signal.SIGHUP),
    ],
    ids=lambda x: getattr(x, "name", x),
)
def test_a_stop_signal_mid_work_exits_128_plus_n_and_leaves_nothing(source, tmp_path, command, sig):
    target, extra = COMMANDS[command]
    out, marker = tmp_path / "out", tmp_path / "marker"
    extra = [*extra, source.parent / "text.txt"] if command == "calibrate" else extra
    args = [command, source, *extra, "-o", out]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "runtime")])}
    cmd = [sys.executable, "-c", _HOOKED, target, str(marker), *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, f"{command} never reached {target}"
            time.sleep(0.05)
        assert _strays(tmp_path), "the hook waits inside the staging: a folder is staged"
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, stderr  # as a shell reports a signal
    assert stderr.splitlines()[-1] == f"stopped by {sig.name}" and "Traceback" not in stderr
    assert not out.exists() and _strays(tmp_path) == []


def test_a_signal_the_process_ignores_stays_ignored():
    """`nohup kvcalib convert ...` ignores SIGHUP: stop_signals must not undo that. Outside the
    block, the handlers are what they were."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    term = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with atomic.stop_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
            with pytest.raises(atomic.Stopped) as stopped:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs at the next bytecode: never reached
            assert stopped.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)
        signal.signal(signal.SIGTERM, term)
