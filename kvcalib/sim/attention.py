"""Attention over a simulated quantized KV cache under the decode rule, in one pass over every
query: the reference (eager, returns the attention weights for observers) and the fast path
(PyTorch's fused scaled_dot_product_attention), which agree to float rounding
(tests/toolkit/sim/test_simulate.py). Fake mode (every position quantized) and full precision need
no rule: they attend through the runtime's one attention, kvcalib_runtime.cache.attention. The
rule stays here, a specialisation of it: a score's key and a weight's value are exact or
quantized per query, which no one K and V express.

Query i sees key j quantized when j < n_k(i) and as it is otherwise (the decode rule's quantized
prefix, kvcalib_runtime.cache.scheme.quantized_prefix; kept sinks are exact in the quantized tensors
already), and value j quantized when j < n_v(i). Fake mode is n = T: everything quantized. Keys
j >= n(i) = min(n_k(i), n_v(i)) form a band below the diagonal (the residual window and a flush
block), handled a block of BLOCK queries at a time:

    Block(a, z, lo, ...): queries a ... z - 1; keys lo ... z - 1 hold the band of each (lo is
    the block's smallest n); bool [z - a, z - lo] masks: band (j >= n(i)), key_exact
    (j >= n_k(i)), value_exact (j >= n_v(i)); key_mixed / value_mixed: whether the band holds a
    quantized key / value for some query of the block

reference  scores = q k_q^T, the band's exact scores written in; softmax; out = p v_q plus the
           band's (p * value_exact) (v - v_q).
fused      fused attention over the keys before each query's band (quantized keys and values)
           with one extra key: a zero key whose score is set through an extra query channel to
           m, the largest band score of the query, and whose value is e_{D+1}. Its output gives
           out' (attention over the quantized part) and e = exp(m) / (Z' + exp(m)), Z' that
           part's softmax sum. With the band's weights P = exp(s - m) (its keys exact or
           quantized as the rule says),

               out = (out' + e dN) / (1 - e + e dZ),   dN = P v_band,   dZ = sum P

           (v_band: each value exact or quantized as the rule says): the two parts' softmax sums
           and numerators added in units of exp(m + log(Z' + exp(m))). No division by e: a band of
           negligible weight (e -> 0) leaves out'. One fused attention and, per block, one
           score and one value matmul over the band (two where its keys or values mix).

Shapes: q [B, Hkv, G, T, D] (query heads grouped by KV head); key, value (exact) and key_q,
value_q (as the body stores them, kept sinks exact) [B, Hkv, T, D]; mask additive float
[B, 1, T, T]; outputs [B, Hkv, G, T, D].
"""

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from kvcalib_runtime.cache.attention import capped

BLOCK = 64  # queries per band block


@dataclass(frozen=True)
class Block:
    a: int
    z: int
    lo: int
    band: torch.Tensor
    key_exact: torch.Tensor
    value_exact: torch.Tensor
    key_mixed: bool
    value_mixed: bool


@dataclass(frozen=True)
class Bands:
    """The decode rule's bands: `blocks`, and n int64 [T] where each query's band starts."""

    blocks: list[Block]
    n: torch.Tensor


def bands(n_key: torch.Tensor | None, n_value: torch.Tensor | None, t: int) -> Bands:
    """The bands of the decode rule: n_key, n_value int64 [T] the quantized prefix each query
    sees of the keys and of the values (None: that tensor is not quantized)."""
    pos = torch.arange(t, device=(n_key if n_key is not None else n_value).device)
    none = pos + 1  # a tensor that is not quantized: every visible position exact
    n_k = none if n_key is None else n_key
    n_v = none if n_value is None else n_value
    n = torch.minimum(n_k, n_v)
    out = []
    for a in range(0, t, BLOCK):
        z = min(a + BLOCK, t)
        lo = int(n[a:z].min())  # n(i) <= i: query i sees itself exactly
        j = pos[lo:z][None, :]
        band, key_exact, value_exact = (j >= x[a:z, None] for x in (n, n_k, n_v))
        key_mixed, value_mixed = (bool((band & ~e).any()) for e in (key_exact, value_exact))
        out.append(Block(a, z, lo, band, key_exact, value_exact, key_mixed, value_mixed))
    return Bands(out, n)


