"""`kvcalib eval --long-context`: the long-context suite (`kvcalib.evaluation.longtasks`) through
every recipe's cache, scored as exact-match accuracy per task and length.

Every prompt is prefilled once in full precision — as a serving runtime prefills, and as the
simulated cache does: the prompt attends to itself exact — recording what each cache stores
(pre-RoPE keys, values, post-RoPE keys for external peers, the residual stream where a sink
predictor reads it). Each recipe's cache takes that prefill in (`QuantizedKVCache.fill`, or an
external peer's own cache through its `update`) and the answer is decoded greedily token by
token through it, as in `kvcalib eval --mode decode`: every answer token attends to the prompt as
the recipe stores it. One prefill serves all recipes of a run.

A cell (task, length) holds one sample per seed (passkey: per seed and depth). Its spread is
the binomial standard error sqrt(p (1 - p) / n): with 2 samples a cell moves in steps of 50
points, so compare recipes on the averages.

`kvcalib eval --passkey` is the suite's passkey task alone at PASSKEY_LENGTHS and 3 depths.
"""

import contextlib
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from kvcalib.core import data as data_mod
from kvcalib.errors import DataError, OptionError
from kvcalib.evaluation import longtasks
from kvcalib.evaluation.external import external_cache
from kvcalib.io.figures import figure, save_png
from kvcalib.sim.cache import QuantizedKVCache
from kvcalib.sim.hooks import Hooks, capture_keys, decoder_layers, hidden_of, key_module

LENGTHS = (2048, 4096, 8192)
SEEDS = (0, 1)  # a sample per seed in every cell (passkey: per seed and depth)
TASKS = ("passkey", "multikey", "multivalue", "vartrack", "freqwords")
PASSKEY_LENGTHS = (1024, 2048, 4096)
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)


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


def samples(
    tokenizer,
    data=None,
    *,
    lengths: Sequence[int] = LENGTHS,
    seeds: Sequence[int] = SEEDS,
    tasks: Sequence[str] = TASKS,
    depths: Sequence[float] = longtasks.DEPTHS,
) -> list[longtasks.Sample]:
    """The suite's prompts: every task at every length, a sample per seed (passkey: per seed
    and depth); the haystack is the evaluation text of `data` (default: the built-in
    evaluation split)."""
    haystack = longtasks.Haystack(tokenizer, data_mod.read_text(data, "evaluation", tokenizer))
    out = []
    for task in tasks:
        build = getattr(longtasks, task)
        for n in lengths:
            for seed in seeds:
                if task == "passkey":
                    out += [build(tokenizer, haystack, n, seed, d) for d in depths]
                else:
                    out.append(build(tokenizer, haystack, n, seed))
    return out


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


def run(
    model,
    tokenizer,
    cands: Sequence,
    *,
    data=None,
    lengths: Sequence[int] = LENGTHS,
    seeds: Sequence[int] = SEEDS,
    tasks: Sequence[str] = TASKS,
    depths: Sequence[float] = longtasks.DEPTHS,
    progress: bool = False,
) -> list[dict[str, dict[str, dict[str, float]]]]:
    """Per candidate (`score.candidates`, in order): {task: {length: {"accuracy", "samples",
    "spread", "seconds"}}}; "seconds" per sample as if the recipe ran alone (the shared
    prefill plus its own decoding)."""
    suite = samples(tokenizer, data, lengths=lengths, seeds=seeds, tasks=tasks, depths=depths)
    device = next(model.parameters()).device
    stop = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
    sinks = {
        c.params.sink_predictor.layer
        for c in cands
        if c.scheme is not None and c.scheme.sink_budget and c.params.sink_predictor is not None
    }
    tally = [{} for _ in cands]  # per candidate: (task, length) -> [(correct, seconds)]
    bar = tqdm(total=len(suite), desc="long-context", disable=not progress, leave=False)
    with torch.no_grad():
        for s in suite:
            bar.set_postfix_str(f"{s.task} {s.length}")
            start = time.perf_counter()
            prefill = Prefill(model, torch.tensor([s.ids], device=device), sinks)
            shared = time.perf_counter() - start
            for c, cells in zip(cands, tally, strict=True):
                start = time.perf_counter()
                answer = _answer(model, tokenizer, c, prefill, s, stop)
                seconds = shared + time.perf_counter() - start
                cells.setdefault((s.task, s.length), []).append((s.correct(answer), seconds))
            bar.update()
    bar.close()
    return [_cells(cells) for cells in tally]


