"""Massive activations in the residual stream, and the sink predictor built on them.

Per decoder layer (its output h [T, E], one window and layer at a time) the meter keeps the
max |h| of every dimension, the median |h| of each window (over every MEDIAN_STRIDE-th entry: a
full sort costs as much as the layer), and, sparsely, every entry with |h| >= FLOOR x that
window's median. A layer's massive dims are those whose max |h| reaches `ratio` x its
median |h| (the mean of the window medians; Sun et al., "Massive activations in LLMs", 2024).

Sink predictor (KVSink, Su & Yuan 2025): flag a token when max over `dims` of |h| after decoder
layer `layer` exceeds `threshold`. For every layer with massive dims and every candidate dim set
(each massive dim alone, then all of them) the threshold that maximizes F1 against the attention
ground truth (judged positions of every window; see sinks.py) is found by sorting the scores;
the predictor is the earliest layer whose best F1 is within F1_SLACK of the best of all layers
(earlier is cheaper online), with its best dim set. Scores come from the sparse entries, so
they are exact above floor = FLOOR x the layer's largest window median, and every threshold is
kept above that floor. Held-out quality: two folds (even / odd windows), each fitted on one half
and scored on the other, counts pooled.
"""

import math

import torch

from kvcalib_runtime.cache.scheme import SinkPredictor

FLOOR = 20.0
F1_SLACK = 0.02
MEDIAN_STRIDE = 11  # divides no common hidden size, so every dim is sampled


class MassiveMeter:
    """Accumulates residual-stream magnitudes of every decoder layer, one (window, layer) at a
    time in any order (window by window in memory, layer by layer from shards)."""

    def __init__(self, num_layers: int, hidden: int):
        self.max_abs = torch.zeros(num_layers, hidden)
        # (window, layer) -> (median |h|, int32 [4, n] window/layer/position/dim, float32 [n])
        self.chunks = {}

    def add(self, window: int, layer: int, hidden: torch.Tensor) -> None:
        """One layer's output in one window: hidden float32 [T, E] on the CPU."""
        a = hidden.abs()
        self.max_abs[layer] = torch.maximum(self.max_abs[layer], a.amax(0))
        median = a.reshape(-1)[::MEDIAN_STRIDE].median()
        pos, dim = (a >= FLOOR * median).nonzero(as_tuple=True)
        where = torch.stack((torch.full_like(pos, window), torch.full_like(pos, layer), pos, dim))
        self.chunks[window, layer] = (median, where.int(), a[pos, dim])

    def update(self, hidden: torch.Tensor) -> None:
        """The next window, every layer: hidden float32 [L, T, E]."""
        window = 1 + max((w for w, _ in self.chunks), default=-1)
        for layer, h in enumerate(hidden):
            self.add(window, layer, h)

    def result(self, ratio: float) -> "Massive":
        keys = sorted(self.chunks)  # window-major, whatever order they came in
        num_layers = len(self.max_abs)
        medians = torch.stack([self.chunks[k][0] for k in keys]).view(-1, num_layers)  # [N, L]
        return Massive(
            max_abs=self.max_abs,
            median=medians.mean(0),
            floor=FLOOR * medians.amax(0),
            index=torch.cat([self.chunks[k][1] for k in keys], 1),
            value=torch.cat([self.chunks[k][2] for k in keys]),
            windows=len(medians),
            ratio=ratio,
        )


