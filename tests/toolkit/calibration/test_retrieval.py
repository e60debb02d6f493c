"""The answer-loss sensitivity: the retrieval prompts hold what they say, their loss counts the
answer alone, and calibration records a sensitivity per layer and width that allocation reads."""

import re

import pytest
import torch
from support.calibrate import calibrate_tiny
from support.tiny import CharTokenizer

from kvcalib.calibration import Settings, codebooks, retrieval, vectorbooks
from kvcalib.calibration.gradients import window_loss
from kvcalib.calibration.sensitivity import BITS
from kvcalib.core.data import calibration_tokens

TEXT = calibration_tokens(CharTokenizer())  # one token per character


def _text(prompts, j, mask) -> str:
    return CharTokenizer().decode(prompts.ids[j][mask].tolist())


def test_each_prompt_asks_for_what_its_context_holds():
    prompts = retrieval.build(CharTokenizer(), TEXT, 6, 900, seed=0)
    assert prompts.ids.shape == prompts.answer.shape == prompts.context.shape == (6, 900)
    for j in range(6):
        answer, context = prompts.answer[j], prompts.context[j]
        # the answer is the prompt's last tokens, the context one span before the question
        assert answer.nonzero().flatten().tolist() == list(range(900 - int(answer.sum()), 900))
        span = context.nonzero().flatten()
        assert span.tolist() == list(range(int(span[0]), int(span[-1]) + 1))
        assert span[0] > 0  # the frame before it
        assert span[-1] + 1 < 900 - int(answer.sum())  # the question after it
        said, heard = _text(prompts, j, answer), _text(prompts, j, context)
        kind = retrieval.KINDS[j % len(retrieval.KINDS)]
        if kind == "lookup":  # the asked code is filed once, among RECORDS
            (code,) = re.findall(r"\d{7}", said)
            assert heard.count(code) == 1
            assert len(re.findall(r"Filed: the access code of \w+ is \d{7}\.", heard)) == 4
        elif kind == "list":  # every number, in the order filed
            assert re.findall(r"\d{7}", said) == re.findall(r"Filed under \w+: (\d{7})", heard)
        else:  # every box the number reaches, in the order it moves
            moved = re.findall(r"Box (\w{4}) receives", heard)
            assert re.findall(r"box (\w{4})", said) == moved
            assert len(moved) == retrieval.HOPS + 1


def test_prompts_repeat_by_seed_and_refuse_a_length_without_a_haystack():
    a = retrieval.build(CharTokenizer(), TEXT, 3, 600, seed=0)
    b = retrieval.build(CharTokenizer(), TEXT, 3, 600, seed=0)
    c = retrieval.build(CharTokenizer(), TEXT, 3, 600, seed=1)
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)
    # the records and the question alone take ~300 characters: 320 leaves < MIN_HAYSTACK of text
    assert retrieval.build(CharTokenizer(), TEXT, 3, 320, seed=0) is None
    assert retrieval.build(CharTokenizer(), TEXT[:100], 3, 600, seed=0) is None


def test_the_answer_loss_counts_only_the_answer_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, 30, generator=gen)
    ids = torch.randint(0, 30, (1, 12), generator=gen)
    targets = torch.zeros(12, dtype=torch.bool)
    targets[[5, 9, 11]] = True
    each = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    torch.testing.assert_close(window_loss(logits, ids, targets), each[[4, 8, 10]].sum())
    torch.testing.assert_close(window_loss(logits, ids), each.sum())  # prose: every token


@pytest.mark.parametrize("method", ["probe", "fisher"])
def test_calibration_records_the_answer_sensitivity(tmp_path, method):
    settings = Settings(sensitivity_windows=1, codebook_windows=1, retrieval_prompts=3,
                        retrieval_tokens=512, answer_sensitivity=method)  # fmt: skip
    profile = calibrate_tiny(tmp_path / "p", settings)
    answer = profile.meta["probe"]["answer"]
    assert (answer["method"], answer["prompts"], answer["tokens"]) == (method, 3, 512)
    assert 0 < answer["answer_tokens"] < answer["context_tokens"] < 3 * 512
    for tensor in ("key", "value"):
        s = profile.tensors[f"sensitivity.answer.{tensor}"]
        assert s.shape == (2, len(BITS)) and torch.isfinite(s).all() and s.abs().sum() > 0
        assert not torch.equal(s, profile.tensors[f"sensitivity.{tensor}"])  # another loss
        assert profile.sensitivity(tensor, 1, 2, "answer") == pytest.approx(float(s[1, 0]))
        if method == "fisher":  # an estimate: less error where the same gradients weigh it
            assert (s >= 0).all() and (s[:, 0] > s[:, -1]).all(), tensor


def test_no_retrieval_prompts_means_no_answer_sensitivity(tmp_path):
    profile = calibrate_tiny(tmp_path / "p", Settings(sensitivity_windows=1, retrieval_prompts=0))
    assert profile.has_sensitivity() and not profile.has_sensitivity("answer")
    assert profile.meta["probe"]["answer"] == {"skipped": "retrieval_prompts = 0"}


def test_answer_weighted_vector_codebooks_read_the_retrieval_prompts(tmp_path):
    # --vector-ablation fits kvcalib-1.5's codebooks also on the retrieval prompts' answer
    # gradients ("fisher+answer"): the gradient pass over the prompts runs though the answer
    # sensitivity is the probe, and the codebooks are finite and not the text's alone.
    settings = Settings(sensitivity_windows=1, codebook_windows=1, retrieval_prompts=2,
                        retrieval_tokens=512, vector_ablation=True)  # fmt: skip
    tensors = calibrate_tiny(tmp_path / "p", settings).tensors
    for variant in ("key:vq4:pre_rope:rope:head", "value:vq4:head"):
        text, both = (tensors[f"vqbook.{variant}:{w}.6"] for w in ("fisher", vectorbooks.ANSWER))
        assert both.shape == text.shape and torch.isfinite(both).all()
        assert not torch.equal(both, text), variant
    with pytest.raises(ValueError, match="retrieval_prompts >= 1"):
        Settings(vector_ablation=True, retrieval_prompts=0)


def test_answer_weighted_scalar_codebooks_read_the_retrieval_prompts(tmp_path):
    # --answer-codebooks: every preset codebook gets an ":answer" twin fitted on the text and
    # the retrieval prompts' answer gradients alike: sorted, in its domain, not the text's.
    settings = Settings(sensitivity_windows=1, codebook_windows=1, retrieval_prompts=2,
                        retrieval_tokens=512, answer_codebooks=True)  # fmt: skip
    profile = calibrate_tiny(tmp_path / "p", settings)
    variants = profile.meta["codebooks"]["variants"]
    twins = [v for v in variants if v.endswith(":answer")]
    assert twins and len(twins) == len(variants) / 2
    for v in twins:
        for bits in codebooks.BITS:
            both, text = (profile.codebook(name, 1, bits) for name in (v, v[: -len(":answer")]))
            assert (both.diff() > 0).all() and not torch.equal(both, text), (v, bits)
