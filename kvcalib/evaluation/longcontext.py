"""`kvcalib eval --long-context`: the long-context suite (`kvcalib.evaluation.longtasks`) through
every recipe's cache, scored as exact-match accuracy per task and length.

Every prompt is prefilled once in full precision — as a serving runtime prefills, and as the
simulated cache does: the prompt attends to itself exact — recording what each cache stores
(pre-RoPE keys, values, post-RoPE keys for external peers, the residual stream where a sink
predictor reads it). Each recipe's cache takes that prefill in (`QuantizedKVCache.fill`, or an
external peer's own cache through its `update`) and the answer is decoded greedily token by
token through it, as in `kvcalib eval --mode decode`: every answer token attends to the prompt as
the recipe stores it. One prefill serves all recipes of a run.

Besides the greedy answer, each recipe scores the expected answer's teacher-forced
log-likelihood through the same cache (a continuous score that separates recipes with far fewer
prompts than accuracy; multikey also ranks it against the distractor needles' values), and a
probe at the answer's first step records attention on the needles and on token 0 and the
needle keys' error (`longprobe`).

A cell (task, length) holds `prompts` prompts (`grid`). It reports n,
the accuracy with its Wilson 95% interval and, since every recipe answers the same prompts, the
paired difference to full precision with a bootstrap interval and the exact McNemar p
(`longstats`); tables and plots are `longreport`'s.

`kvcalib eval --passkey` is the suite's passkey task alone at PASSKEY_LENGTHS and 3 depths.
"""

import contextlib
import time
from collections import Counter
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from kvcalib.core import data as data_mod
from kvcalib.errors import DataError, OptionError
from kvcalib.evaluation import longstats, longtasks
from kvcalib.evaluation.external import external_cache
from kvcalib.evaluation.longprobe import Probe, diagnose
from kvcalib.sim.cache import QuantizedKVCache
from kvcalib.sim.hooks import Hooks, capture_keys, decoder_layers, hidden_of, key_module

LENGTHS = (2048, 4096, 8192)
PROMPTS = 5  # per task and length (passkey: one per depth)
TASKS = ("passkey", "multikey", "multivalue", "vartrack", "freqwords")
PASSKEY_LENGTHS = (1024, 2048, 4096)
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
REFERENCE = "fp16"  # the recipe every other is paired against


def check_lengths(lengths: Sequence[int], context: int | None, *, default: bool = False) -> None:
    """Refuse suite lengths the model cannot hold (`context`: its max positions, if known);
    `default`: the lengths are plain --long-context's, not --long-context-lengths'."""
    for n in lengths:
        if n <= 0:
            raise OptionError(
                f"--long-context-lengths {n}: use positive token counts, e.g. 2048,4096"
            )
        if context and n > context:
            if default:
                raise DataError(
                    f"--long-context runs the suite at {_listed(lengths)} tokens, beyond the "
                    f"model's context ({context} tokens): pass --long-context-lengths with "
                    f"lengths up to {context}"
                )
            raise DataError(
                f"--long-context-lengths {n} exceeds the model's context ({context} tokens): "
                f"use lengths up to {context}"
            )


def check_passkey(context: int | None) -> None:
    """Refuse --passkey when its lengths (PASSKEY_LENGTHS) exceed the model's context."""
    if context and max(PASSKEY_LENGTHS) > context:
        raise DataError(
            f"--passkey runs passkeys at {_listed(PASSKEY_LENGTHS)} tokens, beyond the model's "
            f"context ({context} tokens): leave --passkey out, or pass --long-context-lengths "
            f"with lengths up to {context} (the suite has a passkey task)"
        )


def _listed(lengths: Sequence[int]) -> str:
    return ",".join(str(n) for n in lengths)


