"""The long-context suite: prompts are what they claim (length, needles, answers), scoring is
exact match by hand, seeds reproduce, one prefill serves every cache as a prefill through it
would, and the suite runs end to end on the real model."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.tiny import tiny_model

from kvcalib.core.data import read_text
from kvcalib.core.recipe import load_recipe
from kvcalib.errors import DataError
from kvcalib.evaluation import longcontext, longreport, longtasks
from kvcalib.evaluation.external import external_cache
from kvcalib.evaluation.score import Result, candidates
from kvcalib.sim.cache import QuantizedKVCache

LENGTHS = (1024, 3000)
BUILDERS = {
    "passkey": lambda tok, hay, n, seed: longtasks.passkey(tok, hay, n, seed, 0.3),
    "multikey": longtasks.multikey,
    "multivalue": longtasks.multivalue,
    "vartrack": longtasks.vartrack,
    "freqwords": longtasks.freqwords,
}


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's own tokenizer (byte-level BPE with a chat template): no model weights."""
    from transformers import AutoTokenizer

    from kvcalib.core.models import resolve

    return AutoTokenizer.from_pretrained(resolve(None).path)


@pytest.fixture(scope="module")
def haystack(tokenizer):
    return longtasks.Haystack(tokenizer, read_text(None, "evaluation"))


@pytest.fixture(scope="module")
def suite(tokenizer, haystack):
    return {
        (task, n, seed): build(tokenizer, haystack, n, seed)
        for task, build in BUILDERS.items()
        for n in LENGTHS
        for seed in (0, 1)
    }


def test_prompts_hit_the_target_length(tokenizer, suite):
    for s in suite.values():
        # prompt and answer budget fill the target exactly, as RULER counts a length
        assert len(s.ids) + s.max_new_tokens == s.length, (s.task, s.length)
        # the pieces are tokenized apart; as one text they merge differently only at their
        # seams (haystack window ends, needles): a few tokens, not a drift
        text = tokenizer.decode(s.ids)
        again = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert abs(again - len(s.ids)) <= 2 + 2 * len(s.needles), (s.task, again, len(s.ids))


def test_prompts_use_the_chat_template_and_end_in_the_answer_prefix(tokenizer, suite):
    for s in suite.values():
        text = tokenizer.decode(s.ids)
        assert text.startswith("<|im_start|>system")
        assert text.count("<|im_start|>assistant\n") == 1 + (s.task == "vartrack")  # + example
        tail = text.rsplit("<|im_start|>assistant\n", 1)[1]
        # the answer's first words, no end of turn: the greedy answer continues them
        assert tail.startswith(("The special magic", "Answer: According"))
        assert "<|im_end|>" not in tail


def test_needles_are_where_they_claim(tokenizer, suite):
    for (task, _, _), s in suite.items():
        texts = [tokenizer.decode(s.ids[a:b]) for a, b in s.needles]
        assert all(t.startswith("\n") and t.endswith("\n\n") for t in texts)
        assert all(s.context[0] <= a and b <= s.context[1] for a, b in s.needles)
        assert [a for a, _ in s.needles] == sorted(a for a, _ in s.needles)
        if task == "passkey":
            assert re.fullmatch(f"\nOne of the special magic numbers for [a-z]+-[a-z]+ is: "
                                f"{s.expected[0]}.\n\n", texts[0])  # fmt: skip
            # at the line start nearest 30% of the haystack: a line off at most (pydoc's lines
            # are under 60 tokens)
            (a, b), (c0, c1) = s.needles[0], s.context
            assert abs((a - c0) / (c1 - c0 - (b - a)) - s.depth) < 60 / (c1 - c0)
        if task in ("multikey", "multivalue"):
            assert (
                len(texts) == {"multikey": longtasks.NEEDLES, "multivalue": longtasks.VALUES}[task]
            )
            assert all("special magic numbers for" in t for t in texts)
        if task == "vartrack":
            # the chain in order: the value first, then each variable from the one before
            assert len(texts) == longtasks.HOPS + 1
            names = s.expected
            assert re.fullmatch(f"\\d{{5}} -> VAR {names[0]}", texts[0].strip())
            for i in range(1, len(names)):
                assert texts[i].strip() == f"VAR {names[i - 1]} -> VAR {names[i]}"


