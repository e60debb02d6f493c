"""The session benchmark: a turn's chunk is prefilled against the history as the cache stores
it, the model can run through another cache meanwhile, a tentative score leaves the cache as it
was, and one tiny session per recipe scores what its cache does (fp16 reproduces uncached
greedy decoding; a 2-bit cache drifts, and only where its body holds quantized tokens; keeping
the history dequantized between forwards changes no record); the resumable runner skips the
cells it has."""

import importlib.util
import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.caches import history, random_ids, small_llama
from support.tiny import CharTokenizer, ShapeProfile
from transformers import DynamicCache

from kvcalib.core.data import read_text
from kvcalib.evaluation import session as sess
from kvcalib.evaluation import sessionreport
from kvcalib.evaluation.score import candidates
from kvcalib.sim import cache as sim_cache
from kvcalib.sim.cache import QuantizedKVCache
from kvcalib_runtime.cache.kvcache import QuantizedCache

RECIPES = ("fp16", "kivi-2", "turboquant-2.5", "kvcalib-2")
SIZES = dict(turns=4, probe_every=2, system_tokens=160, user_tokens=(10, 30))


class Tokenizer(CharTokenizer):
    eos_token_id = pad_token_id = None


@pytest.fixture(scope="module")
def model():
    return small_llama()


def _history(cache: QuantizedKVCache, layer: int, n: int):
    """Layer `layer`'s first n keys and values as the cache hands them to attention."""
    keys, values = history(cache.store, layer, cache.ropes[layer])
    return keys[:, :, :n], values[:, :, :n]


@pytest.mark.parametrize("recipe", ["kivi-2", "kvcalib-2", "turboquant-2.5"])
def test_a_chunk_attends_to_the_history_as_stored(model, recipe):
    # A later turn is prefilled as one chunk into the low-bit cache: it must see the history as
    # the cache stores it (quantized body, exact window) and itself exact — the logits of a
    # full-precision cache holding that dequantized history — not the full-precision history.
    (c,) = candidates(model, [recipe], ShapeProfile(1, 32), residual=32)
    a, b = random_ids(90, 0), random_ids(23, 1)
    with QuantizedKVCache(model, c.scheme, c.params, c.transforms, max_len=160) as cache:
        model(a, cache=cache, use_cache=True)
        held = [_history(cache, i, 90) for i in range(2)]
        got = model(b, cache=cache, use_cache=True).logits[0]
        assert cache.get_seq_length() == 113
    reference = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(held):
        reference.update(k, v, i)
    torch.testing.assert_close(got, model(b, cache=reference).logits[0], rtol=0, atol=1e-5)
    exact = model(torch.cat([a, b], 1)).logits[0, 90:]
    assert (got - exact).abs().max() > 0.05  # the history it attended to is quantized


@pytest.mark.parametrize("recipe", ["kivi-2", "kvcalib-2", "turboquant-2.5"])
def test_what_is_stored_does_not_depend_on_the_chunks(model, recipe):
    # Layer 0's keys depend on the tokens alone: prefilled in uneven chunks (a KIVI key group
    # of 32 tokens split across them, single tokens between) the cache must store what one
    # prefill of the same tokens stores.
    (c,) = candidates(model, [recipe], ShapeProfile(1, 32), residual=32)
    ids = random_ids(160, 2)

    def stored(cuts):
        with QuantizedKVCache(model, c.scheme, c.params, c.transforms, max_len=200) as cache:
            for start, end in itertools.pairwise(cuts):
                model(ids[:, start:end], cache=cache, use_cache=True)
            return _history(cache, 0, 160)

    for one, chunked in zip(stored([0, 160]), stored([0, 90, 113, 114, 115, 160]), strict=True):
        torch.testing.assert_close(chunked, one, rtol=0, atol=1e-5)


def test_another_cache_forward_leaves_the_cache_alone(model):
    # The session scores every turn through a full-precision cache too, with the low-bit cache
    # open on the same model: that forward must neither commit into the low-bit cache nor change
    # what its next chunk sees.
    (c,) = candidates(model, ["kivi-2"], residual=32)
    a, b = random_ids(70, 3), random_ids(9, 4)

    def next_logits(interleave: bool):
        with QuantizedKVCache(model, c.scheme, c.params, c.transforms, max_len=160) as cache:
            model(a, cache=cache, use_cache=True)
            if interleave:
                model(a, cache=DynamicCache(config=model.config), use_cache=True)
                assert cache.get_seq_length() == 70
            return model(b, cache=cache, use_cache=True).logits[0]

    torch.testing.assert_close(next_logits(True), next_logits(False), rtol=0, atol=0)


