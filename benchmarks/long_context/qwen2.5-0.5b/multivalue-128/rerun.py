"""The suite's multi-value prompts at Qwen 4K (the committed cells' prompts, sha checked), answered
again through the same caches with RULER's 128-token budget instead of the suite's 48: only the
budget differs (the prompt keeps its 48 tokens of room). One record per prompt, beside this file;
a prompt already recorded is skipped. (The records were scored on 2026-12-04 with kvcalib-2 and
kvcalib-2-vbyte, which became kvcalib-2 that day: renamed to these names.)

    python benchmarks/long_context/qwen2.5-0.5b/multivalue-128/rerun.py 5,7,19,29,10,17,21,16
"""

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
QWEN = ROOT / "benchmarks" / "long_context" / "qwen2.5-0.5b"
RECIPES = ["fp16", str(QWEN / "variants" / "kvcalib-2-codebook.toml"), "kvcalib-2"]
BUDGET = 128  # RULER's niah tasks (lm-eval's ruler/niah_single_1.yaml max_gen_toks)


def main() -> None:
    from kvcalib.evaluation import longcontext

    spec = importlib.util.spec_from_file_location("lc", ROOT / "benchmarks" / "long_context.py")
    lc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lc)
    profile = str(QWEN / "profile")
    args = argparse.Namespace(threads=1, model="qwen2.5-0.5b", split=[], profile=profile)
    model, tokenizer, every, tags = lc._setup(args, RECIPES)
    hay = longcontext.haystack(tokenizer)
    sinks, stop = longcontext.sinks_read(every), longcontext.stop_tokens(tokenizer)
    for seed in map(int, sys.argv[1].split(",")):
        path = HERE / f"{seed}.json"
        if path.exists():
            continue
        sample = longcontext.build(tokenizer, hay, "multivalue", 4096, seed, None)
        committed = json.loads((QWEN / "cells" / "multivalue-4096" / f"{seed}.json").read_text())
        assert committed["sha"] == lc._sha(sample.ids), f"prompt {seed} is not the committed one"
        longer = dataclasses.replace(sample, max_new_tokens=BUDGET)
        prefill = longcontext.Prefill(model, torch.tensor([sample.ids]), sinks)
        records = {}
        for c in every:
            start = time.perf_counter()
            answer = longcontext._answer(model, tokenizer, c, prefill, longer, stop)
            before = committed["recipes"].get(c.name, {})
            records[c.name] = {
                "correct": longer.correct(answer),
                "answer": answer,
                "found": sum(e in answer for e in sample.expected),
                "committed_correct": before.get("correct"),
                "plan_matches": before.get("plan") == tags[c.name],
                "seconds": time.perf_counter() - start,
            }
            print(seed, c.name, records[c.name]["correct"], repr(answer[:100]), flush=True)
        path.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
