"""Text for calibration and evaluation, cut into token windows.

`data=None` is the built-in corpus: Python's own documentation (`pydoc_data.topics`, shipped
with every CPython). Its topics are split once, deterministically, into a calibration part and
an evaluation part that share no text: topics are taken in the order of the SHA-256 of their
names into the evaluation part until it holds EVAL_FRACTION of the characters; the rest is
calibration text, minus every paragraph that also appears in the evaluation part (the topics
repeat each other's paragraphs, ~50K characters of them).

Two more built-in texts, for measuring away from the calibration distribution:

    builtin:licenses  the free-software licenses Debian ships in /usr/share/common-licenses
                      (GPL-3, GFDL-1.3, MPL-2.0, Apache-2.0, LGPL-3, Artistic, CC0-1.0; ~25K
                      tokens of legal English, neither Python documentation nor calibration text)
    builtin:chat      multi-turn conversations in the model's own chat template: a user asks
                      about a topic, the assistant answers with its documentation, four turns a
                      conversation; the topics of the split (so evaluation chats share no text
                      with calibration). Turn boundaries are where later attention sinks appear.

Otherwise `data` is a path to a `.txt` file or a `.jsonl` file whose lines are objects with a
"text" field.

A window starts as the model's training texts did: with the BOS token where the tokenizer puts
one before every text (Gemma, Llama; Gemma 3 270M's perplexity on the evaluation text is 41
without it and 14 with it), then seq_len - 1 tokens of text; without such a BOS (SmolLM2, Qwen)
it is seq_len tokens of text.
"""

import functools
import hashlib
import json
import sys
from pathlib import Path
from pydoc_data.topics import topics

import torch

from kvcalib.errors import DataError

EVAL_FRACTION = 0.3
SPLITS = ("calibration", "evaluation")
LICENSES = Path("/usr/share/common-licenses")
LICENSE_FILES = ("GPL-3", "GFDL-1.3", "MPL-2.0", "Apache-2.0", "LGPL-3", "Artistic", "CC0-1.0")
BUILTINS = ("builtin:licenses", "builtin:chat")
CHAT_TURNS = 4
CHAT_ANSWER_CHARS = 2000
_JSONL = '; give one JSON object with a "text" string per line'


@functools.cache
def _builtin_split() -> dict[str, tuple[str, ...]]:

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

    evaluation = "\n\n".join(topics[k].strip() for k in builtin_topics("evaluation"))
    if split == "evaluation":
        return evaluation
    seen = set(evaluation.split("\n\n"))
    paragraphs = "\n\n".join(topics[k].strip() for k in builtin_topics("calibration"))
    return "\n\n".join(p for p in paragraphs.split("\n\n") if p not in seen)


def _licenses() -> str:
    missing = [n for n in LICENSE_FILES if not (LICENSES / n).is_file()]
    if missing:
        raise DataError(
            f"--data builtin:licenses reads {LICENSES}, which lacks {', '.join(missing)}: "
            "install Debian's base-files package or pass a .txt file"
        )
    return "\n\n".join((LICENSES / n).read_text(encoding="utf-8") for n in LICENSE_FILES)


def _chat(tokenizer, split: str) -> str:
    """The split's topics as multi-turn conversations in the tokenizer's chat template."""

    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("--data builtin:chat needs a tokenizer with a chat template")
    names = builtin_topics(split)
    chats = []
    for start in range(0, len(names), CHAT_TURNS):
        messages = []
        for name in names[start : start + CHAT_TURNS]:
            messages.append({"role": "user", "content": f"What does Python's {name!r} do?"})
            answer = topics[name].strip()[:CHAT_ANSWER_CHARS]
            messages.append({"role": "assistant", "content": answer})
        chats.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return "".join(chats)


def _check_builtin(data: str) -> None:
    if data not in BUILTINS:
        raise DataError(f"--data {data}: unknown built-in text; use one of {', '.join(BUILTINS)}")


def read_text(data: str | Path | None, split: str, tokenizer=None) -> str:
    """The text of `data` (a path or a built-in name), or of one split of the built-in corpus
    when `data` is None; `builtin:chat` needs the tokenizer for its chat template."""
    if data is None:
        return _builtin_text(split)
    if str(data).startswith("builtin:"):
        _check_builtin(str(data))
        return _licenses() if data == "builtin:licenses" else _chat(tokenizer, split)
    path = Path(data)
    if path.exists() and not path.is_file():  # a folder, or a FIFO a read would block on
        raise DataError(f"--data {data}: not a regular file; pass a .txt or .jsonl file")
    if not path.is_file():
        raise DataError(f"--data {data}: no such file; pass a .txt or .jsonl file")
    if path.suffix == ".txt":
        text = _utf8(path)
    elif path.suffix == ".jsonl":
        text = "\n\n".join(_jsonl_texts(path))
    else:
        raise DataError(f"--data {data}: unknown suffix {path.suffix!r}; use .txt or .jsonl")
    if not text.strip():
        raise DataError(f"--data {data}: the file holds no text; pass a file with text in it")
    return text


def check_data(data: str | Path | None) -> None:
    """DataError, before a model loads, for text input that cannot be read: a missing or
    special file, an unknown suffix or built-in name, no text, a malformed .jsonl line
    (builtin:chat needs the tokenizer and is checked when it is read)."""
    if data != "builtin:chat":
        read_text(data, "calibration")


