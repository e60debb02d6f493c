"""Recipes are a closed, typed schema: presets validate; typos and impossible combinations are
refused with the key and the fix named."""

import json
from pathlib import Path

import pytest

from kvcalib.core.plan import plan
from kvcalib.core.recipe import load_recipe, parse_recipe, presets
from kvcalib.errors import RecipeError

PEERS = [
    "fp16",
    "per-token-2",
    "per-token-3",
    "per-token-4",
    "kivi-2",
    "kivi-4",
    "kvquant-2",
    "kvquant-3",
    "quarot-kv4",
    "turboquant-2.5",
    "turboquant-3.5",
    "llamacpp-q4_0",
    "llamacpp-q8_0",
    "hf-quanto-2",
    "hf-quanto-4",
]


def test_every_peer_preset_is_shipped():
    assert set(PEERS) <= set(presets())


@pytest.mark.parametrize("name", presets())
def test_every_preset_validates_and_cites_its_source(name):
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe.description
    text = Path(recipe.source).read_text()
    assert text.lstrip().startswith("#")  # a comment saying what it reproduces
    if not recipe.needs_profile and not recipe.external:
        scheme, _ = plan(recipe, num_layers=3)
        assert len(scheme.layers) == 3


def test_kivi_reproduces_the_paper_setting():
    scheme, _ = plan(load_recipe("kivi-2"), num_layers=1)
    layer = scheme.layers[0]
    assert scheme.residual == 128
    assert (layer.key.granularity, layer.key.group_size, layer.key_flush) == ("channel", 32, 128)
    assert (layer.value.granularity, layer.value.group_size, layer.value_flush) == ("token", 32, 1)
    assert not layer.key.symmetric and not layer.value.symmetric


@pytest.mark.parametrize("bits", [2, 3])
def test_kvquant_stores_as_its_code_does(bits):
    """Keys: static pre-RoPE ranges leaving 1% out, one exact slot per token and head for the
    element farthest outside; values: one range per token over every KV head, 1% outliers per
    vector; Fisher codebooks for both; token 0 kept; no residual window."""
    recipe = load_recipe(f"kvquant-{bits}")
    k, v = recipe.key.spec(), recipe.value.spec()
    assert (k.bits, k.granularity, k.outliers, k.outlier_slots, k.slot_rule) == (
        bits, "static", 0.01, 1, "outside"
    )  # fmt: skip
    assert recipe.key.position == "pre_rope" and k.codebook and v.codebook
    assert (v.bits, v.granularity, v.group_size, v.outliers) == (bits, "vector", 0, 0.01)
    assert (recipe.sinks_first, recipe.residual, recipe.sinks_predicted) == (1, 0, False)
    assert recipe.needs_profile


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name, bits, outlier_bits", [("2.5", 2, 4), ("3.5", 3, 5)])
def test_turboquant_splits_a_quarter_of_the_channels(name, bits, outlier_bits, head_dim):
    # The paper's ratio at every head size (Gemma 3's heads are 256 wide: a fixed 16 there
    # would store 2.25 bits and call it 2.5), planned as the cache will hold it.
    from support.tiny import ShapeProfile

    from kvcalib.core.plan import plan

    recipe = load_recipe(f"turboquant-{name}")
    quarter = head_dim // 4
    for t in (recipe.key, recipe.value):
        spec = t.spec(head_dim)
        assert spec.method == "turboquant"
        assert spec.layout.sets(head_dim) == ((quarter, outlier_bits), (head_dim - quarter, bits))
        sets = spec.layout.sets(head_dim)
        assert sum(c * b for c, b in sets) / head_dim == float(name)  # its label
        assert t.rotation == "none" and t.codebook == "uniform"  # the rotation is TurboQuant's
    scheme, params = plan(
        recipe, num_layers=2, head_dim=head_dim, profile=ShapeProfile(1, head_dim)
    )
    assert scheme.layers[1].key.split_channels == quarter
    assert params.value_split[1].shape == (1, quarter)  # the profile's channels, as many
    assert recipe.key.position == "post_rope" and recipe.residual == 0 and not recipe.sinks_first
    assert recipe.needs_profile  # the outlier channels only


