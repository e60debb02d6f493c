"""Regenerate the leaderboard: every preset, both modes, three texts, passkey, and the ablation
of kvcalib-2's ingredients, on the default model in fp32.

    python benchmarks/leaderboard.py [--profile DIR] [--windows 4] [--seq-len 1024]

Writes benchmarks/leaderboard.md (the tables the README quotes) and benchmarks/leaderboard.json
(every Result, with its text and mode). Without --profile the default calibration is used
(computed once and cached, as `kvcalib eval` does). The texts: the built-in evaluation split of
Python's documentation, `builtin:licenses` (legal English, not calibration text) and
`builtin:chat` (evaluation topics as multi-turn chats in the model's template, where later sinks
appear at turn boundaries). External peers (hf-quanto) run only in decode mode, through their own
cache. About 45 minutes on 2 CPU cores.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kvcalib import load_model
from kvcalib.evaluation import Result, candidates, format_table, score
from kvcalib.models import resolve
from kvcalib.passkey import passkey_accuracy
from kvcalib.profile import ensure_profile
from kvcalib.recipe import load_recipe, presets

HERE = Path(__file__).resolve().parent
TEXTS = {"pydoc": None, "licenses": "builtin:licenses", "chat": "builtin:chat"}
MODES = ("decode", "fake")


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


def _record(rows, results: list[Result], text: str, table: str) -> None:
    for r in results:
        rows.append({"table": table, "text": text, **r.to_json()})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="Profile folder (default: cached).")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", default=str(HERE), help="Folder for leaderboard.md / .json.")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    start = time.time()
    model, tokenizer = load_model(None, dtype=torch.float32)
    profile = ensure_profile(resolve(None), args.profile)
    setup = (
        f"SmolLM2-135M-Instruct (GGUF, dequantized), fp32, CPU; {args.windows} windows x "
        f"{args.seq_len} tokens per text; profile: default `kvcalib calibrate` "
        f"(16 x 512 tokens of the built-in calibration text)"
    )
    rows, md = [], [f"Setup: {setup}.", ""]
    everything = candidates(model, presets(), profile)
    for text, data in TEXTS.items():
        for mode in MODES:
            chosen = [c for c in everything if c.scheme is not None or mode == "decode"]
            results = score(
                model, tokenizer, chosen, data=data, seq_len=args.seq_len,
                windows=args.windows, mode=mode, progress=False,
            )  # fmt: skip
            _record(rows, results, text, "leaderboard")
            md += [f"### {text}, {mode} mode", "", format_table(results), ""]
            print(f"{text} {mode}: {time.time() - start:.0f}s", flush=True)
    md += ["### passkey retrieval (decode, needle at depths 10/50/90%)", ""]
    md += ["| recipe | " + " | ".join(f"{n} tokens" for n in (1024, 2048, 4096)) + " |"]
    md += ["|---|---|---|---|"]
    for c in everything:
        acc = passkey_accuracy(model, tokenizer, c)
        rows.append({"table": "passkey", "recipe": c.name, "passkey": acc})
        md.append(f"| {c.name} | " + " | ".join(f"{v:.0%}" for v in acc.values()) + " |")
    print(f"passkey: {time.time() - start:.0f}s", flush=True)
    md += [""]
    abl = candidates(model, ablations(), profile)
    for mode in MODES:
        results = score(
            model, tokenizer, abl, seq_len=args.seq_len, windows=args.windows, mode=mode,
            progress=False,
        )  # fmt: skip
        _record(rows, results, "pydoc", f"ablation-{mode}")
        md += [f"### ablation of kvcalib-2, pydoc, {mode} mode", "", format_table(results), ""]
    md += [f"Total: {(time.time() - start) / 60:.0f} min."]
    out = Path(args.out)
    (out / "leaderboard.md").write_text("\n".join(md) + "\n")
    (out / "leaderboard.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
