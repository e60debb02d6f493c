"""External peers measured through their own code: transformers' QuantizedCache (quanto).

Decode mode only: the windows are fed token by token through the cache (all windows as one
batch), exactly as `model.generate` would use it.
"""

import time

import torch
from transformers.cache_utils import QuantizedCache

from kvcalib.errors import RecipeError


def external_cache(model, recipe):
    """A fresh transformers QuantizedCache for an external recipe."""

    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        raise RecipeError(
            f"recipe {recipe.name} runs transformers' quanto cache: pip install optimum-quanto"
        ) from None
    return QuantizedCache(
        backend="quanto",
        config=model.config,
        nbits=recipe.key.bits,
        q_group_size=recipe.key.group_size,
        residual_length=recipe.residual,
    )


def evaluate_external(model, recipe, ids: torch.Tensor, scores, bar=None) -> None:
    """Add an external recipe's decode-mode scores over windows ids [W, T] to `scores`."""
    cache = external_cache(model, recipe)
    w, t = ids.shape
    fp_logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)  # [W, T-1, V]
    start = time.perf_counter()
    steps = []
    for i in range(t - 1):
        steps.append(torch.log_softmax(model(ids[:, i : i + 1], cache=cache).logits[:, 0], -1))
    seconds = time.perf_counter() - start
    logp = torch.stack(steps, 1)  # [W, T-1, V]
    for j in range(w):
        scores.add(logp[j], fp_logp[j], ids[j, 1:], seconds / w)
        if bar is not None:
            bar.update()


def external_bits(recipe, context: int, *, residual: bool = False) -> float:
    """quanto stores b-bit codes with a scale and a shift (16 bits each) per group of
    `group_size` elements: that is bits_per_element. With `residual`, per element of a
    sequence of `context` tokens when its last context mod R tokens are still exact (quanto
    quantizes the residual window whole once it fills)."""
    body = recipe.key.bits + 32 / recipe.key.group_size
    if not residual:
        return body
    exact = context % recipe.residual if recipe.residual else 0
    return (body * (context - exact) + 16 * exact) / context