@pytest.mark.parametrize("bits", [4, 8])
def test_llamacpp_rotates_and_blocks_of_32(bits):
    recipe = load_recipe(f"llamacpp-q{bits}_0")
    scheme, _ = plan(recipe, num_layers=2, head_dim=64)
    for layer in scheme.layers:
        for spec in (layer.key, layer.value):
            assert (spec.method, spec.bits, spec.group_size, spec.symmetric) == (
                "ggml",
                bits,
                32,
                True,
            )
        assert layer.key_rotation and layer.value_rotation and layer.key_position == "post_rope"
    assert scheme.rotation_seed is None  # llama.cpp's Hadamard has no random signs
    assert (scheme.residual, scheme.num_sink_slots) == (0, 0) and not recipe.needs_profile


def test_typo_is_refused_with_the_key_named():
    with pytest.raises(RecipeError, match=r"unknown key 'key\.bitz'; did you mean 'key\.bits'"):
        parse_recipe({"name": "x", "key": {"bitz": 2}})


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        ({"sinks": {"frist": 4}}, r"sinks\.frist"),
        ({"allocation": {"budget": 3, "choice": [2]}}, r"allocation\.choice"),
        ({"layers": [{"index": 0, "indx": 1}]}, r"layers\[0\]\.indx"),
        ({"layers": [{"index": 0}, {"index": 1, "key": {"bitz": 2}}]}, r"layers\[1\]\.key\.bitz"),
        ({"layers": [{"index": 0, "value": {"smooth": 0.5}}]}, r"layers\[0\]\.value\.smooth"),
    ],
)
def test_unknown_keys_are_refused_at_every_depth_by_their_path(doc, path):
    with pytest.raises(RecipeError, match=rf"unknown key '{path}'"):
        parse_recipe({"name": "x", **doc})


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"name": "x", "key": {"bits": "2"}}, r"'key\.bits' must be int, not str"),
        ({"name": "x", "key": {"bits": 7}}, r"bits = 7 is not supported"),
        ({"name": "x", "key": {"bits": 2, "granularity": "row"}}, r"use one of token, channel"),
        ({"name": "x", "key": {"bits": 2, "granularity": "channel"}}, r"group_size > 0"),
        (
            {"name": "x", "value": {"bits": 2, "position": "pre_rope"}},
            r"unknown key 'value\.position'",
        ),
        (
            {"name": "x", "key": {"bits": 2, "rotation": "hadamard", "position": "pre_rope"}},
            r"set key\.position = 'post_rope'",
        ),
        ({"name": "x", "sinks": {"predicted": True}}, r"needs sinks\.budget > 0"),
        (
            {"name": "x", "key": {"bits": 2, "granularity": "static", "rotation": "hadamard"}},
            r"static ranges are calibrated unrotated",
        ),
        (
            {
                "name": "x",
                "residual": 4,
                "key": {"bits": 2, "granularity": "channel", "group_size": 32},
            },
            r"multiple of its token group",
        ),
        ({"name": "x", "key": {"bits": 2, "flush": 4}}, r"with no residual window"),
        ({"key": {"bits": 2}}, r"missing key 'name'"),
        ({"name": "x", "key": {"bits": 2, "method": "nf4"}}, r"use one of affine, ggml"),
        ({"name": "x", "key": {"bits": 2, "slot_code": "fp4"}}, r"use one of exact, fp8"),
        (
            {"name": "x", "key": {"bits": 2, "outliers": 0.1, "slot_code": "fp8"}},
            r"slot_code = 'fp8' .* for 'static' granularity with outlier_slots >= 1",
        ),
        (
            {"name": "x", "key": {"bits": 4, "group_size": 32, "method": "ggml"}},
            r"\[key\] method 'ggml' has its own numerics: set symmetric = true",
        ),
    ],
)
def test_impossible_recipes_say_the_fix(doc, message):
    with pytest.raises(RecipeError, match=message):
        recipe = parse_recipe(doc)
        plan(recipe, num_layers=2)


def test_one_byte_slots_reach_the_plan():
    """slot_code = "fp8" on static keys is the QuantSpec's, layer by layer."""
    doc = {"bits": 2, "granularity": "static", "outliers": 0.01, "outlier_slots": 1}
    recipe = parse_recipe({"name": "x", "key": {**doc, "slot_code": "fp8"}})
    assert recipe.key.spec().slot_code == "fp8"
    assert parse_recipe({"name": "x", "key": doc}).key.spec().slot_code == "exact"