def _utf8(path: Path) -> str:
    """The file's text, refused unless it is UTF-8 (a BOM allowed): latin-1 or UTF-16 text
    would be read as replacement characters or NULs and calibrated on."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"--data {path}: not UTF-8 text (byte {e.start}); save the file as UTF-8"
        ) from None
    if "\0" in text:
        raise DataError(
            f"--data {path}: holds NUL characters (UTF-16 text?); save the file as UTF-8"
        )
    return text


def _jsonl_texts(path: Path):
    lines = _utf8(path).splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"--data {path}: line {i} is not JSON ({e.msg}){_JSONL}") from None
        except RecursionError:
            raise DataError(f"--data {path}: line {i} nests JSON too deeply{_JSONL}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise DataError(f'--data {path}: line {i} has no string "text" field{_JSONL}')
        yield obj["text"]


def describe(data: str | Path | None, split: str) -> str:
    """Provenance of a text source: the corpus and split, or the file and its SHA-256."""
    if data is None:
        version = ".".join(map(str, sys.version_info[:3]))
        return f"builtin:pydoc_data.topics[{split}] (Python {version})"
    if str(data).startswith("builtin:"):
        _check_builtin(str(data))
        if data == "builtin:licenses":
            return f"builtin:licenses ({LICENSES}: {', '.join(LICENSE_FILES)})"
        return f"builtin:chat[{split}] (pydoc_data.topics in the model's chat template)"
    digest = hashlib.sha256(Path(data).read_bytes()).hexdigest()
    return f"{Path(data).resolve()} (sha256 {digest[:16]})"


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids [N] of the whole text, no special tokens added."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _tokens(tokenizer, data, split, vocab: int | None = None) -> torch.Tensor:
    ids = tokenize(tokenizer, read_text(data, split, tokenizer))
    if vocab is not None and len(ids) and int(ids.max()) >= vocab:
        source = f"--data {data}" if data is not None else f"the built-in {split} text"
        raise DataError(
            f"{source} tokenizes to id {int(ids.max())}, past the model's {vocab} embedding "
            "rows: use the model's own tokenizer"
        )
    return ids


def bos_prefix(tokenizer) -> list[int]:
    """[BOS id] when the tokenizer starts every text with its BOS token, else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    ids = tokenizer("a", return_attention_mask=False)["input_ids"]  # special tokens added
    return [bos] if ids and ids[0] == bos else []


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`, no special tokens (the pieces a prompt is assembled from)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_frame(tokenizer, instruction, question, prefix, example=None) -> tuple[list, list]:
    """(head, tail) token ids: the user turn up to the haystack, and from the question to the
    assistant's answer prefix; `example` (a user turn, the assistant's answer) is a worked
    example before them (plain text after the BOS token the tokenizer puts first, `bos_prefix`,
    when it has no chat template: the template writes its own)."""
    turns = [] if example is None else [("user", example[0]), ("assistant", example[1])]
    mark = "\x00HAYSTACK\x00"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in [*turns, ("user", mark)]],
            tokenize=False,
            add_generation_prompt=True,
        )
        bos = []
    else:
        text = "".join(f"{c}\n\n" for _, c in turns) + mark + "\n"
        bos = bos_prefix(tokenizer)
    before, after = text.split(mark)
    head = bos + encode(tokenizer, before + instruction)
    return head, encode(tokenizer, question + after + prefix)


def _with_prefix(prefix: list[int], windows: list[torch.Tensor]) -> torch.Tensor:
    """[N, len(prefix) + n]: each window [n] after the prefix tokens."""
    head = torch.tensor(prefix, dtype=torch.long)
    return torch.stack([torch.cat([head, w]) for w in windows])


def _too_short(data, split, have: int, need: str) -> DataError:
    source = f"--data {data}" if data is not None else f"the built-in {split} text"
    return DataError(f"{source} has {have} tokens; {need}: pass more text or ask for less")


def calibration_tokens(tokenizer, data=None, *, vocab: int | None = None) -> torch.Tensor:
    """The calibration text's token ids [n] (no special tokens), checked as
    `calibration_windows` checks them."""
    return _tokens(tokenizer, data, "calibration", vocab)


def calibration_windows(
    tokenizer, data=None, *, num_samples: int, seq_len: int, seed: int, vocab: int | None = None
) -> torch.Tensor:
    """`num_samples` windows [N, seq_len] at random starts drawn with `seed` (after the BOS
    prefix, `bos_prefix`); DataError when a token id is not below `vocab` (the model's
    embedding rows), when given."""
    ids = _tokens(tokenizer, data, "calibration", vocab)
    prefix = bos_prefix(tokenizer)
    n = seq_len - len(prefix)
    if len(ids) < n:
        raise _too_short(data, "calibration", len(ids), f"--seq-len {seq_len} needs {n}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - n + 1, (num_samples,), generator=gen)
    return _with_prefix(prefix, [ids[s : s + n] for s in starts.tolist()])


def eval_windows(
    tokenizer, data=None, *, windows: int, seq_len: int, vocab: int | None = None
) -> torch.Tensor:
    """`windows` non-overlapping windows [W, seq_len]: evenly spaced over a built-in evaluation
    text, or the first W consecutive ones of a `--data` file (the usual perplexity convention);
    each after the BOS prefix (`bos_prefix`); DataError when a token id is not below `vocab`,
    when given."""
    ids = _tokens(tokenizer, data, "evaluation", vocab)
    prefix = bos_prefix(tokenizer)
    n = seq_len - len(prefix)
    if len(ids) < windows * n:
        raise _too_short(
            data, "evaluation", len(ids), f"{windows} windows of {n} need {windows * n}"
        )
    spread = (data is None or str(data).startswith("builtin:")) and windows > 1
    stride = (len(ids) - n) // (windows - 1) if spread else n
    return _with_prefix(prefix, [ids[i * stride : i * stride + n] for i in range(windows)])
