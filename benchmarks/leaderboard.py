"""Regenerate the leaderboard: the issue's presets on two texts and the chat text, in decode mode
with the same 128-token residual window for every recipe, in fake mode, and in decode mode at
each method's own window; passkey retrieval; the ablation of kvcalib-2's ingredients; on one
model (default: the embedded default model) in fp32.

    python benchmarks/leaderboard.py [--model gemma3-270m] [--profile DIR] [--windows 4]
        [--seq-len 1024] [--recipe NAME ...] [--no-extras] [--out DIR]

Writes leaderboard.md (the tables the README quotes) and leaderboard.json (every Result, with its
table, text, setup, preset version and plan digest) into --out (default: benchmarks/); for another
model, leaderboard-<model>.md / .json. Resumable: each (table, text, recipe) cell is kept under
--out/leaderboard-cells/ as it finishes (committed as it comes, as the long-context cells are),
with the digest of its recipe's plan (scheme and calibrated tensors, as the long-context suite
tags its records) and the run's setup; a run stopped anywhere scores only the cells missing or
kept under another plan or setup. The cells the README reads (both decode and fake mode at the
same window) run first, the external peers last among them; the two files are written once every
cell is in, and the cells they hold are then removed (a run restricted by --recipe or
--no-extras keeps the others'). Without --profile the default calibration is used
(computed once and cached, as `kvcalib eval` does); `make leaderboard` passes the committed
profile the long-context suite and the bf16 record read.

The texts: the built-in evaluation split of Python's documentation, `builtin:licenses` (legal
English, not calibration text) and `builtin:chat` (evaluation topics as multi-turn chats in the
model's template, where later sinks appear at turn boundaries). Fake mode quantizes every
position, so a residual window does not enter it. External peers (hf-quanto) run only in decode
mode, through their own cache, whose own window is 128, and not on models with sliding-window layers
(Gemma), which transformers' quantized cache refuses; a model without a chat template skips the chat
text. `--recipe` restricts the tables to some presets and `--no-extras` skips passkey and ablation
(a quick check of the script). Measured on 2 CPU cores shared with other jobs (2026-11-30, one
score per table): the three texts' tables of the 14 presets without hf-quanto, 50 minutes; the
first table with the hf-quanto peers, which decode token by token through transformers' own
cache, 38 minutes alone. A whole run is ~137 cells; on 2026-12-06, nice 5 on 2 cores at a load
of ~7, a cell of the 14 took 40-251 s.
"""

import argparse
import dataclasses
import hashlib
import json
import re
import time
from pathlib import Path

import torch
from long_context import _digest as plan_digest  # the long-context cells' plan tag

