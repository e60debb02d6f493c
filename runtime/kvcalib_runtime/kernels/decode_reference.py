"""`decode_attention`'s spec in plain torch: every stored position dequantized and placed by
position, then SDPA. The fallback where the Triton kernel does not run off the CPU (on the CPU the
cache decodes through kernels.decode_torch, held to this); the tests hold both kernels to it.
It imports no Triton.
"""

import torch
import torch.nn.functional as F

from kvcalib_runtime.kernels.operands import Sinks, Stored
from kvcalib_runtime.layouts.body import as_body
from kvcalib_runtime.model.rope import rotate_half


def _entries(stored: Stored, lengths, is_sink, dtype):
    """Every position a stream holds, scattered by position: (x [B, Hkv, P + 1, D] in dtype,
    held bool [B, P + 1]) with P = is_sink.shape[1]; column P collects the empty slots."""
    body, tail = stored.body, stored.tail
    x_body = as_body(body).dequantize(dtype)
    n, nb, P = lengths[:, None], stored.n_body[:, None], is_sink.shape[1]
    dev = tail.device

    def held(slots):  # the newest position < n in each of `slots` ring slots: [B, slots]
        s = torch.arange(slots, device=dev)
        return n - 1 - torch.remainder(n - 1 - s, max(slots, 1))

    p_body, p_tail = held(x_body.shape[2]), held(tail.shape[2])
    pos = torch.cat([p_body, p_tail], 1)
    ok = torch.cat([p_body < nb, p_tail >= nb], 1) & (pos >= 0)
    ok &= ~is_sink.gather(1, pos.clamp(0, P - 1))  # a kept sink is read from its slot
    x = torch.cat([x_body, tail.to(dtype)], 2)
    where = torch.where(ok, pos, P)
    out = x.new_zeros(*x.shape[:2], P + 1, x.shape[3])
    out.scatter_(2, where[:, None, :, None].expand_as(x), x)
    held_at = torch.zeros(len(n), P + 1, dtype=torch.bool, device=dev)
    held_at.scatter_(1, where, True)
    held_at[:, P] = False
    return out, held_at


def decode_attention_reference(q, k_new, v_new, keys: Stored, values: Stored, sinks: Sinks,
                               lengths, *, inv_freq=None, window=None, dtype=None):  # fmt: skip
    """`decode_attention` in plain torch, the spec: every stored position dequantized and placed
    by position, the sink slots and the new token appended, RoPE at each position (pre-RoPE
    keys), masked to what the token sees (held, not a kept sink's body slot, inside the
    window), then SDPA. Everything is computed in `dtype` (default q's; RoPE angles in at least
    fp32): float64 gives the exact result of the stored bits. No host synchronization."""
    dtype = dtype or q.dtype
    B, _H, _, _D = q.shape
    P = sinks.is_sink.shape[1]
    k_body, k_held = _entries(keys, lengths, sinks.is_sink, dtype)
    v_body, _ = _entries(values, lengths, sinks.is_sink, dtype)
    n = lengths[:, None]
    pos = torch.cat([torch.arange(P + 1, device=q.device).expand(B, P + 1), sinks.positions, n], 1)
    k = torch.cat([k_body, sinks.keys.to(dtype), k_new.to(dtype)], 2)
    v = torch.cat([v_body, sinks.values.to(dtype), v_new.to(dtype)], 2)
    ok_sink = (sinks.positions >= 0) & (sinks.positions < n)
    ok = torch.cat([k_held, ok_sink, torch.ones_like(n, dtype=torch.bool)], 1)
    if window:
        ok &= pos > n - window
    if inv_freq is not None:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        angle = pos[..., None].to(wide) * inv_freq.to(wide)
        angle = torch.cat([angle, angle], -1)[:, None]  # [B, 1, L, D]
        kw = k.to(wide)
        k = (kw * angle.cos() + rotate_half(kw) * angle.sin()).to(dtype)
    return F.scaled_dot_product_attention(
        q.to(dtype), k, v, attn_mask=ok[:, None, None, :], enable_gqa=True
    )
