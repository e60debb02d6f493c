"""What the user sees when something goes wrong: every expected failure is one line on stderr
(`error: ...`, naming the input and the fix) and exit status 2; an unexpected crash keeps its
traceback and exits 1; no command leaves a half-written output; no code from a checkpoint runs
without --trust-remote-code; the recipe parser survives any damaged document.

The CLI runs through click's CliRunner, except where the process itself matters (a crash, a
SIGKILL, two conversions racing): there a real `kvcalib` process runs, with a hook that stops
it at a chosen point so the test does not depend on timing.
"""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from support.mutate import mutated, mutated_bytes
from support.tiny import save_with_tokenizer, tiny_model

from kvcalib.cli import main
from kvcalib.core import models
from kvcalib.core.plan import plan
from kvcalib.core.recipe import load_recipe, parse_recipe, presets
from kvcalib.errors import KvcalibError, ModelError, RecipeError
from kvcalib.io import atomic
from kvcalib_runtime.cache.memory import planned_memory
from kvcalib_runtime.checkpoint import format
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.transforms import Transforms

TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # ASCII: one token per character
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny llama saved with its one-character-per-token tokenizer (do not modify it)."""
    return save_with_tokenizer(tiny_model("llama"), tmp_path_factory.mktemp("src") / "source")


def _copy(source: Path, tmp_path: Path) -> Path:
    return shutil.copytree(source, tmp_path / "model")


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _refused(result, message: str) -> str:
    """Exit 2 with the error as the last line of stderr, one line, no traceback; its text."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.splitlines()[-1] == errors[0], result.stderr
    assert message in errors[0], errors[0]
    return errors[0]


def _strays(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if atomic.TMP_MARK in p.name)


# -- model inputs ------------------------------------------------------------------------------


def _header(tensors: dict) -> bytes:
    text = json.dumps(tensors).encode()
    return struct.pack("<Q", len(text)) + text


