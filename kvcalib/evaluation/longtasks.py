"""The long-context tasks: synthetic prompts in the spirit of RULER (Hsieh et al. 2024,
arXiv:2404.06654), built offline from a built-in text and a seeded RNG.

    passkey     a magic number for a word key at one of DEPTHS of the haystack (RULER's
                niah_single; Mohtashami & Jaggi's passkey, worded as RULER words it: asked for
                "the 5-digit pass key", SmolLM2-135M answers "5")
    multikey    NEEDLES "special magic numbers", each for its own word key, at random depths;
                the question names one key, the other needles are distractors
                (RULER's niah_multikey_1)
    multivalue  VALUES magic numbers for the same key; the answer needs all of them
                (RULER's niah_multivalue)
    vartrack    a chain of assignments "12345 -> VAR A", then HOPS more "VAR A -> VAR B" spread
                over the haystack; the answer names every variable holding the value (RULER's
                vt, written source first: then each hop is a lookup forward, which a small
                model can follow; RULER's "VAR B = VAR A" asks it to look up backwards)
    freqwords   a coded text of random words drawn with Zipf frequencies (alpha 2); the answer
                names the most frequent (RULER's fwe asks for three; the text is the task, no
                haystack)

A prompt is token ids of exactly the target length less the answer's token budget (prompt and
answer fit in the target, as RULER counts): the model's chat template (when the tokenizer has
one) around the instruction, the haystack (a window of the evaluation text at a seeded offset,
needles inserted at line starts, each set off by blank lines) and the question; the assistant
turn opens with the answer's first words, so the greedy answer starts with the value. A sample
is correct when its greedy answer holds every expected string (case-insensitive; RULER's string
match, all items). Its `answer` is the expected continuation written out (the text whose
teacher-forced log-likelihood the suite scores), and multikey's `distractors` are the same
continuation with each other needle's value.
"""

import itertools
import random
import string
from dataclasses import dataclass

import torch

from kvcalib.core.data import chat_frame, encode
from kvcalib.errors import DataError

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # of the passkey needle, as a fraction of the haystack
NEEDLES = 4  # multikey needles (one asked, the others distractors)
VALUES = 3  # multivalue needles (RULER: 4; SmolLM2-135M in full precision lists 3, not 4)
HOPS = 2  # vartrack assignments after the first (RULER: 4; SmolLM2-135M follows 2)
DIGITS = 7  # magic numbers (RULER's)
ZIPF_ALPHA = 2.0
CODED_LETTERS = 6
_NOISE = "...."  # freqwords' rank-0 word, named as noise in the instruction
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go."
_MAGIC = "One of the special magic numbers for {key} is: {value}."

_ADJECTIVES = (
    "amber", "bitter", "brave", "calm", "crimson", "dusty", "eager", "fancy", "frozen", "gentle",
    "golden", "hollow", "humble", "ivory", "jolly", "lively", "lucky", "mellow", "misty", "noble",
    "quiet", "rapid", "silver", "velvet",
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "basket", "candle", "castle", "falcon", "garden", "harbor", "island",
    "kettle", "lantern", "meadow", "mirror", "orchard", "pebble", "pillow", "rocket", "saddle",
    "tunnel", "violin", "wagon", "walnut", "willow", "zipper",
)  # fmt: skip


@dataclass(frozen=True)
class Sample:
    """One prompt and what its greedy answer must hold.

    length      the target: prompt and answer fit in it (RULER's max_seq_length)
    ids         prompt token ids, len(ids) == length - max_new_tokens
    expected    strings the answer must all contain (case-insensitive)
    needles     token spans [start, end) of the inserted needles in ids, in position order
    context     the token span [start, end) of the haystack with its needles
    depth       where the passkey needle sits (a fraction of the haystack); None elsewhere
    answer      the expected continuation of the prompt, as text (the expected strings in the
                answer's own format)
    distractors the continuation with another needle's value instead, per distractor needle
    """

    task: str
    length: int
    seed: int
    ids: tuple[int, ...]
    expected: tuple[str, ...]
    needles: tuple[tuple[int, int], ...]
    context: tuple[int, int]
    max_new_tokens: int
    depth: float | None = None
    answer: str = ""
    distractors: tuple[str, ...] = ()

    def correct(self, answer: str) -> bool:
        """Whether the decoded greedy `answer` holds every expected string."""
        return all(e.lower() in answer.lower() for e in self.expected)


