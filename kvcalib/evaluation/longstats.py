"""Statistics for the long-context suite: what a cell of n prompts can and cannot tell apart.

Every recipe answers the same prompts (one shared full-precision prefill), so a recipe is
compared with full precision prompt by prompt (paired), not cell mean against cell mean:

    wilson(k, n)          the Wilson score 95% interval of an accuracy k/n (Wilson 1927): unlike
                          the normal interval it stays inside [0, 1] and is not empty at 0 or n
    mcnemar(b, c)         the exact McNemar test of a paired difference: b prompts full precision
                          solves and the recipe does not, c the other way round; the two-sided
                          binomial p-value of min(b, c) among b + c discordant pairs at 1/2
    paired_interval(d)    the percentile 95% interval of the mean of per-prompt differences d,
                          from BOOTSTRAP resamples of the prompts (seeded: a table reproduces)

`cell(records, reference)` turns one cell's per-prompt records into its row: n, accuracy and its
interval, mean answer NLL, distractor ranking, and against the reference (full precision) the
paired accuracy difference with its interval and McNemar p, and the paired NLL increase with its
interval.
"""

import math
import random
from collections.abc import Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
BOOTSTRAP = 2000


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar(b: int, c: int) -> float:
    """The exact two-sided McNemar p-value of b against c discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_interval(diffs: Sequence[float], *, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap 95% interval of mean(diffs), resampling prompts."""
    n = len(diffs)
    if n == 0:
        return math.nan, math.nan
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(BOOTSTRAP))
    return means[int(0.025 * BOOTSTRAP)], means[int(0.975 * BOOTSTRAP) - 1]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def cell(records: Sequence[dict], reference: Sequence[dict] | None = None) -> dict:
    """One cell's row from its per-prompt records (each with "correct", "nll", "seconds" and
    optionally "outranks"); `reference`: the reference recipe's records of the same prompts in
    the same order (full precision), for the paired columns."""
    n = len(records)
    k = sum(r["correct"] for r in records)
    low, high = wilson(k, n)
    out = {
        "samples": n,
        "accuracy": k / n,
        "low": low,
        "high": high,
        "nll": _mean([r["nll"] for r in records]),
        "seconds": _mean([r["seconds"] for r in records]),
    }
    ranked = [r["outranks"] for r in records if r.get("outranks") is not None]
    if ranked:
        out["outranks"] = sum(ranked) / len(ranked)
    if reference is not None:
        assert len(reference) == n, (len(reference), n)
        pairs = list(zip(reference, records, strict=True))
        b = sum(f["correct"] and not r["correct"] for f, r in pairs)
        c = sum(r["correct"] and not f["correct"] for f, r in pairs)
        diffs = [int(r["correct"]) - int(f["correct"]) for f, r in pairs]
        nll = [r["nll"] - f["nll"] for f, r in pairs]
        out["diff"] = (c - b) / n
        out["diff_low"], out["diff_high"] = paired_interval(diffs)
        out["mcnemar_p"] = mcnemar(b, c)
        out["nll_diff"] = _mean(nll)
        out["nll_diff_low"], out["nll_diff_high"] = paired_interval(nll)
    return out
