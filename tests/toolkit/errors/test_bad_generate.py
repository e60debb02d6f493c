"""The bad-input corpus, part 4 (issue 52's runtime half): config.json numbers that pass every
shape check but break the forward, weights that make NaN logits, temperatures below what
float32 sampling resolves, devices no machine has, the runtime API's remaining arguments, and
chat templates that fail — through `kvcalib_runtime.load` / `RuntimeModel.generate` (a
KvcalibRuntimeError, one line) and `kvcalib generate` (exit 2, one line).

Same contract as parts 1-3 (`corpus.check`). A damaged config.json comes with a rewritten
manifest and binding, as a careless or hostile writer would leave it: the validator, not the
sha256, must refuse it, before any weight loads. NaN logits need a forward pass: those rows
load the model (before_load=False), as a chat template's need the loaded tokenizer.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from support import native_cases
from support.corpus import Case, Workspace, check, rebind, refused, remanifest

import kvcalib_runtime
from kvcalib.cli import main
from kvcalib_runtime.errors import KvcalibRuntimeError
from kvcalib_runtime.generate import MIN_TEMPERATURE, sample
from kvcalib_runtime.kernels import native

WEIGHTS = "model-00001-of-00001.safetensors"
NAN, INF = float("nan"), float("inf")


def config(**changes):
    """The converted copy with config.json's keys changed (None removes nothing: it sets
    null); `rope` changes rope_parameters' keys."""
    rope = changes.pop("rope", {})

    def edit(cfg):
        cfg.update(changes)
        cfg["rope_parameters"] = {**cfg["rope_parameters"], **rope}

    return lambda ctx: ctx.side_car(config=edit)


def nan_weights(ctx: Workspace):
    """The converted copy with one NaN in the final norm (manifest and binding rewritten):
    every logit is NaN."""
    path = ctx.converted
    tensors = load_file(path / WEIGHTS)
    tensors["model.norm.weight"][0] = NAN
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    rebind(path)
    remanifest(path)
    return path


def chat(template: str):
    """The converted copy with this chat template beside it (in the manifest)."""
    return lambda ctx: ctx.side_car(files={"chat_template.jinja": template.encode()})


def load(build, **kwargs):
    """kvcalib_runtime.load of build(ctx)'s folder (the CPU unless `device` says otherwise)."""
    kwargs.setdefault("device", "cpu")

    def make(ctx):
        folder = build(ctx)
        return lambda: kvcalib_runtime.load(folder, **kwargs)

    return make


def generate(*args, folder=None, **kwargs):
    """RuntimeModel.generate on the intact copy (or folder(ctx)): the checkpoint loads first."""

    def build(ctx):
        path = folder(ctx) if folder else ctx.converted
        return lambda: kvcalib_runtime.load(path, device="cpu").generate(*args, **kwargs)

    return build


