"""The default calibration's cost model: the arithmetic of each phase in forwards over the
calibration tokens, from a model's shape alone (no weights), for each of the answer probe's modes
(`kvcalib calibrate --answer-probe screen`, the default, `cut` and `all`).

    python benchmarks/calibration_cost.py [--json benchmarks/calibration-cost/predicted.json]

A decoder layer's parameters per token (attention and a gated MLP) and the head's (hidden x
vocab) price each phase as its progress bar counts it (kvcalib.calibration: observe, gradients,
answerprobe.work); with L layers, R prompts of T' tokens and A answer tokens, p probes a layer
(2 tensors x the widths measured), N windows of T tokens and W gradient windows:

    forward   N T (L layer + head)
    stats     N T L layer                                   (an observed forward, no head)
    gradients 3 W T (L layer + head)                        (a recomputed forward + backward)
    retrieval R T' (l + 1) layer                            (to the sink predictor's layer l)
    probe     R T' L layer + (A - R) [(L + p L (L + 1) / 2) layer + (1 + p L) head]
              + with the screen, (A - R) s [(L + 1) / 2 layer + head], s = ceil(2 L / 3)

The vector codebooks' k-means is not parameter work: 2 variants x L x Hkv codebooks of 2**6
entries fitted to 2**14 four-channel vectors, 25 steps (vectorbooks.py). Measured seconds per
phase differ from this arithmetic by the attention (not counted) and by how well each phase's
matrix products fill the cores (bench_calibrate.py measures them); the ratios between models
and between the cut and the full probe are what the model predicts.
"""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from kvcalib.calibration import Settings, answerprobe
from kvcalib.calibration.gradients import BACKWARD

# name: (layers, hidden, heads, kv heads, head dim, intermediate, vocab, sink predictor layer)
SHAPES = {
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, 1),
    "qwen2.5-0.5b": (24, 896, 14, 2, 64, 4864, 151936, 1),
    "32 layers, 8 KV heads (Llama-3-8B's shape)": (32, 4096, 32, 8, 128, 14336, 128256, 1),
}
N, T, W = 16, 512, Settings().sensitivity_windows  # windows, tokens, gradient windows
R, T_PROMPT = Settings().retrieval_prompts, Settings().retrieval_tokens  # retrieval prompts
A = R * 332 / 16  # their answer tokens (SmolLM2's: 332 in the first 16 prompts)


class Shape:
    """A LayerSource's `work` and `config` from a model's shape."""

    def __init__(self, layers, hidden, heads, kv, head_dim, inter, vocab, sink_layer):
        attention = hidden * head_dim * (2 * heads + 2 * kv)
        self.layer, self.head = attention + 3 * hidden * inter, hidden * vocab
        self.config = SimpleNamespace(num_hidden_layers=layers)
        self.kv, self.sink_layer = kv, sink_layer

    def work(self):
        return self.layer, self.head


def phases(s: Shape, mode: str) -> dict[str, float]:
    """Each phase's arithmetic in forwards over the N x T calibration tokens."""
    n = s.config.num_hidden_layers
    forward = N * T * (n * s.layer + s.head)
    out = {
        "stats": N * T * n * s.layer,
        "gradients": BACKWARD * W * T * (n * s.layer + s.head),
        "retrieval": R * T_PROMPT * (s.sink_layer + 1) * s.layer,
        "answer probe": answerprobe.work(s, R, T_PROMPT, A, mode),
    }
    return {k: v / forward for k, v in out.items()}


def predictions() -> list[dict]:
    """Every shape and probe mode: its phases in forwards (what --json writes)."""
    out = []
    for name, shape in SHAPES.items():
        for mode in answerprobe.MODES:
            p = phases(Shape(*shape), mode)
            out.append(
                {"model": name, "mode": mode, "phases": {k: round(v, 3) for k, v in p.items()}}
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the predictions")
    args = parser.parse_args()
    rows = predictions()
    for r in rows:
        parts = "  ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
        print(
            f"{r['model']}, --answer-probe {r['mode']}: {sum(r['phases'].values()):.1f}x  ({parts})"
        )
    if args.json:
        settings = {"retrieval_prompts": R, "retrieval_tokens": T_PROMPT, "windows": N, "tokens": T}
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
