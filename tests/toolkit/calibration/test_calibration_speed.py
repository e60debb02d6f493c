"""The calibration's speed-ups change no number (issue 56): each one against the formula it
replaced, op for op, with torch.equal (not a tolerance: every preset's plan digest on the
long-context suite's committed profiles is kept by computing the same bits)."""

import torch
from support.tiny import CharTokenizer, tiny_model

from kvcalib.calibration import answerprobe, retrieval, vectorbooks
from kvcalib.calibration.layerwise import InMemory
from kvcalib.calibration.massive import MassiveMeter
from kvcalib.core.data import calibration_tokens


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


def test_the_answer_probe_losses_are_the_same_with_the_causal_kernel(monkeypatch):
    # The probe's prompt forward and its branches' own rows attend under the causal mask: the
    # fused kernel's causal mode (blocks above the diagonal skipped) against the mask added,
    # as before, on the tiny llama's retrieval prompts: the same losses bit for bit, and the
    # causal mode taken.
    model = tiny_model("llama")
    prompts = retrieval.build(CharTokenizer(), calibration_tokens(CharTokenizer()), 2, 700, 0)
    n, hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    d = model.config.hidden_size // model.config.num_attention_heads
    key_range = (torch.full((n, hkv, d), -0.5), torch.full((n, hkv, d), 0.5))

    def losses():
        with torch.no_grad():
            return answerprobe.answer_pass(
                InMemory(model), prompts, prompts.context, key_range, lambda w: 0
            )[0]

    causal = answerprobe._causal
    taken = []
    monkeypatch.setattr(answerprobe, "_causal", lambda m: taken.append(causal(m)) or taken[-1])
    fast = losses()
    monkeypatch.setattr(answerprobe, "_causal", lambda m: False)
    before = losses()
    assert sum(taken) >= 2 * n  # every layer's prompt forward of both prompts
    for name, v in before.items():
        assert torch.equal(fast[name], v), name
        assert float(v.abs().max()) > 1e-3


def test_only_the_causal_mask_takes_the_causal_kernel():
    lowest = torch.finfo(torch.float32).min
    causal = torch.full((6, 6), lowest).triu(1)[None, None]
    assert answerprobe._causal(causal)
    assert answerprobe._causal(torch.full((6, 6), float("-inf")).triu(1)[None, None])
    window = causal.clone()
    window[..., 5, 0] = lowest  # a sliding window: a key below the diagonal masked
    assert not answerprobe._causal(window)
    assert not answerprobe._causal(causal[..., :4, :])  # not square: a branch over the prompt
    assert not answerprobe._causal(torch.full((6, 6), -1e4).triu(1)[None, None])  # exp not 0