def test_a_tentative_forward_is_undone(model):
    (c,) = candidates(model, ["kivi-2"], residual=32)
    a, b, c_ids = random_ids(70, 5), random_ids(40, 6), random_ids(5, 7)

    def next_logits(tentative: bool):
        with QuantizedKVCache(model, c.scheme, c.params, c.transforms, max_len=200) as cache:
            model(a, cache=cache, use_cache=True)
            if tentative:
                with cache.tentative():
                    model(b, cache=cache, use_cache=True)  # flushes part of the window
                    assert cache.get_seq_length() == 110
            return model(c_ids, cache=cache, use_cache=True).logits[0]

    torch.testing.assert_close(next_logits(True), next_logits(False), rtol=0, atol=0)


@pytest.fixture(scope="module")
def sessions(model):
    tok = Tokenizer()
    session = sess.generate(tok, 0, text=read_text(None, "evaluation"), **SIZES)
    cands = candidates(model, RECIPES, ShapeProfile(1, 32), residual=32)
    wide = candidates(model, ["kivi-2"], residual=2048)[0]  # a window wider than the session
    records = {c.name: sess.run_session(model, tok, c, session, max_new=8) for c in cands}
    records["kivi-2 wide"] = sess.run_session(model, tok, wide, session, max_new=8)
    return tok, session, records


def test_session_shape(sessions):
    tok, session, records = sessions
    assert len(session.users) == 4 and set(session.probes) == {1, 3}
    assert sess.system_tokens(tok, session) >= 160
    for name, record in records.items():
        turns = record["turns"]
        assert [t["turn"] for t in turns] == [1, 2, 3, 4], name
        assert all(len(t["answer"]) == 8 for t in turns)  # no end of turn: the cap
        for t in (turns[1], turns[3]):
            assert t["fact"] in session.facts and isinstance(t["correct"], bool)
            assert 0 < t["fact_nll"] < 20
        for t in turns:
            assert all(0 <= t[k] <= 1 for k in ("sink_mass", "system_mass", "fp_sink_mass"))
            assert t["repeat4"] is None or 0 <= t["repeat4"] <= 1


def test_fp16_reproduces_uncached_greedy_decoding(model, sessions):
    # fp16 runs the session through its own cache; an uncached forward over the whole
    # history at every step must choose exactly its tokens, and the full-precision reference on
    # the same history must agree with it everywhere (KL ~ 0).
    tok, session, records = sessions
    history = []
    for t, rec in enumerate(records["fp16"]["turns"]):
        history += sess.pieces(tok, session, t)
        for token in rec["answer"]:
            assert int(model(torch.tensor([history])).logits[0, -1].argmax()) == token
            history.append(token)
        assert rec["kl"] < 1e-6 and rec["agree"] == 1.0 and rec["first_agree"]
        assert abs(rec["sink_mass"] - rec["fp_sink_mass"]) < 1e-5


def test_a_2_bit_cache_drifts_only_where_it_quantizes(sessions):
    _, _, records = sessions
    for name in ("kivi-2", "turboquant-2.5", "kvcalib-2"):
        kl = [t["kl"] for t in records[name]["turns"]]
        assert all(math.isfinite(x) and x >= -1e-6 for x in kl), name
        assert sum(kl) / len(kl) > 1e-3, (name, kl)  # its body holds 2-bit tokens
    # the same 2-bit KIVI with a window wider than the session quantizes nothing: no drift
    assert max(t["kl"] for t in records["kivi-2 wide"]["turns"]) < 1e-6


def test_the_held_history_changes_no_record(model, sessions, monkeypatch):
    # The simulated cache extends each body's dequantized copy by what was committed instead of
    # dequantizing the whole body at every forward (kvcalib_runtime.cache.held): a session run
    # as before, every read dequantizing the whole body, must give the same record — every
    # token, every score, bit for bit — so that cells written before and after compare.
    tok, session, records = sessions

    class Whole(QuantizedCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "keep_dequantized": False})

    monkeypatch.setattr(sim_cache, "QuantizedCache", Whole)
    cands = candidates(model, RECIPES[1:], ShapeProfile(1, 32), residual=32)
    for c in cands:
        before = sess.run_session(model, tok, c, session, max_new=8)
        assert before["turns"] == records[c.name]["turns"], c.name


