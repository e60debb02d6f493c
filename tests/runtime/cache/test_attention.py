"""The one reference attention (kvcalib_runtime.cache.attention) against the eager attentions it
replaced, pinned here as they stood before the switch (issue 54): bit for bit (torch.equal) on
random fp32 inputs over masks, sliding windows, softcap on and off and GQA groups. The toolkit's
adapter is pinned the same way in tests/toolkit/evaluation/test_probe_attention.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvcalib_runtime.cache.attention import attention, causal_attention

CAP = 50.0


def _capped_before(q, keys, values, mask, cap):
    """fpcache.capped_attention before the switch."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values


def _kvcache_before(q, keys, values, valid, causal=False, window=None, softcap=None):
    """kvcache._attention (now attention.causal_attention) before the switch."""
    T, N = q.shape[2], keys.shape[2]
    if causal and (window is None or window >= N) and softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, is_causal=q.shape[2] > 1, enable_gqa=True
        )
    qpos = valid.sum(-1)[:, None] - T + torch.arange(T)
    j = torch.arange(N)[None, None, :]
    mask = (j <= qpos[:, :, None]) & valid[:, None, :]
    if window is not None:
        mask &= j > qpos[:, :, None] - window
    if softcap is not None:
        return _capped_before(q, keys, values, mask[:, None], softcap)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)


def _same(a, b):
    """Bit for bit, NaN where the other is NaN (a row whose window holds no valid key)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _inputs(seed, b, hkv, group, t, n, d):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * group, t, d, generator=g) * 2  # large scores: the cap bites
    k, v = (torch.randn(b, hkv, n, d, generator=g) for _ in range(2))
    return g, q, k, v


CASES = [(1, 1, 1, 5, 5, 64), (2, 2, 2, 3, 9, 64), (2, 1, 4, 7, 7, 32), (1, 2, 3, 4, 11, 256)]


@pytest.mark.parametrize("softcap", [None, CAP])
@pytest.mark.parametrize("case", CASES)
def test_capped_attention_bits(case, softcap):
    """A bool mask (what the full-precision cache builds) with the cap: the eager path's bits
    are capped_attention's, at every head dim (the division by sqrt(D) kept)."""
    g, q, k, v = _inputs(0, *case)
    mask = torch.rand(case[0], 1, case[3], case[4], generator=g) < 0.7
    mask[..., 0] = True  # every row sees a key
    assert torch.equal(attention(q, k, v, mask, softcap=CAP), _capped_before(q, k, v, mask, CAP))
    if softcap is None:  # no cap, no observer: the fused path, as the cache called it
        fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.equal(attention(q, k, v, mask), fused)


@pytest.mark.parametrize("softcap", [None, CAP])
@pytest.mark.parametrize("window", [None, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_kvcache_attention_bits(case, window, softcap):
    """The quantized cache's prefill attention (valid keys, causal, window, cap) is unchanged."""
    g, q, k, v = _inputs(1, *case)
    b, t, n = case[0], case[3], case[4]
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[-1, : n - t] = torch.rand(n - t, generator=g) < 0.5  # a shorter, gappy sequence
    for causal in [True, False] if t == n else [False]:
        ok = valid if not causal else torch.ones(b, n, dtype=torch.bool)
        args = (q, k, v, ok, causal, window, softcap)
        _same(causal_attention(*args), _kvcache_before(*args))


def test_observer_sees_eager_probabilities():
    """With an observer and no cap the eager path runs: its probabilities sum to 1 per row and
    the output agrees with the fused path to float rounding (1e-5; fp32, D 64)."""
    _, q, k, v = _inputs(3, 1, 2, 2, 6, 6, 64)
    seen = []
    out = attention(q, k, v, causal=True, observer=seen.append)
    (probs,) = seen
    assert probs.shape == (1, 4, 6, 6) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(1, 4, 6))
    assert (probs.triu(1) == 0).all()  # causal
    assert torch.allclose(out, attention(q, k, v, causal=True), atol=1e-5)
