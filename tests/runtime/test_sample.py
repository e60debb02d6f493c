"""The runtime's sampler (generate.sample): tokens drawn in the proportions of
softmax(logits / temperature) within the top_p nucleus, whatever the softmax's shift; -1 for a
row a broken forward gave (NaN, +Inf, only -Inf), so that generate refuses it in one line."""

import torch

from kvcalib_runtime.generate import sample

N = 40_000  # draws: a frequency's standard error is at most 0.0025


def _frequencies(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    tokens = sample(logits.expand(N, -1), temperature, top_p, g)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / N


def _close(freq: torch.Tensor, p: torch.Tensor) -> bool:
    """Within 4.5 binomial standard errors everywhere (a false alarm: ~1e-5 per token)."""
    sigma = (p * (1 - p) / N).sqrt()
    return bool(((freq - p).abs() <= 4.5 * sigma + 1e-12).all())


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -50.0]])
    for temperature in (0.5, 1.0, 3.0):
        p = torch.softmax(logits.double()[0] / temperature, dim=-1)
        assert _close(_frequencies(logits, temperature, 1.0), p)
    # a no-op sampler (argmax, or uniform) fails the bound: the test can tell
    assert not _close(torch.tensor([0, 0, 0, 1, 0.0]).double(), p)


def test_the_nucleus_keeps_the_tokens_before_top_p():
    # probabilities at T = 1: 0.644, 0.237, 0.087, 0.032, 0: top_p 0.7 keeps the first two
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -50.0]])
    p = torch.softmax(logits.double()[0], dim=-1)
    kept = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]).double()
    assert _close(_frequencies(logits, 1.0, 0.7), p * kept / (p * kept).sum())


def test_a_broken_row_is_minus_one_and_the_others_are_drawn():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [0.0, 5.0, 1.0, 2.0],
            [0.0, nan, 1.0, 2.0],
            [inf, 0.0, 1.0, 2.0],
            [-inf, -inf, -inf, -inf],
            [-inf, 1.0, -inf, 0.5],  # -Inf logits beside finite ones: probability 0, no harm
        ]
    )
    assert sample(logits, 0.0, 1.0, None).tolist() == [1, -1, -1, -1, 1]
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        got = sample(logits, 0.8, 0.9, g).tolist()
        assert got[1:4] == [-1, -1, -1] and got[0] in (1, 3) and got[4] in (1, 3)
