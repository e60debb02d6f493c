"""Vector codebooks (kvcalib.calibration.vectorbooks) and the kvcalib-1.5 recipe around them:
the k-means against known answers, the Fisher weighting against plain, the variants the
presets ask for, and the recipe's walked bits."""

import pytest
import torch

from kvcalib.calibration import vectorbooks
from kvcalib.core.plan import codebook_variant
from kvcalib.core.recipe import load_recipe, parse_recipe
from kvcalib.errors import RecipeError
from kvcalib.evaluation.listing import recipe_bits
from kvcalib_runtime.layouts.quant import QuantSpec, fake_quantize


def _clusters(gen, heads=2, t=512, d=16, spread=0.01):
    """x [heads, t, d] drawn around 4 centres per vector of 2 channels (the same 4 for every
    vector, in the normalized domain of the range (lo, hi) returned), and the centres [4, 2]."""
    centres = torch.tensor([[0.1, 0.1], [0.1, 0.9], [0.9, 0.1], [0.9, 0.9]])
    pick = torch.randint(0, 4, (heads, t, d // 2), generator=gen)
    u = centres[pick] + spread * torch.randn(heads, t, d // 2, 2, generator=gen)
    lo = torch.randn(heads, d, generator=gen)
    width = torch.rand(heads, d, generator=gen) * 10 + 0.1  # channels of very different scales
    return lo[:, None] + width[:, None] * u.flatten(-2), (lo, lo + width), centres


def test_kmeans_recovers_known_centres():
    # Four tight clusters per vector (spread 0.01 of the range): 4 entries must land on the four
    # centres within 0.01 in the normalized domain, whatever each channel's scale.
    gen = torch.Generator().manual_seed(0)
    x, rng, centres = _clusters(gen)
    book = vectorbooks.fit(x, None, rng, 2, "adjacent", 2, per_head=False)
    assert book.shape == (1, 4, 2)
    found = book[0][torch.cdist(centres, book[0]).argmin(-1)]
    assert (found - centres).abs().max() < 0.01


@pytest.mark.parametrize("weight", ["fisher", "plain"])
def test_a_constant_channel_leaves_the_codebook_finite(weight):
    # Gemma 3's pre-RoPE keys hold channels whose non-sink range is one value (0-15 a layer):
    # the codebook windows may still see another value there (here 5.0 on one token). Such a
    # channel restores lo whatever the code (scale 0), so it carries no weight; the default
    # calibration wrote NaN into kvcalib-1.5's codebook instead, and every reader refused the
    # profile. The other channels' entries stay the centres.
    gen = torch.Generator().manual_seed(0)
    x, (lo, hi), centres = _clusters(gen)
    x[:, :, 3], hi[:, 3] = lo[:, None, 3], lo[:, 3]
    x[0, 7, 3] += 5.0
    g = None if weight == "plain" else torch.ones_like(x)
    book = vectorbooks.fit(x, g, (lo, hi), 2, "adjacent", 2, per_head=False)
    assert torch.isfinite(book).all()
    other = book[0, :, 0]  # the vector (2, 3): its channel 2 still finds the two centre values
    assert (other[:, None] - centres[:, 0].unique()).abs().amin(0).max() < 0.01


def test_fisher_weights_lower_the_weighted_error():
    # The Fisher objective is sum F (x - x_hat)^2: where the gradients sit on a few elements,
    # the Fisher-weighted codebook must give a lower weighted error than the plain one (and the
    # plain one a lower unweighted error): each wins its own objective.
    gen = torch.Generator().manual_seed(1)
    spec = QuantSpec(3, "static", 2, codebook=True, method="vq")
    x = torch.randn(2, 1024, 16, generator=gen)
    rng = (x.amin(1), x.amax(1))
    g = torch.where(x > 1.0, 10.0, 0.01)  # the loss cares about the elements above 1 only
    costs = {}
    for name, grad in (("fisher", g), ("plain", None)):
        book = vectorbooks.fit(x, grad, rng, 2, "adjacent", 3, per_head=True)
        err = fake_quantize(x, spec, static_range=rng, codebook=book) - x
        costs[name] = ((g * err).square().sum().item(), err.square().sum().item())
    assert costs["fisher"][0] < 0.9 * costs["plain"][0]
    assert costs["plain"][1] < costs["fisher"][1]


def test_the_presets_variants_and_their_ablation_neighbours():
    # kvcalib-1.5 (vectors of 4, RoPE pairs, per head, Fisher) asks for its own codebooks; with
    # the ablation the calibration fits each one-factor neighbour too, its own vectors at 4-8
    # bits and values in octets at 8: what the README's ablation and bits curve evaluate. A
    # default calibration fits only the presets' own (each costs k-means).
    recipe = load_recipe("kvcalib-1.5")
    own = {codebook_variant(t, getattr(recipe, t)): (6,) for t in ("key", "value")}
    assert vectorbooks.wanted() == own
    wanted = vectorbooks.wanted(ablation=True)
    for variant in own:
        assert wanted[variant] == (4, 5, 6, 7, 8)
    assert wanted["key:vq2:pre_rope:rope:head:fisher"] == (3,)
    assert {"key:vq4:pre_rope:head:fisher", "key:vq4:pre_rope:rope:layer:fisher"} <= set(wanted)
    assert {"value:vq4:head:plain", "value:vq4:layer:fisher"} <= set(wanted)
    assert wanted["value:vq8:head:fisher"] == (8,)
    for variant in wanted:
        assert vectorbooks.parse(variant)[1] in (2, 4, 8)


def test_kvcalib_1_5_walks_at_most_1_6_bits():
    # Issue 26's budget on SmolLM2-135M's geometry: the quantized body walked from the meta
    # cache's buffers at kvcalib eval's 1024 tokens and at `kvcalib recipes`' 4K.
    sizes = dict(num_layers=30, kv_heads=3, head_dim=64)
    for context in (1024, 4096):
        _, body = recipe_bits("kvcalib-1.5", **sizes, context=context)
        assert 1.5 < body <= 1.6


def test_codebook_choices_are_vq_only():
    base = {"name": "x", "key": {"bits": 2, "granularity": "static"}}
    with pytest.raises(RecipeError, match="set method 'vq'"):
        parse_recipe({**base, "key": {**base["key"], "codebook_scope": "head"}})
    with pytest.raises(RecipeError, match="pairing"):
        parse_recipe({**base, "key": {**base["key"], "pairing": "ropes"}})