def test_report_pairs_against_fp16(sessions, tmp_path):
    _, _, records = sessions
    by_seed = {0: {r: records[r] for r in RECIPES}}
    by_recipe = {r: sessionreport.scores(by_seed, r) for r in RECIPES}
    kivi = by_recipe["kivi-2"]
    assert [row["turn"] for row in kivi["recall"]] == [2, 4]
    assert all(row["n"] == 1 and "diff" in row for row in kivi["recall"])
    assert len(kivi["kl"]) == 4 and kivi["kl"][0]["n"] == 1
    text = sessionreport.report(by_recipe)
    assert "McNemar" in text and "| 4 | 1 |" in text
    # fp16's drift to itself is zero up to rounding: never shown as -0.0000
    assert "-0.0000" not in text and sessionreport._num(-4e-9, 4) == "0.0000"
    # a recipe over fewer sessions than the row's n says its own
    fewer = {**by_recipe, "kivi-2": {**kivi, "kl": [{**r, "n": 7} for r in kivi["kl"]]}}
    assert "(n 1)" in sessionreport.format_turns(fewer, "kl")
    assert sessionreport.plot(by_recipe, tmp_path / "s.png").stat().st_size > 0


def _bench():
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "session.py"
    spec = importlib.util.spec_from_file_location("session_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runner_writes_a_cell_per_session_and_recipe_and_skips_done_ones(
    model, tmp_path, monkeypatch, capsys
):
    bench = _bench()
    tok = Tokenizer()
    cands = candidates(model, ["fp16", "kivi-2"], residual=32)
    tags = {"fp16": None, "kivi-2": None}
    args = SimpleNamespace(
        out=str(tmp_path), turns=2, max_new=4, threads=1, sessions=1, system_tokens=120,
        user_tokens=[10, 20], model="tiny", name="sessions",
    )  # fmt: skip
    bench._worker(args, [0], ["fp16", "kivi-2"], (model, tok, cands, tags))
    cells = tmp_path / "cells" / "s000"
    assert sorted(p.name for p in cells.iterdir()) == ["fp16.json", "kivi-2.json"]
    known = json.loads((cells / "kivi-2.json").read_text())
    assert len(known["record"]["turns"]) == 2 and known["plan"] is None
    assert set(bench.collect(args, tok, tags)[0]) == {"fp16", "kivi-2"}
    # a report under another plan (another --profile) leaves the cell out, and says so
    assert set(bench.collect(args, tok, {"fp16": None, "kivi-2": "another plan"})[0]) == {"fp16"}
    assert "kivi-2: 1 cells scored under another plan left out" in capsys.readouterr().err
    text = bench.report(args, tok, tags, 0.0)
    assert "Drift" in text and (tmp_path / "sessions.png").is_file()

    ran = []
    real = sess.run_session
    monkeypatch.setattr(sess, "run_session", lambda m, t, c, *a, **k: ran.append(c.name) or
                        real(m, t, c, *a, **k))  # fmt: skip
    bench._worker(args, [0], ["fp16", "kivi-2"], (model, tok, cands, tags))
    assert ran == []  # both cells done: resumed, nothing runs
    moved = {"fp16": None, "kivi-2": "another plan"}  # kivi-2 planned from another calibration
    bench._worker(args, [0], ["fp16", "kivi-2"], (model, tok, cands, moved))
    assert ran == ["kivi-2"]
    args.turns = 3  # another session size: another session, every cell runs
    bench._worker(args, [0], ["fp16", "kivi-2"], (model, tok, cands, moved))
    assert ran == ["kivi-2", "fp16", "kivi-2"]


def test_cli_runs_sessions_and_prints_the_tables(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import kvcalib.api
    from kvcalib.cli import main

    seen = {}

    def fake(model, recipes, **kwargs):
        seen.update(kwargs, recipes=recipes)
        row = {"turn": 1, "n": 1, "mean": 0.5, "low": 0.1, "high": 0.9}
        scores = {k: [row] for k in (*sessionreport.SCORES, "repeat3", "repeat4_diff")}
        scores["recall"] = []
        return {}, {"fp16": scores}

    monkeypatch.setattr(kvcalib.api, "evaluate_sessions", fake)
    out = CliRunner().invoke(
        main,
        ["eval", "--recipe", "kivi-2", "--session", "--sessions", "3", "--session-turns", "9",
         "--plots", str(tmp_path)],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert seen["sessions"] == 3 and seen["turns"] == 9 and seen["residual"] == 128
    assert seen["recipes"] == ["kivi-2"] and "Drift" in out.output
    assert (tmp_path / "session.png").is_file()
    bad = CliRunner().invoke(main, ["eval", "--recipe", "kivi-2", "--session", "--sessions", "0"])
    assert bad.exit_code == 2 and "--sessions" in bad.output


def test_api_refuses_a_session_without_a_probe_turn():
    from kvcalib.api import evaluate_sessions
    from kvcalib.errors import OptionError

    with pytest.raises(OptionError, match=r"--session-turns 3: .* every 7 turns"):
        evaluate_sessions(recipes=["kivi-2"], turns=3)
    with pytest.raises(OptionError, match="--sessions 0"):
        evaluate_sessions(recipes=["kivi-2"], sessions=0)