class Haystack:
    """Token ids of the text needles are hidden in, and where its lines start."""

    def __init__(self, tokenizer, text: str):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # a token ending a line may carry the next line's indentation ("\n   " is one token)
        ends = {i for i in set(ids) if tokenizer.decode([i]).rstrip(" \t").endswith("\n")}
        self.ids = torch.tensor(ids, dtype=torch.long)
        # position p is a line start when token p - 1 ends a line
        self.is_line_start = torch.tensor([False] + [i in ends for i in ids[:-1]])

    def window(self, rng: random.Random, n: int) -> tuple[list[int], list[int]]:
        """n tokens at a seeded offset and the line starts within them (offsets)."""
        if n > len(self.ids):
            raise DataError(
                f"the long-context haystack has {len(self.ids)} tokens; a prompt needs {n}: "
                "pass a longer --data text or shorter --long-context-lengths"
            )
        start = rng.randrange(len(self.ids) - n + 1)
        starts = self.is_line_start[start : start + n].nonzero().flatten().tolist()
        return self.ids[start : start + n].tolist(), starts


def _assemble(tokenizer, length, new, head, tail, fill, needles, depths):
    """head + a body of `fill(n)` tokens (ids, line starts) with the needles inserted at the line
    starts nearest `depths` + tail: `length - new` tokens, leaving `new` to the answer. Returns
    (ids, needle spans in position order, the context's span)."""
    pieces = [encode(tokenizer, f"\n{n}\n\n") for n in needles]
    room = length - new - len(head) - len(tail) - sum(map(len, pieces))
    if room < len(pieces) + 1:
        raise DataError(
            f"long-context length {length} leaves no room for a haystack: use at least "
            f"{length - room + len(pieces) + 1} tokens"
        )
    body, starts = fill(room)
    starts = starts or [0]
    cuts = [min(starts, key=lambda s: abs(s - d * room)) for d in depths]
    order = sorted(range(len(pieces)), key=lambda i: cuts[i])
    ids, spans, prev = list(head), [], 0
    for i in order:
        ids += body[prev : cuts[i]]
        spans.append((len(ids), len(ids) + len(pieces[i])))
        ids += pieces[i]
        prev = cuts[i]
    ids += body[prev:] + tail
    assert len(ids) == length - new, (len(ids), length, new)
    return tuple(ids), tuple(spans), (len(head), len(ids) - len(tail))


def _number(rng: random.Random, digits: int = DIGITS) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _word_keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample(range(len(_ADJECTIVES) * len(_NOUNS)), n)
    return [f"{_ADJECTIVES[p // len(_NOUNS)]}-{_NOUNS[p % len(_NOUNS)]}" for p in pairs]


def _depths(rng: random.Random, n: int) -> list[float]:
    return sorted(rng.random() for _ in range(n))


def passkey(tokenizer, haystack: Haystack, length: int, seed: int, depth: float) -> Sample:
    rng = random.Random(f"passkey-{length}-{seed}-{depth}")
    (key,) = _word_keys(rng, 1)
    value = _number(rng)
    head, tail = chat_frame(
        tokenizer,
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n\n",
        f"\n\nWhat is the special magic number for {key} mentioned in the provided text?",
        f"The special magic number for {key} mentioned in the provided text is",
    )
    needle = _MAGIC.format(key=key, value=value)
    window = lambda n: haystack.window(rng, n)  # noqa: E731
    ids, spans, context = _assemble(tokenizer, length, 12, head, tail, window, [needle], [depth])
    return Sample(
        "passkey", length, seed, ids, (value,), spans, context, 12, depth, answer=f" {value}."
    )