class Massive:
    """What the meter found: massive dims per layer, who carries them, and the sink predictor.

    max_abs [L, E], median [L], floor [L]; index [4, n] and value [n] the sparse entries.
    """

    def __init__(self, *, max_abs, median, floor, index, value, windows: int, ratio: float):
        self.max_abs, self.median, self.floor = max_abs, median, floor
        self.index, self.value, self.windows, self.ratio = index, value, windows, ratio
        big = max_abs >= ratio * median[:, None]
        self.dims = [row.nonzero().flatten().tolist() for row in big]  # per layer
        self._layers = {}  # (layer, T) -> its entries (flat position, dim, value) for `scores`

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"massive.max_abs": self.max_abs, "massive.median_abs": self.median}

    def carriers(self, layer: int, ids: torch.Tensor, decode, limit: int = 5) -> list:
        """[token text, count] of the tokens carrying layer `layer`'s massive values."""
        w, lay, pos, dim = self.index
        hit = (lay == layer) & torch.isin(dim, torch.tensor(self.dims[layer], dtype=dim.dtype))
        hit &= self.value >= self.ratio * self.median[layer]
        counts = {}
        for ww, tt in sorted({(int(a), int(b)) for a, b in zip(w[hit], pos[hit], strict=True)}):
            text = decode(ids[ww, tt])
            counts[text] = counts.get(text, 0) + 1
        return [[k, v] for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:limit]]

    def scores(self, layer: int, dims, seq_len: int) -> torch.Tensor:
        """max over `dims` of |h| after `layer`, float32 [N, T] (0 where below the floor)."""
        if (layer, seq_len) not in self._layers:  # the fits score a layer's dim sets many times
            w, lay, pos, dim = self.index
            mine = lay == layer
            where = w[mine].long() * seq_len + pos[mine]
            self._layers[layer, seq_len] = (where, dim[mine], self.value[mine])
        where, dim, value = self._layers[layer, seq_len]
        hit = torch.isin(dim, torch.tensor(dims, dtype=dim.dtype))
        flat = torch.zeros(self.windows * seq_len)
        flat.scatter_reduce_(0, where[hit], value[hit], "amax")
        return flat.view(self.windows, seq_len)

    def fit(self, flags: torch.Tensor, judged: torch.Tensor) -> dict | None:
        """The sink predictor and its quality against flags bool [N, T] on judged bool [T]
        (JSON-ready), or None when no layer has massive dims that separate any sink."""
        every = torch.ones(self.windows, dtype=torch.bool)
        best = self._fit(flags, judged, every)
        if best is None:
            return None
        predictor, _ = best
        tp, fp, fn = self._count(predictor, flags, judged, every)
        out = {
            "layer": predictor.layer,
            "dims": list(predictor.dims),
            "threshold": predictor.threshold,
            **_quality(tp, fp, fn),
            "held_out": None,
        }
        if self.windows >= 2:
            pooled = torch.zeros(3)
            parity = torch.arange(self.windows) % 2 == 0
            for train in (parity, ~parity):
                fold = self._fit(flags, judged, train)
                if fold is not None:
                    pooled += torch.tensor(self._count(fold[0], flags, judged, ~train))
                else:  # nothing to fit on this half: every sink of the other half is missed
                    pooled[2] += int(flags[~train][:, judged].sum())
            out["held_out"] = _quality(*pooled.tolist())
        return out

    def _fit(self, flags, judged, windows) -> tuple[SinkPredictor, float] | None:
        seq_len = flags.shape[1]
        y = flags[windows][:, judged].flatten()
        if not y.any():
            return None
        found = []  # (f1, predictor): the best dim set of each layer, in layer order
        for layer, dims in enumerate(self.dims):
            sets = [[d] for d in dims] + ([dims] if len(dims) > 1 else [])
            best = None
            for ds in sets:
                s = self.scores(layer, ds, seq_len)[windows][:, judged].flatten()
                cut = _best_cut(s, y, float(self.floor[layer]))
                if cut is not None and (best is None or cut[0] > best[0]):
                    best = (cut[0], SinkPredictor(layer, tuple(ds), cut[1]))
            if best is not None:
                found.append(best)
        if not found:
            return None
        top = max(f1 for f1, _ in found)
        f1, predictor = next(f for f in found if f[0] >= top - F1_SLACK)
        return predictor, f1

    def _count(self, predictor: SinkPredictor, flags, judged, windows) -> tuple[int, int, int]:
        s = self.scores(predictor.layer, list(predictor.dims), flags.shape[1])
        hit = (s > predictor.threshold)[windows][:, judged]
        y = flags[windows][:, judged]
        return int((hit & y).sum()), int((hit & ~y).sum()), int((~hit & y).sum())


def _best_cut(s: torch.Tensor, y: torch.Tensor, floor: float) -> tuple[float, float] | None:
    """(F1, threshold) of the best rule `s > threshold` for labels y, threshold >= floor."""
    order = s.argsort(descending=True, stable=True)
    s, y = s[order], y[order].double()
    after = torch.cat((s[1:], s.new_zeros(1)))
    tp = y.cumsum(0)
    f1 = 2 * tp / (torch.arange(1, len(s) + 1) + y.sum())
    valid = (s > after) & (s > floor)
    if not valid.any():
        return None
    i = int(torch.where(valid, f1, -1.0).argmax())
    return float(f1[i]), math.sqrt(float(s[i]) * max(float(after[i]), floor))


def _quality(tp: float, fp: float, fn: float) -> dict:
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return {"precision": round(precision, 4), "recall": round(recall, 4), "f1": round(f1, 4)}