def reference(
    q, key, value, key_q, value_q, mask, scaling: float, rule: Bands | None, softcap=None
):
    """(out, probs float32 [B, Hkv, G, T, T]): eager attention under the decode rule (None:
    fake mode, every position as key_q / value_q hold it); softcap (Gemma 2): the scaled scores
    s become softcap * tanh(s / softcap)."""
    mask = mask[:, :, None]
    blocks = rule.blocks if rule is not None else ()
    scores = q @ key_q[:, :, None].transpose(-1, -2)
    for bl in blocks:
        a, z, lo = bl.a, bl.z, bl.lo
        exact = q[..., a:z, :] @ key[:, :, None, lo:z].transpose(-1, -2)
        scores[..., a:z, lo:z] = torch.where(bl.key_exact, exact, scores[..., a:z, lo:z])
    scores = capped(scores * scaling, softcap)
    probs = torch.softmax(scores + mask, -1, torch.float32)
    p = probs.to(value.dtype)
    out = p @ value_q[:, :, None]
    diff = (value - value_q)[:, :, None]  # zero where kept exact
    for bl in blocks:
        a, z, lo = bl.a, bl.z, bl.lo
        out[..., a:z, :] += (p[..., a:z, lo:z] * bl.value_exact) @ diff[..., lo:z, :]
    return out, probs


def fused(q, key, value, key_q, value_q, mask, scaling: float, rule: Bands):
    """out: the same attention as `reference` through scaled_dot_product_attention (see the
    module docstring), without the weights."""
    b, hkv, g, t, d = q.shape
    flat = q.reshape(b, hkv * g, t, d)
    low = torch.finfo(mask.dtype).min
    m = torch.empty(b, hkv, g, t, 1, dtype=torch.float32, device=q.device)
    dn = torch.empty(b, hkv, g, t, d, dtype=torch.float32, device=q.device)
    dz = torch.empty_like(m)
    k, kq = key[:, :, None].float(), key_q[:, :, None].float()
    v, vq = value[:, :, None].float(), value_q[:, :, None].float()
    for bl in rule.blocks:
        a, z, lo = bl.a, bl.z, bl.lo
        qb = q[..., a:z, :].float()
        bias = mask[:, :, None, a:z, lo:z].float().masked_fill(~bl.band, low)
        s = qb @ k[..., lo:z, :].transpose(-1, -2)
        if bl.key_mixed:
            s = torch.where(bl.key_exact, s, qb @ kq[..., lo:z, :].transpose(-1, -2))
        s = s * scaling + bias
        m[..., a:z, :] = s.amax(-1, keepdim=True)  # finite: query i's band holds key i
        p = (s - m[..., a:z, :]).exp()
        dz[..., a:z, :] = p.sum(-1, keepdim=True)
        if bl.value_mixed:
            exact = p * bl.value_exact
            dn[..., a:z, :] = exact @ v[..., lo:z, :] + (p - exact) @ vq[..., lo:z, :]
        else:
            dn[..., a:z, :] = p @ v[..., lo:z, :]
    # one more key: zero but for an extra channel that the queries give the score m / scaling
    score = (m / scaling).to(q.dtype)
    shift = (m - score.float() * scaling).exp()  # the band in units of exp(its score as rounded)
    dn, dz = dn * shift, dz * shift
    extra = torch.zeros(b, hkv, 1, d + 1, dtype=q.dtype, device=q.device)
    extra[..., d] = 1
    pos = torch.arange(t, device=q.device)
    before = mask.masked_fill(pos[None, :] >= rule.n[:, None], low)  # the quantized part
    out = scaled_dot_product_attention(
        torch.cat((flat, score.view(b, hkv * g, t, 1)), -1),
        torch.cat((_pad(key_q), extra), 2),
        torch.cat((_pad(value_q), extra), 2),
        attn_mask=torch.cat((before, mask.new_zeros(*mask.shape[:-1], 1)), -1),
        scale=scaling,
        enable_gqa=True,
    ).float()
    out, e = out[..., :d].view(b, hkv, g, t, d), out[..., d:].view(b, hkv, g, t, 1)
    return ((out + e * dn) / (1 - e + e * dz)).to(q.dtype)


def _pad(x: torch.Tensor) -> torch.Tensor:
    """[..., T, D] -> [..., T, D + 1], the extra channel zero."""
    return torch.nn.functional.pad(x, (0, 1))
