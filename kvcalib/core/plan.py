"""Resolve a recipe (and a calibration profile) into what the cache runs: KVScheme + KVParams.

The recipe says how; the profile supplies the numbers a recipe may ask for — static ranges,
codebooks, smoothing scales, the sink predictor, per-layer sensitivities for bit allocation.
"""

import dataclasses
import logging

from kvcalib.core.recipe import (
    Recipe,
    TensorRecipe,
    layer_scheme,
    load_recipe,
    with_bits,
)
from kvcalib.errors import ProfileError, RecipeError
from kvcalib_runtime.cache.scheme import KVParams, KVScheme
from kvcalib_runtime.checkpoint import checks
from kvcalib_runtime.layouts import Kind
from kvcalib_runtime.model.geometry import Geometry

log = logging.getLogger("kvcalib")


def codebook_variant(name: str, t: TensorRecipe) -> str:
    """The profile's name for the normalized domain a codebook of this tensor recipe lives in:
    tensor, granularity with its group size, key position, rotation, symmetry and outlier
    fraction, e.g. "key:channel64:pre_rope", "value:token:hadamard:symmetric" or
    "value:vector:outliers0.01". Levels are fitted where the quantizer uses them: on each
    group's range with its outliers left out (for "static", the calibrated range with that
    fraction left out). The clip ratio does not enter. A "vq" tensor's codebook of vectors
    (profile tensor vqbook.{variant}.{bits}) is named by its vectors, their pairing, scope and
    weighting, e.g. "key:vq2:pre_rope:rope:head:fisher" or "value:vq4:layer:plain"; a scalar
    codebook weighted by the answer loss too ends in ":answer"."""
    if t.layout.vectors:
        parts = [name, f"vq{t.group_size}"] + ([t.position] if name == "key" else [])
        parts += ["rope"] if t.pairing == "rope" else []
        return ":".join([*parts, t.codebook_scope, t.codebook_weight])
    parts = [name, f"{t.granularity}{t.group_size or ''}"]
    if name == "key":
        parts.append(t.position)
    if t.rotation != "none":
        parts.append("hadamard")
    if t.symmetric:
        parts.append("symmetric")
    if t.outliers:
        parts.append(f"outliers{t.outliers:g}")
    if t.codebook_weight == "fisher+answer":
        parts.append("answer")
    return ":".join(parts)


def with_residual(recipe: Recipe, residual: int, option: str = "--residual") -> Recipe:
    """`recipe` with a residual window of `residual` tokens instead of its own (`kvcalib eval
    --residual`, which gives every recipe of a run the same window). Flush blocks follow the
    recipe's own rule at the new window (`flush_of`): a tensor grouped over tokens ("channel",
    KIVI's keys) flushes the whole window at once, so the window must be a positive multiple of
    its token group; per-token tensors flush one token at a time; an explicit flush is kept and
    must fit in the window. Kept-exact sinks stay the recipe's own. `option` names the
    window's option in messages (`--residual N`; lm-eval's model arg is `residual=N`)."""
    where = f"recipe {recipe.name} with {_named(option, residual)}"
    if residual < 0:
        raise RecipeError(f"{where}: the residual window is a token count, use >= 0")
    for name in ("key", "value"):  # per-layer overrides are checked when the recipe is planned
        t = getattr(recipe, name)
        channel = t.quantized and t.layout.kind == Kind.CHANNEL
        if channel and (residual % t.group_size or not residual):
            raise RecipeError(
                f"{where}: its {name}s are grouped over {t.group_size} tokens and flushed a "
                f"window at a time; use a positive multiple of {t.group_size}"
            )
        if t.quantized and t.flush and t.flush > max(residual, 1):
            raise RecipeError(f"{where}: its {name} flush of {t.flush} tokens exceeds the window")
    return dataclasses.replace(recipe, residual=residual)


def _named(option: str, value) -> str:
    return f"{option}{value}" if option.endswith("=") else f"{option} {value}"