def test_layer_overrides_apply():
    recipe = parse_recipe(
        {
            "name": "x",
            "key": {"bits": 2},
            "value": {"bits": 2},
            "layers": [{"index": "1-2", "key": {"bits": 4}}],
        }
    )
    scheme, _ = plan(recipe, num_layers=4)
    assert [layer.key.bits for layer in scheme.layers] == [2, 4, 4, 2]
    assert [layer.value.bits for layer in scheme.layers] == [2, 2, 2, 2]


def test_unknown_preset_suggests_close_names():
    with pytest.raises(RecipeError, match="did you mean kivi-2"):
        load_recipe("kivi2")


def test_profile_needed_is_said():
    from kvcalib.errors import ProfileError

    with pytest.raises(ProfileError, match="needs calibrated tensors: pass --profile"):
        plan(load_recipe("kvquant-3"), num_layers=2)


def test_a_folder_named_like_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    """A name without a / or .toml is a preset, whatever the working directory holds: the
    natural `-o kvcalib-2` folder broke `--recipe kvcalib-2` (and every default calibration,
    which loads the presets)."""
    from kvcalib.calibration.codebooks import preset_variants

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kvcalib-2").mkdir()
    (tmp_path / "mine").write_text('name = "mine"\n')
    assert load_recipe("kvcalib-2").name == "kvcalib-2"
    assert preset_variants()
    with pytest.raises(RecipeError, match=r"recipe kvcalib-2: not a regular file; pass a TOML"):
        load_recipe("./kvcalib-2")  # a path: the folder
    with pytest.raises(RecipeError, match=r"recipe mine: no such preset; .*\(\./NAME\.toml"):
        load_recipe("mine")  # a file of that name is not read unless named as a path
    assert load_recipe("./mine").name == load_recipe(tmp_path / "mine").name == "mine"
    with pytest.raises(RecipeError, match=r"recipe missing\.toml: no such file; pass a TOML"):
        load_recipe("missing.toml")


def test_convert_takes_the_preset_beside_a_folder_of_its_name(corpus, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from kvcalib.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "per-token-4").mkdir()  # kvcalib-2 wants larger heads than the tiny llama
    args = ["convert", str(corpus.src), "--profile", str(corpus.profile), "--recipe", "per-token-4"]
    result = CliRunner().invoke(main, [*args, "-o", "out"])
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "out" / "kvcalib.json").read_text())
    assert meta["recipe"]["name"] == "per-token-4"


def test_a_recipe_saved_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b'\xef\xbb\xbfname = "bom"\n[key]\nbits = 4\n')
    assert load_recipe(path).key.bits == 4  # was "Invalid statement (line 1, column 1)"


def test_two_overrides_of_one_field_of_a_layer_are_refused_naming_both():
    """The later entry used to win silently (issue 52); entries setting different fields of a
    layer still merge."""
    doc = {"name": "x", "key": {"bits": 2}, "value": {"bits": 2}}
    layers = [{"index": "0-3", "key": {"bits": 4}}, {"index": [5, 2], "key": {"bits": 3}}]
    with pytest.raises(
        RecipeError,
        match=r"recipe x: layers\[0\] and layers\[1\] both set key\.bits of layer 2; set each "
        r"layer's key\.bits in one \[\[layers\]\] entry",
    ):
        parse_recipe({**doc, "layers": layers})
    merged = [{"index": "0-3", "key": {"bits": 4}}, {"index": 2, "value": {"bits": 4}}]
    scheme, _ = plan(parse_recipe({**doc, "layers": merged}), num_layers=4)
    assert [(layer.key.bits, layer.value.bits) for layer in scheme.layers] == [
        (4, 2), (4, 2), (4, 4), (4, 2)
    ]  # fmt: skip


def test_a_version_is_a_label_that_changes_no_plan():
    # Presets carry `version`; a file of one's own may leave it out. The version labels records
    # and never reaches the scheme, so adding it kept every record's plan digest.
    kv2 = load_recipe("kvcalib-2")
    doc = {"name": "x", "key": {"bits": 2}, "value": {"bits": 2}}
    assert kv2.version == 1 and parse_recipe(doc).version is None
    assert plan(parse_recipe({**doc, "version": 7}), num_layers=2) == plan(
        parse_recipe(doc), num_layers=2
    )
    with pytest.raises(RecipeError, match=r"version = 0: use an integer >= 1"):
        parse_recipe({**doc, "version": 0})
    with pytest.raises(RecipeError, match=r"'version' must be int"):
        parse_recipe({**doc, "version": "1"})
    assert parse_recipe({"name": "q", "external": "hf-quanto", "version": 2}).version == 2
