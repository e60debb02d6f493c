"""Text for calibration and evaluation, cut into token windows.

`data=None` is the built-in corpus: Python's own documentation (`pydoc_data.topics`, shipped
with every CPython). Its topics are split once, deterministically, into a calibration part and
an evaluation part that share no text: topics are taken in the order of the SHA-256 of their
names into the evaluation part until it holds EVAL_FRACTION of the characters; the rest is
calibration text, minus every paragraph that also appears in the evaluation part (the topics
repeat each other's paragraphs, ~50K characters of them). Otherwise `data`
is a path to a `.txt` file or a `.jsonl` file whose lines are objects with a "text" field.
"""

import functools
import hashlib
import json
import sys
from pathlib import Path

import torch

from kvcalib.errors import DataError

EVAL_FRACTION = 0.3
SPLITS = ("calibration", "evaluation")


@functools.cache
def _builtin_split() -> dict[str, tuple[str, ...]]:
    from pydoc_data.topics import topics

    total = sum(len(v) for v in topics.values())
    by_hash = sorted(topics, key=lambda k: hashlib.sha256(k.encode()).hexdigest())
    evaluation, size = set(), 0
    for name in by_hash:
        if size >= EVAL_FRACTION * total:
            break
        evaluation.add(name)
        size += len(topics[name])
    return {
        "calibration": tuple(k for k in sorted(topics) if k not in evaluation),
        "evaluation": tuple(k for k in sorted(topics) if k in evaluation),
    }


def builtin_topics(split: str) -> tuple[str, ...]:
    """Names of the `pydoc_data.topics` entries in one split."""
    assert split in SPLITS, split
    return _builtin_split()[split]


@functools.cache
def _builtin_text(split: str) -> str:
    from pydoc_data.topics import topics

    evaluation = "\n\n".join(topics[k].strip() for k in builtin_topics("evaluation"))
    if split == "evaluation":
        return evaluation
    seen = set(evaluation.split("\n\n"))
    paragraphs = "\n\n".join(topics[k].strip() for k in builtin_topics("calibration"))
    return "\n\n".join(p for p in paragraphs.split("\n\n") if p not in seen)


def read_text(data: str | Path | None, split: str) -> str:
    """The text of `data` (a path), or of one split of the built-in corpus when `data` is None."""
    if data is None:
        return _builtin_text(split)
    path = Path(data)
    if not path.is_file():
        raise DataError(f"--data {data}: no such file; pass a .txt or .jsonl file")
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
    elif path.suffix == ".jsonl":
        text = "\n\n".join(_jsonl_texts(path))
    else:
        raise DataError(f"--data {data}: unknown suffix {path.suffix!r}; use .txt or .jsonl")
    if not text.strip():
        raise DataError(f"--data {data}: the file holds no text")
    return text


def _jsonl_texts(path: Path):
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"--data {path}: line {i} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise DataError(f'--data {path}: line {i} has no string "text" field')
        yield obj["text"]


def describe(data: str | Path | None, split: str) -> str:
    """Provenance of a text source: the corpus and split, or the file and its SHA-256."""
    if data is None:
        version = ".".join(map(str, sys.version_info[:3]))
        return f"builtin:pydoc_data.topics[{split}] (Python {version})"
    digest = hashlib.sha256(Path(data).read_bytes()).hexdigest()
    return f"{Path(data).resolve()} (sha256 {digest[:16]})"


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids [N] of the whole text, no special tokens added."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _tokens(tokenizer, data, split) -> torch.Tensor:
    return tokenize(tokenizer, read_text(data, split))


def _too_short(data, split, have: int, need: str) -> DataError:
    source = f"--data {data}" if data is not None else f"the built-in {split} text"
    return DataError(f"{source} has {have} tokens; {need}: pass more text or ask for less")


def calibration_windows(
    tokenizer, data=None, *, num_samples: int, seq_len: int, seed: int
) -> torch.Tensor:
    """`num_samples` windows [N, seq_len] at random starts drawn with `seed`."""
    ids = _tokens(tokenizer, data, "calibration")
    if len(ids) < seq_len:
        raise _too_short(data, "calibration", len(ids), f"--seq-len {seq_len} needs {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len + 1, (num_samples,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


def eval_windows(tokenizer, data=None, *, windows: int, seq_len: int) -> torch.Tensor:
    """`windows` non-overlapping windows [W, seq_len]: evenly spaced over the built-in evaluation
    text, or the first W consecutive ones of a `--data` file (the usual perplexity convention)."""
    ids = _tokens(tokenizer, data, "evaluation")
    if len(ids) < windows * seq_len:
        raise _too_short(
            data, "evaluation", len(ids), f"{windows} windows of {seq_len} need {windows * seq_len}"
        )
    spread = data is None and windows > 1
    stride = (len(ids) - seq_len) // (windows - 1) if spread else seq_len
    return torch.stack([ids[i * stride : i * stride + seq_len] for i in range(windows)])