_W = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
DAMAGED_WEIGHTS = {
    "truncated": (lambda raw: raw[: len(raw) // 2], "out of range"),
    "length beyond the file": (
        lambda raw: struct.pack("<Q", len(raw)) + raw[8:],
        "runs past the end of the file",
    ),
    "bad JSON": (lambda raw: raw[:8] + b"#" + raw[9:], "header is not valid JSON"),
    "offsets out of range": (
        lambda raw: _header({"w": {**_W, "data_offsets": [0, 64]}}) + bytes(16),
        "data_offsets [0, 64] out of range",
    ),
    "wrong dtype": (
        lambda raw: _header({"w": {**_W, "dtype": "F128"}}) + bytes(16),
        "unknown dtype 'F128'",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGED_WEIGHTS))
def test_damaged_safetensors_are_named_before_loading(source, tmp_path, case):
    damage, message = DAMAGED_WEIGHTS[case]
    model = _copy(source, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    line = _refused(
        _run("convert", model, "--recipe", "per-token-4", "-o", tmp_path / "out"), message
    )
    assert line.startswith(f"error: model {model}: model.safetensors: ")
    assert line.endswith("the file is damaged - download or save the model again")
    assert not (tmp_path / "out").exists()


def _bare_folder(tmp_path: Path, files: dict[str, str | bytes]) -> Path:
    folder = tmp_path / "bare"
    folder.mkdir()
    for name, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        (folder / name).write_bytes(data)
    return folder


LLAMA = json.dumps({"model_type": "llama"})
BAD_FOLDERS = {
    "missing": (None, "no such file or folder; pass a local path or a hub id"),
    "no config": ({"model.safetensors": b""}, "no config.json, so not a Hugging Face model"),
    "config not JSON": ({"config.json": "{", "x.safetensors": b""}, "config.json is not valid"),
    "config not an object": ({"config.json": "[]", "x.safetensors": b""}, "not a JSON object"),
    "no weights": ({"config.json": LLAMA}, "no *.safetensors weights in the folder"),
    "pickle only": (
        {"config.json": LLAMA, "pytorch_model.bin": b"\x80\x04"},
        "only pickle weights (pytorch_model.bin); kvcalib reads safetensors only - convert "
        "on a trusted machine with model.save_pretrained(dir)",
    ),
    "unsupported": (  # an empty but valid safetensors file: 8-byte header length, then "{}"
        {
            "config.json": json.dumps({"model_type": "gpt2"}),
            "m.safetensors": b"\x02" + bytes(7) + b"{}",
        },
        {
            "convert": "model_type 'gpt2' names its sizes its own way (no num_attention_heads)",
            "inspect": "model_type 'gpt2' names its sizes its own way (no num_attention_heads)",
        },
    ),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_bad_model_folders_exit_2_with_the_fix(tmp_path, case, command):
    files, message = BAD_FOLDERS[case]
    message = message[command] if isinstance(message, dict) else message
    folder = tmp_path / "nowhere" if files is None else _bare_folder(tmp_path, files)
    args = ["--recipe", "per-token-4", "-o", tmp_path / "out"] if command == "convert" else []
    line = _refused(_run(command, folder, *args), message)
    assert str(folder) in line


def _gguf(path: Path, arch: str) -> Path:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_of_an_unsupported_architecture_or_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _gguf(tmp_path / "gpt2.gguf", "gpt2")
    _refused(_run("inspect", gguf), "GGUF architecture 'gpt2' is not supported; supported: gemma2")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[:40])  # gguf's reader fails with an IndexError here
    _refused(_run("inspect", cut), "not a readable GGUF file")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    _refused(_run("inspect", junk), "not a readable GGUF file")
    assert not (tmp_path / "cache" / "gguf").exists()  # nothing dequantized


# -- custom code -------------------------------------------------------------------------------

_EVIL = """
from pathlib import Path
Path(__file__).with_name("EXECUTED").touch()
from transformers import LlamaForCausalLM as EvilForCausalLM  # noqa
"""


def _with_custom_code(source: Path, tmp_path: Path) -> Path:
    model = _copy(source, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    (model / "modeling_evil.py").write_text(_EVIL)
    return model


def test_custom_code_needs_trust_remote_code(source, tmp_path):
    model = _with_custom_code(source, tmp_path)
    message = (
        "config.json has an auto_map, so transformers would run the folder's own Python code; "
        "kvcalib runs no code that comes with a checkpoint - read that code, then pass "
        "--trust-remote-code"
    )
    out = tmp_path / "out"
    _refused(_run("convert", model, "--recipe", "per-token-4", "-o", out), message)
    _refused(_run("inspect", model), message)
    with pytest.raises(ModelError, match="pass --trust-remote-code"):
        models.load_model(model)
    assert not (model / "EXECUTED").exists() and not out.exists()
    # With the flag: convert reads tensors only, so still nothing runs; the output drops auto_map
    result = _run("convert", model, "--recipe", "per-token-4", "-o", out, "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert "auto_map" not in format.read_checkpoint(out).config
    assert _run("inspect", model, "--trust-remote-code").exit_code == 0
    assert not (model / "EXECUTED").exists()


def test_custom_tokenizer_code_needs_trust_remote_code(source, tmp_path):
    model = _copy(source, tmp_path)
    auto_map = {"auto_map": {"AutoTokenizer": ["tokenization_evil.Evil", None]}}
    (model / "tokenizer_config.json").write_text(json.dumps(auto_map))
    with pytest.raises(ModelError, match=r"tokenizer_config\.json has an auto_map"):
        models.resolve(model)
    models.resolve(model, trust_remote_code=True)


# -- recipes and profiles ----------------------------------------------------------------------

BAD_RECIPES = {
    "unknown key": (
        'name = "x"\n[key]\nbitz = 2\n',
        "recipe x: unknown key 'key.bitz'; did you mean 'key.bits'?",
    ),
    "wrong type": ('name = "x"\n[key]\nbits = "2"\n', "recipe x: 'key.bits' must be int, not str"),
    "impossible": (
        'name = "x"\n[sinks]\npredicted = true\n',
        "recipe x: sinks.predicted needs sinks.budget > 0",
    ),
    "seed out of range": ('name = "x"\nrotation_seed = -1\n', "rotation_seed = -1: use an"),
    "not TOML": ('name = "x"\n[key\n', "not valid TOML"),
    "nested too deep": ("name = " + "[" * 5000, "not valid TOML"),
}


@pytest.mark.parametrize("case", list(BAD_RECIPES))
def test_bad_recipes_exit_2_naming_the_key(source, tmp_path, case):
    text, message = BAD_RECIPES[case]
    recipe = tmp_path / "r.toml"
    recipe.write_text(text)
    _refused(_run("convert", source, "--recipe", recipe, "-o", tmp_path / "out"), message)


def test_unknown_preset_lists_the_presets(source, tmp_path):
    _refused(
        _run("convert", source, "--recipe", "kivi3", "-o", tmp_path / "out"),
        "recipe kivi3: no such preset; did you mean kivi-",
    )


def _profile(path: Path, meta: dict) -> Path:
    path.mkdir()
    (path / "profile.json").write_text(json.dumps(meta))
    save_file(
        {"windows.input_ids": torch.zeros(1, 16, dtype=torch.long)}, path / "profile.safetensors"
    )
    return path


BAD_PROFILES = {
    "another model": (
        {"format_version": 1, "model": {"spec": "other-model", "fingerprint": "f" * 64}},
        "was calibrated on model other-model (fingerprint ffffffffffffffff), not {src}",
    ),
    "another version": (
        {"format_version": 0, "model": {"spec": "other-model", "fingerprint": "f" * 64}},
        "has format version 0; this kvcalib reads 1: recalibrate with kvcalib calibrate",
    ),
    "no model": ({"format_version": 1}, "profile.json lacks model.spec or .fingerprint"),
}


@pytest.mark.parametrize("case", list(BAD_PROFILES))
def test_bad_profiles_exit_2(source, tmp_path, case):
    meta, message = BAD_PROFILES[case]
    profile = _profile(tmp_path / "profile", meta)
    args = [
        "convert",
        source,
        "--recipe",
        "per-token-4",
        "--profile",
        profile,
        "-o",
        tmp_path / "o",
    ]
    _refused(_run(*args), message.format(src=source))
    assert not (tmp_path / "o").exists()


# -- calibration data and numerics ---------------------------------------------------------------


def test_bad_calibration_data_exits_2(source, tmp_path):
    base = ["calibrate", source, "--num-samples", "1", "--seq-len", "32"]
    empty, short, text = tmp_path / "empty.txt", tmp_path / "short.txt", tmp_path / "text.txt"
    empty.write_text("  \n")
    short.write_text("too short")
    text.write_text(TEXT)
    _refused(_run(*base, "--data", empty, "-o", tmp_path / "p"), "the file holds no text")
    _refused(
        _run(*base, "--data", short, "-o", tmp_path / "p"),
        f"--data {short} has 9 tokens; --seq-len 32 needs 32: pass more text or ask for less",
    )
    _refused(_run(*base, "--data", tmp_path / "none.txt", "-o", tmp_path / "p"), "no such file")
    (tmp_path / "taken").mkdir()
    _refused(_run(*base, "--data", text, "-o", tmp_path / "taken"), "exists; pass --force")
    assert not (tmp_path / "p").exists() and _strays(tmp_path) == []


def test_seq_len_beyond_the_context_exits_2(tmp_path):
    model = save_with_tokenizer(tiny_model("llama", max_position_embeddings=64), tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = ["calibrate", model, "--data", text, "--seq-len", "128", "-o", tmp_path / "p"]
    _refused(_run(*args), "--seq-len 128 exceeds the model's context (64 tokens)")


def test_nan_activations_exit_2_naming_the_layer(tmp_path):
    net = tiny_model("llama")
    with torch.no_grad():
        net.model.layers[1].self_attn.k_proj.weight[3, 5] = float("nan")
    model = save_with_tokenizer(net, tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "p"
    args = ["calibrate", model, "--data", text, "--num-samples", "2", "--seq-len", "32", "-o", out]
    _refused(_run(*args), "error: layer 1: NaN or Inf in the keys before RoPE")
    assert not out.exists() and _strays(tmp_path) == []


# -- converted checkpoints at generate time ------------------------------------------------------


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    """per-token-4 conversion of a tiny llama whose context is 16 tokens."""
    root = tmp_path_factory.mktemp("converted")
    short = save_with_tokenizer(tiny_model("llama", max_position_embeddings=16), root / "src")
    out = root / "per-token-4"
    assert _run("convert", short, "--recipe", "per-token-4", "-o", out).exit_code == 0
    return out


def test_a_file_changed_after_conversion_is_named(converted, tmp_path):
    folder = shutil.copytree(converted, tmp_path / "copy")
    weights = folder / "model-00001-of-00001.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(data)
    _refused(
        _run("generate", folder, "--prompt", "hi", "--device", "cpu"),
        "error: model-00001-of-00001.safetensors: changed since it was written (size or sha256 "
        "differs from manifest.json); convert the model again",
    )


def test_a_prompt_longer_than_the_cache_exits_2(converted):
    _refused(
        _run("generate", converted, "--prompt", "x" * 20, "--max-new-tokens", "1"),
        "a prompt of 20 tokens + max_new_tokens = 1 needs 20 cache slots, more than the "
        "model's context of 16 tokens: shorten the prompt or lower max_new_tokens",
    )


# -- nothing half-written ----------------------------------------------------------------------

# A real `kvcalib` process, stopped at a chosen point: "raise" fails after the third tensor is
# written, "hang" waits there to be killed, "race" waits before the final rename until a second
# process is there too (a file barrier), so that both rename at once.
_HOOKED = """
import glob, os, signal, sys, time
from pathlib import Path
# Ctrl-C as a terminal sends it: a suite started in the background (`cmd &`) runs with SIGINT
# ignored, and a child would inherit that and never see the interrupt
signal.signal(signal.SIGINT, signal.default_int_handler)
import kvcalib.conversion.convert as conversion
import kvcalib.io.shards as shards
from kvcalib.cli import main

mode, marker, *args = sys.argv[1:]
write, validate = shards.ShardWriter.write, conversion.format.read_checkpoint

def hooked_write(self, name, tensor):
    write(self, name, tensor)
    if self.next == 3 and mode == "raise":
        raise RuntimeError("disk on fire")
    if self.next == 3 and mode == "hang":
        Path(marker).touch()
        time.sleep(600)

def hooked_validate(path, **kw):
    Path(f"{marker}.{os.getpid()}").touch()
    deadline = time.monotonic() + 300
    while len(glob.glob(marker + ".*")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return validate(path, **kw)

shards.ShardWriter.write = hooked_write
if mode == "race":
    conversion.format.read_checkpoint = hooked_validate
main(args, prog_name="kvcalib")
"""


def _hooked(mode: str, marker: Path, *args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "runtime")])}
    cmd = [sys.executable, "-c", _HOOKED, mode, str(marker), *map(str, args)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_crash_midway_keeps_its_traceback_and_leaves_nothing(source, tmp_path):
    out = tmp_path / "out"
    args = ["convert", source, "--recipe", "per-token-4", "-o", out, "--max-shard-size", "20KB"]
    proc = _hooked("raise", tmp_path / "marker", *args)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1  # a bug, not a bad input: traceback kept, exit 1
    assert "Traceback" in stderr and stderr.rstrip().endswith("RuntimeError: disk on fire")
    assert not out.exists() and _strays(tmp_path) == []
    result = _run(*args)  # the next run is not disturbed by the failed one
    assert result.exit_code == 0, result.output
    format.read_checkpoint(out)
    assert _strays(tmp_path) == []


def test_a_sigkilled_convert_leaves_no_output_and_the_next_cleans_up(source, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "marker"
    args = ["convert", source, "--recipe", "per-token-4", "-o", out, "--max-shard-size", "20KB"]
    proc = _hooked("hang", marker, *args)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the conversion never reached its third tensor"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    [stale] = _strays(tmp_path)  # SIGKILL runs no cleanup: its temporary folder is left
    assert list((tmp_path / stale).glob("model-*.safetensors"))  # killed mid-write
    assert not out.exists()
    result = _run(*args)
    assert result.exit_code == 0, result.output
    assert _strays(tmp_path) == []  # the next run into the same output removed it
    format.read_checkpoint(out)


def test_ctrl_c_exits_130_and_leaves_nothing(source, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "marker"
    args = ["convert", source, "--recipe", "per-token-4", "-o", out, "--max-shard-size", "20KB"]
    proc = _hooked("hang", marker, *args)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the conversion never reached its third tensor"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr  # as a shell reports SIGINT (click's Abort says 1)
    assert stderr.splitlines()[-1] == "interrupted" and "Traceback" not in stderr
    assert not out.exists() and _strays(tmp_path) == []


def test_two_conversions_racing_leave_one_result_and_one_clear_error(source, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "barrier"
    procs = [
        _hooked("race", marker, "convert", source, "--recipe", recipe, "-o", out)
        for recipe in ("per-token-4", "quarot-kv4")
    ]
    stderr = [p.communicate(timeout=300)[1] for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], stderr
    loser = stderr[codes.index(2)]
    line = loser.strip().splitlines()[-1]
    assert line.startswith(f"error: output {out} ") and "Traceback" not in loser
    assert "pass --force to replace it" in line
    ckpt = format.read_checkpoint(out)  # complete, every sha256 checked: one of the two
    assert ckpt.meta["recipe"]["name"] in ("per-token-4", "quarot-kv4")
    assert _strays(tmp_path) == []


def test_a_single_file_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic.file_staging(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old" and _strays(tmp_path) == []
    with atomic.file_staging(path) as tmp:
        tmp.write_text("new")
    assert path.read_text() == "new" and _strays(tmp_path) == []


def test_eval_json_into_a_missing_folder_is_refused_before_any_work(tmp_path):
    target = tmp_path / "no" / "such" / "r.json"
    _refused(
        _run("eval", "--recipe", "fp16", "--json", target),
        f"--json {target}: its folder does not exist; create it first",
    )


# -- fuzzing the recipe parser -----------------------------------------------------------------

PRESET_TEXTS = {name: Path(load_recipe(name).source).read_text() for name in presets()}


GEOMETRY = Geometry.from_config(
    {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 128, "num_attention_heads": 2,
     "num_key_value_heads": 2, "vocab_size": 16, "intermediate_size": 8,
     "max_position_embeddings": 256}
)  # fmt: skip


def _parse_or_recipe_error(doc) -> None:
    """parse_recipe raises RecipeError (one line), or the recipe plans (or says why not, in one
    line) into a scheme within the model's context from which a quantized cache builds."""
    start = time.monotonic()
    try:
        recipe = parse_recipe(doc)
    except RecipeError as e:
        assert "\n" not in str(e)
        return
    if recipe.external is None and not recipe.needs_profile:
        try:
            scheme, params = plan(recipe, geometry=GEOMETRY)
        except KvcalibError as e:
            assert "\n" not in str(e)
        else:
            assert scheme.residual <= 256 and scheme.num_sink_slots <= 256
            transforms = Transforms.online(scheme, params)
            planned_memory(
                scheme, params, transforms, num_layers=3, kv_heads=2, head_dim=64, context=64
            )
    assert time.monotonic() - start < 5


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(PRESET_TEXTS)), st.data())
def test_a_mutated_recipe_parses_or_raises_recipe_error(name, data):
    """Keys dropped, values of any type (TOML's and None), unknown keys, in every preset: the
    parser returns a Recipe, which then plans into a cache that builds, or raises RecipeError -
    nothing else."""
    import tomllib

    doc = tomllib.loads(PRESET_TEXTS[name])
    _parse_or_recipe_error(data.draw(mutated(doc)))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(PRESET_TEXTS)), st.data())
def test_recipe_text_flipped_or_cut_loads_or_raises_recipe_error(tmp_path_factory, name, data):
    path = tmp_path_factory.mktemp("recipe") / "r.toml"
    path.write_bytes(data.draw(mutated_bytes(PRESET_TEXTS[name].encode())))
    try:
        load_recipe(path)
    except RecipeError as e:
        assert "\n" not in str(e)
