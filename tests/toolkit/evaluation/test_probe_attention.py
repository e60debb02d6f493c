"""The long-context probe's attention backend (kvcalib.evaluation.longprobe._attention) against
its eager attention as it stood before it became an adapter over
kvcalib_runtime.cache.attention (issue 54): output, returned weights and the probabilities the
active probe observes, bit for bit on random fp32 inputs (float masks wider than the keys,
softcap on and off, GQA groups, scaling given or not)."""

from types import SimpleNamespace

import pytest
import torch

from kvcalib.evaluation import longprobe


def _before(query, key, value, attention_mask, scaling, softcap):
    """longprobe._attention before the switch: (out [B, T, H, D], probs)."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scores = (query @ k.transpose(-1, -2)).float() * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask[..., : k.shape[-2]].float()
    probs = scores.softmax(-1)
    out = probs.to(v.dtype) @ v
    return out.transpose(1, 2).contiguous(), probs


class _Seen:
    def __init__(self):
        self.calls = []

    def observe(self, layer, probs, key):
        self.calls.append((layer, probs, key))


@pytest.mark.parametrize("scaling", [None, 0.11])
@pytest.mark.parametrize("softcap", [None, 50.0])
@pytest.mark.parametrize("case", [(1, 1, 1, 1, 9, 64), (2, 2, 3, 4, 11, 32), (1, 2, 2, 3, 7, 256)])
def test_probe_attention_bits(case, softcap, scaling):
    b, hkv, group, t, n, d = case
    g = torch.Generator().manual_seed(sum(case))
    q = torch.randn(b, hkv * group, t, d, generator=g) * 2
    k, v = (torch.randn(b, hkv, n, d, generator=g) for _ in range(2))
    mask = torch.zeros(b, 1, t, n + 3)
    mask[torch.rand(b, 1, t, n + 3, generator=g) < 0.3] = torch.finfo(torch.float32).min
    mask[..., 0] = 0
    seen = _Seen()
    longprobe._ACTIVE.append(seen)
    try:
        out, probs = longprobe._attention(
            SimpleNamespace(layer_idx=3), q, k, v, mask, scaling, softcap=softcap
        )
    finally:
        longprobe._ACTIVE.remove(seen)
    want, want_probs = _before(q, k, v, mask, scaling, softcap)
    assert torch.equal(out, want) and torch.equal(probs, want_probs)
    ((layer, observed, key),) = seen.calls
    assert layer == 3 and observed is probs and key is k