def test_answers_are_in_the_prompt(tokenizer, suite):
    for (task, _, _), s in suite.items():
        text = tokenizer.decode(s.ids)
        assert all(e in text for e in s.expected)
        if task == "multikey":
            # the asked key's needle holds the answer; the question names that key
            (key,) = re.findall(r"magic number for (\S+) mentioned in the provided text\?", text)
            assert f"numbers for {key} is: {s.expected[0]}." in text
            assert len(set(re.findall(r"numbers for (\S+) is:", text))) == longtasks.NEEDLES
        # the written-out answer is scored correct; a distractor's is not
        assert s.correct(s.answer) and not any(s.correct(d) for d in s.distractors)
        assert len(s.distractors) == (longtasks.NEEDLES - 1 if task == "multikey" else 0)
        if task == "freqwords":
            # the expected word is the most frequent of the coded text (the dots aside), by
            # a clear margin: Zipf's 1/2^2 against 1/3^2
            coded = text.split("coded word.\n\n", 1)[1].split("\n\nQuestion:")[0]
            (first, n1), (_, n2) = Counter(w for w in coded.split() if w != "....").most_common(2)
            assert (first,) == s.expected and n1 > 1.8 * n2


def test_seeds_reproduce(tokenizer, haystack, suite):
    for (task, n, seed), s in suite.items():
        assert BUILDERS[task](tokenizer, haystack, n, seed) == s  # the same prompt and answer
    for task in BUILDERS:
        assert suite[task, 1024, 0].ids != suite[task, 1024, 1].ids
        assert suite[task, 1024, 0].expected != suite[task, 1024, 1].expected


def test_scoring_by_hand():
    def sample(*expected):
        return longtasks.Sample("t", 100, 0, (1,), expected, (), (0, 1), 8)

    assert sample("4821937").correct(" 4821937.")
    assert not sample("4821937").correct(" 482193.")  # a digit short is wrong
    many = sample("1111111", "2222222", "3333333")
    assert many.correct(": 3333333, 1111111 and 2222222")  # any order
    assert not many.correct(": 1111111, 2222222")  # all items, no partial credit
    assert sample("QWERT", "ASDFG").correct(" qwert, asdfg")  # case-insensitive

    def rec(ok, nll):
        probe = {"needle_mass": 0.1, "sink_mass": 0.5, "needle_key_error": 1.0}
        return {"correct": ok, "nll": nll, "seconds": 1.0, "layers": LAYERS, **probe}

    fp = [rec(True, 0.1), rec(True, 0.2), rec(True, 0.3)]
    q = [rec(True, 0.2), rec(False, 0.5), rec(True, 0.3)]
    records = [(sample(), {"fp16": f, "kivi-2": k}) for f, k in zip(fp, q, strict=True)]
    cell = longcontext.cells(records, "kivi-2")["t"]["100"]
    assert cell["accuracy"] == pytest.approx(2 / 3) and cell["samples"] == 3
    assert cell["diff"] == pytest.approx(-1 / 3) and cell["mcnemar_p"] == 1.0  # 1 discordant
    assert cell["nll_diff"] == pytest.approx(0.4 / 3)
    assert cell["failures"] == {"neither": 1}  # the probe saw nothing (LAYERS: all alike)
    assert "diff" not in longcontext.cells(records, "fp16")["t"]["100"]


LAYERS = {"needle_mass": [0.1], "sink_mass": [0.5], "key_error": [1.0]}


def test_lengths_are_checked(tokenizer, haystack):
    with pytest.raises(DataError, match="model's context \\(8192 tokens\\)"):
        longcontext.check_lengths([2048, 9000], 8192)
    with pytest.raises(DataError, match="no room for a haystack"):
        longtasks.vartrack(tokenizer, haystack, 300, 0)
    short = longtasks.Haystack(tokenizer, "a few words\n" * 20)
    with pytest.raises(DataError, match="haystack has"):
        longtasks.passkey(tokenizer, short, 1024, 0, 0.5)


def _result(name, cells):
    return Result(name, "decode", 10.0, 10.0, 0.0, 1.0, 16.0, {}, 128, 1.0, long_context=cells)


def _cells(acc, paired=False):
    cell = {"accuracy": acc, "samples": 2, "low": acc / 2, "high": 1.0, "nll": 0.5,
            "seconds": 1.0, "probe": LAYERS}  # fmt: skip
    if paired:
        cell |= {"diff": acc - 1, "diff_low": -1.0, "diff_high": 0.0, "mcnemar_p": 0.5,
                 "nll_diff": 0.25, "nll_diff_low": 0.1, "nll_diff_high": 0.4}  # fmt: skip
    return {task: {str(n): dict(cell) for n in (2048, 4096)} for task in ("passkey", "multikey")}


