"""Retrieval prompts for the answer-loss sensitivity: what a long-context answer reads from its
context, built from the calibration text.

The next-token loss of prose weighs every token alike; a retrieval answer is copied, digit by
digit, from keys far back in the context, and that is where a 2-bit cache fails (a seven-digit
number comes back with one digit wrong). These prompts give the gradient pass a loss made of
such answers: the Fisher sensitivity of the answer's tokens alone (sensitivity.FisherSensitivity
over `context` positions, gradients of the `answer` tokens' loss), which bit allocation can
spend on instead of the prose one (a recipe's `[allocation] sensitivity = "answer"`).

Three kinds, in turn, each worded unlike the evaluation suite's tasks (kvcalib.evaluation
.longtasks), so that the evaluation's prompts stay unseen:

    lookup  RECORDS codes for made-up names among the haystack; the question names one
    list    RECORDS numbers filed under one name; the answer lists them all, in order
    chain   a number handed from box to box (HOPS moves); the answer names every box

A prompt is `length` tokens: the chat frame (kvcalib.core.data.chat_frame) around a window of the
calibration text with the records inserted at seeded positions, the question, the answer's
opening words, then the expected answer itself (teacher-forced: its tokens are the loss).
"""

import itertools
import random
import string
from dataclasses import dataclass

import torch

from kvcalib.core.data import chat_frame, encode

KINDS = ("lookup", "list", "chain")
RECORDS = 4
HOPS = 3
DIGITS = 7
MIN_HAYSTACK = 64  # tokens of text around the records: less is no long-context prompt


@dataclass(frozen=True)
class Prompts:
    """Retrieval prompts as the gradient pass takes them.

    ids      int64 [R, length]  prompt and expected answer, teacher-forced
    answer   bool [R, length]   the expected answer's tokens (the loss's targets)
    context  bool [R, length]   the haystack with its records (whose keys and values the
                                sensitivity sums over; the question and answer stay in any
                                residual window, exact)
    """

    ids: torch.Tensor
    answer: torch.Tensor
    context: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)


def _name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=6))


def _number(rng: random.Random) -> str:
    return str(rng.randint(10 ** (DIGITS - 1), 10**DIGITS - 1))


def _task(kind: str, rng: random.Random) -> tuple[str, list[str], str, str, str]:
    """(instruction, records, question, answer prefix, answer) of one prompt."""
    if kind == "lookup":
        names = [_name(rng) for _ in range(RECORDS)]
        codes = [_number(rng) for _ in names]
        asked = rng.randrange(RECORDS)
        return (
            "The text below files access codes for several names. Note every code.\n\n",
            [f"Filed: the access code of {n} is {c}." for n, c in zip(names, codes, strict=True)],
            f"\n\nWhich access code is filed for {names[asked]}?",
            f"The access code filed for {names[asked]} is",
            f" {codes[asked]}.",
        )
    if kind == "list":
        name, numbers = _name(rng), [_number(rng) for _ in range(RECORDS)]
        return (
            "The text below files numbers under a name. Note every number.\n\n",
            [f"Filed under {name}: {x}." for x in numbers],
            f"\n\nList every number filed under {name}, in order.",
            f"The numbers filed under {name} are",
            " " + ", ".join(numbers) + ".",
        )
    assert kind == "chain", kind
    boxes = ["".join(rng.choices(string.ascii_uppercase, k=4)) for _ in range(HOPS + 1)]
    number = _number(rng)
    moves = [f"Box {boxes[0]} receives {number}."] + [
        f"Box {b} receives what box {a} holds." for a, b in itertools.pairwise(boxes)
    ]
    return (
        "The text below moves a number from box to box. Follow every move.\n\n",
        moves,
        f"\n\nWhich boxes end up holding {number}?",
        f"The boxes holding {number} are",
        " " + ", ".join(f"box {b}" for b in boxes) + ".",
    )


def build(tokenizer, text_ids: torch.Tensor, count: int, length: int, seed: int) -> Prompts | None:
    """`count` prompts of `length` tokens over the calibration text's token ids [n] (kinds in
    turn, records at seeded depths, in order), or None when `length` leaves fewer than
    MIN_HAYSTACK tokens of text or the text is shorter than a haystack."""
    rows, answers, contexts = [], [], []
    for j in range(count):
        rng = random.Random(f"kvcalib-retrieval-{seed}-{j}")
        instruction, records, question, prefix, answer = _task(KINDS[j % len(KINDS)], rng)
        head, tail = chat_frame(tokenizer, instruction, question, prefix)
        pieces = [encode(tokenizer, f"\n{r}\n") for r in records]
        answer_ids = encode(tokenizer, answer)
        room = length - len(head) - len(tail) - len(answer_ids) - sum(map(len, pieces))
        if room < MIN_HAYSTACK or room > len(text_ids):
            return None
        start = rng.randrange(len(text_ids) - room + 1)
        body = text_ids[start : start + room].tolist()
        cuts = sorted(rng.randrange(room + 1) for _ in pieces)
        ids, prev = list(head), 0
        for cut, piece in zip(cuts, pieces, strict=True):
            ids += body[prev:cut] + piece
            prev = cut
        ids += body[prev:]
        context = (len(head), len(ids))
        ids += tail + answer_ids
        assert len(ids) == length, (len(ids), length)
        rows.append(ids)
        answers.append([False] * (length - len(answer_ids)) + [True] * len(answer_ids))
        contexts.append([context[0] <= p < context[1] for p in range(length)])
    return Prompts(torch.tensor(rows), torch.tensor(answers), torch.tensor(contexts))
