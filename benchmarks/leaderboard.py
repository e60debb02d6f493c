"""Regenerate the leaderboard: every preset in both modes on two texts, the sink-sensitive
recipes on chat text, passkey retrieval, and the ablation of kvcalib-2's ingredients, on the
default model in fp32.

    python benchmarks/leaderboard.py [--profile DIR] [--windows 4] [--seq-len 1024]

Writes benchmarks/leaderboard.md (the tables the README quotes) and benchmarks/leaderboard.json
(every Result, with its text and mode). Without --profile the default calibration is used
(computed once and cached, as `kvcalib eval` does). The texts: the built-in evaluation split of
Python's documentation, `builtin:licenses` (legal English, not calibration text) and
`builtin:chat` (evaluation topics as multi-turn chats in the model's template, where later sinks
appear at turn boundaries). External peers (hf-quanto) run only in decode mode, through their own
cache. Measured: 34 minutes on 2 CPU cores.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kvcalib import load_model
from kvcalib.api import default_profile
from kvcalib.core.models import resolve
from kvcalib.core.recipe import load_recipe, presets
from kvcalib.evaluation.longcontext import PASSKEY_LENGTHS, passkey_accuracy
from kvcalib.evaluation.score import candidates, format_table, score

HERE = Path(__file__).resolve().parent
TEXTS = {"pydoc": None, "licenses": "builtin:licenses", "chat": "builtin:chat"}
MODES = ("decode", "fake")
SINK_RECIPES = ("fp16", "kivi-2", "kvquant-3", "kvcalib-2")  # on the chat text
PASSKEY_RECIPES = ("fp16", "per-token-2", "kivi-2", "kvquant-3", "kvcalib-2", "kvcalib-3")


def ablations() -> list:
    """kvcalib-2 with one ingredient changed at a time, and kvcalib-3 without its per-layer
    bit allocation. A change of a tensor's normalized domain (granularity, RoPE side, rotation)
    has no calibrated codebook in the default profile: those rows use uniform levels for that
    tensor and compare against the "- key codebook" / "- value codebook" rows."""
    base, k3 = load_recipe("kvcalib-2"), load_recipe("kvcalib-3")
    key, value = base.key, base.value

    def variant(name, **changes):
        return dataclasses.replace(base, name=f"kvcalib-2 {name}", **changes)

    return [
        base,
        variant("- predicted sinks", sinks_predicted=False, sink_budget=0),
        variant("- all sinks", sinks_predicted=False, sink_budget=0, sinks_first=0),
        variant("- outliers", key=dataclasses.replace(key, outliers=0.0)),
        variant("- key codebook", key=dataclasses.replace(key, codebook="uniform")),
        variant("- value codebook", value=dataclasses.replace(value, codebook="uniform")),
        variant(
            "- value Hadamard (uniform)",
            value=dataclasses.replace(value, rotation="none", codebook="uniform"),
        ),
        variant(
            "static -> dynamic keys, groups of 64 (uniform)",
            key=dataclasses.replace(
                key, granularity="channel", group_size=64, outliers=0.0, codebook="uniform"
            ),
        ),
        variant(
            "pre -> post-RoPE keys (uniform)",
            key=dataclasses.replace(key, position="post_rope", codebook="uniform"),
        ),
        variant(
            "keys: online Hadamard per token, QuaRot (uniform)",
            key=dataclasses.replace(
                key,
                granularity="token",
                position="post_rope",
                rotation="hadamard",
                outliers=0.0,
                codebook="uniform",
            ),
        ),
        k3,
        dataclasses.replace(k3, name="kvcalib-3 - allocation (3 bits everywhere)", allocation=None),
    ]


class Board:
    """The tables so far, rewritten to leaderboard.md / .json after every block: an interrupted
    run keeps what it measured."""

    def __init__(self, out: Path, setup: str):
        self.out, self.setup, self.start = out, setup, time.time()
        self.rows, self.md = [], [f"Setup: {setup}.", ""]

    def add(self, title: str, table: str, rows: list[dict]) -> None:
        self.rows += rows
        self.md += [f"### {title}", "", table, ""]
        self.out.joinpath("leaderboard.md").write_text("\n".join(self.md))
        doc = {"setup": self.setup, "rows": self.rows}
        self.out.joinpath("leaderboard.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{title}: {time.time() - self.start:.0f}s", flush=True)

    def scores(self, title, model, tokenizer, cands, *, text, table="leaderboard", **kw):
        results = score(model, tokenizer, cands, data=TEXTS[text], progress=False, **kw)
        rows = [{"table": table, "text": text, **r.to_json()} for r in results]
        self.add(title, format_table(results), rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="Profile folder (default: cached).")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", default=str(HERE), help="Folder for leaderboard.md / .json.")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(None, dtype=torch.float32)
    profile = default_profile(resolve(None), args.profile)
    board = Board(
        Path(args.out),
        f"SmolLM2-135M-Instruct (GGUF, dequantized), fp32, CPU; {args.windows} windows x "
        f"{args.seq_len} tokens per text; profile: default `kvcalib calibrate` "
        "(16 x 512 tokens of the built-in calibration text)",
    )
    size = dict(seq_len=args.seq_len, windows=args.windows)
    everything = candidates(model, presets(), profile)

    def presets_on(text: str, mode: str) -> None:
        chosen = [c for c in everything if c.scheme is not None or mode == "decode"]
        board.scores(f"{text}, {mode} mode", model, tokenizer, chosen, text=text, mode=mode, **size)

    presets_on("pydoc", "decode")
    presets_on("pydoc", "fake")
    table = ["| recipe | " + " | ".join(f"{n} tokens" for n in PASSKEY_LENGTHS) + " |"]
    table += ["|---" * (len(PASSKEY_LENGTHS) + 1) + "|"]
    rows = []
    for c in everything:
        if c.name in PASSKEY_RECIPES:
            acc = passkey_accuracy(model, tokenizer, c)
            rows.append({"table": "passkey", "recipe": c.name, "passkey": acc})
            table.append(f"| {c.name} | " + " | ".join(f"{v:.0%}" for v in acc.values()) + " |")
    board.add("passkey retrieval (needle at depths 10/50/90%)", "\n".join(table), rows)
    abl = candidates(model, ablations(), profile)
    board.scores(
        "ablation, pydoc, decode mode", model, tokenizer, abl, text="pydoc", mode="decode",
        table="ablation", **size,
    )  # fmt: skip
    presets_on("licenses", "decode")
    presets_on("licenses", "fake")
    sinks = [c for c in everything if c.name in SINK_RECIPES] + abl[1:3]
    board.scores("chat, decode mode", model, tokenizer, sinks, text="chat", mode="decode", **size)


if __name__ == "__main__":
    main()
