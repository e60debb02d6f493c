"""Batched generation: per-prompt prefill, then one decode step for all sequences at once.

Each prompt is prefilled alone through `cache.view(b)`, so prompts of different lengths need no
padding; decode then feeds one token per sequence (T = 1), each at its own position. On CUDA,
with a cache whose decode step is device work only (`capturable`: the quantized cache), the
step is captured once in a CUDA graph and replayed (`DecodeStep`); elsewhere it runs eagerly.
"""

import math
from collections.abc import Callable

import torch

from kvcalib_runtime.errors import KvcalibRuntimeError

# The lowest temperature sampling takes: float32's smallest normal number. Logits are divided by
# it in float32 after their maximum is subtracted (softmax's shift, done first), so every scaled
# logit is <= 0 and the largest is 0 however small the temperature: nothing overflows. Below it,
# the temperature loses bits as a float32 subnormal, and below 7e-46 rounds to 0 (0 / 0 = NaN).
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny
SEEDS = 1 << 64  # torch.Generator.manual_seed takes seeds in [0, 2^64)


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Next tokens from logits float [B, vocab] -> LongTensor[B], -1 for a row that holds a NaN
    or +Inf or only -Inf (what a broken forward gives).

    Greedy (argmax) when temperature == 0; otherwise softmax(logits / temperature) restricted to
    the nucleus: the most likely tokens whose cumulative probability first reaches top_p (the
    most likely token always stays). Finite logits and temperature >= MIN_TEMPERATURE always
    give a token. The check reads one number per row (the argmax's logit, or the maximum that
    softmax subtracts anyway), so it costs a greedy step next to nothing.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)  # a NaN or +Inf is the largest
        top = logits.gather(-1, tokens[:, None])  # [B, 1]
    else:
        top = logits.amax(dim=-1, keepdim=True)  # NaN where the row holds one
        shifted = torch.where(top.isfinite(), logits - top, 0.0)  # a broken row: drawn, then -1
        probs = torch.softmax(shifted / temperature, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
            sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens.masked_fill(~top[:, 0].isfinite(), -1)


class DecodeStep:
    """One decode step for every sequence: tokens LongTensor[B] -> logits float32 [B, vocab].

    Eager, or — on CUDA with a `capturable` cache — eager once (it compiles and tunes the
    kernels), then captured in a CUDA graph at the second call and replayed from then on; the
    cache's host bookkeeping follows each replay (`cache.replayed`). The logits of a replay
    live in the graph's output buffer: read them before the next call.
    """

    def __init__(self, model, cache, cuda_graph: bool = True):
        self.model, self.cache = model, cache
        capturable = getattr(cache, "capturable", False)
        self.graphed = cuda_graph and model.device.type == "cuda" and capturable
        self.graph = self.tokens = self.logits = None
        self.warm = False

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.graphed or not self.warm:
            self.warm = True
            return self.model(tokens[:, None], self.cache, last_only=True)[:, -1]
        self.cache.check_capacity(1)
        if self.graph is None:
            self.tokens = tokens.clone()
            self.graph = torch.cuda.CUDAGraph()
            with self.cache.capture(), torch.cuda.graph(self.graph):
                self.logits = self.model(self.tokens[:, None], self.cache, last_only=True)[:, -1]
        self.tokens.copy_(tokens)
        self.graph.replay()
        self.cache.replayed(1)
        return self.logits


def _not_finite(b: int, step: int) -> KvcalibRuntimeError:
    where = "after its prompt" if step == 0 else f"at new token {step + 1}"
    return KvcalibRuntimeError(
        f"the model's logits for sequence {b} hold NaN or Inf {where}: its weights or "
        "config.json (rms_norm_eps, rope_theta, ...) make the forward overflow or divide by "
        "zero; convert the model again from its source, or load it in float32"
    )


def check_options(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """KvcalibRuntimeError unless max_new_tokens is an integer >= 1, temperature 0 or a finite
    number >= MIN_TEMPERATURE and 0 < top_p <= 1 (NaN is none of these)."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
        raise KvcalibRuntimeError(f"max_new_tokens = {max_new_tokens!r}: use an integer >= 1")
    if max_new_tokens < 1:
        raise KvcalibRuntimeError(f"max_new_tokens = {max_new_tokens}: ask for at least 1")
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise KvcalibRuntimeError(f"{name} = {v!r}: use a finite number")
    if temperature < 0 or not 0 < top_p <= 1:
        raise KvcalibRuntimeError(
            f"temperature = {temperature}, top_p = {top_p}: use temperature >= 0, 0 < top_p <= 1"
        )
    if 0 < temperature < MIN_TEMPERATURE:
        raise KvcalibRuntimeError(
            f"temperature = {temperature!r} is below what float32 sampling resolves: use 0 "
            f"(greedy) or at least {MIN_TEMPERATURE:.4g}"
        )


def check_request(eos_token_id, seed, callback) -> None:
    """KvcalibRuntimeError unless eos_token_id is None, an integer or a list or tuple of
    integers, seed None or an integer in [0, 2^64), and callback None or callable."""
    ids = eos_token_id if isinstance(eos_token_id, list | tuple) else [eos_token_id]
    if eos_token_id is not None and not all(is_int(t) for t in ids):
        raise KvcalibRuntimeError(
            f"eos_token_id = {eos_token_id!r}: use a token id, a list of them, [] or None"
        )
    if seed is not None and not (is_int(seed) and 0 <= seed < SEEDS):
        raise KvcalibRuntimeError(f"seed = {seed!r}: use an integer in [0, 2^64) or None")
    if callback is not None and not callable(callback):
        raise KvcalibRuntimeError(f"callback = {callback!r}: use a function or None")


def is_int(x) -> bool:
    """Whether x is an integer (True, JSON's true, is not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check(prompts, max_new_tokens: int, temperature: float, top_p: float, cache) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise KvcalibRuntimeError("every prompt needs at least one token")
    check_options(max_new_tokens, temperature, top_p)
    if len(cache.lengths) != len(prompts):
        raise KvcalibRuntimeError(
            f"the cache holds {len(cache.lengths)} sequences for {len(prompts)} prompts: "
            "build it with batch = len(prompts)"
        )


@torch.inference_mode()
def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    cache,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    callback: Callable[[int, list[int | None]], None] | None = None,
    cuda_graph: bool = True,
) -> list[list[int]]:
    """Up to max_new_tokens new tokens for each prompt (token ids), as a list per prompt.

    cache:         a cache with one sequence per prompt (see `FullPrecisionCache`); it is reset
                   first, so its contents afterwards are the prompts and the generated tokens
    temperature:   0 for greedy decoding, else sampling from softmax(logits / temperature)
    top_p:         nucleus sampling mass (1.0 = the whole distribution); ignored when greedy
    eos_token_id:  a sequence stops after producing one of these (it is included in its output)
    seed:          seeds a torch.Generator for sampling; None uses torch's global generator
    callback:      callback(step, tokens) after every step: tokens[b] is the token sequence b got
                   at this step, None once it has stopped
    cuda_graph:    replay the decode step from a CUDA graph where it can be (`DecodeStep`)
    """
    _check(prompts, max_new_tokens, temperature, top_p, cache)
    check_request(eos_token_id, seed, callback)
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    device = model.device
    generator = None
    if seed is not None and temperature > 0:
        generator = torch.Generator(device=device).manual_seed(seed)
    cache.reset()

    last = []  # logits after each prompt: [1, vocab] each
    for b, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, T_b]
        last.append(model(ids, cache.view(b), last_only=True)[:, -1])
    tokens = sample(torch.cat(last), temperature, top_p, generator)  # [B]

    step_fn = DecodeStep(model, cache, cuda_graph)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_new_tokens):
        got: list[int | None] = [None] * len(prompts)
        for b, token in enumerate(tokens.tolist()):
            if not done[b]:
                if token < 0:
                    raise _not_finite(b, step)
                outputs[b].append(token)
                got[b], done[b] = token, token in eos
        if callback is not None:
            callback(step, got)
        if all(done) or step == max_new_tokens - 1:
            break
        logits = step_fn(tokens)  # [B, vocab]
        tokens = sample(logits, temperature, top_p, generator)
    return outputs
