"""kvcalib eval on the real model: the instrument is exact where it must be and sensitive where
quantization bites."""

import json

import pytest
from click.testing import CliRunner

from kvcalib.cli import main
from kvcalib.core.recipe import parse_recipe
from kvcalib.evaluation.longcontext import passkey_accuracy
from kvcalib.evaluation.score import candidates, score

EIGHT_BIT = {"name": "int8", "key": {"bits": 8}, "value": {"bits": 8}}


@pytest.fixture(scope="module")
def results(real_model):
    model, tokenizer = real_model
    recipes = ["fp16", parse_recipe(EIGHT_BIT), "per-token-2", "kivi-2"]
    cands = candidates(model, recipes)
    fake = score(model, tokenizer, cands, seq_len=256, windows=2, mode="fake", progress=False)
    decode = score(model, tokenizer, cands, seq_len=256, windows=2, mode="decode", progress=False)
    return {r.recipe: r for r in fake}, {r.recipe: r for r in decode}


def test_fp16_reproduces_the_unquantized_perplexity_exactly(results):
    for by_name in results:
        fp16 = by_name["fp16"]
        assert fp16.ppl == fp16.ppl_fp  # the model's own attention: bit-identical
        assert fp16.kld < 1e-9 and fp16.top1 == 1.0


def test_eight_bit_is_near_lossless(results):
    fake = results[0]["int8"]
    # 8-bit per-token steps are 1/255 of each head's range: far below what moves the model.
    assert abs(fake.delta_ppl) < 0.01 * fake.ppl_fp
    assert fake.kld < 1e-3 and fake.top1 > 0.98


def test_two_bit_per_token_is_catastrophic_and_kivi_is_not(results):
    fake = results[0]
    # The literature's starting point: per-token 2-bit keys break the model (ppl x10 or worse),
    # KIVI's per-channel keys do not.
    assert fake["per-token-2"].ppl > 10 * fake["per-token-2"].ppl_fp
    assert fake["kivi-2"].ppl < 3 * fake["kivi-2"].ppl_fp


def test_decode_mode_is_gentler_than_fake_mode(results):
    # Decode keeps the residual window exact, fake quantizes every position.
    fake, decode = results
    assert decode["kivi-2"].kld < fake["kivi-2"].kld


def test_bits_per_element_accounting(results):
    fake = results[0]
    assert fake["per-token-2"].bits_per_element == 2.5  # codes + fp16 scale/offset per 64
    assert fake["kivi-2"].bits_per_element == 3.0  # + 32 bits per 32-token group of a channel
    assert fake["fp16"].bits_per_element == 16.0


def test_full_precision_solves_a_passkey(real_model):
    model, tokenizer = real_model
    (fp16,) = candidates(model, ["fp16"])
    acc = passkey_accuracy(model, tokenizer, fp16, lengths=(1024,), depths=(0.5,))
    assert acc == {"1024": 1.0}


def test_cli_json_schema(tmp_path):
    out = tmp_path / "r.json"
    recipe = tmp_path / "int8.toml"
    recipe.write_text('name = "int8"\n[key]\nbits = 8\n[value]\nbits = 8\n')
    args = [
        "eval",
        "--recipe",
        "fp16",
        "--recipe",
        str(recipe),
        "--seq-len",
        "64",
        "--windows",
        "1",
        "--mode",
        "fake",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "| int8 | fake |" in result.output
    rows = json.loads(out.read_text())
    assert [r["recipe"] for r in rows] == ["fp16", "int8"]
    for r in rows:
        assert {"recipe", "mode", "ppl", "ppl_fp", "kld", "bits_per_element"} <= set(r)
        assert r["mode"] == "fake" and r["ppl"] > 1


def test_cli_seq_len_beyond_context_exits_2():
    result = CliRunner().invoke(main, ["eval", "--recipe", "fp16", "--seq-len", "9000"])
    assert result.exit_code == 2
    assert "exceeds the model's context (8192 tokens)" in result.output