def scheme_with_residual(
    scheme: KVScheme, residual: int, name: str, option: str = "--residual"
) -> KVScheme:
    """A resolved scheme (a converted checkpoint's) with the residual window `residual`, by the
    rule of `with_residual`: "channel" tensors flush the window, others keep their flush."""
    where = f"{name} with {_named(option, residual)}"
    layers = []
    for i, layer in enumerate(scheme.layers):
        flush = {}
        for kind in ("key", "value"):
            spec = getattr(layer, kind)
            if spec is not None and spec.layout.kind == Kind.CHANNEL:
                flush[f"{kind}_flush"] = residual
        try:
            layers.append(dataclasses.replace(layer, **flush))
        except ValueError as e:
            raise RecipeError(f"{where}, layer {i}: {e}") from None
    try:
        return dataclasses.replace(scheme, layers=tuple(layers), residual=residual)
    except ValueError as e:
        raise RecipeError(f"{where}: {e}") from None


def plan(
    recipe: Recipe,
    *,
    num_layers: int | None = None,
    head_dim: int | None = None,
    profile=None,
    geometry: Geometry | None = None,
    windows: tuple[int | None, ...] | None = None,
) -> tuple[KVScheme, KVParams]:
    """The per-layer scheme and calibrated tensors of `recipe` for a model of `num_layers`
    decoder layers (and heads of `head_dim` channels, checked against token groups; per layer
    its sliding window or None, `Geometry.windows`, for `quantized_layers = "global"`).

    With the model's `geometry` (which then gives all three), the result is also checked as
    the runtime checks a side-car (kvcalib_runtime.checkpoint.checks): sizes within the model's
    context (RecipeError), calibrated tensors that mean what they say (ProfileError)."""
    if geometry is not None:
        num_layers, head_dim, windows = geometry.layers, geometry.head_dim, geometry.windows
    where = f"recipe {recipe.name}"
    if recipe.external:
        raise RecipeError(f"{where} runs through {recipe.external}, not kvcalib's cache")
    if beyond := [i for i in recipe.override_layers if i >= num_layers]:
        raise RecipeError(
            f"{where}: [[layers]] index {beyond[0]} names a layer the model does not have; "
            f"it has {num_layers}: use indices 0-{num_layers - 1}"
        )
    if recipe.needs_profile and profile is None:
        raise ProfileError(f"{where} needs calibrated tensors: pass --profile DIR")
    windows = (None,) * num_layers if windows is None else windows
    assert len(windows) == num_layers, "one window (or None) per layer"
    quantized = [recipe.quantized_layers == "all" or w is None for w in windows]
    bits = None
    losses = recipe.allocation.losses if recipe.allocation else ()
    if "answer" in losses and profile.has_sensitivity() and not profile.has_sensitivity("answer"):
        log.warning(
            f"note: {where} allocates bits per layer from the answer loss of retrieval prompts, "
            "and the profile has none (calibrated before them, with the probe, or without a "
            "prompt that fits: profile.json's probe.answer says which): allocating from the "
            "calibration text's sensitivity"
        )
        losses = ("text",)
    if recipe.allocation and not profile.has_sensitivity():
        log.warning(
            f"note: {where} allocates bits per layer from sensitivities, and the profile has "
            f"none (calibrated with --sensitivity none): {recipe.key.bits}-bit keys and "
            f"{recipe.value.bits}-bit values in every layer"
        )
    elif recipe.allocation:
        bits = _allocate(recipe, quantized, profile, losses)
    layers, params = [], KVParams()
    for i in range(num_layers):
        key, value = recipe.tensor("key", i), recipe.tensor("value", i)
        if head_dim is None and (key.split_fraction or value.split_fraction):
            raise RecipeError(f"{where}: split_fraction needs the model's head_dim to plan")
        if not quantized[i]:  # a sliding layer under quantized_layers = "global"
            key, value = TensorRecipe(), TensorRecipe()
        elif bits is not None:
            key = with_bits(key, bits["key"][i])
            value = with_bits(value, bits["value"][i])
        try:
            layers.append(layer_scheme(key, value, recipe.residual, head_dim))
            if head_dim is not None:
                for spec in (layers[-1].key, layers[-1].value):
                    if spec is not None:
                        spec.layout.check_head(head_dim)
        except ValueError as e:
            raise RecipeError(f"{where}, layer {i}: {e}") from None
        if profile is not None:
            _calibrated(params, profile, i, key, value, head_dim)
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
    if geometry is not None:
        _check_runtime(where, scheme, params, geometry, profile)
    return scheme, params


