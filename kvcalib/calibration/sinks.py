"""Attention sinks, measured on the attention weights of every layer.

For one window, layer and query head h, with weights p [H, T, T] (query i, key j):

    received[h, j] = mean over queries i >= j      of p[h, i, j]   (every query that sees j)
    distant[h, j]  = mean over queries i >= j + r  of p[h, i, j]   (r = local span, below)

`received` is what the profile stores (token 0's is `token0_attention`). Sinks are judged on
`distant`, so that heads attending to the previous few tokens do not make every late position
look like a sink: position j is a sink of a layer when the head mean of distant[:, j] exceeds
max(weight, ratio * u(j)), u(j) = mean over i >= j + r of 1 / (i + 1) being what uniform
attention would give it, and a sink of the window when that holds in at least `min_layers`
layers. r = min(16, T // 32); positions with fewer than max(2r, 8) distant queries are not judged
(flag False, and left out when the sink predictor is scored).
"""

import torch

LOCAL_MAX = 16
MIN_QUERIES = 8


def local_span(seq_len: int) -> int:
    """r: queries closer than this to a key do not count towards its sink weight."""
    return min(LOCAL_MAX, seq_len // 32)


class SinkMeter:
    """Accumulates received attention over windows and flags each window's sink positions."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        seq_len: int,
        *,
        weight: float,
        ratio: float,
        min_layers: int,
        windows: int = 1,
    ):
        t = seq_len
        self.local = local_span(t)
        i = torch.arange(t)
        self.count_all = (t - i).float()
        self.count_far = (t - i - self.local).clamp_min(0).float()
        self.judged = self.count_far >= max(2 * self.local, MIN_QUERIES)  # bool [T]
        inv = 1.0 / (i + 1).double()
        tail = inv.flip(0).cumsum(0).flip(0)  # tail[j] = sum over i >= j of 1 / (i + 1)
        start = (i + self.local).clamp_max(t - 1)
        uniform = (tail[start] / self.count_far.double().clamp_min(1)).float()
        self.limit = torch.clamp(ratio * uniform, min=weight)  # [T]
        self.min_layers = min_layers
        self.received = torch.zeros(num_layers, num_heads, t, dtype=torch.float64)
        # the open windows: one at a time in memory, all of them from shards (layer by layer)
        self.distant = torch.zeros(windows, num_layers, num_heads, t)
        self.token0 = torch.zeros(num_layers)  # windows in which token 0 is a sink, per layer
        self.flags, self.layers, self.weights = [], [], []

    def observe(self, layer: int, probs: torch.Tensor, window: int = 0) -> None:
        """One layer of an open window (0 ... windows - 1): probs [..., T, T] (query, key),
        heads leading. Each layer sees the windows in order."""
        t, r = probs.shape[-1], self.local
        p = probs.reshape(-1, t, t).float().contiguous()
        total = p.sum(-2)
        # p[h, j + o, j] for o < r and j <= T - r: a strided view of r diagonals, no T x T mask.
        # Later keys have no distant queries (not judged): their near weight is all of it.
        near = total.clone() if r else torch.zeros_like(total)
        if r:
            band = p.as_strided((len(p), t - r + 1, r), (t * t, t + 1, t))
            near[:, : t - r + 1] = band.sum(-1)
        self.received[layer] += (total / self.count_all).double()
        self.distant[window, layer] = (total - near) / self.count_far.clamp_min(1)

    def end_window(self, window: int = 0) -> torch.Tensor:
        """Close an open window, every layer observed: its sink flags, bool [T]. Windows close
        in order."""
        mean = self.distant[window].mean(1)  # [L, T]
        sink = (mean > self.limit) & self.judged  # [L, T]
        self.token0 += sink[:, 0]
        layers = sink.sum(0)
        flags = layers >= self.min_layers
        self.flags.append(flags)
        self.layers.append(layers.int())
        self.weights.append(mean.amax(0))
        return flags

    def result(self) -> dict[str, torch.Tensor]:
        """Profile tensors; see kvcalib.core.profile for their names and shapes."""
        received = (self.received / len(self.flags)).float()
        return {
            "attention.received": received,
            "attention.token0": received[:, :, 0].contiguous(),
            "sinks.token0": self.token0 / len(self.flags),
            "sinks.flags": torch.stack(self.flags).to(torch.uint8),
            "sinks.layers": torch.stack(self.layers),
            "sinks.weight": torch.stack(self.weights),
            "sinks.judged": self.judged.to(torch.uint8),
        }


def later_sinks(tensors: dict, ids: torch.Tensor, decode, limit: int = 40) -> dict:
    """The JSON summary of sinks after token 0: each one (heaviest first, at most `limit`) and
    per token text; ids [N, T] are the calibration windows."""
    flags = tensors["sinks.flags"].bool()
    layers, weight = tensors["sinks.layers"], tensors["sinks.weight"]
    found = []
    for w, t in flags[:, 1:].nonzero().tolist():
        t += 1
        found.append(
            {
                "window": w,
                "position": t,
                "token": decode(ids[w, t]),
                "layers": int(layers[w, t]),
                "weight": round(float(weight[w, t]), 4),
            }
        )
    found.sort(key=lambda s: -s["weight"])
    by_token = {}
    for s in found:
        entry = by_token.setdefault(s["token"], {"token": s["token"], "count": 0, "weight": 0.0})
        entry["count"] += 1
        entry["weight"] += s["weight"]
    tokens = sorted(by_token.values(), key=lambda e: -e["count"])
    for e in tokens:
        e["weight"] = round(e["weight"] / e["count"], 4)
    return {
        "token0_windows": int(flags[:, 0].sum()),
        "windows": int(flags.shape[0]),
        "later_windows": int(flags[:, 1:].any(1).sum()),
        "count": len(found),
        "positions": found[:limit],
        "tokens": tokens[:limit],
    }
