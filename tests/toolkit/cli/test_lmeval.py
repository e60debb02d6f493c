"""The `kvcalib` model type for lm-evaluation-harness: through the fp16 recipe it scores and
generates what transformers does on the same tokens, a quantized recipe moves the scores, and
lm-eval's own offline RULER tasks run through `kvcalib lm-eval --model kvcalib`."""

import json
import shutil
import sys

import pytest
import torch
from click.testing import CliRunner
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from support.corpus import TEXT as CORPUS_TEXT
from support.tiny import tiny_model

from kvcalib.cli import main
from kvcalib.core.models import resolve
from kvcalib.errors import OptionError, RecipeError
from kvcalib.lmeval import KvcalibLM, _device, task_metadata

OFFLINE_TASKS = (
    "niah_single_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "ruler_vt",
    "ruler_cwe",
    "ruler_fwe",
)
LENGTH = 1024  # RULER's max_seq_lengths for the tiny runs (at 512 its ruler_vt generator loops)
# A fp32 forward through the fp16 recipe's cache against one over the whole sequence: only the
# order of float sums differs (a quantized recipe moves these scores by far more: asserted)
ATOL = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random llama (head_dim 32, which KIVI's groups fit) with SmolLM2's vocabulary and
    tokenizer files (byte-level BPE: RULER sizes its prompts with it)."""
    path = tmp_path_factory.mktemp("lmeval") / "tiny"
    model = tiny_model(
        "llama",
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=49152,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model.save_pretrained(path)
    for f in resolve(None).path.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def models(folder):
    return {r: KvcalibLM(pretrained=str(folder), recipe=r) for r in ("fp16", "kivi-2")}


CONTEXT = " ".join(f"The value of key {i} is {i * 37 % 101}." for i in range(30))
CONTINUATIONS = (" The value of key 7 is 57.", " 12", " Done")


def _request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _reference(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """transformers' own log-likelihood of the continuation: one forward over the sequence."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(context) - 1 : -1].float(), -1)
    target = torch.tensor(continuation)
    return logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


def test_loglikelihood_through_fp16_is_transformers_and_a_2_bit_cache_moves_it(models):
    fp16, kivi = models["fp16"], models["kivi-2"]
    context = fp16.tok_encode(CONTEXT)
    assert len(context) > 2 * 128  # the default residual window: KIVI quantizes the rest
    requests = [_request("loglikelihood", CONTEXT, c) for c in CONTINUATIONS]
    got = fp16.loglikelihood(requests, disable_tqdm=True)
    moved = kivi.loglikelihood(requests, disable_tqdm=True)
    lengths = set()
    for c, (logp, greedy), (quantized, _) in zip(CONTINUATIONS, got, moved, strict=True):
        continuation = fp16.tok_encode(CONTEXT + c)[len(context) :]
        assert fp16.tok_encode(CONTEXT + c)[: len(context)] == context
        want, want_greedy = _reference(fp16.model, context, continuation)
        assert logp == pytest.approx(want, abs=ATOL * len(continuation))
        assert greedy == want_greedy
        lengths.add(len(continuation))
        if len(continuation) == 1:  # predicted by the exact prefill, as a served answer's first
            assert quantized == logp
        else:
            assert abs(quantized - want) > 100 * ATOL * len(continuation)
    assert 1 in lengths and max(lengths) > 4


def test_loglikelihood_rolling_through_fp16_is_transformers_window_by_window(folder):
    lm = KvcalibLM(pretrained=str(folder), recipe="fp16", max_length=48)
    text = CONTEXT[:300]
    tokens = lm.tok_encode(text)
    assert len(tokens) > 2 * 48  # three windows at least
    windows = get_rolling_token_windows(tokens, lm.prefix_token_id, 48, 1)
    want = sum(_reference(lm.model, *map(list, make_disjoint_window(w)))[0] for w in windows)
    (got,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", text)], True)
    assert got == pytest.approx(want, abs=ATOL * len(tokens))


def test_generate_until_through_fp16_is_transformers_greedy(models):
    fp16 = models["fp16"]
    context = fp16.tok_encode(CONTEXT)
    with torch.no_grad():
        ids = fp16.model.generate(
            torch.tensor([context]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    want = fp16.tokenizer.decode(ids[0, len(context) :])
    args = {"until": [], "max_gen_toks": 12, "do_sample": False}
    (got,) = fp16.generate_until([_request("generate_until", CONTEXT, args)], True)
    assert got == want
    stop = want[len(want) // 2 :]  # a stop sequence cuts the text where it first appears
    args = {"until": [stop], "max_gen_toks": 12, "do_sample": False}
    (cut,) = fp16.generate_until([_request("generate_until", CONTEXT, args)], True)
    assert cut == want.split(stop)[0]


def test_a_converted_folder_runs_its_own_side_car(corpus):
    side_car = KvcalibLM(pretrained=str(corpus.converted))
    fp16 = KvcalibLM(pretrained=str(corpus.converted), recipe="fp16")
    assert side_car.candidate.name == "full (converted)"
    assert side_car.candidate.scheme.residual == 128  # every recipe's window, the side-car's too
    tokens = fp16.tok_encode(CORPUS_TEXT[:230])
    context, continuation = tokens[:200], tokens[200:]
    want = _reference(fp16.model, context, continuation)[0]
    assert fp16.score(context, continuation)[0] == pytest.approx(want, abs=ATOL * 30)
    assert abs(side_car.score(context, continuation)[0] - want) > 100 * ATOL * 30


def test_without_lm_eval_the_command_says_what_to_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "kvcalib.lmeval")
    for name in [m for m in sys.modules if m.split(".")[0] == "lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    result = CliRunner().invoke(main, ["lm-eval", "--model", "kvcalib"])
    assert result.exit_code == 2
    assert "pip install 'kvcalib[ruler]'" in result.output


def test_ruler_tasks_get_the_local_tokenizer_of_a_model_spec():
    path = str(resolve("smollm2-135m").path)
    assert task_metadata({"pretrained": "smollm2-135m"}, None) == {"tokenizer": path}
    assert task_metadata({}, {"max_seq_lengths": [LENGTH]})["tokenizer"] == path  # the default
    mine = {"tokenizer": "/my/tokenizer"}
    assert task_metadata({"pretrained": "smollm2-135m"}, mine) == mine


def test_bad_model_args_name_the_fix(folder):
    with pytest.raises(RecipeError, match="kivi-2"):  # did you mean
        KvcalibLM(pretrained=str(folder), recipe="kivi-3")
    with pytest.raises(OptionError, match=r"batch_size 4: .* use --batch_size 1"):
        KvcalibLM(pretrained=str(folder), batch_size=4)


def test_a_tasks_max_gen_toks_below_1_is_refused_naming_where_it_comes_from(models):
    """A task's (or --gen_kwargs') max_gen_toks overrides the model arg per request; -5 used
    to cut the context by a negative slice and answer nothing."""
    args = {"until": [], "max_gen_toks": -5, "do_sample": False}
    with pytest.raises(OptionError, match=r"max_gen_toks -5 \(the task's generation_kwargs or "):
        models["fp16"].generate_until([_request("generate_until", CONTEXT, args)], True)


@pytest.mark.slow  # lm-eval indexes its task folder per run: ~10 s each on 2 cores
@pytest.mark.parametrize("recipe", ["fp16", "kivi-2"])
def test_offline_ruler_tasks_run_through_kvcalib_lm_eval(folder, tmp_path, recipe):
    args = [
        "lm-eval",
        "--model",
        "kvcalib",
        "--model_args",
        f"pretrained={folder},recipe={recipe}",
        "--gen_kwargs",
        "max_gen_toks=16",
        "--tasks",
        ",".join(OFFLINE_TASKS),
        "--metadata",
        json.dumps({"max_seq_lengths": [LENGTH]}),
        "--limit",
        "1",
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path),
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (out,) = tmp_path.rglob("results_*.json")
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(OFFLINE_TASKS)
    for task, metrics in results.items():
        score = metrics[f"{LENGTH},none"]  # lm-eval's own metric key: the score at that length
        assert 0.0 <= score <= 1.0, (task, score)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_lm_evals_default_device_falls_back_to_the_cpu():
    assert _device("cuda:0") == "cpu"  # what lm-eval's command line passes without --device
    with pytest.raises(OptionError, match="use cpu, cuda, cuda:N"):
        _device("tpu")
