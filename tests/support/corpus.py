"""The bad-input corpus's machinery: a tiny model, its profile and a converted checkpoint made
once, copies of them per case, a snapshot of every byte before and after, and the contract
every refusal keeps (exit 2, one line naming the input and a fix, no traceback, nothing written,
no input changed, and no model loaded when the input could be judged without one).

    CASES = [Case("options", "calibrate", lambda ctx: [ctx.src, "--seq-len", "-5"], "--seq-len")]
    check(case, Workspace(tmp_path, fixtures), monkeypatch)   # the whole contract, one case
"""

import hashlib
import json
import os
import re
import shutil
import signal
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kvcalib.calibration import run
from kvcalib.cli import main
from kvcalib.io import shards
from kvcalib_runtime.checkpoint import format
from kvcalib_runtime.errors import KvcalibRuntimeError
from kvcalib_runtime.model.forward import Transformer

TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # ASCII: one token per character
# A refusal says how to get on: one of these words (click's own usage errors end in "see ...").
FIX = re.compile(
    r"\b(use|pass|pick|recalibrate|calibrate|convert|run|give|fix|remove|create|save|name|"
    r"drop|set|install|download|copy|see|shorten|lower|ask|put|must)\b"
)
# The kvcalib recipe every side-car case starts from: every calibrated tensor the format holds.
FULL_RECIPE = """name = "full"
description = "static smoothed codebook keys, rotated codebook values"
residual = 16
[key]
bits = 2
granularity = "static"
position = "pre_rope"
codebook = "calibrated"
outliers = 0.01
outlier_slots = 1
smooth = 0.5
[value]
bits = 2
rotation = "hadamard"
symmetric = true
codebook = "calibrated"
[sinks]
first = 1
"""


@dataclass(frozen=True)
class Case:
    """One bad input. cls: its class; command: a kvcalib command, or "load" for the runtime's
    Python API; build(ctx): the arguments after the command, or for "load" a callable that
    makes the call; fragment: what the one-line answer says; before_load: it must be answered
    before any model or weight loads."""

    cls: str
    command: str
    build: Callable
    fragment: str
    before_load: bool = True


def _timeout(*_):
    raise TimeoutError("no answer in 120 s: a read blocks (a FIFO?) or the work started")


def _no_load(*args, **kwargs):
    raise AssertionError("a model loaded, though the input could be judged without it")


def check(case: Case, ctx: "Workspace", monkeypatch) -> str:
    """Run one case and hold the whole contract; returns the answer's line."""
    target = case.build(ctx)
    before = snapshot(ctx.root)
    if case.before_load:
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_load)
        monkeypatch.setattr(run, "LayerwiseModel", _no_load)
        monkeypatch.setattr(shards.SourceWeights, "read", _no_load)
        monkeypatch.setattr(Transformer, "from_folder", _no_load)
    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(120)  # a FIFO read would block forever: fail instead
    try:
        if case.command == "load":
            try:
                target()
            except KvcalibRuntimeError as e:
                line = one_line(e, case.fragment)
            else:
                raise AssertionError(f"accepted: {case}")
        else:
            args = [case.command, *map(str, target)]
            line = refused(CliRunner().invoke(main, args), case.fragment)
    finally:
        signal.alarm(0)
    assert snapshot(ctx.root) == before, "a file was written or an input changed"
    return line


@dataclass(frozen=True)
class Fixtures:
    """Made once per module: a tiny llama (context 256), its profile, its conversion under
    FULL_RECIPE. Never modified: cases work on copies."""

    src: Path
    profile: Path
    converted: Path