def passkey_accuracy(
    model,
    tokenizer,
    candidate,
    *,
    lengths=PASSKEY_LENGTHS,
    depths=PASSKEY_DEPTHS,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, float]:
    """{"1024": accuracy, ...}: the suite's passkey task alone, one key per depth."""
    (cells,) = run(
        model,
        tokenizer,
        [candidate],
        lengths=lengths,
        seeds=(seed,),
        tasks=("passkey",),
        depths=depths,
        progress=progress,
    )
    return {n: cell["accuracy"] for n, cell in cells["passkey"].items()}


def _cells(cells: dict) -> dict[str, dict[str, dict[str, float]]]:
    out = {}
    for (task, length), marks in cells.items():
        n = len(marks)
        p = sum(ok for ok, _ in marks) / n
        out.setdefault(task, {})[str(length)] = {
            "accuracy": p,
            "samples": n,
            "spread": math.sqrt(p * (1 - p) / n),
            "seconds": sum(s for _, s in marks) / n,
        }
    return out


def mean_accuracy(cells: dict, lengths: Sequence[str] | None = None) -> float:
    """The accuracy averaged over tasks and lengths (or only `lengths`), each cell weighing
    the same."""
    accs = [
        cell["accuracy"]
        for by_length in cells.values()
        for n, cell in by_length.items()
        if lengths is None or n in lengths
    ]
    return sum(accs) / len(accs)


def format_table(results) -> str:
    """A Markdown table, a row per task and length, a column per recipe: accuracy ± spread
    (binomial standard error), and the samples per cell."""
    with_lc = [r for r in results if r.long_context]
    first = with_lc[0].long_context
    rows = ["| task | tokens | samples | " + " | ".join(r.recipe for r in with_lc) + " |"]
    rows.append("|---|---:|---:|" + "---:|" * len(with_lc))
    for task, by_length in first.items():
        for n, cell in by_length.items():
            accs = [r.long_context[task][n] for r in with_lc]
            cells = [f"{a['accuracy']:.0%} ±{a['spread']:.0%}" for a in accs]
            rows.append(f"| {task} | {n} | {cell['samples']} | " + " | ".join(cells) + " |")
    means = [f"{mean_accuracy(r.long_context):.1%}" for r in with_lc]
    rows.append("| **mean** | | | " + " | ".join(means) + " |")
    return "\n".join(rows)


def plot(results, path: str | Path) -> Path:
    """Accuracy against length, a panel per task and one for the mean, a line per recipe
    (error bars: the binomial standard error)."""
    with_lc = [r for r in results if r.long_context]
    tasks = list(with_lc[0].long_context)
    cols = math.ceil((len(tasks) + 1) / 2)
    fig = figure(3.2 * cols, 6.4)
    axes = fig.subplots(2, cols, sharey=True).flatten()[: len(tasks) + 1]
    for r in with_lc:
        lengths = list(r.long_context[tasks[0]])
        x = [int(n) for n in lengths]
        for ax, task in zip(axes, tasks, strict=False):
            cells = [r.long_context[task][n] for n in lengths]
            acc = [c["accuracy"] for c in cells]
            ax.errorbar(x, acc, yerr=[c["spread"] for c in cells], marker="o", capsize=3)
            ax.set_title(task)
        mean = [mean_accuracy(r.long_context, [n]) for n in lengths]
        axes[-1].plot(x, mean, marker="o", label=r.recipe)
        axes[-1].set_title("mean over tasks")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{n / 1024:g}K" for n in x])
        ax.minorticks_off()
        ax.set_xlabel("tokens")
        ax.set_ylim(-0.05, 1.05)
    for ax in axes[::cols]:
        ax.set_ylabel("exact-match accuracy")
    axes[-1].legend(fontsize="small")
    return save_png(fig, Path(path), dpi=110)