def multikey(tokenizer, haystack: Haystack, length: int, seed: int) -> Sample:
    rng = random.Random(f"multikey-{length}-{seed}")
    keys = _word_keys(rng, NEEDLES)
    values = [_number(rng) for _ in keys]
    asked = rng.randrange(NEEDLES)
    head, tail = chat_frame(
        tokenizer,
        "Some special magic numbers are hidden within the following text. Make sure to memorize "
        "them. I will quiz you about one of them afterwards.\n\n",
        f"\n\nWhat is the special magic number for {keys[asked]} mentioned in the provided text?",
        f"The special magic number for {keys[asked]} mentioned in the provided text is",
    )
    needles = [_MAGIC.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
    window = lambda n: haystack.window(rng, n)  # noqa: E731
    depths = [rng.random() for _ in keys]
    ids, spans, context = _assemble(tokenizer, length, 12, head, tail, window, needles, depths)
    others = tuple(f" {v}." for i, v in enumerate(values) if i != asked)
    return Sample(
        "multikey", length, seed, ids, (values[asked],), spans, context, 12,
        answer=f" {values[asked]}.", distractors=others,
    )  # fmt: skip


def multivalue(tokenizer, haystack: Haystack, length: int, seed: int) -> Sample:
    rng = random.Random(f"multivalue-{length}-{seed}")
    (key,) = _word_keys(rng, 1)
    values = [_number(rng) for _ in range(VALUES)]
    head, tail = chat_frame(
        tokenizer,
        "Some special magic numbers are hidden within the following text. Make sure to memorize "
        "them. I will quiz you about them afterwards.\n\n",
        f"\n\nWhat are all the special magic numbers for {key} mentioned in the provided text?",
        f"The special magic numbers for {key} mentioned in the provided text are",
    )
    needles = [_MAGIC.format(key=key, value=v) for v in values]
    window = lambda n: haystack.window(rng, n)  # noqa: E731
    depths = [rng.random() for _ in values]
    new = 16 * VALUES
    ids, spans, context = _assemble(tokenizer, length, new, head, tail, window, needles, depths)
    answer = " " + ", ".join(values) + "."
    return Sample(
        "multivalue", length, seed, ids, tuple(values), spans, context, new, answer=answer
    )


_VARTRACK = (
    "Memorize and track the chain of variable assignments hidden in the following text: "
    "X -> VAR Y assigns X to VAR Y.\n\n"
)


def _chain(names: list[str], value: str) -> list[str]:
    """The assignments of `value` down a chain of variables, in order."""
    return [f"{value} -> VAR {names[0]}"] + [
        f"VAR {a} -> VAR {b}" for a, b in itertools.pairwise(names)
    ]


def _vartrack_question(names: list[str], value: str) -> tuple[str, str]:
    return (
        f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above.",
        "Answer: According to the chain of variable assignments in the text above, "
        f"{len(names)} variables are assigned the value {value}: {value} ->",
    )


def vartrack(tokenizer, haystack: Haystack, length: int, seed: int) -> Sample:
    rng = random.Random(f"vartrack-{length}-{seed}")
    names = set()
    while len(names) < 2 * (HOPS + 1):
        names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
    names = sorted(names)
    rng.shuffle(names)
    names, shown = names[: HOPS + 1], names[HOPS + 1 :]
    value, shown_value = _number(rng, 5), _number(rng, 5)
    # a worked example first: another chain in filler lines, and its answer (RULER adds one)
    context = "".join(f"{_FILLER}\n{line}\n" for line in _chain(shown, shown_value))
    question, prefix = _vartrack_question(shown, shown_value)
    answer = " -> ".join(f"VAR {n}" for n in shown)
    example = (f"{_VARTRACK}{context}{_FILLER}{question}", f"{prefix} {answer}")
    head, tail = chat_frame(tokenizer, _VARTRACK, *_vartrack_question(names, value), example)
    chain = _chain(names, value)
    window = lambda n: haystack.window(rng, n)  # noqa: E731
    new, depths = 8 * len(names), _depths(rng, len(chain))
    ids, spans, context = _assemble(tokenizer, length, new, head, tail, window, chain, depths)
    answer = " " + " -> ".join(f"VAR {n}" for n in names)
    return Sample("vartrack", length, seed, ids, tuple(names), spans, context, new, answer=answer)


def freqwords(tokenizer, haystack: Haystack, length: int, seed: int) -> Sample:
    del haystack  # the coded text is the whole context
    rng = random.Random(f"freqwords-{length}-{seed}")
    vocab = set()
    size = max(length // 50, 4)  # RULER's vocabulary size
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=CODED_LETTERS)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = _NOISE
    head, tail = chat_frame(
        tokenizer,
        "Read the following coded text and track the frequency of each coded word. Find the "
        "most frequently appeared coded word.\n\n",
        f"\n\nQuestion: Do not provide any explanation. Please ignore the dots '{_NOISE}'. What "
        "is the most frequently appeared word in the above coded text?",
        "Answer: According to the coded text above, the most frequently appeared word is:",
    )

    def coded(n: int) -> tuple[list[int], list[int]]:
        # word k (from 1) appears in proportion to k^-alpha; counts fill n tokens, padded with
        # the noise word, shuffled
        pieces = {w: encode(tokenizer, f" {w}") for w in vocab}
        weights = [(k + 1) ** -ZIPF_ALPHA for k in range(len(vocab))]
        per_unit = sum(w * len(pieces[v]) for w, v in zip(weights, vocab, strict=True))
        counts = [int(w * n / per_unit) for w in weights]
        words = [v for v, c in zip(vocab, counts, strict=True) for _ in range(c)]
        used = sum(len(pieces[w]) for w in words)
        noise = pieces[_NOISE]
        words += [_NOISE] * ((n - used) // len(noise))
        rng.shuffle(words)
        ids = [t for w in words for t in pieces[w]]
        return ids + noise[: n - len(ids)], []

    # room for one word: a listed second one is cut off, not counted
    ids, _, context = _assemble(tokenizer, length, 8, head, tail, coded, [], [])
    answer = f" {vocab[1]}"
    return Sample("freqwords", length, seed, ids, (vocab[1],), (), context, 8, answer=answer)
