"""Which positions a quantized cache keeps exact in its sink slots, and their copies there.

A position becomes a sink when it is among the first `sinks_first` of its sequence, or when the
sink predictor flags it (`scheme.SinkPredictor`) while predicted sinks are fewer than
`sink_budget`, in position order. Slot s < sinks_first holds position s; predicted sinks take
the following slots in the order they came. The buffers (`QuantizedCache.sink_k`, `sink_v`,
`sink_pos`, `is_sink`; shapes in kvcache's module docstring) belong to the cache; these
functions decide and write in them.
"""

import torch


def decide(sink_pos, is_sink, lengths: list[int], T: int, flags, first: int, budget: int):
    """A commit of T tokens per sequence after `lengths` (host): first-N positions, then
    predicted ones (flags bool [B, T] on the CPU, or None) while the budget lasts, marked in
    `sink_pos` and `is_sink`. Returns every sequence's sink positions (host)."""
    pos = torch.tensor(lengths)[:, None] + torch.arange(T)  # [B, T]
    held = sink_pos.cpu()
    sink, slot = pos < first, pos.clone()
    if flags is not None:
        candidate = flags & ~sink
        used = (held >= first).sum(1, keepdim=True)
        rank = used + candidate.cumsum(1)  # 1-based, among predicted sinks
        taken = candidate & (rank <= budget)
        sink |= taken
        slot = torch.where(taken, first + rank - 1, slot)
    rows, cols = sink.nonzero(as_tuple=True)
    held[rows, slot[rows, cols]] = pos[rows, cols]
    sink_pos.copy_(held)
    device = is_sink.device
    is_sink[rows.to(device), pos[rows, cols].to(device)] = True
    return held.tolist()


def store(slots: torch.Tensor, positions: list[int], n: int, new: torch.Tensor) -> None:
    """A prefill's copies for one sequence and layer: its new positions [n, n + T) (new
    [Hkv, T, D]) into the slots [Hkv, S, D] that `decide` gave them (positions: each slot's
    position, host)."""
    T = new.shape[1]
    for slot, pos in enumerate(positions):
        if n <= pos < n + T:
            slots[:, slot] = new[:, pos - n]


def decide_step(sink_pos, is_sink, n: torch.Tensor, flags, first: int, budget: int, max_len: int):
    """The decision of commit(1) on the device, without host synchronization: the token at
    n [B] (each sequence's length) is a sink when n < first or flagged (flags bool [B, 1], or
    None) while the budget lasts; marked in `sink_pos` and `is_sink`. Returns (sink bool [B],
    slot int64 [B, 1]: its slot, 0 where it is no sink)."""
    sink, slot = n < first, n.clone()
    if flags is not None:
        used = (sink_pos >= first).sum(1)
        taken = flags[:, 0] & ~sink & (used < budget)
        sink, slot = sink | taken, torch.where(taken, first + used, slot)
    slot = torch.where(sink, slot, 0)[:, None]
    old = sink_pos.gather(1, slot)
    sink_pos.scatter_(1, slot, torch.where(sink[:, None], n[:, None], old))
    at = n.clamp(max=max_len - 1)[:, None]
    is_sink.scatter_(1, at, is_sink.gather(1, at) | sink[:, None])
    return sink, slot


def store_step(sink_k, sink_v, pending: dict, sink: torch.Tensor, slot: torch.Tensor) -> None:
    """Copy each staged layer's new key and value (pending: layer -> (k, v), [B, Hkv, 1, D])
    into its slot of sink_k / sink_v [L, B, Hkv, S, D] where `decide_step` made it a sink."""
    layers = sorted(pending)
    for slots, j in ((sink_k, 0), (sink_v, 1)):
        new = torch.stack([pending[i][j][:, :, 0] for i in layers])  # [L', B, Hkv, D]
        index = slot[None, :, None, :, None].expand(len(layers), -1, new.shape[2], 1,
                                                    new.shape[3])  # fmt: skip
        held = slots[layers] if len(layers) < len(slots) else slots
        kept = torch.where(sink[None, :, None, None, None], new[:, :, :, None],
                           held.gather(3, index))  # fmt: skip
        if len(layers) < len(slots):
            slots[layers] = held.scatter(3, index, kept)
        else:
            slots.scatter_(3, index, kept)
