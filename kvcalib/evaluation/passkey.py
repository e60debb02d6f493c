"""Passkey retrieval (Mohtashami & Jaggi, 2023): a 5-digit key hidden at a depth of a filler
haystack, asked for at the end, answered by greedy decoding through the quantized cache.

The prompt is prefilled in one chunk (full precision within the prompt, as a serving runtime
does) and the answer tokens attend to the cache as the recipe stores it: the needle sits in the
quantized body unless it is within the residual window.
"""

import random

import torch
from tqdm.auto import tqdm

from kvcalib.core.data import bos_prefix
from kvcalib.evaluation.external import external_cache
from kvcalib.sim.cache import QuantizedKVCache

LENGTHS = (1024, 2048, 4096)
DEPTHS = (0.1, 0.5, 0.9)
ANSWER_TOKENS = 8
_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
_QUESTION = "What is the pass key? The pass key is"


def prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of a passkey prompt of about `length` tokens, the needle at `depth` ∈ [0, 1];
    after the BOS token where the tokenizer puts one first (`data.bos_prefix`)."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    intro, filler = bos_prefix(tokenizer) + enc(_INTRO), enc(_FILLER)
    needle, question = enc(_NEEDLE.format(key=key)), enc(_QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    hay = (filler * (room // len(filler) + 1))[:room]
    cut = int(len(hay) * depth)
    cut -= cut % len(filler)  # keep the filler sentences whole around the needle
    return intro + hay[:cut] + needle + hay[cut:] + question


def _generate(model, ids: torch.Tensor, cache) -> torch.Tensor:
    return model.generate(
        ids, cache=cache, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=0
    )[0, ids.shape[1] :]


def passkey_accuracy(
    model, tokenizer, candidate, *, lengths=LENGTHS, depths=DEPTHS, progress=False, seed=0
) -> dict[str, float]:
    """{"1024": accuracy, ...}: fraction of depths at which the key is in the greedy answer."""

    rng = random.Random(seed)
    device = next(model.parameters()).device
    out = {}
    cases = [(n, d) for n in lengths for d in depths]
    with torch.no_grad():
        for n, d in tqdm(
            cases, desc=f"passkey {candidate.name}", disable=not progress, leave=False
        ):
            key = rng.randint(10000, 99999)
            ids = torch.tensor([prompt(tokenizer, n, d, key)], device=device)
            max_len = ids.shape[1] + ANSWER_TOKENS
            if candidate.scheme is None:
                answer = _generate(model, ids, external_cache(model, candidate.recipe))
            else:
                with QuantizedKVCache(
                    model,
                    candidate.scheme,
                    candidate.params,
                    max_len=max_len,
                    transforms=candidate.transforms,
                ) as cache:
                    answer = _generate(model, ids, cache)
            found = str(key) in tokenizer.decode(answer)
            out[str(n)] = out.get(str(n), 0) + found / len(depths)
    return out
