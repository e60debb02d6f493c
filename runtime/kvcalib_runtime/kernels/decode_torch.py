"""Decode attention in torch ops, for a cache on the CPU: `decode_attention_reference`'s result
at a fraction of its work.

The reference (the spec) dequantizes every slot of every body and scatters body, ring and sinks
into a buffer indexed by position, whatever the lengths. Here each sequence is read where it
lies: the positions both its key and value bodies hold (dequantized up to its own n_body, or an
exact body read in place), then the few after them in order (body or ring), the sink slots and
the new token, each span scored against the query separately and one softmax taken over all
of them; RoPE and the mask follow each span's positions. Attention does not depend on the order
of its keys, so the result is the reference's to rounding. A body that wraps (a sliding window's
ring of fewer slots than the sequence has positions) goes to the reference.

`dequantize` reads a body as `PackedBody.dequantize` does, bit for bit, with one table lookup per
packed byte where the codes fill whole bytes (1, 2, 4 or 8 bits; static channels and groups of a
head's row): the levels of every byte value's codes (the layout's own levels), per head (and for
static channels per byte position, scale and offset folded in), instead of unpacking codes one
by one. Keys are rotated as the reference
rotates them, bit for bit, from one table of angles per frequency set.
"""

import torch
import torch.nn.functional as F

from kvcalib_runtime.kernels.decode_attention import decode_attention_reference
from kvcalib_runtime.kernels.layout import Sinks, Stored
from kvcalib_runtime.layouts import Kind
from kvcalib_runtime.layouts.affine import PackedBody


