"""Two profiles' per-layer sensitivities against each other (issue 16's check of the Fisher
estimate against the direct probe): Spearman rank correlation over every (tensor, layer) at
each calibrated width, for keys and values apart, and how many of the six most sensitive each
names alike.

    kvcalib calibrate -o fisher/                                  # the default: Fisher
    kvcalib calibrate -o probe/ --sensitivity probe --sensitivity-windows 1
    python benchmarks/compare_sensitivity.py fisher/ probe/
"""

import argparse

import torch

from kvcalib.core.profile import Profile

WIDTHS = (2, 3, 4, 8)
TOP = 6


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation of two 1-D tensors without ties (sensitivities are continuous)."""
    ra, rb = (x.argsort().argsort().double() for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", help="profile folder (e.g. the Fisher estimate)")
    parser.add_argument("second", help="profile folder (e.g. the probe)")
    args = parser.parse_args()
    first, second = Profile.load(args.first), Profile.load(args.second)
    layers = first.meta["model"]["num_layers"]
    print("| width | all | keys | values | top-6 shared |\n|---|---:|---:|---:|---:|")
    for bits in WIDTHS:
        a, b = (
            torch.tensor(
                [p.sensitivity(t, i, bits) for t in ("key", "value") for i in range(layers)],
                dtype=torch.float64,
            )
            for p in (first, second)
        )
        shared = set(a.topk(TOP).indices.tolist()) & set(b.topk(TOP).indices.tolist())
        keys, values = slice(0, layers), slice(layers, None)
        print(
            f"| {bits} bits | {spearman(a, b):.2f} | {spearman(a[keys], b[keys]):.2f} | "
            f"{spearman(a[values], b[values]):.2f} | {len(shared)} of {TOP} |"
        )


if __name__ == "__main__":
    main()
