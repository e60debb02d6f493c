"""Text sources and windows: the built-in split never overlaps, bad input gets DataError."""

import json

import pytest
import torch

from kvcalib.core.data import builtin_topics, calibration_windows, eval_windows, read_text
from kvcalib.errors import DataError


class CharTokenizer:
    """One token per character: windows are then easy to check by hand."""

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [ord(c) for c in text]}


def test_builtin_split_is_disjoint_and_complete():
    from pydoc_data.topics import topics

    calib, evl = set(builtin_topics("calibration")), set(builtin_topics("evaluation"))
    assert not calib & evl  # no topic in both
    assert calib | evl == set(topics)
    eval_chars = sum(len(topics[k]) for k in evl)
    total = sum(len(v) for v in topics.values())
    assert 0.3 <= eval_chars / total < 0.45  # EVAL_FRACTION, overshooting by one topic at most


def test_builtin_texts_share_no_paragraph():
    # The topics repeat each other's paragraphs: the split must remove them from calibration.
    calib = set(read_text(None, "calibration").split("\n\n"))
    evl = set(read_text(None, "evaluation").split("\n\n"))
    assert not calib & evl
    assert len("".join(calib)) > 200_000  # most of the corpus is still calibration text


def test_builtin_split_is_deterministic():
    assert read_text(None, "evaluation") == read_text(None, "evaluation")
    assert builtin_topics("evaluation")[:3] == tuple(sorted(builtin_topics("evaluation"))[:3])


def test_file_windows_are_the_first_consecutive_ones(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abcdefghij")
    w = eval_windows(CharTokenizer(), f, windows=3, seq_len=3)
    assert ["".join(map(chr, r)) for r in w.tolist()] == ["abc", "def", "ghi"]


class BosTokenizer(CharTokenizer):
    """Puts "^" (its BOS) before every text unless told not to, as Gemma's tokenizer does."""

    bos_token_id = ord("^")

    def __call__(self, text, add_special_tokens=True, return_attention_mask=False):
        return super().__call__(("^" if add_special_tokens else "") + text)


def test_windows_start_with_the_bos_the_tokenizer_puts_first(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abcdefghij")
    w = eval_windows(BosTokenizer(), f, windows=3, seq_len=3)
    assert ["".join(map(chr, r)) for r in w.tolist()] == ["^ab", "^cd", "^ef"]
    c = calibration_windows(BosTokenizer(), f, num_samples=4, seq_len=5, seed=0)
    assert c.shape == (4, 5) and (c[:, 0] == ord("^")).all() and (c[:, 1:] != ord("^")).all()


def test_jsonl_reads_text_fields(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"text": "ab"}) + "\n\n" + json.dumps({"text": "cd"}) + "\n")
    assert read_text(f, "evaluation") == "ab\n\ncd"


def test_calibration_windows_follow_the_seed(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("".join(chr(65 + i % 26) for i in range(500)))
    a = calibration_windows(CharTokenizer(), f, num_samples=4, seq_len=16, seed=0)
    b = calibration_windows(CharTokenizer(), f, num_samples=4, seq_len=16, seed=0)
    c = calibration_windows(CharTokenizer(), f, num_samples=4, seq_len=16, seed=1)
    assert a.shape == (4, 16) and torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    "content, suffix, message",
    [
        ("", ".txt", "holds no text"),
        ("x", ".csv", "unknown suffix"),
        ("{not json", ".jsonl", "line 1 is not JSON"),
        ('{"body": "x"}', ".jsonl", 'no string "text" field'),
    ],
)
def test_bad_files(tmp_path, content, suffix, message):
    f = tmp_path / f"data{suffix}"
    f.write_text(content)
    with pytest.raises(DataError, match=message):
        read_text(f, "evaluation")


def test_missing_file():
    with pytest.raises(DataError, match="no such file"):
        read_text("/nonexistent/data.txt", "evaluation")


def test_too_short_says_how_much_there_is(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abcdefghij")
    with pytest.raises(DataError, match="has 10 tokens; 4 windows of 3 need 12"):
        eval_windows(CharTokenizer(), f, windows=4, seq_len=3)
    with pytest.raises(DataError, match="has 10 tokens; --seq-len 11 needs 11"):
        calibration_windows(CharTokenizer(), f, num_samples=1, seq_len=11, seed=0)


def test_license_text_is_long_english_outside_the_calibration_text():
    text = read_text("builtin:licenses", "evaluation")
    assert len(text) > 100_000  # ~25K tokens: room for 4 windows of 1024 several times over
    assert "GNU GENERAL PUBLIC LICENSE" in text
    calib = set(read_text(None, "calibration").split("\n\n"))
    assert not calib & set(text.split("\n\n"))


def test_unknown_builtin_text_is_refused():
    with pytest.raises(DataError, match="builtin:licenses"):
        read_text("builtin:wikipedia", "evaluation")
    with pytest.raises(DataError, match="chat template"):
        read_text("builtin:chat", "evaluation", CharTokenizer())


def test_chat_text_is_templated_and_split(real_model):
    _, tokenizer = real_model
    evl = read_text("builtin:chat", "evaluation", tokenizer)
    calib = read_text("builtin:chat", "calibration", tokenizer)
    # One user turn per evaluation topic, CHAT_TURNS of them to a conversation.
    assert evl.count("<|im_start|>user") == len(builtin_topics("evaluation"))
    questions = {line for line in evl.splitlines() if line.startswith("What does Python's")}
    assert not questions & set(calib.splitlines())  # no topic asked in both splits
    ids = eval_windows(tokenizer, "builtin:chat", windows=4, seq_len=1024)
    assert ids.shape == (4, 1024)
