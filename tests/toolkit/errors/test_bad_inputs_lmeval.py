"""The bad-input corpus, part 4: lm-eval's `kvcalib` model type (`--model kvcalib`).

Each row is a set of --model_args (and the options lm-eval passes itself), given to the model
type as lm-eval's command line does (`create_from_arg_obj`, with device and batch size beside
them). The contract is the corpus's (`corpus.py`), said in lm-eval's words: one line (an
OptionError, RecipeError or ProfileError, which `kvcalib lm-eval` prints as `error: ...`, exit
2) naming the argument as the user wrote it (NAME=VALUE for --model_args, lm-eval's own option
for the device and the batch size) and a fix, no model loaded (the loaders are patched to fail
the test), no file written, no input changed. Issue 52 found tracebacks (TypeError, ValueError)
for these, a collision on `device` that left no way to choose it, and refusals naming options
lm-eval does not have (--seq-len, --no-calibrate, --residual).
"""

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import transformers
from click.testing import CliRunner
from support.corpus import Workspace, one_line, snapshot

from kvcalib.cli import main
from kvcalib.errors import KvcalibError
from kvcalib.lmeval import KvcalibLM
from kvcalib_runtime.model.forward import Transformer

LM_EVAL = {"batch_size": 1, "max_batch_size": None, "device": "cpu"}  # what its CLI passes
# KIVI-style keys (grouped over 16 tokens, flushed a window at a time) for the corpus model's
# 16-channel heads
CHANNEL = 'name = "ch"\nresidual = 128\n[key]\nbits = 2\ngranularity = "channel"\n'
CHANNEL += "group_size = 16\n"


@dataclass(frozen=True)
class Row:
    """build(ctx): the --model_args; own: lm-eval's own options over LM_EVAL's; fragment: what
    the one line says."""

    build: Callable
    fragment: str
    own: dict | None = None


def src(**args):
    return lambda ctx: {"pretrained": str(ctx.src), **args}


def converted(**args):
    return lambda ctx: {"pretrained": str(ctx.converted), **args}


ROWS = [
    Row(src(residual="abc", recipe="per-token-4"), "residual=abc (--model_args): use a token"),
    Row(src(residual=-1.0), "residual=-1.0 (--model_args): use a token count >= 0, or none"),
    Row(converted(residual="abc"), "residual=abc (--model_args): use a token count >= 0"),
    Row(src(residual=[1]), "residual=[1] (--model_args)"),
    Row(src(max_length="abc"), "max_length=abc (--model_args): use an integer >= 2"),
    Row(src(max_length=1.5), "max_length=1.5 (--model_args): use an integer >= 2"),
    Row(src(max_gen_toks="abc"), "max_gen_toks=abc (--model_args): use an integer >= 1"),
    Row(src(max_gen_toks=-5.0), "max_gen_toks=-5.0 (--model_args): use an integer >= 1"),
    Row(src(max_gen_toks=0), "max_gen_toks=0 (--model_args): use an integer >= 1"),
    Row(
        src(recipie="kivi-2"),
        "recipie=kivi-2 (--model_args): the kvcalib model type has no argument recipie; did "
        "you mean recipe?",
    ),
    Row(src(pretraind="x"), "has no argument pretraind; did you mean pretrained?"),
    Row(
        src(device="cpu"),
        "device=cpu (--model_args): lm-eval passes the device itself; use lm-eval's --device "
        "cpu instead",
    ),
    Row(src(batch_size=1), "use lm-eval's --batch_size 1 instead"),
    Row(src(), "--device tpu: not a device", own={"device": "tpu"}),
    Row(
        src(),
        "--batch_size 4: the kvcalib model type runs one request at a time",
        {"batch_size": 4},
    ),
    Row(src(), "--batch_size auto: ", own={"batch_size": "auto"}),
    Row(src(), "--max_batch_size 8: ", own={"max_batch_size": 8}),
    Row(src(dtype="fp8"), "dtype=fp8 (--model_args): use one of float32, float16, bfloat16"),
    Row(src(trust_remote_code="maybe"), "trust_remote_code=maybe (--model_args): use true or"),
    Row(src(pretrained=True), "pretrained=True (--model_args): use a kvcalib model spec"),
    Row(src(recipe=""), "recipe= (--model_args): use a preset name or a recipe TOML file"),
    Row(
        src(max_length=100000),
        "max_length=100000 (--model_args): the model reads at most 256 positions; use at most",
    ),
    Row(
        src(max_gen_toks=300),
        "max_gen_toks=300 (--model_args): leaves no room for a context in max_length 256",
    ),
    Row(
        lambda c: {**src(residual=100)(c), "recipe": str(c.recipe(CHANNEL))},
        "recipe ch with residual=100: its keys are grouped over 16 tokens",
    ),
    Row(
        src(recipe="kvcalib-2"),
        "no profile in --model_args: the recipe needs calibrated tensors, and the default "
        "calibration reads windows of 512 tokens, longer than",
    ),
    Row(src(recipe="kivi-3"), "recipe kivi-3: no such preset; did you mean kivi-4, kivi-2"),
]


