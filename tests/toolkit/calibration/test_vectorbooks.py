"""Vector codebooks (kvcalib.calibration.vectorbooks) and the kvcalib-1.5 recipe around them:
the k-means against known answers, the Fisher weighting against plain, the variants the
presets ask for, and the recipe's walked bits."""

from pathlib import Path

import pytest
import torch

from kvcalib.calibration import vectorbooks
from kvcalib.core.plan import codebook_variant
from kvcalib.core.recipe import load_recipe, parse_recipe
from kvcalib.errors import RecipeError
from kvcalib.evaluation.listing import recipe_bits
from kvcalib_runtime.layouts.quant import QuantSpec, fake_quantize

ABLATION = Path(__file__).resolve().parents[3] / "benchmarks" / "kvcalib-1.5-ablation"
SLOTS = ABLATION.parent / "long_context" / "smollm2-135m" / "variants" / "kvcalib-1.5s.toml"


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
    # kvcalib-1.5 (vectors of 4, RoPE pairs, per head, Fisher; 6-bit indices) asks for its own
    # codebooks; with the ablation the calibration fits each one-factor neighbour too, its own
    # vectors at 4-8 bits (kvcalib-1.5s's 5 among them: the retired variant's profile) and
    # values in octets at 8: what the README's ablation and bits curve evaluate. A default
    # calibration fits only the presets' own (each costs k-means).
    recipe = load_recipe("kvcalib-1.5")
    own = {codebook_variant(t, getattr(recipe, t)): (6,) for t in ("key", "value")}
    slots = load_recipe(str(SLOTS))
    assert {codebook_variant(t, getattr(slots, t)) for t in ("key", "value")} == set(own)
    assert vectorbooks.wanted() == own
    wanted = vectorbooks.wanted(ablation=True)
    for variant in own:
        assert wanted[variant] == (4, 5, 6, 7, 8)
    assert wanted["key:vq2:pre_rope:rope:head:fisher"] == (3,)
    assert {"key:vq4:pre_rope:head:fisher", "key:vq4:pre_rope:rope:layer:fisher"} <= set(wanted)
    assert {"value:vq4:head:plain", "value:vq4:layer:fisher"} <= set(wanted)
    assert wanted["value:vq8:head:fisher"] == (8,)
    assert wanted["key:vq4:pre_rope:rope:head:fisher+answer"] == (6,)
    assert wanted["value:vq4:head:fisher+answer"] == (6,)
    for variant in wanted:
        assert vectorbooks.parse(variant)[1] in (2, 4, 8)


@pytest.mark.parametrize("path", sorted(ABLATION.glob("*.toml")), ids=lambda p: p.stem)
def test_an_ablation_calibration_fits_every_ablation_recipes_codebooks(path):
    # The README's ablation and curve evaluate these files on a `--vector-ablation` profile: a
    # codebook it does not fit would fail the eval an hour into the calibration's work.
    recipe, wanted = load_recipe(str(path)), vectorbooks.wanted(ablation=True)
    coded = [t for t in ("key", "value") if recipe.tensor(t, 0).layout.vectors]
    assert coded, "an ablation recipe codes keys or values as vectors"
    for tensor in coded:
        t = recipe.tensor(tensor, 0)
        assert t.bits in wanted[codebook_variant(tensor, t)], tensor


def _draws_of(x, g, rng, count, seed=0):
    u, weight, s2 = vectorbooks.samples(x, g, rng, 2, "adjacent", per_head=True)
    return vectorbooks.draw(u, weight, s2, count, torch.Generator().manual_seed(seed))


def test_answer_draws_estimate_the_weighted_sums():
    # Drawing by weight keeps what the k-means sums: each codebook's weight in total (exactly,
    # by construction) and its weighted first moment (in expectation: within 3% at 4096 draws of
    # 2000 vectors whose weights span 4 orders of magnitude).
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 1000, 8, generator=gen)
    g = 10 ** (4 * torch.rand(2, 1000, 8, generator=gen) - 2)
    rng = (x.amin(1), x.amax(1))
    u, weight, _ = vectorbooks.samples(x, g, rng, 2, "adjacent", per_head=True)
    du, dw, _ = _draws_of(x, g, rng, 4096)
    assert du.shape == dw.shape == (2, 4096, 2)
    torch.testing.assert_close(dw.sum((1, 2)), weight.sum((1, 2)), rtol=1e-4, atol=0)
    moment, drawn = (weight * u).sum((1, 2)), (dw * du).sum((1, 2))
    assert ((drawn - moment).abs() / moment).max() < 0.03
    zero = _draws_of(x, torch.zeros_like(g), rng, 16)  # no gradient anywhere: weight 0, finite
    assert zero[1].abs().sum() == 0 and torch.isfinite(zero[0]).all()


def test_answer_weighted_entries_cover_what_the_answer_reads():
    # The text's vectors sit at four centres; a retrieval prompt's answer reads 8 tokens whose
    # vectors sit at (0.5, 0.5), where no text vector lies. With 4 entries the text's Fisher
    # codebook spends all of them on the text's centres; weighing the answer's draws as much as
    # the text puts an entry on the needles' point (within 0.02 in the normalized domain) for
    # every vector of every head, at the cost of one text centre.
    gen = torch.Generator().manual_seed(3)
    x, (lo, hi), _ = _clusters(gen)
    g = torch.ones_like(x)
    prompt, needles = x.clone(), torch.arange(100, 108)
    prompt[:, needles] = lo[:, None] + 0.5 * (hi - lo)[:, None]
    pg = torch.full_like(x, 1e-3)
    pg[:, needles] = 1.0
    extra = _draws_of(prompt, pg, (lo, hi), 2048)
    point = torch.tensor([0.5, 0.5])
    for extra_samples, covered in ((None, False), (extra, True)):
        book = vectorbooks.fit(x, g, (lo, hi), 2, "adjacent", 2, per_head=True, extra=extra_samples)
        gap = (book - point).norm(dim=-1).amin(-1)  # [heads]: the nearest entry to the needles
        assert bool((gap < 0.02).all()) == covered and bool((gap > 0.2).all()) != covered


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
    with pytest.raises(RecipeError, match="set method 'vq'"):
        parse_recipe({**base, "key": {**base["key"], "codebook_weight": "plain"}})
    # the answer loss weighs any calibrated codebook's k-means, and only a calibrated one's
    answer = {**base["key"], "codebook_weight": "fisher+answer"}
    with pytest.raises(RecipeError, match="weighs a calibrated codebook"):
        parse_recipe({**base, "key": answer})
    recipe = parse_recipe({**base, "key": {**answer, "codebook": "calibrated"}})
    assert codebook_variant("key", recipe.key) == "key:static:post_rope:answer"
    with pytest.raises(RecipeError, match="pairing"):
        parse_recipe({**base, "key": {**base["key"], "pairing": "ropes"}})
