"""How well one exact slot per token and head covers KVQuant's key outliers on the evaluation texts.

KVQuant keeps every pre-RoPE key element outside its calibrated per-channel range (the range
that leaves 1% of the calibration values out) in a sparse matrix; the kvquant-{2,3} presets keep
a fixed K = 1 slot per (token, KV head), the element farthest outside, and clamp the others. For
every layer this counts, over the key vectors of the text (token 0 excluded: both keep it exact),
how many channels fall outside the range the preset uses (kvcalib.core.plan: the profile's
non-sink range with outliers = 0.01):

    outside        fraction of key elements outside their channel's range (KVQuant: ~1%)
    vectors > K    fraction of (token, head) vectors with more than K elements outside
    clamped        fraction of the outside elements that no slot keeps (they are clamped)

    python benchmarks/bench_coverage.py --profile DIR [--windows 4] [--seq-len 1024] [--slots 1]
"""

import argparse

import torch

from kvcalib import load_model
from kvcalib.api import default_profile
from kvcalib.core.data import eval_windows
from kvcalib.core.models import resolve
from kvcalib.core.recipe import load_recipe
from kvcalib.sim.hooks import Hooks, capture_keys, key_module

TEXTS = {"pydoc": None, "licenses": "builtin:licenses", "chat": "builtin:chat"}


def coverage(model, profile, ids: torch.Tensor, outliers: float, slots: int) -> dict[str, float]:
    """The three fractions of the module docstring over windows ids [W, T]."""
    n = model.config.num_hidden_layers
    outside = elements = vectors = over = clamped = 0
    for window in ids:
        keys = {}
        with Hooks(model) as hooks, torch.no_grad():
            for i in range(n):
                hooks.forward(key_module(model, i), capture_keys(model, keys, i))
            model(window[None])
        for i in range(n):
            k = keys[i][0, :, 1:].float()  # [Hkv, T - 1, D] pre-RoPE, token 0 left out
            lo, hi = profile.range("key", i, position="pre_rope", outliers=outliers)
            out = ((k < lo[:, None]) | (k > hi[:, None])).sum(-1)  # [Hkv, T - 1]
            outside += int(out.sum())
            elements += k.numel()
            vectors += out.numel()
            over += int((out > slots).sum())
            clamped += int((out - slots).clamp_min(0).sum())
    return {
        "outside": outside / elements,
        "vectors > K": over / vectors,
        "clamped": clamped / max(outside, 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="Profile folder (default: cached).")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=None, help="K (default: kvquant-3's).")
    args = parser.parse_args()
    key = load_recipe("kvquant-3").key
    slots = args.slots if args.slots is not None else key.outlier_slots
    model, tokenizer = load_model(None, dtype=torch.float32)
    profile = default_profile(resolve(None), args.profile)
    print(
        f"kvquant keys: pre-RoPE static ranges with outliers = {key.outliers}, K = {slots} slot(s) "
        f"per (token, KV head); {args.windows} windows x {args.seq_len} tokens per text"
    )
    print("| text | outside | vectors > K | clamped |\n|---|---|---|---|")
    for text, data in TEXTS.items():
        ids = eval_windows(tokenizer, data, windows=args.windows, seq_len=args.seq_len)
        c = coverage(model, profile, ids, key.outliers, slots)
        print(f"| {text} | " + " | ".join(f"{v:.2%}" for v in c.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
