"""Per-layer bit allocation: the greedy spends the budget where the sensitivity says, and a
layer given more bits than a codebook covers (2-4) falls back to uniform levels."""

import re

import pytest
from support.tiny import ShapeProfile

from kvcalib.core.plan import plan
from kvcalib.core.recipe import load_recipe, parse_recipe
from kvcalib.errors import RecipeError

ALLOCATED = {
    "name": "allocated",
    "key": {"bits": 3, "granularity": "static", "position": "pre_rope", "codebook": "calibrated"},
    "value": {"bits": 3, "symmetric": True, "codebook": "calibrated"},
    "allocation": {"budget": 3.0, "choices": [2, 3, 4, 8]},
}


def test_a_very_sensitive_layer_gets_eight_uniform_bits():
    # layer 0's keys hurt 1000x more than anything else: the first upgrades go there
    profile = ShapeProfile(2, 16, sensitive={("key", 0): 1000.0})
    scheme, params = plan(parse_recipe(ALLOCATED), num_layers=8, head_dim=16, profile=profile)
    first = scheme.layers[0].key
    assert first.bits == 8 and not first.codebook and 0 not in params.key_codebook
    codes = [b for layer in scheme.layers for b in (layer.key.bits, layer.value.bits)]
    assert sum(codes) <= 3.0 * len(codes)  # the mean code width is within the budget
    assert all(layer.key.codebook for layer in scheme.layers if layer.key.bits <= 4)


def test_uniform_sensitivity_spends_the_budget_evenly():
    """Every tensor equally sensitive: the whole budget (whole bits: 3.125 x 8 tensors = 25) is
    spent, no tensor more than one bit above another."""
    recipe = load_recipe("kvcalib-3")
    scheme, _ = plan(recipe, num_layers=4, head_dim=16, profile=ShapeProfile(2, 16))
    codes = [b for layer in scheme.layers for b in (layer.key.bits, layer.value.bits)]
    assert sum(codes) == int(recipe.allocation.budget * len(codes))
    assert max(codes) - min(codes) <= 1


def test_the_answer_loss_allocation_follows_its_own_sensitivity(caplog):
    """`sensitivity = "answer"` spends on the layers the answer loss names, not the text's; a
    profile without answer sensitivities plans from the text's and says so."""
    answer = {**ALLOCATED, "allocation": {**ALLOCATED["allocation"], "sensitivity": "answer"}}
    text_says, answer_says = {("key", 0): 1000.0}, {("key", 5): 1000.0}
    profile = ShapeProfile(2, 16, sensitive=text_says, answer=answer_says)
    for recipe, loud in ((ALLOCATED, 0), (answer, 5)):
        scheme, _ = plan(parse_recipe(recipe), num_layers=8, head_dim=16, profile=profile)
        assert [i for i, layer in enumerate(scheme.layers) if layer.key.bits == 8] == [loud]
    assert "answer loss" not in caplog.text
    without = ShapeProfile(2, 16, sensitive=text_says)
    scheme, _ = plan(parse_recipe(answer), num_layers=8, head_dim=16, profile=without)
    assert scheme.layers[0].key.bits == 8
    assert "allocating from the calibration text's sensitivity" in caplog.text


def test_two_losses_weigh_alike_whatever_their_scales():
    """ "text+answer": each loss counts as its share of its own total, so a loss measured in
    larger numbers does not drown the other: the first upgrades go to both losses' sensitive
    layers, though the answer's sensitivities are 1000x the text's."""
    both = {**ALLOCATED, "allocation": {"budget": 2.125, "choices": [2, 3],
                                        "sensitivity": "text+answer"}}  # fmt: skip
    # two upgrades: summed raw, the answer's 1000s would take both (key layer 5 and another)
    answer = {("key", i): 1000.0 for i in range(1, 8)} | {("key", 5): 20000.0}
    profile = ShapeProfile(2, 16, sensitive={("key", 0): 20.0}, answer=answer)
    scheme, _ = plan(parse_recipe(both), num_layers=8, head_dim=16, profile=profile)
    assert [i for i, layer in enumerate(scheme.layers) if layer.key.bits == 3] == [0, 5]


def test_an_unknown_allocation_loss_is_refused_with_the_choices():
    bad = {**ALLOCATED, "allocation": {**ALLOCATED["allocation"], "sensitivity": "answers"}}
    for loss in ("answers", "text+text", "text+"):
        bad["allocation"]["sensitivity"] = loss
        with pytest.raises(RecipeError, match=rf"sensitivity = '{re.escape(loss)}': use one of"):
            parse_recipe(bad)
