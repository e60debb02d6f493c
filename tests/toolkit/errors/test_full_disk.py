"""A full disk (ENOSPC, simulated by the write that meets it) under every command that writes:
one line naming the path, exit 2, whatever was measured printed first, and nothing of the
output left behind (no temporary folder, no empty plots/ or offload folder)."""

import errno
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.corpus import TEXT, refused, snapshot

from kvcalib.cli import main
from kvcalib.io.atomic import TMP_MARK


def _full(*_, **__):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    return path


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _left(root: Path) -> list[str]:
    return sorted(p for p in snapshot(root) if TMP_MARK in p)


def test_convert(corpus, tmp_path, monkeypatch):
    from kvcalib.conversion import convert

    monkeypatch.setattr(convert, "save_file", _full)  # kv_params.safetensors, after the shards
    out = tmp_path / "out"
    line = refused(_run("convert", corpus.src, "--recipe", "per-token-4", "-o", out), "no space")
    assert line.startswith(f"error: output {out}: no space left on the device")
    assert not out.exists() and _left(tmp_path) == []


def test_calibrate(corpus, tmp_path, text, monkeypatch):
    from kvcalib.core import profile

    monkeypatch.setattr(profile, "save_file", _full)
    out = tmp_path / "p"
    args = ["calibrate", corpus.src, "-o", out, "--data", text, "--num-samples", "2"]
    line = refused(_run(*args, "--seq-len", "32"), "no space")
    assert line.startswith(f"error: output {out}: no space left on the device")
    assert not out.exists() and _left(tmp_path) == []


def test_calibrate_offload_dir(corpus, tmp_path, text, monkeypatch):
    write = Path.write_bytes

    def full_offload(self, data):
        if self.suffix == ".bin" and "kvcalib-offload-" in str(self):
            _full()
        return write(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_offload)
    out, offload = tmp_path / "p", tmp_path / "scratch" / "act"
    args = ["calibrate", corpus.src, "-o", out, "--data", text, "--num-samples", "2"]
    args += ["--seq-len", "32", "--sequential", "--offload-dir", offload]
    line = refused(_run(*args), "no space")
    assert line.startswith(f"error: --offload-dir {offload}: no space left on the device")
    assert not out.exists() and not (tmp_path / "scratch").exists() and _left(tmp_path) == []


def _eval(corpus, text, *extra):
    args = ["eval", corpus.src, "--recipe", "per-token-4", "--seq-len", "16", "--windows", "1"]
    return _run(*args, "--data", text, *extra)


def test_eval_json(corpus, tmp_path, text, monkeypatch):
    write = Path.write_text
    monkeypatch.setattr(
        Path, "write_text", lambda p, *a, **k: _full() if TMP_MARK in p.name else write(p, *a, **k)
    )
    out = tmp_path / "r.json"
    result = _eval(corpus, text, "--json", out)
    line = refused(result, "no space")
    assert line.startswith(f"error: --json {out}: no space left on the device")
    assert "| per-token-4 | decode |" in result.stdout  # the table came first
    assert not out.exists() and _left(tmp_path) == []


def test_eval_plots(corpus, tmp_path, text, monkeypatch):
    from kvcalib.io import figures

    save = figures.Figure.savefig
    calls = []

    def full_second(fig, *args, **kwargs):  # the first plot is written, the second is not
        calls.append(1)
        return _full() if len(calls) == 2 else save(fig, *args, **kwargs)

    monkeypatch.setattr(figures.Figure, "savefig", full_second)
    plots = tmp_path / "plots"
    result = _eval(corpus, text, "--plots", plots)
    line = refused(result, "no space")
    assert f"{plots}/" in line and "no space left on the device" in line
    assert "| per-token-4 | decode |" in result.stdout
    assert len(calls) == 2 and not plots.exists() and _left(tmp_path) == []