class Workspace:
    """Per-case copies of the fixtures and small input files under `root`."""

    def __init__(self, root: Path, fixtures: Fixtures):
        self.root, self.fixtures = root, fixtures

    def _copy(self, name: str) -> Path:
        target = self.root / name
        if not target.exists():
            shutil.copytree(getattr(self.fixtures, name), target)
        return target

    @property
    def src(self) -> Path:
        return self._copy("src")

    @property
    def profile(self) -> Path:
        return self._copy("profile")

    @property
    def converted(self) -> Path:
        return self._copy("converted")

    def file(self, name: str, content: str | bytes = TEXT) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    def fifo(self, name: str = "fifo") -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        return path

    def folder(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def recipe(self, text: str, name: str = "r.toml") -> Path:
        return self.file(name, text)

    # -- damaging copies -----------------------------------------------------------------------

    def profile_json(self, edit) -> Path:
        """A profile copy whose profile.json went through edit(meta) (in place)."""
        path = self.profile
        meta = json.loads((path / "profile.json").read_text())
        edit(meta)
        (path / "profile.json").write_text(json.dumps(meta))
        return path

    def profile_tensors(self, edit, *, rebind: bool = False) -> Path:
        """A profile copy whose tensors went through edit(tensors) (in place); `rebind`: its
        profile.json's tensors_sha256 rewritten to match, as a careless writer would."""
        path = self.profile
        tensors = load_file(path / "profile.safetensors")
        edit(tensors)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, path / "profile.safetensors", metadata={"format": "pt"})
        if rebind:
            digest = hashlib.sha256((path / "profile.safetensors").read_bytes()).hexdigest()
            self.profile_json(lambda m: m.update(tensors_sha256=digest))
        return path

    def side_car(self, *, meta=None, params=None, config=None, files=None) -> Path:
        """A converted copy with kvcalib.json, kv_params.safetensors or config.json edited in
        place (or files replaced: {name: bytes}), the manifest rewritten to match, as a careless
        or hostile writer would: the validator, not the sha256, must refuse it."""
        path = self.converted
        for name, edit in ((format.META, meta), (format.CONFIG, config)):
            if edit is not None:
                doc = json.loads((path / name).read_text())
                edit(doc)
                (path / name).write_text(json.dumps(doc))
        if params is not None:
            tensors = load_file(path / format.PARAMS)
            params(tensors)
            save_file(tensors, path / format.PARAMS, metadata={"format": "pt"})
        for name, data in (files or {}).items():
            (path / name).write_bytes(data)
        rebind(path)
        remanifest(path)
        return path


# -- builders of bad inputs (callables of a Workspace) ----------------------------------

STATIC = 'name = "st"\n[key]\nbits = 2\ngranularity = "static"\nposition = "pre_rope"\n'


def deep(n: int = 100_000) -> str:
    return "[" * n + "]" * n


def config(ctx: Workspace, **changes):
    """The model copy with config.json changed."""
    path = ctx.src / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return ctx.src


def config_bytes(ctx: Workspace, data: bytes):
    (ctx.src / "config.json").write_bytes(data)
    return ctx.src


def quantiles(value, name="key_pre_rope.nonsink.quantiles"):
    return lambda ctx: ctx.profile_tensors(lambda t: t.update({name: nan_at(t[name], value)}))


def codebook(edit):
    def change(t):
        name = next(n for n in sorted(t) if n.startswith("codebook.key"))
        t[name] = edit(t[name])

    return lambda ctx: ctx.profile_tensors(change)


def meta(**changes):
    def change(m):
        for key, value in changes.items():
            parent, *path = key.split(".")
            target = m
            for k in [parent, *path][:-1]:
                target = target[k]
            target[[parent, *path][-1]] = value

    return lambda ctx: ctx.profile_json(change)


def out(ctx):
    return ctx.root / "out"


def profile_file(name: str, content: str):
    def build(ctx):
        (ctx.profile / name).write_text(content)
        return ctx.profile

    return build


def profile_fifo(name: str):
    def build(ctx):
        (ctx.profile / name).unlink()
        return ctx.fifo(f"profile/{name}").parent

    return build


def recipe_file(content: bytes):
    return lambda ctx: ctx.file("r.toml", content)


def the_profile(ctx):
    return ctx.profile


def rebind(path: Path) -> None:
    """kvcalib.json's binding rewritten to the folder's kv_params and weights."""
    doc = json.loads((path / format.META).read_text())
    if "binding" in doc:
        files = [p for p in path.iterdir() if p.is_file()]
        digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
        doc["binding"] = format.binding(digests)
        (path / format.META).write_text(json.dumps(doc))


def remanifest(path: Path) -> None:
    files = {
        p.name: {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
        for p in sorted(path.iterdir())
        if p.name != format.MANIFEST and p.is_file()
    }
    manifest = {"format_version": format.FORMAT_VERSION, "files": files}
    (path / format.MANIFEST).write_text(json.dumps(manifest))


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root -> sha256 of a regular file, or its kind (folder, fifo, ...)."""
    out = {}
    for p in sorted(root.rglob("*")):
        mode = p.lstat().st_mode
        if stat.S_ISREG(mode):
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p.relative_to(root))] = "folder" if stat.S_ISDIR(mode) else oct(mode)
    return out


def refused(result, fragment: str) -> str:
    """Exit 2 with one `error:` line, last on stderr, holding `fragment` and a fix; no
    traceback. Returns the line."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert fragment in errors[0], errors[0]
    assert FIX.search(errors[0]), f"no fix named: {errors[0]}"
    return errors[0]


def one_line(error: Exception, fragment: str) -> str:
    """The same contract for an exception raised through the Python API."""
    text = str(error)
    assert "\n" not in text and fragment in text, text
    assert FIX.search(text), f"no fix named: {text}"
    return text


def nan_at(t: torch.Tensor, value=float("nan")) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = value
    return t