def test_tables_and_plot(tmp_path):
    from kvcalib.evaluation.score import format_table

    results = [_result("fp16", _cells(1.0)), _result("kivi-2", _cells(0.5, paired=True))]
    lines = format_table(results).splitlines()  # setup, blank, head, rule, full precision, ...
    assert lines[2].endswith("| long-ctx |") and lines[4].endswith("| - |")
    assert lines[5].endswith("| 100.0% |") and lines[6].endswith("| 50.0% |")
    per_task = longreport.format_table(results).splitlines()
    assert per_task[0] == "| task | tokens | n | fp16 | kivi-2 |"
    assert per_task[2] == "| passkey | 2048 | 2 | 100% [50, 100] | 50% [25, 100] |"
    assert len(per_task) == 2 + 4 + 1  # head, a row per task and length, the mean
    paired = longreport.format_paired(results).splitlines()
    assert len(paired) == 2 + 4  # fp16 is the reference: only kivi-2's rows
    assert paired[2] == (
        "| passkey | 2048 | 2 | kivi-2 | 50% | -50 [-100, +0] | 0.5 | 0.500 "
        "| +0.250 [+0.100, +0.400] | - | - |"
    )
    assert longreport.format_paired(results[:1]) == ""  # nothing paired: no table
    for draw, name in ((longreport.plot, "lc.png"), (longreport.plot_probe, "probe.png")):
        png = draw(results, tmp_path / name)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_passes_the_lengths_and_prints_the_second_table(monkeypatch, tmp_path):
    from kvcalib import api
    from kvcalib.cli import main

    seen = {}

    def evaluate(model, recipes, **kwargs):
        seen.update(kwargs)
        results = [_result("fp16", _cells(1.0))]
        kwargs["report"](results)  # the CLI prints its tables there
        return results

    monkeypatch.setattr(api, "evaluate", evaluate)
    out = tmp_path / "r.json"
    args = ["eval", "--recipe", "fp16", "--long-context-lengths", "2048,4096", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert seen["long_context"] == [2048, 4096] and seen["long_context_prompts"] == 5
    assert "| task | tokens | n | fp16 |" in result.output
    row = json.loads(out.read_text())[0]
    assert row["long_context"]["multikey"]["4096"] == _cells(1.0)["multikey"]["4096"]
    CliRunner().invoke(
        main, ["eval", "--recipe", "fp16", "--long-context", "--long-context-prompts", "30"]
    )
    # the suite's own lengths, named as --long-context's
    assert seen["long_context"] is True and seen["long_context_prompts"] == 30
    bad = CliRunner().invoke(main, ["eval", "--recipe", "fp16", "--long-context-lengths", "4k"])
    assert bad.exit_code == 2 and "--long-context-lengths" in bad.output


@pytest.mark.parametrize("recipe", ["kivi-2", "per-token-2", "hf-quanto-2"])
def test_one_prefill_fills_a_cache_as_a_prefill_through_it(recipe):
    # The suite prefills once and hands the recording to every cache: the decode steps after it
    # must see exactly what they see after the model's own prefill through that cache.
    model = tiny_model("llama", num_attention_heads=2, num_key_value_heads=1)  # head_dim 32
    (c,) = candidates(model, [recipe])
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    steps = torch.tensor([[5], [17], [99]])

    if c.scheme is None:
        own = external_cache(model, c.recipe)
    else:
        own = QuantizedKVCache(model, c.scheme, c.params, c.transforms, max_len=160)
    with torch.no_grad():
        first = model(ids, cache=own, use_cache=True).logits[0, -1]
        after_own = [model(t[None], cache=own).logits[0, -1] for t in steps]
        if c.scheme is not None:
            own.close()
        prefill = longcontext.Prefill(model, ids, set())
        with longcontext.filled_cache(model, c, prefill, 160) as filled:
            after_fill = [model(t[None], cache=filled).logits[0, -1] for t in steps]
    torch.testing.assert_close(prefill.logits, first, rtol=0, atol=1e-5)
    for a, b in zip(after_own, after_fill, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_one_cell_end_to_end(real_model):
    model, tokenizer = real_model
    cands = candidates(model, ["fp16", "kivi-2"])
    fp16, kivi = longcontext.run(
        model, tokenizer, cands, lengths=(1024,), prompts=1, tasks=("multikey",)
    )
    cell, lossy = fp16["multikey"]["1024"], kivi["multikey"]["1024"]
    assert cell["samples"] == 1 and cell["accuracy"] == 1.0  # full precision finds it
    assert cell["outranks"] == 1.0  # and ranks the asked value above the three distractors
    assert lossy["samples"] == 1 and lossy["seconds"] > 0
    # 2-bit KIVI misses this prompt (measured: answer NLL 0.85 against 0.22 per token): the
    # paired columns see it, and the probe measured a real key error at the needles
    assert lossy["nll_diff"] > 0.1 and lossy["diff"] == -1.0
    assert all(x is not None and x > 0.5 for x in lossy["probe"]["key_error"])
    assert all(x is None for x in cell["probe"]["key_error"])  # fp16 stores keys exactly


def _bench():
    """benchmarks/long_context.py as a module (it is a script, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "long_context.py"
    spec = importlib.util.spec_from_file_location("long_context_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_rescores_a_record_from_another_plan_only():
    # The resumable benchmark keeps a record while the plan it was scored under stands: a
    # calibrated recipe planned from another profile (one range moved) must be scored again, the
    # same profile must keep it; a profile-free recipe's record carries its plan too, and one
    # written before records carried it stands only where legacy-plans.json names today's plan
    # as the one it was scored under (a preset changed since is scored again).
    from support.tiny import ShapeProfile

    bench = _bench()
    model = tiny_model("llama", num_attention_heads=2, num_key_value_heads=1)
    profile = ShapeProfile(1, 32)
    (kv2,) = candidates(model, ["kvcalib-2"], profile, residual=128)
    (again,) = candidates(model, ["kvcalib-2"], ShapeProfile(1, 32), residual=128)
    moved = ShapeProfile(1, 32)
    moved.range = lambda *a, **k: (-2 * torch.ones(1, 32), torch.ones(1, 32))
    (other,) = candidates(model, ["kvcalib-2"], moved, residual=128)
    assert bench._digest(kv2) == bench._digest(again)
    assert bench._digest(kv2) != bench._digest(other)
    fp16, kivi2, kivi4 = candidates(model, ["fp16", "kivi-2", "kivi-4"], residual=128)
    assert len({bench._digest(c) for c in (fp16, kivi2, kivi4)}) == 3

    tags = {"fp16": bench._digest(fp16), "kvcalib-2": bench._digest(kv2)}
    known = {"recipes": {"fp16": {"plan": tags["fp16"]}, "kvcalib-2": {"plan": tags["kvcalib-2"]}}}
    assert bench._current(known, tags, {}) == {"fp16", "kvcalib-2"}
    known["recipes"]["kvcalib-2"]["plan"] = bench._digest(other)
    assert bench._current(known, tags, {}) == {"fp16"}
    del known["recipes"]["kvcalib-2"]["plan"]  # scored before records carried a plan
    assert bench._current(known, tags, {"kvcalib-2": tags["kvcalib-2"]}) == {"fp16", "kvcalib-2"}
    del known["recipes"]["fp16"]["plan"]
    assert bench._current(known, tags, {}) == set()
    assert bench._current(known, tags, {"fp16": tags["fp16"]}) == {"fp16"}
    assert bench._current(known, tags, {"fp16": bench._digest(kivi2)}) == set()


def test_the_legacy_plans_name_profile_free_presets():
    # Each committed legacy-plans.json (records written without a plan) names presets that read
    # no profile, each once with a digest: what the runner compares today's plan against.
    root = Path(__file__).resolve().parents[3] / "benchmarks"
    files = sorted(root.glob("*/*/legacy-plans.json"))
    assert len(files) >= 4
    for path in files:
        for name, digest in json.loads(path.read_text()).items():
            assert not load_recipe(name).needs_profile, (path, name)
            assert len(digest) == 16 and int(digest, 16) >= 0, (path, name)


def test_benchmark_split_quantizes_one_side_of_the_plan():
    # --split scores a recipe's plan with only its keys, or only its values, quantized: the
    # coded side must be the parent's own specs (allocation included), and the other side must be
    # stored exact, which the walked buffers show: each layer's coded stream holds the parent's
    # bytes, the exact one the full-precision cache's.
    from support.tiny import ShapeProfile

    bench = _bench()
    model = tiny_model("llama", num_attention_heads=2, num_key_value_heads=1)
    fp, kv2 = candidates(model, ["fp16", "kvcalib-2"], ShapeProfile(1, 32), residual=16)
    keys, values = (bench.coded_alone(kv2, side) for side in bench.SIDES)
    assert (keys.name, values.name) == ("kvcalib-2:keys", "kvcalib-2:values")
    assert len({bench._digest(c) for c in (kv2, keys, values)}) == 3
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(0))
    prefill = longcontext.Prefill(model, ids, longcontext.sinks_read([kv2]))

    def stream_bytes(c):
        with longcontext.filled_cache(model, c, prefill, 96) as cache:
            return [
                [sum(t.untyped_storage().nbytes() for t in s.tensors()) for s in streams]
                for streams in (cache.store.keys, cache.store.values)
            ]

    full, parent, k, v = (stream_bytes(c) for c in (fp, kv2, keys, values))
    assert k == [parent[0], full[1]] and v == [full[0], parent[1]]
    assert all(p < f for p, f in zip(parent[0] + parent[1], full[0] + full[1], strict=True))