def dequantize(body: PackedBody, dtype, b: int, n: int) -> torch.Tensor:
    """`body.dequantize(dtype, b, n)`: slots [0, n) of sequence b, [Hkv, n, D], bit for bit."""
    spec, layout = body.spec, body.layout
    if 8 % spec.bits or layout.joins_heads or layout.kind == Kind.CHANNEL:
        return body.dequantize(dtype, b, n)
    per_byte, mask = 8 // spec.bits, (1 << spec.bits) - 1
    packed = body.codes[b, :, :n]  # [H, n, bytes]
    heads, nbytes = packed.shape[0], packed.shape[2]
    byte = torch.arange(256, device=packed.device)
    codes = (byte[:, None] >> (torch.arange(per_byte, device=packed.device) * spec.bits)) & mask
    # [H, 256, per_byte]: the levels of each byte value's codes, as the layout reads them
    table = layout.levels(codes.expand(heads, -1, -1), body.levels).expand(heads, -1, -1)
    if layout.kind == Kind.STATIC:  # the channels' scale and offset folded into the table
        padded = nbytes * per_byte - body.width  # a row's last byte may hold fewer codes

        def per_code(t):  # [H, D] -> [H, bytes, 1, per_byte]
            return F.pad(t.float(), (0, padded)).view(heads, nbytes, 1, per_byte)

        table = table[:, None] * per_code(body.scale)
        if body.offset is not None:
            table = table + per_code(body.offset)  # [H, bytes, 256, per_byte]
        rows = torch.arange(heads * nbytes, device=packed.device).view(heads, 1, nbytes) * 256
    else:
        rows = torch.arange(heads, device=packed.device).view(heads, 1, 1) * 256
    index = (packed.long() + rows).view(-1)  # index_select: 3x advanced indexing's speed
    x = torch.index_select(table.reshape(-1, per_byte), 0, index)
    x = x.view(heads, packed.shape[1], nbytes * per_byte)[..., : body.width]
    if layout.kind != Kind.STATIC:
        groups = body.scale.shape[-1]
        x = x.reshape(*x.shape[:2], groups, body.width // groups)
        x = x * body.scale[b, :, :n, :, None].float()
        if body.offset is not None:
            x = x + body.offset[b, :, :n, :, None].float()
        x = x.reshape(*x.shape[:2], body.width)
    if body.slot_index is not None:
        index, delta = body.slot_index[b, :, :n], body.slot_delta[b, :, :n]
        scale = body.scale[:, None] if layout.kind == Kind.STATIC else None  # "fp8" steps
        x = layout.add_slots(x, index, delta, scale)
    return x.to(dtype)


_TABLES: dict = {}


def _rope_table(inv_freq: torch.Tensor, wide, length: int):
    """(cos, sin) [N, D] of every position below N >= length, as the reference computes each
    angle (position * inv_freq in `wide`, both halves): one table per frequency set, dtype and
    device, shared by every layer and step and regrown by doubling."""
    key = (tuple(inv_freq.tolist()), wide, inv_freq.device)
    table = _TABLES.get(key)
    if table is None or table[0].shape[0] < length:
        size = max(1024, 1 << (length - 1).bit_length())
        pos = torch.arange(size, device=inv_freq.device, dtype=torch.int64)
        angle = pos[:, None].to(wide) * inv_freq.to(wide)
        angle = torch.cat([angle, angle], -1)
        table = _TABLES[key] = (angle.cos(), angle.sin())
    return table


def _slots(stored: Stored) -> int:
    body = stored.body
    return (body.codes if isinstance(body, PackedBody) else body).shape[2]


def _held(stored: Stored, b: int, n: int, dtype) -> tuple[torch.Tensor, int]:
    """(x, nb): sequence b's body positions [0, nb) (nb = its n_body, at most n) as [Hkv, nb,
    D] in dtype — dequantized, or a view of an exact body — and nb."""
    nb = min(int(stored.n_body[b]), n)
    if isinstance(stored.body, PackedBody):
        return dequantize(stored.body, dtype, b, nb), nb
    return stored.body[b, :, :nb].to(dtype), nb


def _after(stored: Stored, b: int, body: torch.Tensor, nb: int, lo: int, n: int, dtype):
    """Positions [lo, n) of sequence b in order (lo <= nb): the body's past lo, then the ring."""
    ring = torch.arange(nb, n, device=stored.tail.device) % stored.tail.shape[2]
    return torch.cat([body[:, lo:nb], stored.tail[b][:, ring].to(dtype)], 1)


def _rotate(k: torch.Tensor, pos, inv_freq, n: int, dtype) -> torch.Tensor:
    """Pre-RoPE keys [Hkv, L, D] at positions pos (LongTensor [L], or an int L for 0..L-1; an
    empty sink slot, -1, is masked: any angle serves) rotated as the reference rotates them,
    bit for bit: x * cos + rotate_half(x) * sin, one half at a time."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = _rope_table(inv_freq, wide, n + 1)
    half = k.shape[-1] // 2
    if isinstance(pos, int):
        cos, sin = cos[:pos, :half], sin[:pos, :half]
    else:
        at = pos.clamp(0, n)
        cos, sin = cos[at, :half], sin[at, :half]
    x1, x2 = k.to(wide).split(half, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(dtype)


def _attend(q: torch.Tensor, parts) -> torch.Tensor:
    """softmax(q K^T / sqrt(D)) V over `parts` [(k [Hkv, L, D], v, ok bool [L]), ...] taken as
    one set of keys, none of them copied where they are float32 already: q [H, D] (query head h
    reads KV head h // G); computed in float32 at least (as SDPA accumulates), returned in q's
    dtype."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    hkv, d = parts[0][0].shape[0], q.shape[-1]
    qg = q.to(wide).reshape(hkv, -1, d) * d**-0.5  # [Hkv, G, D]
    scores = [
        (qg @ k.to(wide).transpose(1, 2)).masked_fill(~ok, float("-inf")) for k, _, ok in parts
    ]  # fmt: skip
    p = torch.softmax(torch.cat(scores, -1), -1).split([k.shape[1] for k, _, _ in parts], -1)
    out = sum(pi @ v.to(wide) for pi, (_, v, _) in zip(p, parts, strict=True))
    return out.reshape(q.shape).to(q.dtype)


def decode_attention_torch(q, k_new, v_new, keys: Stored, values: Stored, sinks: Sinks, lengths,
                           *, inv_freq=None, window=None, dtype=None):  # fmt: skip
    """`decode_attention_reference` (same arguments, same result to rounding), one sequence at
    a time over the positions it holds. Synchronizes with the host: meant for the CPU."""
    n_of = lengths.tolist()
    if any(n > min(_slots(keys), _slots(values)) for n in n_of):
        return decode_attention_reference(
            q, k_new, v_new, keys, values, sinks, lengths,
            inv_freq=inv_freq, window=window, dtype=dtype,
        )  # fmt: skip
    dtype = dtype or q.dtype
    out = []
    for b, n in enumerate(n_of):
        (kb, nbk), (vb, nbv) = _held(keys, b, n, dtype), _held(values, b, n, dtype)
        lo = min(nbk, nbv)  # below it both bodies hold the positions: read in place
        dev = kb.device
        sink_pos = sinks.positions[b]
        spans = (  # (positions (an int L: 0..L-1), keys, values, what of them the token sees)
            (lo, kb[:, :lo], vb[:, :lo], ~sinks.is_sink[b, :lo]),
            (
                torch.arange(lo, n, device=dev),
                _after(keys, b, kb, nbk, lo, n, dtype),
                _after(values, b, vb, nbv, lo, n, dtype),
                ~sinks.is_sink[b, lo:n],
            ),
            (sink_pos, sinks.keys[b].to(dtype), sinks.values[b].to(dtype),
             (sink_pos >= 0) & (sink_pos < n)),
            (torch.tensor([n], device=dev), k_new[b].to(dtype), v_new[b].to(dtype),
             torch.ones(1, dtype=torch.bool, device=dev)),
        )  # fmt: skip
        parts = []
        for pos, k, v, ok in spans:
            if window:
                at = torch.arange(pos, device=dev) if isinstance(pos, int) else pos
                ok = ok & (at > n - window)
            if inv_freq is not None:
                k = _rotate(k, pos, inv_freq, n, dtype)
            parts.append((k, v, ok))
        out.append(_attend(q[b, :, 0].to(dtype), parts)[:, None])
    return torch.stack(out)