def grid(tasks, lengths, prompts: int, depths=longtasks.DEPTHS) -> list[tuple]:
    """(task, length, seed, depth) of `prompts` prompts per task and length, prompt index first
    (a run cut short has every cell about equally far): passkey cycles over `depths` (seed =
    prompt // len(depths)), the other tasks take seed = prompt and depth None."""
    out = []
    for j in range(prompts):
        for n in lengths:
            for task in tasks:
                if task == "passkey":
                    out.append((task, n, j // len(depths), depths[j % len(depths)]))
                else:
                    out.append((task, n, j, None))
    return out


def build(tokenizer, haystack, task: str, length: int, seed: int, depth) -> longtasks.Sample:
    """The prompt a `grid` entry names."""
    extra = () if depth is None else (depth,)
    return getattr(longtasks, task)(tokenizer, haystack, length, seed, *extra)


def haystack(tokenizer, data=None) -> longtasks.Haystack:
    """The evaluation text of `data` (default: the built-in evaluation split) as a haystack."""
    return longtasks.Haystack(tokenizer, data_mod.read_text(data, "evaluation", tokenizer))


def samples(
    tokenizer,
    data=None,
    *,
    lengths: Sequence[int] = LENGTHS,
    prompts: int = PROMPTS,
    tasks: Sequence[str] = TASKS,
    depths: Sequence[float] = longtasks.DEPTHS,
) -> list[longtasks.Sample]:
    """The suite's prompts, `grid`'s order."""
    hay = haystack(tokenizer, data)
    return [build(tokenizer, hay, *p) for p in grid(tasks, lengths, prompts, depths)]


class Prefill:
    """A prompt's full-precision forward: the next-token logits [V], and per layer the pre-RoPE
    keys, the post-RoPE keys and the values [1, Hkv, T, D]; the residual stream [1, T, hidden]
    out of the decoder layers in `layers`."""

    def __init__(self, model, ids: torch.Tensor, layers: set[int]):
        pre, self.hidden = {}, {}
        cache = DynamicCache(config=model.config)
        with Hooks(model) as hooks:
            for i in range(model.config.num_hidden_layers):
                hooks.forward(key_module(model, i), capture_keys(model, pre, i))
            for i in layers:
                hooks.forward(decoder_layers(model)[i], self._keep(i))
            out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        self.logits = out.logits[0, -1]
        self.keys_pre = [pre[i] for i in range(len(pre))]
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]

    def _keep(self, layer: int):
        def hook(module, args, output):
            self.hidden[layer] = hidden_of(output)

        return hook


def _greedy(model, cache, logits: torch.Tensor, max_new: int, stop: set[int], done) -> list[int]:
    """Greedy tokens after a prefill whose next-token logits are `logits`, through `cache`: up
    to `max_new`, an end-of-turn token in `stop`, or until `done(tokens)` (the answer so far
    is already correct: more tokens cannot unmake it, so they are not decoded)."""
    device = logits.device
    out = []
    while len(out) < max_new:
        token = int(logits.argmax())
        if token in stop:
            break
        out.append(token)
        if len(out) < max_new and not done(out):
            x = torch.tensor([[token]], device=device)
            logits = model(x, cache=cache, use_cache=True).logits[0, -1]
        else:
            break
    return out


@contextlib.contextmanager
def filled_cache(model, candidate, prefill: Prefill, max_len: int):
    """`candidate`'s cache (for `max_len` tokens) holding `prefill`'s prompt, as after a prefill
    through it: a QuantizedKVCache, or an external peer's own cache through its `update`."""
    if candidate.scheme is None:
        cache = external_cache(model, candidate.recipe)
        for i, (k, v) in enumerate(zip(prefill.keys, prefill.values, strict=True)):
            cache.update(k, v, i)
        yield cache
        return
    with QuantizedKVCache(
        model, candidate.scheme, candidate.params, candidate.transforms, max_len=max_len
    ) as cache:
        cache.fill(prefill.keys_pre, prefill.values, prefill.hidden)
        yield cache


def _answer(model, tokenizer, candidate, prefill: Prefill, sample: longtasks.Sample, stop) -> str:
    """The greedy answer to `sample` through `candidate`'s cache, filled with `prefill`."""
    new = sample.max_new_tokens
    done = lambda ids: sample.correct(tokenizer.decode(ids))  # noqa: E731
    with filled_cache(model, candidate, prefill, len(sample.ids) + new) as cache:
        return tokenizer.decode(_greedy(model, cache, prefill.logits, new, stop, done))


def _likelihood(model, tokenizer, candidate, prefill: Prefill, sample, text: str, probe=None):
    """(summed NLL, tokens) of `text` continuing the prompt, teacher-forced through
    `candidate`'s cache filled with `prefill`: its first token is scored on the prefill's logits,
    the others on one forward of the continuation through the cache (they attend to the prompt
    as the recipe stores it, and to each other exactly, as inside a residual window). `probe`
    (a longprobe.Probe) records that forward's first step."""
    ids = data_mod.encode(tokenizer, text)
    with filled_cache(model, candidate, prefill, len(sample.ids) + len(ids)) as cache:
        x = torch.tensor([ids], device=prefill.logits.device)
        with probe or contextlib.nullcontext():
            logits = model(x, cache=cache, use_cache=True).logits[0, :-1]
    logp = torch.cat([prefill.logits[None], logits]).float().log_softmax(-1)
    return -float(logp[torch.arange(len(ids)), torch.tensor(ids)].sum()), len(ids)


def score_prompt(model, tokenizer, cands: Sequence, sample: longtasks.Sample, *, sinks, stop):
    """{recipe: record} for one prompt, every candidate through one shared full-precision
    prefill. A record: "correct" and the greedy "answer"; "nll" (mean per token) and
    "nll_sum" of the expected answer, teacher-forced; "outranks" (multikey: whether the asked
    value's continuation is likelier than every distractor's); the first answer step's
    "needle_mass", "sink_mass", "needle_key_error" and per-layer "layers" (longprobe);
    "seconds" as if the recipe ran alone (the shared prefill plus its own work)."""
    device = next(model.parameters()).device
    start = time.perf_counter()
    prefill = Prefill(model, torch.tensor([sample.ids], device=device), sinks)
    shared = time.perf_counter() - start
    out = {}
    for c in cands:
        start = time.perf_counter()
        answer = _answer(model, tokenizer, c, prefill, sample, stop)
        probe = Probe(model, prefill.keys, sample.needles, sample.context)
        nll, n = _likelihood(model, tokenizer, c, prefill, sample, sample.answer, probe)
        rivals = [
            _likelihood(model, tokenizer, c, prefill, sample, d)[0] for d in sample.distractors
        ]
        out[c.name] = {
            "correct": sample.correct(answer),
            "answer": answer,
            "nll": nll / n,
            "nll_sum": nll,
            "outranks": nll < min(rivals) if rivals else None,
            **probe.record(),
            "seconds": shared + time.perf_counter() - start,
        }
    return out


def sinks_read(cands: Sequence) -> set[int]:
    """The layers whose residual stream some candidate's sink predictor reads."""
    return {
        c.params.sink_predictor.layer
        for c in cands
        if c.scheme is not None and c.scheme.sink_budget and c.params.sink_predictor is not None
    }


def stop_tokens(tokenizer) -> set[int]:
    return {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}


def run(
    model,
    tokenizer,
    cands: Sequence,
    *,
    data=None,
    lengths: Sequence[int] = LENGTHS,
    prompts: int = PROMPTS,
    tasks: Sequence[str] = TASKS,
    depths: Sequence[float] = longtasks.DEPTHS,
    progress: bool = False,
) -> list[dict[str, dict[str, dict]]]:
    """Per candidate (`score.candidates`, in order): {task: {length: cell}}, a cell as
    `cells` builds it (paired against "fp16" when it is among the candidates)."""
    suite = samples(tokenizer, data, lengths=lengths, prompts=prompts, tasks=tasks, depths=depths)
    sinks, stop = sinks_read(cands), stop_tokens(tokenizer)
    records = []
    bar = tqdm(total=len(suite), desc="long-context", disable=not progress, leave=False)
    with torch.no_grad():
        for s in suite:
            bar.set_postfix_str(f"{s.task} {s.length}")
            records.append((s, score_prompt(model, tokenizer, cands, s, sinks=sinks, stop=stop)))
            bar.update()
    bar.close()
    return [cells(records, c.name) for c in cands]


def passkey_accuracy(
    model,
    tokenizer,
    candidate,
    *,
    lengths=PASSKEY_LENGTHS,
    depths=PASSKEY_DEPTHS,
    progress: bool = False,
) -> dict[str, float]:
    """{"1024": accuracy, ...}: the suite's passkey task alone, one key per depth."""
    (by_task,) = run(
        model,
        tokenizer,
        [candidate],
        lengths=lengths,
        prompts=len(depths),
        tasks=("passkey",),
        depths=depths,
        progress=progress,
    )
    return {n: cell["accuracy"] for n, cell in by_task["passkey"].items()}


def cells(records: Sequence[tuple], name: str, reference: str = REFERENCE) -> dict:
    """{task: {length: cell}} of recipe `name` from (sample, {recipe: record}) pairs: the cell
    is `longstats.cell` (paired against `reference` when the records hold it) plus, where
    `reference` solves a prompt that `name` does not, the count of each `longprobe.diagnose`
    cause ("failures") and, over every prompt, the per-layer probe means ("probe")."""
    grouped = {}
    for s, by_recipe in records:
        grouped.setdefault((s.task, s.length), []).append(by_recipe)
    out = {}
    for (task, length), prompts in grouped.items():
        mine = [p[name] for p in prompts]
        paired = name != reference and all(reference in p for p in prompts)
        ref = [p[reference] for p in prompts] if paired else None
        cell = longstats.cell(mine, ref)
        if paired:
            failed = [(m, r) for m, r in zip(mine, ref, strict=True) if r["correct"] > m["correct"]]
            cell["failures"] = dict(Counter(diagnose(m, r) for m, r in failed))
        cell["probe"] = {
            key: _layer_means([m["layers"][key] for m in mine]) for key in mine[0]["layers"]
        }
        out.setdefault(task, {})[str(length)] = cell
    return out


def _layer_means(rows: list[list]) -> list[float | None]:
    """Per layer, the mean over prompts of the known values (None where none is known)."""
    per_layer = [[x for x in col if x is not None] for col in zip(*rows, strict=True)]
    return [sum(xs) / len(xs) if xs else None for xs in per_layer]
