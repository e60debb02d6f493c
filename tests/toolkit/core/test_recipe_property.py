"""No error deferred to the last command: any recipe the schema can express either fails to
parse with one clear line (RecipeError), or is refused by `convert` for a fact of the model that
a recipe cannot know (a group that does not divide head_dim, a layer the model lacks, a window
beyond its context) before a byte is written — or it converts, loads in the runtime and
generates. A recipe that parses and then breaks in `generate` is the bug this test looks for.

The recipes are drawn over every key of the schema, with values inside and outside their
ranges, on a tiny llama (2 layers, head_dim 16, context 128) with a fake profile that supplies
every calibrated tensor a recipe may ask for.
"""

import shutil

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.tiny import save_with_tokenizer, tiny_model

import kvcalib_runtime
from kvcalib.conversion.convert import convert
from kvcalib.core.recipe import parse_recipe
from kvcalib.errors import RecipeError
from kvcalib_runtime.cache.scheme import SinkPredictor

LAYERS, KV_HEADS, HEAD_DIM, CONTEXT = 2, 2, 16, 128
# What only the model can refute: refusals allowed at convert, before any write.
MODEL_FACTS = (
    "does not divide head_dim",
    "names a layer the model does not have",
    "beyond the model's context",
)


class FakeProfile:
    """Every calibrated tensor plan may ask for, sane: ranges around the tiny model's keys,
    sorted codebooks in their domain, positive RoPE-pair-equal smoothing, a sink predictor,
    sensitivities that fall with the bit width."""

    fingerprint, path = "fake", None

    def check_model(self, source):
        pass

    def range(self, tensor, layer, *, position="post_rope", outliers=0.0):
        g = torch.Generator().manual_seed(layer)
        width = torch.rand(KV_HEADS, HEAD_DIM, generator=g) + 0.5
        return -width, width

    def codebook(self, variant, layer, bits):
        levels = torch.linspace(0, 1, 2**bits) ** 1.5
        return levels * 2 - 1 if variant.endswith(":symmetric") else levels

    def smoothing(self, layer, alpha, *, position):
        half = torch.linspace(0.5, 2.0, HEAD_DIM // 2) ** alpha
        return torch.cat((half, half)).expand(KV_HEADS, -1).contiguous()

    def sink_predictor(self):
        return SinkPredictor(layer=0, dims=(1, 5), threshold=50.0)

    def has_sensitivity(self, loss="text"):
        return True

    def sensitivity(self, tensor, layer, bits, loss="text"):
        return (layer + 1) / 2**bits


def _pick(valid, bad=()):
    """One of `valid`, or (about one draw in five per field, when there are some) of `bad`:
    out-of-range values, so that both halves of the property are exercised often."""
    valid, bad = list(valid), list(bad)
    return st.sampled_from(valid * max(1, 4 * len(bad) // len(valid)) + bad)


def _tensor(key: bool):
    fields = {
        "bits": _pick([2, 3, 4, 8, 16], [5, 7]),
        "granularity": _pick(["token", "channel", "static", "vector"], ["row"]),
        "group_size": _pick([0, 4, 8, 16, 32], [3]),
        "symmetric": st.booleans(),
        "clip": _pick([1.0, 0.9], [0.0, 1.5]),
        "codebook": _pick(["uniform", "calibrated"]),
        "outliers": _pick([0.0, 0.01, 0.05], [0.6]),
        "outlier_slots": _pick([0, 1, 2]),
        "slot_rule": _pick(["outside", "error"]),
        "flush": _pick([0, 1, 4, 8, 16], [-1]),
        "rotation": _pick(["none", "hadamard"]),
    }
    if key:
        fields |= {"position": _pick(["pre_rope", "post_rope"]), "smooth": _pick([0, 0.5], [1.5])}
    return st.fixed_dictionaries({}, optional=fields)


RECIPES = st.fixed_dictionaries(
    {"name": st.just("drawn")},
    optional={
        "residual": _pick([0, 4, 8, 16, 32, 64], [300, -1]),
        "rotation_seed": _pick([0, 7], [-3]),
        "key": _tensor(key=True),
        "value": _tensor(key=False),
        "sinks": st.fixed_dictionaries(
            {},
            optional={
                "first": _pick([0, 1, 4], [200]),
                "predicted": st.booleans(),
                "budget": _pick([0, 2]),
            },
        ),
        "allocation": st.fixed_dictionaries(
            {"budget": _pick([2.0, 3.0], [20.0])},
            optional={"choices": _pick([[2, 3, 4], [2, 4], [2, 4, 8]])},
        ),
        "layers": st.lists(
            st.fixed_dictionaries(
                {"index": _pick([0, 1, "0-1", [1]], [5])},
                optional={"key": _tensor(key=True), "value": _tensor(key=False)},
            ),
            max_size=2,
        ),
    },
)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    net = tiny_model("llama", max_position_embeddings=CONTEXT)
    return save_with_tokenizer(net, tmp_path_factory.mktemp("property") / "src")


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(doc=RECIPES)
def test_a_recipe_parses_or_says_why_and_then_converts_loads_and_generates(
    source, tmp_path_factory, doc
):
    try:
        recipe = parse_recipe(doc)
    except RecipeError as e:
        assert "\n" not in str(e)
        event("refused by the parser")
        return
    out = tmp_path_factory.mktemp("drawn") / "out"
    try:
        convert(source, recipe=recipe, output=out, profile=FakeProfile())
    except RecipeError as e:
        assert "\n" not in str(e)
        assert any(fact in str(e) for fact in MODEL_FACTS), str(e)
        assert not out.exists()
        event("refused by convert: a fact of the model")
        return
    model = kvcalib_runtime.load(out, device="cpu")
    [new] = model.generate([list(range(1, 101))], 3, eos_token_id=[])  # past most windows
    assert len(new) == 3 and all(0 <= t < 128 for t in new)
    event("converted, loaded, generated")
    shutil.rmtree(out)
