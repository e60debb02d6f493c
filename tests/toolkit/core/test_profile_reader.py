"""The profile reader: a damaged profile parses into something sane or raises ProfileError.

Damage comes from hypothesis: profile.json with keys dropped, values of any type, unknown keys
(tests/support/mutate.py); profile.safetensors with a value made NaN, Inf or huge, a tensor negated,
reversed or cut. Whatever `Profile.load` accepts must give what plan asks of it — finite
ordered ranges, sorted codebooks in their domain, positive RoPE-pair-equal smoothing, finite
sensitivities, a predictor of the model's dims — or a ProfileError when plan asks.
"""

import json
import math
import shutil
import tomllib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from support.corpus import FULL_RECIPE
from support.mutate import mutated

from kvcalib.core.plan import codebook_variant, plan
from kvcalib.core.profile import Profile
from kvcalib.core.recipe import load_recipe, parse_recipe
from kvcalib.errors import ProfileError
from kvcalib_runtime.model.geometry import Geometry

# What plan reads of a profile, all of it: static ranges, codebooks, smoothing, sensitivities.
ALLOCATED = (
    FULL_RECIPE.replace('name = "full"', 'name = "allocated"') + "[allocation]\nbudget = 3\n"
)
RECIPES = [
    load_recipe("kvquant-3"),
    *(parse_recipe(tomllib.loads(t)) for t in (FULL_RECIPE, ALLOCATED)),
]
FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _copy(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "p"
    path.mkdir()
    for name in ("profile.json", "profile.safetensors"):
        shutil.copyfile(corpus.profile / name, path / name)
    return path


def _assert_sane(profile: Profile, corpus) -> None:
    """What plan reads from `profile`, checked value by value; ProfileError is allowed only as
    the answer to a question the profile cannot answer (a missing tensor, width or phase)."""
    layers = profile.meta["model"]["num_layers"]
    assert type(layers) is int and layers >= 1
    for i in range(layers):
        for tensor, position in (("key", "pre_rope"), ("key", "post_rope"), ("value", "")):
            try:
                lo, hi = profile.range(tensor, i, position=position or "post_rope", outliers=0.01)
            except ProfileError as e:
                assert "\n" not in str(e)
                continue
            assert torch.isfinite(lo).all() and torch.isfinite(hi).all() and (lo <= hi).all()
        for name in (n for n in profile.tensors if n.startswith("codebook.")):
            book = profile.tensors[name][i]
            low = -1 if name.split(".")[1].endswith(":symmetric") else 0
            assert torch.isfinite(book).all() and (book.diff() >= 0).all()
            assert low - 1e-6 <= book.min() and book.max() <= 1 + 1e-6
            assert book.numel() == 2 ** int(name.split(".")[-1])
        try:
            s = profile.smoothing(i, 0.5, position="pre_rope")
            assert torch.isfinite(s).all() and (s > 0).all()
            for tensor in ("key", "value"):
                assert math.isfinite(profile.sensitivity(tensor, i, 2))
        except ProfileError as e:
            assert "\n" not in str(e)
    p = profile.meta.get("sink_predictor")
    if p is not None:
        predictor = profile.sink_predictor()
        assert math.isfinite(predictor.threshold) and 0 <= predictor.layer < layers
    config = json.loads((corpus.src / "config.json").read_text())
    for recipe in RECIPES:
        try:
            plan(recipe, geometry=Geometry.from_config(config), profile=profile)
        except ProfileError as e:
            assert "\n" not in str(e)


def _load_or_profile_error(path, corpus) -> None:
    try:
        profile = Profile.load(path)
    except ProfileError as e:
        assert "\n" not in str(e)
        return
    _assert_sane(profile, corpus)


@FUZZ
@given(st.data())
def test_a_mutated_profile_json_loads_sane_or_raises(corpus, tmp_path_factory, data):
    path = _copy(corpus, tmp_path_factory)
    meta = json.loads((path / "profile.json").read_text())
    (path / "profile.json").write_text(json.dumps(data.draw(mutated(meta))))
    _load_or_profile_error(path, corpus)


@FUZZ
@given(st.data())
def test_damaged_profile_numbers_load_sane_or_raise(corpus, tmp_path_factory, data):
    path = _copy(corpus, tmp_path_factory)
    tensors = load_file(path / "profile.safetensors")
    name = data.draw(st.sampled_from(sorted(tensors)))
    t = tensors[name].clone()
    flat = t.view(-1)
    i = data.draw(st.integers(0, flat.numel() - 1))
    edit = data.draw(st.sampled_from(["nan", "inf", "huge", "negate", "flip", "cut"]))
    if edit in ("nan", "inf", "huge"):
        value = {"nan": math.nan, "inf": math.inf, "huge": 3e38}[edit]
        flat[i] = value if t.is_floating_point() else -1
    elif edit == "negate":
        t = -t if t.dtype != torch.uint8 else t
    elif edit == "flip":
        t = t.flip(-1)
    else:
        t = t[..., : max(t.shape[-1] - 1, 0)] if t.dim() else t
    tensors[name] = t.contiguous()
    save_file(tensors, path / "profile.safetensors", metadata={"format": "pt"})
    _load_or_profile_error(path, corpus)


def test_codebook_variant_names_what_the_reader_checks():
    """The reader's domain rule ([-1, 1] for ":symmetric") is the planner's naming."""
    recipe = load_recipe("kvcalib-3")  # symmetric codebook values, static keys
    assert codebook_variant("value", recipe.value).endswith(":symmetric")
    assert not codebook_variant("key", recipe.key).endswith(":symmetric")