def gen(*args, folder=None):
    """`kvcalib generate` on the converted copy (or folder(ctx)) with `args`."""

    def build(ctx):
        path = folder(ctx) if folder else ctx.converted
        return [path, "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "3", *args]

    return build


def converted(ctx):
    return ctx.converted


RAISES = "{{ raise_exception('only system messages') }}"
UNPARSED = "{% for m in messages %}{{ m['content'] }"
MISSING = "{{ messages[1]['content'] }}"
DIVIDES = "{{ messages | length / 0 }}"

CONFIG = [
    Case("numbers", "load", load(config(rope={"rope_theta": -1.0})), "rope_theta = -1.0; RoPE"),
    Case("numbers", "load", load(config(rope={"rope_theta": 0})), "rope_theta = 0; RoPE"),
    Case("numbers", "load", load(config(rope={"rope_theta": NAN})), "rope_theta = nan"),
    Case(
        "numbers",
        "load",
        load(config(rope_parameters={}, rope_theta=0)),  # the legacy key: 0 was read as unset
        "rope_theta = 0",
    ),
    Case("numbers", "load", load(config(rms_norm_eps=-1)), "rms_norm_eps = -1; RMSNorm"),
    Case("numbers", "load", load(config(rms_norm_eps=0)), "rms_norm_eps = 0"),
    Case("numbers", "load", load(config(rms_norm_eps=INF)), "rms_norm_eps = inf"),
    Case("numbers", "load", load(config(rms_norm_eps=None)), "rms_norm_eps = None"),
    Case("numbers", "load", load(config(rms_norm_eps=True)), "rms_norm_eps = True"),
    Case(
        "numbers",
        "load",
        load(config(rope={"partial_rotary_factor": NAN})),
        "partial_rotary_factor = nan",
    ),
    Case(
        "numbers",
        "load",
        load(config(rope={"partial_rotary_factor": 2.0})),
        "partial_rotary_factor = 2.0; RoPE rotates that share of a head: use a number in (0, 1]",
    ),
    Case(
        "numbers",
        "load",
        load(config(rope={"rope_type": "linear", "factor": 0.0})),
        "rope_parameters.factor = 0.0; RoPE divides its frequencies by it",
    ),
    Case(
        "numbers",
        "load",
        load(
            config(
                rope={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 128,
                }
            )
        ),
        "rope_parameters.high_freq_factor = 4.0; RoPE divides by it minus low_freq_factor: use "
        "a finite number > low_freq_factor (4)",
    ),
    Case("numbers", "load", load(config(eos_token_id=1.5)), "eos_token_id = 1.5; use a"),
    Case("numbers", "load", load(config(eos_token_id=[2, -1])), "eos_token_id = [2, -1]"),
    Case("numbers", "load", load(config(num_key_value_heads=3)), "not a multiple of"),
    Case("numbers", "load", load(config(num_attention_heads=0)), "num_attention_heads = 0"),
    Case(
        "numbers",
        "generate",
        lambda c: [config(rope={"rope_theta": -1})(c), "--prompt", "hi"],
        "config.json: rope_theta = -1",
    ),
    Case(
        "numbers",
        "generate",
        lambda c: [config(rms_norm_eps=-1)(c), "--prompt", "hi"],
        "config.json: rms_norm_eps = -1",
    ),
]

LOGITS = [
    Case("numbers", "load", generate("hi", 3, folder=nan_weights), "hold NaN or Inf after", False),
    Case(
        "numbers",
        "load",
        generate("hi", 3, folder=nan_weights, temperature=1.0, seed=0),
        "logits for sequence 0 hold NaN or Inf after its prompt",
        False,
    ),
    Case("numbers", "generate", gen(folder=nan_weights), "hold NaN or Inf after its", False),
]

OPTIONS = [
    Case("options", "load", generate("hi", 2, temperature=1e-39), "temperature = 1e-39 is", False),
    Case("options", "load", generate("hi", 2, temperature=1e-300), "at least 1.175e-38", False),
    Case("options", "generate", gen("--temperature", "1e-39"), "--temperature 1e-39 is below"),
    Case("options", "generate", gen("--temperature", "1e-300"), "use 0 (greedy) or at least"),
    Case("options", "load", load(converted, device="cpu:99"), "cpu:99: there is one CPU"),
    Case("options", "load", load(converted, device="cpu:1"), "cpu:1: there is one CPU"),
    Case("options", "generate", gen("--device", "cpu:99"), "--device cpu:99: there is one CPU"),
    Case("options", "load", generate("hi", 2, eos_token_id=1.5), "eos_token_id = 1.5", False),
    Case("options", "load", generate("hi", 2, eos_token_id=[2, "x"]), "eos_token_id = [2", False),
    Case("options", "load", generate("hi", 2, eos_token_id=True), "eos_token_id = True", False),
    Case("options", "load", generate("hi", 2, seed=2**70), "seed = 1180591620717411303424", False),
    Case("options", "load", generate("hi", 2, seed="abc"), "seed = 'abc': use an integer", False),
    Case("options", "load", generate("hi", 2, seed=-1), "seed = -1", False),
    Case("options", "load", generate(None, 2), "prompts = 'None' (NoneType): pass a str", False),
    Case("options", "load", generate(5, 2), "prompts = '5' (int)", False),
    Case("options", "load", generate(b"hi", 2), "(bytes): pass a str", False),
    Case("options", "load", generate([None], 2), "prompt 'None' is neither text", False),
    Case("options", "load", generate("hi", 2, callback=3), "callback = 3: use a function", False),
]

CHAT = [
    Case("special", "generate", gen("--chat", folder=chat(t)), why, False)
    for t, why in [
        (RAISES, "(TemplateError: only system messages); fix chat_template.jinja"),
        (UNPARSED, "TemplateSyntaxError"),
        (MISSING, "UndefinedError"),
        (DIVIDES, "ZeroDivisionError"),
    ]
]


@pytest.mark.parametrize(
    "case", CONFIG + LOGITS + OPTIONS + CHAT, ids=lambda c: f"{c.command}-{c.cls}-{c.fragment[:24]}"
)
def test_bad_input_is_refused_in_one_line(case, corpus, tmp_path, monkeypatch):
    check(case, Workspace(tmp_path, corpus), monkeypatch)


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_kvcalib_native_unrecognised_exits_2(value, corpus, tmp_path, monkeypatch):
    # refused before the checkpoint loads, from the CLI and from the API
    monkeypatch.setenv("KVCALIB_NATIVE", value)
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU path, whose kernels the variable turns off
    folder = Workspace(tmp_path, corpus).converted
    result = CliRunner().invoke(main, ["generate", str(folder), "--prompt", "hi"])
    refused(result, f"KVCALIB_NATIVE={value!r} is neither on nor off")
    with pytest.raises(KvcalibRuntimeError, match="set it to 0/false/no/off"):
        kvcalib_runtime.load(folder, device="cpu")


def test_cpu_0_is_the_cpu(corpus):
    # torch's name for the one CPU device, which safetensors does not take: read as "cpu"
    model = kvcalib_runtime.load(corpus.converted, device="cpu:0")
    assert model.device == torch.device("cpu")
    assert len(model.generate("hi", 2, eos_token_id=[])[0]) == 2


def test_sampling_survives_the_lowest_temperature():
    # at MIN_TEMPERATURE every finite row gives its most likely token, even logits near
    # float32's largest (dividing them first overflowed: 5 / 1.2e-38 is past 3.4e38); just
    # below it, float32 rounds the temperature toward 0 and the division gives NaN
    logits = torch.tensor([[0.0, 5.0, -3e38, 1.0], [3e38, -3e38, 0.0, 2e38], [1.0, 1.0, 1.0, 2.0]])
    for top_p in (1.0, 0.5):
        for seed in range(5):
            g = torch.Generator().manual_seed(seed)
            got = sample(logits, MIN_TEMPERATURE, top_p, g)
            assert got.tolist() == [1, 0, 3]
    assert torch.softmax(logits[:1] / 1e-46, dim=-1).isnan().all()  # what the bound keeps out


@pytest.mark.skipif(native_cases.CC is None, reason="no C compiler: no C library to damage")
def test_generate_with_a_truncated_library_builds_it_again(corpus, tmp_path, monkeypatch):
    # the red team's reproduction: build once, truncate native/kvcalib-<key>.so to 10,000
    # bytes, generate. It exited 135 (SIGBUS); now the library is linked again (the stand-in
    # compiler copies the intact one back), with one warning, and the answer is the one the
    # intact library gives, token for token
    good = native_cases.built()
    cache = native_cases.cache_with(tmp_path / "cache", good)
    os.truncate(cache / "native" / good[0].name, 10_000)
    cc = native_cases.compiler(tmp_path / "cc", native_cases.RELINK, good=good[0])
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCALIB_NATIVE")}
    env.update(CC=str(cc), KVCALIB_CACHE_DIR=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", "from kvcalib.cli import main; main()", "generate",
         str(corpus.converted), "--prompt", "hi", "--max-new-tokens", "6", "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [warning] = native_cases.warnings_in(done.stderr)
    assert "did not match its sha256" in warning
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU path, through the intact library
    monkeypatch.setattr(native, "_LOADED", {})
    model = kvcalib_runtime.load(corpus.converted, device="cpu")
    assert native.library() is not None
    [ids] = model.generate("hi", 6)
    assert done.stdout.split("\nprefill:")[0] == model.decode(ids)


def test_generate_with_a_compiler_that_cannot_run_answers_with_torch(corpus, tmp_path, monkeypatch):
    # CC naming an executable file that is no program: `native.pending()`, which generate asks
    # first, raised OSError (a traceback); now the answer comes from the torch ops, one warning
    cc = tmp_path / "cc"
    cc.write_text("not a program\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU path, whose C kernels it would build
    monkeypatch.setattr(native, "_LOADED", {})
    args = ["generate", str(corpus.converted), "--prompt", "hi", "--max-new-tokens", "4"]
    with pytest.warns(UserWarning, match="Exec format error") as caught:
        result = CliRunner().invoke(main, [*args, "--device", "cpu"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert len(caught) == 1 and native.library() is None
    model = kvcalib_runtime.load(corpus.converted, device="cpu")  # torch ops, as above
    [ids] = model.generate("hi", 4)
    assert result.stdout.startswith(model.decode(ids) + "\nprefill:")


def _generate(folder, env: dict) -> subprocess.CompletedProcess:
    """`kvcalib generate` on the CPU path in a fresh process, with `env` added."""
    full = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCALIB_NATIVE")}
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run(
        [sys.executable, "-c", "from kvcalib.cli import main; main()", "generate", str(folder),
         "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu"],
        env=full, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.skipif(native_cases.CC is None, reason="no C compiler: no C library to build")
def test_generate_builds_through_a_compiler_command_with_arguments(corpus, tmp_path):
    # CC="ccache gcc" counted as no compiler: torch ops, without a word. Now it is split as a
    # shell splits it, and the library is built through it (here `env` running the stand-in,
    # which links the intact library), announced, with no warning
    good = native_cases.built()
    (tmp_path / "my cc").mkdir()
    cc = native_cases.compiler(tmp_path / "my cc" / "cc", native_cases.RELINK, good=good[0])
    done = _generate(corpus.converted, {"CC": f"env '{cc}'", "KVCALIB_CACHE_DIR": tmp_path / "c"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "building the runtime's CPU kernels" in done.stderr
    assert not native_cases.warnings_in(done.stderr)
    assert (tmp_path / "c" / "native" / good[0].name).read_bytes() == good[0].read_bytes()


@pytest.mark.skipif(native_cases.CC is None, reason="no C compiler: no C library to build")
def test_generate_sweeps_a_build_folder_a_sigkill_left(corpus, tmp_path):
    # a build killed outright (SIGKILL, a power cut) leaves native/tmpXXXX with its objects,
    # never removed; the next load removes it once it is older than a build may take (3 steps
    # of 300 s; an hour here) and no live build holds its lock
    cache = native_cases.cache_with(tmp_path / "cache", native_cases.built())
    stale = cache / "native" / "tmpk1ll3d"
    stale.mkdir()
    (stale / "decode_cpu.o").write_bytes(b"\0" * 4096)
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    done = _generate(corpus.converted, {"CC": native_cases.CC, "KVCALIB_CACHE_DIR": cache})
    assert done.returncode == 0, done.stderr[-2000:]
    assert not native_cases.warnings_in(done.stderr)
    assert not stale.exists()
