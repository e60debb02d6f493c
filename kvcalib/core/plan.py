"""Resolve a recipe (and a calibration profile) into what the cache runs: KVScheme + KVParams.

The recipe says how; the profile supplies the numbers a recipe may ask for — static ranges,
codebooks, smoothing scales, the sink predictor, per-layer sensitivities for bit allocation.
"""

import dataclasses

from kvcalib.core.recipe import Recipe, TensorRecipe, load_recipe
from kvcalib.errors import ProfileError, RecipeError
from kvcalib_runtime.geometry import Geometry
from kvcalib_runtime.scheme import KVParams, KVScheme, LayerScheme


def codebook_variant(name: str, t: TensorRecipe) -> str:
    """The profile's name for the normalized domain a codebook of this tensor recipe lives in:
    tensor, granularity with its group size, key position, rotation, symmetry, e.g.
    "key:channel64:pre_rope" or "value:token:hadamard:symmetric". (Clip ratio and outlier
    fraction do not enter: levels are fitted to the unclipped, 1%-outlier-free domain.)"""
    parts = [name, f"{t.granularity}{t.group_size or ''}"]
    if name == "key":
        parts.append(t.position)
    if t.rotation != "none":
        parts.append("hadamard")
    if t.symmetric:
        parts.append("symmetric")
    return ":".join(parts)


def flush_of(t: TensorRecipe, residual: int) -> int:
    """The flush block: as the recipe says, else R for token groups (KIVI's keys), else 1."""
    if t.flush:
        return t.flush
    return residual if t.granularity == "channel" and residual else 1


def plan(
    recipe: Recipe,
    *,
    num_layers: int,
    head_dim: int | None = None,
    profile=None,
    windows: tuple[int | None, ...] | None = None,
) -> tuple[KVScheme, KVParams]:
    """The per-layer scheme and calibrated tensors of `recipe` for a model of `num_layers`
    decoder layers (and heads of `head_dim` channels, checked against token groups; per layer
    its sliding window or None, `Geometry.windows`, for `quantized_layers = "global"`)."""
    where = f"recipe {recipe.name}"
    if recipe.external:
        raise RecipeError(f"{where} runs through {recipe.external}, not kvcalib's cache")
    if recipe.needs_profile and profile is None:
        raise ProfileError(f"{where} needs calibrated tensors: pass --profile DIR")
    windows = (None,) * num_layers if windows is None else windows
    assert len(windows) == num_layers, "one window (or None) per layer"
    quantized = [recipe.quantized_layers == "all" or w is None for w in windows]
    bits = _allocate(recipe, quantized, profile) if recipe.allocation else None
    layers, params = [], KVParams()
    for i in range(num_layers):
        key, value = recipe.tensor("key", i), recipe.tensor("value", i)
        if not quantized[i]:  # a sliding layer under quantized_layers = "global"
            key, value = TensorRecipe(), TensorRecipe()
        elif bits is not None:
            key = dataclasses.replace(key, bits=bits["key"][i])
            value = dataclasses.replace(value, bits=bits["value"][i])
        try:
            layers.append(
                LayerScheme(
                    key=key.spec(),
                    value=value.spec(),
                    key_position=key.position,
                    key_rotation=key.rotation == "hadamard",
                    value_rotation=value.rotation == "hadamard",
                    key_flush=flush_of(key, recipe.residual),
                    value_flush=flush_of(value, recipe.residual),
                )
            )
            if head_dim is not None:
                for spec in (layers[-1].key, layers[-1].value):
                    if spec is not None and spec.granularity == "token":
                        spec.channel_group(head_dim)
        except ValueError as e:
            raise RecipeError(f"{where}, layer {i}: {e}") from None
        if profile is not None:
            _calibrated(params, profile, i, key, value)
    if recipe.sinks_predicted:
        params.sink_predictor = profile.sink_predictor()
    try:
        scheme = KVScheme(
            layers=tuple(layers),
            residual=recipe.residual,
            sinks_first=recipe.sinks_first,
            sink_budget=recipe.sink_budget,
            rotation_seed=recipe.rotation_seed,
        )
    except ValueError as e:
        raise RecipeError(f"{where}: {e}") from None
    return scheme, params


def _calibrated(params: KVParams, profile, i: int, key: TensorRecipe, value: TensorRecipe) -> None:
    """Fill layer i's static ranges, codebooks and smoothing scales from the profile."""
    if key.quantized and key.granularity == "static":
        params.key_range[i] = profile.range("key", i, position=key.position, outliers=key.outliers)
    if value.quantized and value.granularity == "static":
        params.value_range[i] = profile.range("value", i, outliers=value.outliers)
    if key.quantized and key.codebook == "calibrated":
        params.key_codebook[i] = profile.codebook(codebook_variant("key", key), i, key.bits)
    if value.quantized and value.codebook == "calibrated":
        params.value_codebook[i] = profile.codebook(codebook_variant("value", value), i, value.bits)
    if key.smooth > 0:
        params.key_smooth[i] = profile.smoothing(i, key.smooth, position=key.position)
    if i in params.key_smooth and i in params.key_range:
        lo, hi = params.key_range[i]
        params.key_range[i] = (lo / params.key_smooth[i], hi / params.key_smooth[i])


def _allocate(recipe: Recipe, quantized: list[bool], profile) -> dict[str, list[int]]:
    """Per-layer key and value bits minimizing the summed sensitivity (KL divergence when only
    that tensor of that layer is quantized) under a mean-bits budget over the quantized layers:
    greedy upgrades by the largest KL saved per extra bit, which is optimal for convex per-item
    costs."""
    choices = sorted(recipe.allocation.choices)
    num_layers, count = len(quantized), sum(quantized)
    kl = {
        (name, i, b): profile.sensitivity(name, i, b)
        for name in ("key", "value")
        for i in range(num_layers)
        for b in choices
        if quantized[i]
    }
    bits = {name: [choices[0]] * num_layers for name in ("key", "value")}
    budget = recipe.allocation.budget * 2 * count
    spent = choices[0] * 2 * count
    while True:
        best = None
        for name in ("key", "value"):
            for i in (i for i in range(num_layers) if quantized[i]):
                now = bits[name][i]
                up = next((b for b in choices if b > now), None)
                if up is None or spent + up - now > budget:
                    continue
                gain = (kl[name, i, now] - kl[name, i, up]) / (up - now)
                if best is None or gain > best[0]:
                    best = (gain, name, i, up)
        if best is None:
            return bits
        _, name, i, up = best
        spent += up - bits[name][i]
        bits[name][i] = up


def plan_for_model(model, recipe, profile=None) -> tuple[KVScheme, KVParams]:
    """`plan` for a transformers model; `recipe` is a Recipe, a preset name or a path."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    geo = Geometry.from_config(model.config)
    return plan(
        recipe, num_layers=geo.layers, head_dim=geo.head_dim, profile=profile, windows=geo.windows
    )