def _no_load(*args, **kwargs):
    raise AssertionError("a model loaded, though the arguments could be judged without it")


@pytest.fixture
def no_load(monkeypatch, tmp_path):
    """Loading a model fails the test; the default profiles' cache is an empty folder."""
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_load)
    monkeypatch.setattr(Transformer, "from_folder", _no_load)
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.fragment[:32])
def test_bad_model_args_are_refused_in_lm_evals_words(row, corpus, tmp_path, no_load):
    ctx = Workspace(tmp_path / "work", corpus)
    args = row.build(ctx)
    before = snapshot(ctx.root)
    with pytest.raises(KvcalibError) as refused:
        KvcalibLM.create_from_arg_obj(args, {**LM_EVAL, **(row.own or {})})
    line = one_line(refused.value, row.fragment)
    ours = re.sub(r"run kvcalib calibrate [^;:]*? and ", "", line)  # another command's options
    for foreign in ("--seq-len", "--no-calibrate", "--residual", "--profile "):
        assert foreign not in ours, line  # options lm-eval does not have
    assert snapshot(ctx.root) == before, "a file was written or an input changed"


def test_residual_none_keeps_the_recipes_or_the_side_cars_own_window(corpus, tmp_path):
    """What the README documents: `residual=none` (lm-eval's CLI hands it over as the text
    "none", its Python parser as None) keeps each recipe's own window; it crashed (TypeError)
    on a recipe and was refused ("must be int") on a converted folder."""
    recipe = tmp_path / "r8.toml"
    recipe.write_text('name = "r8"\nresidual = 8\n[key]\nbits = 4\n')
    for none, window in (("none", 8), (None, 8), (128, 128)):
        args = {"pretrained": str(corpus.src), "recipe": str(recipe), "residual": none}
        lm = KvcalibLM.create_from_arg_obj(args, LM_EVAL)
        assert lm.candidate.scheme.residual == window
    for none, window in (("none", 16), ("None", 16), (4, 4)):  # 16: FULL_RECIPE's own
        args = {"pretrained": str(corpus.converted), "residual": none}
        lm = KvcalibLM.create_from_arg_obj(args, LM_EVAL)
        assert lm.candidate.scheme.residual == window


def test_the_device_is_lm_evals_own_option(corpus):
    """lm-eval passes `--device` to every model type: that is where a user picks it."""
    lm = KvcalibLM.create_from_arg_obj({"pretrained": str(corpus.src)}, {"device": "cpu"})
    assert str(lm._device) == "cpu"


@pytest.mark.slow  # lm-eval indexes its task folder first: ~30 s on 2 cores
def test_kvcalib_lm_eval_prints_the_refusal_as_one_line(corpus):
    args = [
        "lm-eval", "--model", "kvcalib", "--model_args", f"pretrained={corpus.src},device=cpu",
        "--tasks", "niah_single_1", "--limit", "1",
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.splitlines()[-1] == (
        "error: device=cpu (--model_args): lm-eval passes the device itself; use lm-eval's "
        "--device cpu instead"
    )