def _check_runtime(where: str, scheme, params, geometry: Geometry, profile) -> None:
    """What the runtime would refuse when it loads the side-car, refused here instead."""
    try:
        checks.check_scheme(scheme, geometry)
    except ValueError as e:
        raise RecipeError(f"{where}: {e}") from None
    try:
        checks.check_params(scheme, params, geometry)
    except ValueError as e:
        path = getattr(profile, "path", None)
        raise ProfileError(
            f"{where} with profile {path or '(in memory)'}: {e}; calibrate the profile again"
        ) from None


def _calibrated(params: KVParams, profile, i: int, key, value, head_dim) -> None:
    """Fill layer i's static ranges, codebooks, outlier channels and smoothing scales from the
    profile (key, value: the layer's TensorRecipes; head_dim resolves a split_fraction)."""
    if key.quantized and key.layout.calibrated_range:
        params.key_range[i] = profile.range("key", i, position=key.position, outliers=key.outliers)
    if value.quantized and value.layout.calibrated_range:
        params.value_range[i] = profile.range("value", i, outliers=value.outliers)
    for name, t in (("key", key), ("value", value)):
        if t.quantized and t.codebook == "calibrated":
            read = profile.vector_codebook if t.layout.vectors else profile.codebook
            getattr(params, f"{name}_codebook")[i] = read(codebook_variant(name, t), i, t.bits)
    if key.quantized and key.split(head_dim):
        n = key.split(head_dim)
        params.key_split[i] = profile.outlier_channels("key", i, n, position=key.position)
    if value.quantized and value.split(head_dim):
        params.value_split[i] = profile.outlier_channels("value", i, value.split(head_dim))
    if key.smooth > 0:
        params.key_smooth[i] = profile.smoothing(i, key.smooth, position=key.position)
    if i in params.key_smooth and i in params.key_range:
        lo, hi = params.key_range[i]
        params.key_range[i] = (lo / params.key_smooth[i], hi / params.key_smooth[i])


def _allocate(recipe: Recipe, quantized: list[bool], profile, losses) -> dict[str, list[int]]:
    """Per-layer key and value bits minimizing the summed sensitivity (KL divergence when only
    that tensor of that layer is quantized) under a mean-bits budget over the quantized layers:
    greedy upgrades by the largest KL saved per extra bit, which is optimal for convex per-item
    costs. Each of `losses` (kvcalib.core.profile.SENSITIVITY_LOSSES) counts as its share of
    its own total at the narrowest width, so that several weigh alike (one alone allocates as
    its raw sensitivities would: the greedy is blind to a common scale)."""
    choices = sorted(recipe.allocation.choices)
    num_layers, count = len(quantized), sum(quantized)
    keys = [
        (name, i, b)
        for name in ("key", "value")
        for i in range(num_layers)
        for b in choices
        if quantized[i]
    ]
    kl = dict.fromkeys(keys, 0.0)
    for loss in losses:
        one = {k: profile.sensitivity(*k, loss) for k in keys}
        total = sum(v for (_, _, b), v in one.items() if b == choices[0]) or 1.0
        for k, v in one.items():
            kl[k] += v / total
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
    """`plan` for a transformers model, or for its config alone (a config.json dict or a
    transformers config: no weights needed); `recipe` is a Recipe, a preset name or a path."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    config = getattr(model, "config", model)
    return plan(recipe, geometry=Geometry.from_config(config), profile=profile)
