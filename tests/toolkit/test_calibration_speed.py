"""The calibration's speed-ups change no number (issue 56): each one against the formula it
replaced, op for op, with torch.equal (not a tolerance: every preset's plan digest on the
long-context suite's committed profiles is kept by computing the same bits)."""

import torch

from kvcalib.calibration import vectorbooks
from kvcalib.calibration.massive import MassiveMeter


def _lloyd_before(u, weight, s2, count: int, generator) -> torch.Tensor:
    """vectorbooks._lloyd as it was: a fresh distance matrix a step, argmin."""
    m = u.shape[0]
    start = torch.randperm(m, generator=generator)[: min(count, m)].to(u.device)
    book = u[start]
    if len(book) < count:
        book = torch.cat([book, book[:1].expand(count - len(book), -1)])
    su2 = (s2 * u).T
    base = (s2 * u.square()).sum(-1, keepdim=True)
    for _ in range(vectorbooks.ITERATIONS):
        dist = base - 2 * (su2.T @ book.T) + s2 @ book.square().T
        cell = dist.argmin(-1)
        mass = torch.zeros_like(book).index_add_(0, cell, weight)
        moment = torch.zeros_like(book).index_add_(0, cell, weight * u)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-30), book)
        if torch.equal(new, book):
            break
        book = new
    return book


def test_the_kmeans_gives_the_same_codebooks_bit_for_bit():
    # Vectors on a coarse grid (many equal distances: the first minimum must win as before),
    # and continuous ones of very different scales, weighted and plain, more entries than
    # distinct vectors included.
    gen = torch.Generator().manual_seed(0)
    grid = torch.randint(0, 5, (4096, 4), generator=gen).float() / 4
    smooth = torch.rand(4096, 4, generator=gen)
    for u in (grid, smooth):
        for weight in (torch.ones_like(u), torch.rand(u.shape, generator=gen) ** 4):
            s2 = (torch.rand(4, generator=gen) * 100).expand_as(u).contiguous()
            for count in (16, 64, 1024):
                a = vectorbooks._lloyd(u, weight * s2, s2, count, torch.Generator().manual_seed(1))
                b = _lloyd_before(u, weight * s2, s2, count, torch.Generator().manual_seed(1))
                assert torch.equal(a, b), count


def _scores_before(m, layer: int, dims, seq_len: int) -> torch.Tensor:
    """Massive.scores as it was: the whole index filtered at every call."""
    w, lay, pos, dim = m.index
    hit = (lay == layer) & torch.isin(dim, torch.tensor(dims, dtype=dim.dtype))
    flat = torch.zeros(m.windows * seq_len)
    flat.scatter_reduce_(0, w[hit].long() * seq_len + pos[hit], m.value[hit], "amax")
    return flat.view(m.windows, seq_len)


def test_the_sink_predictor_scores_are_the_same():
    # Three layers, four windows, a few massive dims on a few tokens: every layer's scores for
    # every dim set the fit tries, asked in any order and twice (the per-layer cache).
    gen = torch.Generator().manual_seed(0)
    layers, windows, t, e = 3, 4, 64, 32
    meter = MassiveMeter(layers, e)
    for w in range(windows):
        for i in range(layers):
            h = torch.randn(t, e, generator=gen)
            h[torch.randint(0, t, (3,), generator=gen), i + 1] = 500.0 + w
            h[0, 7] = 300.0 * (i + 1)
            meter.add(w, i, h)
    found = meter.result(ratio=100.0)
    asked = [(i, ds) for i in (2, 0, 1) for ds in ([i + 1], [7], [i + 1, 7])]
    for layer, dims in asked + asked:
        got = found.scores(layer, dims, t)
        assert torch.equal(got, _scores_before(found, layer, dims, t)), (layer, dims)
        assert got.amax() > 0
