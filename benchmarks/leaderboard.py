"""Regenerate the leaderboard: the issue's presets on two texts and the chat text, in decode mode
with the same 128-token residual window for every recipe, in fake mode, and in decode mode at
each method's own window; passkey retrieval; the ablation of kvcalib-2's ingredients; on one
model (default: the embedded default model) in fp32.

    python benchmarks/leaderboard.py [--model gemma3-270m] [--profile DIR] [--windows 4]
        [--seq-len 1024] [--recipe NAME ...] [--no-extras] [--out DIR]

Writes leaderboard.md (the tables the README quotes) and leaderboard.json (every Result, with its
table, text and setup) into --out (default: benchmarks/); for another model, leaderboard-<model>.md
/ .json. Without --profile the default calibration is used (computed once and cached, as `kvcalib
eval` does). The texts: the built-in evaluation split of Python's documentation, `builtin:licenses`
(legal English, not calibration text) and `builtin:chat` (evaluation topics as multi-turn chats in
the model's template, where later sinks appear at turn boundaries). Fake mode quantizes every
position, so a residual window does not enter it. External peers (hf-quanto) run only in decode
mode, through their own cache, whose own window is 128, and not on models with sliding-window layers
(Gemma), which transformers' quantized cache refuses; a model without a chat template skips the chat
text. `--recipe` restricts the tables to some presets and `--no-extras` skips passkey and ablation
(a quick check of the script). Measured on 2 CPU cores shared with other jobs: the three texts'
tables of the 14 presets without hf-quanto, 50 minutes; the first table with the hf-quanto peers,
which decode token by token through transformers' own cache, 38 minutes alone.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kvcalib import load_model
from kvcalib.api import default_profile
from kvcalib.core.models import DEFAULT_MODEL, GEMMA3, resolve
from kvcalib.core.recipe import load_recipe
from kvcalib.evaluation.listing import DEFAULT_GEOMETRY, recipe_bits
from kvcalib.evaluation.longcontext import PASSKEY_LENGTHS, passkey_accuracy
from kvcalib.evaluation.score import candidates, format_table, score
from kvcalib_runtime.model.geometry import Geometry

HERE = Path(__file__).resolve().parent
TEXTS = {"pydoc": None, "licenses": "builtin:licenses", "chat": "builtin:chat"}
RESIDUAL = 128  # the window every recipe gets in the headline tables (KIVI's and kvcalib's own)
LEADERBOARD = (
    "fp16",
    "per-token-2",
    "per-token-4",
    "kivi-2",
    "kivi-4",
    "kvquant-2",
    "kvquant-3",
    "quarot-kv4",
    "turboquant-2.5",
    "turboquant-3.5",
    "llamacpp-q4_0",
    "hf-quanto-2",
    "hf-quanto-4",
    "kvcalib-2",
    "kvcalib-3",
    "kvcalib-4",
)
NAMES = {
    DEFAULT_MODEL: "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
    GEMMA3: "Gemma 3 270M base (GGUF Q4_K_M, dequantized; 15 of 18 layers slide over 512 tokens)",
}
PASSKEY_RECIPES = ("fp16", "per-token-2", "kivi-2", "kvquant-3", "kvcalib-2", "kvcalib-3")


def ablations() -> list:
    """kvcalib-2 with one ingredient changed at a time, and kvcalib-3 without its per-layer
    bit allocation (each at its fixed width everywhere). A change of a tensor's normalized
    domain (granularity, RoPE side, rotation) has no calibrated codebook in the default profile:
    those rows use uniform levels for that tensor and compare against the "- key codebook" /
    "- value codebook" rows."""
    base, k3 = load_recipe("kvcalib-2"), load_recipe("kvcalib-3")
    key, value = base.key, base.value
    no_slots = dict(outliers=0.0, outlier_slots=0, codebook="uniform")  # full range, uniform

    def variant(name, **changes):
        return dataclasses.replace(base, name=f"kvcalib-2 {name}", **changes)

    return [
        base,
        variant("- allocation (2 bits everywhere)", allocation=None),
        variant("- predicted sinks", sinks_predicted=False, sink_budget=0),
        variant("- all sinks", sinks_predicted=False, sink_budget=0, sinks_first=0),
        variant(
            "- exact slot, full range (uniform)",
            key=dataclasses.replace(key, **no_slots),
        ),
        variant("- key codebook", key=dataclasses.replace(key, codebook="uniform")),
        variant("- value codebook", value=dataclasses.replace(value, codebook="uniform")),
        variant(
            "- value Hadamard (uniform)",
            value=dataclasses.replace(value, rotation="none", codebook="uniform"),
        ),
        variant(
            "static -> dynamic keys, groups of 64 (uniform)",
            key=dataclasses.replace(key, granularity="channel", group_size=64, **no_slots),
        ),
        variant(
            "pre -> post-RoPE keys (uniform)",
            key=dataclasses.replace(key, position="post_rope", codebook="uniform"),
        ),
        variant(
            "keys: online Hadamard per token, QuaRot (uniform)",
            key=dataclasses.replace(
                key, granularity="token", position="post_rope", rotation="hadamard", **no_slots
            ),
        ),
        k3,
        dataclasses.replace(k3, name="kvcalib-3 - allocation (3 bits everywhere)", allocation=None),
    ]


class Board:
    """The tables so far, rewritten to leaderboard.md / .json after every block: an interrupted
    run keeps what it measured."""

    def __init__(self, out: Path, stem: str, setup: str):
        self.out, self.stem, self.setup, self.start = out, stem, setup, time.time()
        self.rows, self.md = [], [f"Setup: {setup}.", ""]

    def add(self, title: str, table: str, rows: list[dict]) -> None:
        self.rows += rows
        self.md += [f"### {title}", "", table, ""]
        self.out.joinpath(f"{self.stem}.md").write_text("\n".join(self.md))
        doc = {"setup": self.setup, "rows": self.rows}
        self.out.joinpath(f"{self.stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{title}: {time.time() - self.start:.0f}s", flush=True)

    def results(self, title, table, text, results) -> None:
        rows = [{"table": table, "text": text, **r.to_json()} for r in results]
        self.add(title, format_table(results), rows)


def bits_table(names) -> str:
    """Bits per element at 4K tokens of every recipe, as `kvcalib recipes` measures them."""
    lines = ["| recipe | at 4K, everything | quantized body |", "|---|---|---|"]
    for name in names:
        total, body = recipe_bits(load_recipe(name), **DEFAULT_GEOMETRY)
        lines.append(f"| {name} | {total:.2f} | {body:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Model spec (default: %(default)s).")
    parser.add_argument("--profile", default=None, help="Profile folder (default: cached).")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--recipe", action="append", help="Only these presets (repeat).")
    parser.add_argument("--no-extras", action="store_true", help="Skip passkey and ablation.")
    parser.add_argument("--out", default=str(HERE), help="Folder for leaderboard.md / .json.")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    profile = default_profile(resolve(args.model), args.profile)
    names = tuple(args.recipe or LEADERBOARD)
    if Geometry.from_config(model.config).sliding:  # transformers' QuantizedCache refuses it
        names = tuple(n for n in names if not load_recipe(n).external)
    stem = "leaderboard" if args.model == DEFAULT_MODEL else f"leaderboard-{Path(args.model).stem}"
    board = Board(
        Path(args.out),
        stem,
        f"{NAMES.get(args.model, args.model)}, fp32, CPU; {args.windows} windows x "
        f"{args.seq_len} tokens per text; profile: {args.profile or 'the default calibration'}",
    )
    board.add("bits per element at 4K tokens (`kvcalib recipes`)", bits_table(names), [])
    size = dict(seq_len=args.seq_len, windows=args.windows, progress=False)
    same = candidates(model, names, profile, residual=RESIDUAL)
    own = candidates(model, names, profile)
    chat = getattr(tokenizer, "chat_template", None) is not None  # not a base model's
    for text, data in TEXTS.items():
        if text == "chat" and not chat:
            board.add("chat", "Skipped: the tokenizer has no chat template.", [])
            continue
        fixed = score(model, tokenizer, same, data=data, mode="decode", **size)
        board.results(
            f"{text}, decode mode, residual {RESIDUAL} for all", "same-window", text, fixed
        )
        internal = [c for c in same if c.scheme is not None]
        fake = score(model, tokenizer, internal, data=data, mode="fake", **size)
        board.results(f"{text}, fake mode (every position quantized)", "fake", text, fake)
        rerun = [c for c, r in zip(own, fixed, strict=True) if r.residual != _own(c)]
        again = iter(score(model, tokenizer, rerun, data=data, mode="decode", **size))
        setup = {**fixed[0].setup, "residual": None}  # reused rows keep their numbers
        mixed = [
            dataclasses.replace(r if r.residual == _own(c) else next(again), setup=setup)
            for c, r in zip(own, fixed, strict=True)
        ]
        board.results(f"{text}, decode mode, each method's own window", "own-window", text, mixed)
    if args.no_extras:
        return
    table = ["| recipe | " + " | ".join(f"{n} tokens" for n in PASSKEY_LENGTHS) + " |"]
    table += ["|---" * (len(PASSKEY_LENGTHS) + 1) + "|"]
    rows = []
    for c in own:
        if c.name in PASSKEY_RECIPES:
            acc = passkey_accuracy(model, tokenizer, c)
            rows.append({"table": "passkey", "recipe": c.name, "passkey": acc})
            table.append(f"| {c.name} | " + " | ".join(f"{v:.0%}" for v in acc.values()) + " |")
    board.add("passkey retrieval, own windows (needle at depths 10/50/90%)", "\n".join(table), rows)
    abl = candidates(model, ablations(), profile)
    results = score(model, tokenizer, abl, data=None, mode="decode", **size)
    board.results("ablation, pydoc, decode mode", "ablation", "pydoc", results)


def _own(c) -> int:
    """A candidate's own residual window."""
    return c.scheme.residual if c.scheme is not None else c.recipe.residual


if __name__ == "__main__":
    main()