from kvcalib import load_model
from kvcalib.api import default_profile
from kvcalib.core.models import DEFAULT_MODEL, GEMMA3, resolve
from kvcalib.core.recipe import load_recipe
from kvcalib.evaluation.listing import DEFAULT_GEOMETRY, recipe_bits
from kvcalib.evaluation.longcontext import PASSKEY_LENGTHS, passkey_accuracy
from kvcalib.evaluation.score import Result, candidates, format_table, score
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
    bit allocation (each at its fixed width everywhere). A change of the keys' normalized
    domain (granularity, RoPE side, rotation) has no calibrated codebook in the default profile:
    those rows use uniform levels for the keys and compare against the "- key codebook" row.
    kvcalib-2's values have uniform levels already, so no row takes a value codebook away."""
    base, k3 = load_recipe("kvcalib-2"), load_recipe("kvcalib-3")
    key, value = base.key, base.value
    # full range, uniform levels, no exact slot
    no_slots = dict(outliers=0.0, outlier_slots=0, slot_code="exact", codebook="uniform")

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
        variant("one-byte slot -> exact slot", key=dataclasses.replace(key, slot_code="exact")),
        variant("- value Hadamard", value=dataclasses.replace(value, rotation="none")),
        variant(
            "one-byte value scale and zero point -> fp16",
            value=dataclasses.replace(value, metadata_code="dtype"),
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


def bits_table(names) -> str:
    """Bits per element at 4K tokens of every recipe, as `kvcalib recipes` measures them."""
    lines = ["| recipe | at 4K, everything | quantized body |", "|---|---|---|"]
    for name in names:
        total, body = recipe_bits(load_recipe(name), **DEFAULT_GEOMETRY)
        lines.append(f"| {name} | {total:.2f} | {body:.2f} |")
    return "\n".join(lines)


class Cells:
    """Every (table, text, recipe) cell scored once and kept under `folder` with its recipe's tag
    (the digest of its plan: scheme and calibrated tensors; of the recipe for an external peer)
    and the run's setup, written as it finishes: a run stopped anywhere resumes from the cells
    whose tag and setup are today's. The tables are written once every cell is in; the cells they
    hold are then removed (`clear`), those of presets a restricted run left out kept."""

    def __init__(self, folder: Path, setup: str):
        self.folder, self.setup, self.tags, self.used = folder, setup, {}, set()

    def tag(self, c) -> str:
        if id(c) not in self.tags:
            external = hashlib.sha256(repr(c.recipe).encode()).hexdigest()[:16]
            self.tags[id(c)] = external if c.scheme is None else plan_digest(c)
        return self.tags[id(c)]

    def get(self, table: str, text: str, c, run):
        """The kept value of the cell, or run() kept."""
        tag = self.tag(c)
        path = self.folder / f"{table}-{text}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', c.name)}.json"
        self.used.add(path)
        kept = json.loads(path.read_text()) if path.exists() else {}
        if kept.get("tag") == tag and kept.get("setup") == self.setup:
            return kept["value"]
        start = time.perf_counter()
        value = run()
        seconds = time.perf_counter() - start
        self.folder.mkdir(parents=True, exist_ok=True)
        doc = dict(tag=tag, setup=self.setup, seconds=round(seconds, 1), value=value)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)
        print(f"{table} {text} {c.name}: {seconds:.0f}s", flush=True)
        return value

    def clear(self) -> None:
        """Remove the cells this run read or wrote, and the folder once it is empty."""
        for path in self.used:
            path.unlink(missing_ok=True)
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()


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
    setup = (
        f"{NAMES.get(args.model, args.model)}, fp32, CPU; {args.windows} windows x "
        f"{args.seq_len} tokens per text; profile: {args.profile or 'the default calibration'}"
    )
    out = Path(args.out)
    cells = Cells(out / f"{stem}-cells", setup)
    size = dict(seq_len=args.seq_len, windows=args.windows, progress=False)
    same = candidates(model, names, profile, residual=RESIDUAL)
    own = candidates(model, names, profile)
    chat = getattr(tokenizer, "chat_template", None) is not None  # not a base model's
    texts = [t for t in TEXTS if t != "chat" or chat]

    def scored(table, text, c, mode="decode") -> Result:
        def run():
            return score(model, tokenizer, [c], data=TEXTS[text], mode=mode, **size)[0].to_json()

        return _result(cells.get(table, text, c, run))

    def owns(text) -> list[Result]:
        """Each method at its own window: the same-window row where that is its own."""
        rows = []
        for c, s in zip(own, same, strict=True):
            fixed = scored("same-window", text, s)
            mine = fixed if fixed.residual == _own(c) else scored("own-window", text, c)
            rows.append(dataclasses.replace(mine, setup={**fixed.setup, "residual": None}))
        return rows

    # The cells the README's tables read first (the external peers, which decode token by token
    # through transformers' cache, after the others), then the rest.
    for external in (False, True):
        for text in texts:
            for c in same:
                if (c.scheme is None) == external:
                    scored("same-window", text, c)
                    if c.scheme is not None:
                        scored("fake", text, c, "fake")
    board = [("bits per element at 4K tokens (`kvcalib recipes`)", bits_table(names))]
    rows = []
    for text in TEXTS:
        if text not in texts:
            board.append(("chat", "Skipped: the tokenizer has no chat template."))
            continue
        internal = [c for c in same if c.scheme is not None]
        tables = (
            (f"{text}, decode mode, residual {RESIDUAL} for all", "same-window",
             [scored("same-window", text, c) for c in same], same),
            (f"{text}, fake mode (every position quantized)", "fake",
             [scored("fake", text, c, "fake") for c in internal], internal),
            (f"{text}, decode mode, each method's own window", "own-window", owns(text), own),
        )  # fmt: skip
        for title, table, results, cands in tables:
            board.append((title, format_table(results)))
            rows += [_row(cells, table, text, c, r) for c, r in zip(cands, results, strict=True)]
    if not args.no_extras:
        table = ["| recipe | " + " | ".join(f"{n} tokens" for n in PASSKEY_LENGTHS) + " |"]
        table += ["|---" * (len(PASSKEY_LENGTHS) + 1) + "|"]
        for c in own:
            if c.name in PASSKEY_RECIPES:
                acc = cells.get(
                    "passkey", "pydoc", c, lambda c=c: passkey_accuracy(model, tokenizer, c)
                )
                rows.append(
                    {"table": "passkey", "recipe": c.name, "passkey": acc, **_tags(cells, c)}
                )
                table.append(f"| {c.name} | " + " | ".join(f"{v:.0%}" for v in acc.values()) + " |")
        board.append(
            ("passkey retrieval, own windows (needle at depths 10/50/90%)", "\n".join(table))
        )
        abl = candidates(model, ablations(), profile)
        results = [scored("ablation", "pydoc", c) for c in abl]
        board.append(("ablation, pydoc, decode mode", format_table(results)))
        rows += [_row(cells, "ablation", "pydoc", c, r) for c, r in zip(abl, results, strict=True)]
    board.append(("recipes: preset version and plan digest", _plans(cells, [*same, *own])))
    md = [f"Setup: {setup}.", ""] + [
        x for title, body in board for x in (f"### {title}", "", body, "")
    ]
    out.joinpath(f"{stem}.md").write_text("\n".join(md))
    doc = {"setup": setup, "rows": rows}
    out.joinpath(f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    cells.clear()  # the tables are whole: they hold the cells


def _result(d: dict) -> Result:
    return Result(**{f.name: d[f.name] for f in dataclasses.fields(Result)})


def _tags(cells: Cells, c) -> dict:
    """A row's recipe version (a preset's; None for an ablation variant) and plan digest."""
    preset = c.recipe.version if c.name in LEADERBOARD else None
    return {"version": preset, "plan": cells.tag(c)}


def _row(cells: Cells, table: str, text: str, c, r: Result) -> dict:
    return {"table": table, "text": text, **r.to_json(), **_tags(cells, c)}


def _plans(cells: Cells, cands) -> str:
    lines = ["| recipe | R | version | plan |", "|---|---:|---:|---|"]
    seen = {}
    for c in cands:
        seen.setdefault((c.name, _own(c), cells.tag(c)), _tags(cells, c))
    for (name, residual, _), t in seen.items():
        lines.append(f"| {name} | {residual} | {t['version'] or '–'} | {t['plan']} |")
    return "\n".join(lines)


def _own(c) -> int:
    """A candidate's own residual window."""
    return c.scheme.residual if c.scheme is not None else c.recipe.residual


if __name__ == "__main__":
    main()
