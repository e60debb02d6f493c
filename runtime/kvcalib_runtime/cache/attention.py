"""The one reference attention: the caches call it directly (`causal_attention`: the queries over
the positions a cache holds), the toolkit's transformers attention backends (kvcalib.sim.simulate,
kvcalib.evaluation.longprobe) through thin adapters that pass their observers.

    scores = q K^T, scaled (by `scaling`, or divided by sqrt(D)); with a softcap (Gemma 2)
    s -> softcap * tanh(s / softcap); masked (a bool mask: -inf where False; a float mask:
    added); softmax in float32; the observer, if any, sees those probabilities; cast to the
    values' dtype and times V.

That is transformers' eager attention, op for op. Without a softcap and an observer it takes the
fast path, PyTorch's fused scaled_dot_product_attention (no scores in memory), which agrees with
the eager path to float rounding, not bit for bit. Paths that stay separate, and why: the
simulation's decode rule (kvcalib.sim.attention: each score's key and each weight's value exact
or quantized per query band, which no single K and V express) and the answer probe's
log-sum-exp parts (kvcalib.calibration.answerprobe: partial softmaxes merged across branches).
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Observer = Callable[[torch.Tensor], None]


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's soft-cap on scaled scores, softcap * tanh(s / softcap); None: s unchanged. The
    one definition, shared with the paths that stay separate."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = False,
    observer: Observer | None = None,
) -> torch.Tensor:
    """q [B, H, T, D] over keys, values [B, Hkv, S, D] -> [B, H, T, D]; H a multiple of Hkv
    (query head h reads KV head h // (H / Hkv)).

    mask: bool [B or 1, 1, T, S] (True: attended), additive float [B or 1, 1, T, S'] with
    S' >= S (its first S columns), or None. causal (mask None, T == S): query i sees keys <= i.
    observer: called with the probabilities, float32 [B, H, T, S]; it forces the eager path.
    """
    if softcap is None and observer is None:
        if mask is not None and mask.dtype != torch.bool:
            mask = mask[..., : keys.shape[2]]
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=True
        )
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = q @ keys.transpose(-1, -2)
    scores = scores / math.sqrt(q.shape[-1]) if scaling is None else scores * scaling
    scores = capped(scores, softcap)
    if causal:
        t = q.shape[2]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask[..., : keys.shape[2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if observer is not None:
        observer(probs)
    return probs.to(values.dtype) @ values


def causal_attention(q, keys, values, valid, causal=False, window=None, softcap=None):
    """q [B, H, T, D] over a cache's keys/values [B, Hkv, N, D] (key j at position j); the T
    queries are the last valid T keys of each sequence (causal among them), seeing keys
    p - window < j <= p with a sliding window, scores soft-capped with `softcap`. valid bool
    [B, N]; `causal` when every key is valid and N == T (a first prefill)."""
    T, N = q.shape[2], keys.shape[2]
    if causal and (window is None or window >= N) and softcap is None:
        return attention(q, keys, values, causal=T > 1)
    qpos = valid.sum(-1)[:, None] - T + torch.arange(T, device=q.device)  # [B, T]
    j = torch.arange(N, device=q.device)[None, None, :]
    mask = (j <= qpos[:, :, None]) & valid[:, None, :]  # [B, T, N]
    if window is not None:
        mask &= j > qpos[:, :, None] - window
    return attention(q, keys, values, mask[:, None], softcap=softcap)
