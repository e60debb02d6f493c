"""Streaming per-channel statistics of one KV tensor kind, with exact tail quantiles.

A `ChannelStats` sees every layer's keys (before or after RoPE) or values of one calibration
window at a time, x [L, H, T, D], with the window's sink flags [T], and keeps per channel over
all tokens ("all") and over non-sink tokens ("nonsink"): min, max, absmax, mean, std (Bessel-
corrected; each window's moments are merged in float64) and the quantiles at QUANTILE_LEVELS.

The tails are exact, not sketched: the running top-k and bottom-k values of every channel are
carried, k = ceil(2.5% of all calibration tokens) + 1 (the + 1 holds the upper neighbour that
linear interpolation needs), so quantile(q) for q <= 2.5% or >= 97.5% equals torch.quantile on
the concatenated data. Only non-sink tokens go through the top-k merge; sink tokens (a few per
window) are kept aside and merged once at the end for the "all" scope.

`range_ratio` and `outlier_list` name the channels whose range stands out from their head's.
"""

import math

import torch

from kvcalib.core.profile import QUANTILE_LEVELS

TAIL = 0.025


class ChannelStats:
    """Per-channel statistics of x [L, H, T, D] over windows; see the module docstring."""

    def __init__(self, shape: tuple[int, int, int], total_tokens: int):
        self.k = math.ceil(TAIL * total_tokens) + 1
        self.nonsink, self.sink = _Moments(shape), _Moments(shape)
        empty = torch.empty(*shape, 0)
        self.top, self.bottom = empty, empty  # non-sink tails [L, H, D, <= k], unsorted
        self.sink_top, self.sink_bottom = empty, empty  # sink tokens' values [L, H, D, <= 2k]

    def update(self, x: torch.Tensor, sinks: torch.Tensor) -> None:
        """Add one window: x [L, H, T, D] (any float dtype), sinks bool [T]."""
        rows = x.float().transpose(2, 3)  # [L, H, D, T]
        kept = rows[..., ~sinks]  # contiguous [L, H, D, T']
        self.nonsink.add(kept)
        self.top = _merge(self.top, kept, self.k, largest=True)
        self.bottom = _merge(self.bottom, kept, self.k, largest=False)
        if sinks.any():
            dropped = rows[..., sinks]
            self.sink.add(dropped)
            self.sink_top = _append(self.sink_top, dropped, self.k, largest=True)
            self.sink_bottom = _append(self.sink_bottom, dropped, self.k, largest=False)

    def result(self) -> dict[str, torch.Tensor]:
        """{f"{scope}.{stat}": float32 [L, H, D] (quantiles: [L, H, D, len(QUANTILE_LEVELS)])}."""
        scopes = {
            "nonsink": (self.nonsink, self.bottom, self.top),
            "all": (
                self.nonsink.merged(self.sink),
                _merge(self.bottom, self.sink_bottom, self.k, largest=False),
                _merge(self.top, self.sink_top, self.k, largest=True),
            ),
        }
        out = {}
        for scope, (moments, bottom, top) in scopes.items():
            out[f"{scope}.min"] = moments.min
            out[f"{scope}.max"] = moments.max
            out[f"{scope}.absmax"] = torch.maximum(moments.min.abs(), moments.max.abs())
            out[f"{scope}.mean"] = moments.mean.float()
            out[f"{scope}.std"] = (moments.m2 / max(moments.n - 1, 1)).sqrt().float()
            out[f"{scope}.quantiles"] = _quantiles(bottom, top, moments.n)
        return out


class _Moments:
    """Count, mean and sum of squared deviations (float64), min and max per row, combined
    window by window with Chan et al.'s parallel update (no E[x^2] - E[x]^2 cancellation)."""

    def __init__(self, shape):
        self.n = 0
        self.mean = torch.zeros(shape, dtype=torch.float64)
        self.m2 = torch.zeros(shape, dtype=torch.float64)
        self.min = torch.full(shape, math.inf)
        self.max = torch.full(shape, -math.inf)

    def add(self, rows: torch.Tensor) -> None:
        """rows [..., m]: m new values per row."""
        m = rows.shape[-1]
        if m == 0:
            return
        var, mean = torch.var_mean(rows, dim=-1, correction=0)
        lo, hi = torch.aminmax(rows, dim=-1)
        self._combine(m, mean.double(), var.double() * m, lo, hi)

    def merged(self, other: "_Moments") -> "_Moments":
        out = _Moments(self.mean.shape)
        out._combine(self.n, self.mean, self.m2, self.min, self.max)
        if other.n:
            out._combine(other.n, other.mean, other.m2, other.min, other.max)
        return out

    def _combine(self, m: int, mean, m2, lo, hi) -> None:
        n = self.n + m
        delta = mean - self.mean
        self.mean = self.mean + delta * (m / n)
        self.m2 = self.m2 + m2 + delta.square() * (self.n * m / n)
        self.n = n
        self.min = torch.minimum(self.min, lo)
        self.max = torch.maximum(self.max, hi)


def _merge(carry: torch.Tensor, new: torch.Tensor, k: int, *, largest: bool) -> torch.Tensor:
    """The k largest (smallest) of carry and new along the last dim, unsorted."""
    both = torch.cat((carry, new), -1)
    if both.shape[-1] <= k:
        return both
    return both.topk(k, -1, largest=largest, sorted=False).values


def _append(store: torch.Tensor, new: torch.Tensor, k: int, *, largest: bool) -> torch.Tensor:
    """Sink values: appended, cut back to the k most extreme only when the store passes 2k."""
    store = torch.cat((store, new), -1)
    return _merge(store[..., :0], store, k, largest=largest) if store.shape[-1] > 2 * k else store


def _quantiles(bottom: torch.Tensor, top: torch.Tensor, n: int) -> torch.Tensor:
    """[L, H, D, len(QUANTILE_LEVELS)] from the carried tails of n values, interpolated exactly
    as torch.quantile does (rank = q (n - 1) in float32, lerp between its floor and ceil)."""
    ascending = bottom.sort(-1).values  # the smallest values, index i = rank i
    descending = top.sort(-1, descending=True).values  # index i = rank n - 1 - i
    out = []
    for q in QUANTILE_LEVELS:
        rank = torch.tensor(q, dtype=torch.float32) * (n - 1)
        below, above = int(rank.floor()), int(rank.ceil())
        weight = rank - below
        if q <= 0.5:
            a, b = ascending[..., below], ascending[..., above]
        else:
            a, b = descending[..., n - 1 - below], descending[..., n - 1 - above]
        out.append(torch.lerp(a, b, weight))
    return torch.stack(out, -1)


def range_ratio(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Range of each channel over its head's median channel range: [..., H, D] -> [..., H, D]
    (median: the lower middle value for even D). Channels above R are outlier channels."""
    width = hi - lo
    median = width.median(-1, keepdim=True).values
    return width / median.clamp_min(torch.finfo(width.dtype).tiny)


def outlier_list(ratios: torch.Tensor, ratio: float) -> list[list[list[float]]]:
    """Per head, the [channel, ratio] pairs above `ratio`, largest first: ratios [H, D]."""
    out = []
    for head in ratios:
        idx = (head > ratio).nonzero().flatten()
        order = head[idx].argsort(descending=True)
        out.append([[int(c), round(float(head[c]), 2)] for c in idx[order]])
    return out
