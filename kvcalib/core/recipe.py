"""Recipes: a closed, typed TOML schema for a KV-cache quantization method.

A recipe is parsed once, at the edge, into frozen dataclasses; an unknown key, a wrong type or
an impossible combination raises RecipeError naming the recipe, the key and the fix. Presets
live in `recipes/<name>.toml`; `load_recipe` takes a preset name or a path.

    name, description, version, residual, rotation_seed, external, quantized_layers
    [key]    bits granularity group_size symmetric clip codebook outliers outlier_slots
             slot_rule slot_code method split_channels split_fraction split_bits pairing
             metadata_code codebook_scope codebook_weight flush position rotation smooth
    [value]  bits granularity group_size symmetric clip codebook outliers outlier_slots
             slot_rule slot_code method split_channels split_fraction split_bits pairing
             metadata_code codebook_scope codebook_weight flush rotation
    [sinks]  first predicted budget
    [allocation]  budget choices sensitivity   (per-layer bits from the profile's sensitivities:
                  sensitivity "text", the calibration text's next-token loss, "answer", the
                  answer loss of retrieval prompts, or "text+answer", both weighed alike)
    [[layers]]    index key value           (per-layer overrides of [key] / [value]; entries
                                            may share a layer, never a field of it)

bits = 16 means full precision. `rotation` is "none" or "hadamard": for values a Hadamard per KV
head fused into v_proj/o_proj, for keys an online Hadamard on queries and keys after RoPE.
`codebook` is "uniform" or "calibrated" (non-uniform levels from the profile). `flush` defaults
to the residual window for "channel" granularity (KIVI flushes keys R at a time) and to 1 otherwise.
`quantized_layers` is "all" (default) or "global": then the layers with a sliding window
(Gemma's local layers, `Geometry.windows`) keep their cache in full precision (a ring of their
window) and only the global layers follow [key] / [value] (the key is not `layers`, which holds
the per-layer overrides).
`outliers` is the fraction left out of each range; exact slots per vector keep what the codes
clamp: `outlier_slots` of them for "static" granularity, chosen by `slot_rule` ("outside": the
farthest outside the range, KVQuant's; "error": the largest errors, kvcalib's) and stored as
`slot_code` says ("exact": the cache's dtype; "fp8": one byte, the delta in steps of its
channel's scale as float8 E4M3, within 1/16 of it) — see kvcalib_runtime.layouts.quant.
`metadata_code` says how a per-token group's scale and offset are stored: "dtype" (the cache's)
or "byte" (one byte each: the scale rounded up to 5 exponent and 3 mantissa bits, the offset a
zero point in 1/255 of the range; kvcalib_runtime.layouts.metabyte).
`method` is "affine" (all of the above), "ggml" (llama.cpp's q4_0 / q8_0 blocks) or
"turboquant" (TurboQuant: a random rotation and fixed Lloyd-Max levels per vector, with
`split_channels` outlier channels per head at `split_bits` bits, chosen from the profile's
channel statistics; or `split_fraction` of each head's channels, rounded, whatever the model's
head size: TurboQuant's 2.5 and 3.5 bits are a quarter of the channels at one bit more), or
"vq" (kvcalib-1.5's vector codes: `bits` index bits per vector of `group_size` channels,
normalized by calibrated "static" ranges; `pairing` "adjacent" or "rope", RoPE's channel pairs
for pre-RoPE keys; its calibrated codebook is one per layer or per KV head, `codebook_scope`
"layer" / "head", fitted by k-means weighted by the Fisher information of the text's loss, by
that and the retrieval prompts' answer loss alike, or by neither, `codebook_weight` "fisher" /
"fisher+answer" / "plain"; kvcalib_runtime.layouts.vq). A scalar calibrated codebook takes
`codebook_weight` "fisher" or "fisher+answer" too.
"""

import dataclasses
import difflib
import errno
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvcalib.core.paths import is_recipe_file
from kvcalib.core.profile import SENSITIVITY_LOSSES
from kvcalib.errors import RecipeError
from kvcalib_runtime.cache.scheme import KEY_POSITIONS, KVScheme, LayerScheme
from kvcalib_runtime.checkpoint.checks import MAX_TOKENS
from kvcalib_runtime.layouts import Kind, Layout, layout_class
from kvcalib_runtime.layouts.spec import QuantSpec, choices

MAX_LAYERS = 4096  # an override index beyond this is a typo, not a layer
MAX_CODEBOOK_BITS = 4
RECIPE_DIRS = (
    Path(__file__).resolve().parents[1] / "recipes",  # installed wheel: the kvcalib.recipes package
    Path(__file__).resolve().parents[2] / "recipes",  # source tree / editable install
)
FULL_PRECISION = 16
EXTERNAL = ("hf-quanto",)
QUANTIZED_LAYERS = ("all", "global")


def _layout_fields() -> list[tuple]:
    """QuantSpec's fields, in its order, as a recipe writes them: `bits` defaults to full
    precision, `codebook` names where levels come from ("uniform" or "calibrated"), and
    `split_fraction` (after split_channels) sizes the split by head."""
    out = []
    for f in dataclasses.fields(QuantSpec):
        kind, default = f.type, f.default
        if f.name == "bits":
            default = FULL_PRECISION
        elif f.name == "codebook":
            kind, default = str, "uniform"
        out.append((f.name, kind, dataclasses.field(default=default)))
        if f.name == "split_channels":
            out.append(("split_fraction", float, dataclasses.field(default=0.0)))
    return out


_LayoutFields = dataclasses.make_dataclass("_LayoutFields", _layout_fields(), frozen=True)


@dataclass(frozen=True)
class TensorRecipe(_LayoutFields):
    """How keys (or values) are quantized; see the module docstring for each field. The layout's
    fields are the runtime QuantSpec's, derived from it under the same names (`_layout_fields`;
    `spec` resolves them); `flush`, `position`, `rotation` and `smooth` place the layout in the
    model."""

    codebook_scope: str = "layer"
    codebook_weight: str = "fisher"
    flush: int = 0
    position: str = "post_rope"
    rotation: str = "none"
    smooth: float = 0.0

    @property
    def quantized(self) -> bool:
        return self.bits != FULL_PRECISION

    @property
    def layout(self) -> type[Layout]:
        """The stored layout its method and granularity select (kvcalib_runtime.layouts)."""
        return layout_class(self.method, self.granularity)

    def split(self, head_dim: int | None) -> int:
        """The outlier set's channels per head: `split_channels`, or `split_fraction` of
        head_dim (without a head size, the smallest set, 2: enough to check everything else)."""
        if not self.split_fraction:
            return self.split_channels
        return 2 if head_dim is None else round(self.split_fraction * head_dim)

    def spec(self, head_dim: int | None = None) -> QuantSpec | None:
        """The runtime's QuantSpec; `head_dim` resolves a `split_fraction`."""
        if not self.quantized:
            return None
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(QuantSpec)}
        fields.update(codebook=self.codebook == "calibrated", split_channels=self.split(head_dim))
        return QuantSpec(**fields)


@dataclass(frozen=True)
class Allocation:
    """Per-layer bits for keys and values, chosen from the sensitivity profile so that their
    mean is at most `budget` bits (codes only); `sensitivity` names the loss it is measured on
    (kvcalib.core.profile.SENSITIVITY_LOSSES), or several joined by "+", weighed alike."""

    budget: float
    choices: tuple[int, ...] = (2, 3, 4)
    sensitivity: str = "text"

    @property
    def losses(self) -> tuple[str, ...]:
        return tuple(self.sensitivity.split("+"))


@dataclass(frozen=True)
class LayerOverride:
    layers: tuple[int, ...]
    key: dict
    value: dict


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    version: int | None = None  # a preset's: a changed preset gets the next (docs/recipes.md)
    key: TensorRecipe = TensorRecipe()
    value: TensorRecipe = TensorRecipe()
    residual: int = 0
    sinks_first: int = 0
    sinks_predicted: bool = False
    sink_budget: int = 0
    rotation_seed: int | None = None
    allocation: Allocation | None = None
    overrides: tuple[LayerOverride, ...] = ()
    external: str | None = None
    quantized_layers: str = "all"
    source: str = ""

    @property
    def needs_profile(self) -> bool:
        """Whether resolving this recipe needs calibrated tensors (on any layer)."""
        pairs = self.layer_variants()
        tensors = [t for pair in pairs for t in pair]
        return (
            self.sinks_predicted
            or self.allocation is not None
            or any(key.smooth > 0 for key, _ in pairs)
            or any(t.quantized and t.layout.calibrated_range for t in tensors)
            or any(t.quantized and t.codebook == "calibrated" for t in tensors)
            or any(t.quantized and (t.split_channels or t.split_fraction) for t in tensors)
        )

    def tensor(self, name: str, layer: int) -> TensorRecipe:
        """The key or value recipe of one layer, overrides applied."""
        base = getattr(self, name)
        for o in self.overrides:
            if layer in o.layers and getattr(o, name):
                base = dataclasses.replace(base, **getattr(o, name))
        return base

    def layer_variants(self) -> list[tuple[TensorRecipe, TensorRecipe]]:
        """Every distinct (key, value) recipe a layer can get: the base one and each layer's
        with its overrides merged."""
        pairs = [(self.key, self.value)]
        pairs += [(self.tensor("key", i), self.tensor("value", i)) for i in self.override_layers]
        return list(dict.fromkeys(pairs))

    @property
    def override_layers(self) -> tuple[int, ...]:
        """The layer indices [[layers]] overrides name, sorted."""
        return tuple(sorted({i for o in self.overrides for i in o.layers}))


_TENSOR_KEYS = {f.name: f.type for f in dataclasses.fields(TensorRecipe)}
_VALUE_ONLY_OUT = {"position", "smooth"}
_TOP_KEYS = {
    "name": str,
    "description": str,
    "version": int,
    "residual": int,
    "rotation_seed": int,
    "external": str,
    "quantized_layers": str,
    "key": dict,
    "value": dict,
    "sinks": dict,
    "allocation": dict,
    "layers": list,
}
_SINK_KEYS = {"first": int, "predicted": bool, "budget": int}
_ALLOCATION_KEYS = {"budget": float, "choices": list, "sensitivity": str}
_OUR_CHOICES = {
    "codebook": ("uniform", "calibrated"),
    "position": KEY_POSITIONS,
    "rotation": ("none", "hadamard"),
    "codebook_scope": ("layer", "head"),
    "codebook_weight": ("fisher", "fisher+answer", "plain"),
}


def _choices() -> dict[str, tuple[str, ...]]:
    """The values each enumerated key takes: the runtime's (QuantSpec's fields, the layouts
    registered when called), then ours."""
    return {**choices(), **_OUR_CHOICES}


def _preset_entries() -> list[Path]:
    return [p for d in RECIPE_DIRS if d.is_dir() for p in sorted(d.glob("*.toml"))]


def presets() -> list[str]:
    """Names of the preset recipes shipped with kvcalib: the regular files (or links to one)
    named *.toml in the presets folders (`preset_problems` names the other entries)."""
    return sorted({p.stem for p in _preset_entries() if p.is_file()})


def preset_problems() -> list[str]:
    """One line per entry named *.toml in the presets folders that is no regular file (a
    folder, a FIFO, a link to nothing or a link loop): its path, what it is and the fix."""
    return [
        f"{p}: {_not_a_file(p)}, not a preset; remove it (a preset is a TOML file)"
        for p in _preset_entries()
        if not p.is_file()
    ]


def _not_a_file(path: Path) -> str:
    """What `path`, which is no regular file, is."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "a symlink to nothing"
    except OSError as e:
        return "a symlink loop" if e.errno == errno.ELOOP else f"unreadable ({e.strerror})"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a socket or device"


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A preset by name (see `presets()`) or a recipe TOML file by path (`is_recipe_file`)."""
    if is_recipe_file(name_or_path):
        path = Path(name_or_path)
        if path.exists() and not path.is_file():  # a folder, or a FIFO a read would block on
            raise RecipeError(
                f"recipe {path}: not a regular file; pass a TOML file or a preset name"
            )
        if not path.is_file():
            raise RecipeError(f"recipe {path}: no such file; pass a TOML file or a preset name")
    else:
        found = [d / f"{name_or_path}.toml" for d in RECIPE_DIRS]
        path = next((p for p in found if p.is_file()), None)
        broken = next((p for p in found if p.is_symlink() or p.exists()), None)
        if path is None and broken is not None:
            raise RecipeError(
                f"recipe {name_or_path}: the preset's entry {broken} is {_not_a_file(broken)}, "
                "not a TOML file; remove it, or reinstall kvcalib"
            )
        if path is None:
            close = difflib.get_close_matches(str(name_or_path), presets(), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise RecipeError(
                f"recipe {name_or_path}: no such preset; {hint}use a preset "
                f"({', '.join(presets())}) or a TOML file's path (./NAME.toml: a name without "
                "a / or .toml is a preset)"
            )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a BOM, as editors write
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise RecipeError(f"recipe {path}: not valid TOML ({e}); fix the file") from None
    except OSError as e:
        raise RecipeError(
            f"recipe {path}: cannot be read ({e.strerror}); fix its permissions"
        ) from None
    return parse_recipe(data, source=str(path))


def parse_recipe(data: dict, source: str = "<dict>") -> Recipe:
    """Validate a parsed TOML document into a Recipe (RecipeError on any problem)."""
    name = data.get("name") if isinstance(data, dict) else None
    where = f"recipe {name if isinstance(name, str) and name.strip() else source}"
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a TOML table at the top level")
    _check_keys(data, _TOP_KEYS, "", where)
    if "name" not in data:
        raise RecipeError(f"{where}: missing key 'name'")
    if not data["name"].strip() or "\n" in data["name"]:
        raise RecipeError(f"{where}: 'name' must be a non-empty single line")
    if data.get("version", 1) < 1:
        raise RecipeError(f"{where}: version = {data['version']}: use an integer >= 1")
    if data.get("external") is not None:
        return _parse_external(data, source, where)
    key = _tensor(data.get("key", {}), "key", where)
    value = _tensor(data.get("value", {}), "value", where)
    sinks = data.get("sinks", {})
    _check_keys(sinks, _SINK_KEYS, "sinks.", where)
    allocation = None
    if "allocation" in data:
        _check_keys(data["allocation"], _ALLOCATION_KEYS, "allocation.", where)
        choices = tuple(data["allocation"].get("choices", (2, 3, 4)))
        ints = all(isinstance(c, int) and not isinstance(c, bool) for c in choices)
        if "budget" not in data["allocation"] or not choices or not ints:
            raise RecipeError(f"{where}: allocation needs budget = <bits> and integer choices")
        if len(set(choices)) != len(choices):
            raise RecipeError(f"{where}: allocation.choices {list(choices)} repeat a width")
        loss = data["allocation"].get("sensitivity", "text")
        parts = loss.split("+")
        if not set(parts) <= set(SENSITIVITY_LOSSES) or len(set(parts)) != len(parts):
            raise RecipeError(
                f"{where}: allocation.sensitivity = {loss!r}: use one of "
                f"{', '.join(SENSITIVITY_LOSSES)}, or several joined by '+' ('text+answer')"
            )
        allocation = Allocation(float(data["allocation"]["budget"]), choices, loss)
    overrides = tuple(_override(o, i, where) for i, o in enumerate(data.get("layers", [])))
    _check_overlaps(overrides, where)
    recipe = Recipe(
        name=data["name"],
        description=data.get("description", ""),
        version=data.get("version"),
        key=key,
        value=value,
        residual=data.get("residual", 0),
        sinks_first=sinks.get("first", 0),
        sinks_predicted=sinks.get("predicted", False),
        sink_budget=sinks.get("budget", 0),
        rotation_seed=data.get("rotation_seed"),
        allocation=allocation,
        overrides=overrides,
        quantized_layers=data.get("quantized_layers", "all"),
        source=source,
    )
    _check_combinations(recipe, where)
    return recipe


def _parse_external(data: dict, source: str, where: str) -> Recipe:
    if data["external"] not in EXTERNAL:
        raise RecipeError(f"{where}: external = {data['external']!r}; known: {', '.join(EXTERNAL)}")
    extra = set(data) - {"name", "description", "version", "external", "residual", "key", "value"}
    if extra:
        raise RecipeError(f"{where}: an external recipe takes no {', '.join(sorted(extra))}")
    key = _tensor(data.get("key", {}), "key", where)
    value = _tensor(data.get("value", {}), "value", where)
    _check_tokens({"residual": data.get("residual", 0)}, where)
    return Recipe(
        name=data["name"],
        description=data.get("description", ""),
        version=data.get("version"),
        key=key,
        value=value,
        residual=data.get("residual", 0),
        external=data["external"],
        source=source,
    )


def _check_keys(table: dict, known: dict, prefix: str, where: str) -> None:
    if not isinstance(table, dict):
        raise RecipeError(f"{where}: {prefix.rstrip('.')} must be a table")
    for k, v in table.items():
        if k not in known:
            close = difflib.get_close_matches(k, known, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise RecipeError(
                f"{where}: unknown key '{prefix}{k}'{hint} (known: {', '.join(sorted(known))})"
            )
        _check_type(v, known[k], f"{prefix}{k}", where)


def _check_type(value, expected, key: str, where: str) -> None:
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if not ok:
        raise RecipeError(
            f"{where}: '{key}' must be {expected.__name__}, not {type(value).__name__} ({value!r})"
        )


def _tensor(table: dict, name: str, where: str) -> TensorRecipe:
    _tensor_keys(table, name, where)
    tensor = TensorRecipe(**table)
    try:
        tensor.spec()
    except ValueError as e:
        raise RecipeError(f"{where}: [{name}] {e}") from None
    return tensor


def _tensor_keys(table: dict, name: str, where: str, at: str = "") -> None:
    """Known keys of the right types and choices (no cross-field rules: see `_check_layer`);
    `at` is the path of the table's parent ("layers[2]." for an override)."""
    known = {k: t for k, t in _TENSOR_KEYS.items() if name == "key" or k not in _VALUE_ONLY_OUT}
    path = f"{at}{name}."
    _check_keys(table, {k: _type(t) for k, t in known.items()}, path, where)
    for k, allowed in _choices().items():
        if k in table and table[k] not in allowed:
            raise RecipeError(
                f"{where}: '{path}{k}' = {table[k]!r}; use one of {', '.join(allowed)}"
            )
    if table.get("flush", 0) < 0:
        raise RecipeError(f"{where}: '{path}flush' = {table['flush']}: use 0 (default) or >= 1")


def _type(annotation) -> type:
    return {"int": int, "str": str, "bool": bool, "float": float}.get(
        getattr(annotation, "__name__", str(annotation)), annotation
    )


def _override(obj, i: int, where: str) -> LayerOverride:
    if not isinstance(obj, dict):
        raise RecipeError(f"{where}: layers[{i}] must be a table")
    _check_keys(obj, {"index": object, "key": dict, "value": dict}, f"layers[{i}].", where)
    index = obj.get("index")
    span = re.fullmatch(r"([0-9]{1,9})-([0-9]{1,9})", index) if isinstance(index, str) else None
    if isinstance(index, int) and not isinstance(index, bool):
        layers = (index,)
    elif isinstance(index, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in index
    ):
        layers = tuple(index)
    elif span:
        lo, hi = int(span[1]), int(span[2])
        layers = tuple(range(lo, hi + 1)) if lo <= hi < MAX_LAYERS else ()
    else:
        raise RecipeError(f"{where}: layers[{i}].index must be an int, a list or 'a-b' ranges")
    if not layers or not all(0 <= x < MAX_LAYERS for x in layers):
        raise RecipeError(
            f"{where}: layers[{i}].index = {index!r}: use layer indices in [0, {MAX_LAYERS}) "
            "(a range 'a-b' with a <= b)"
        )
    for name in ("key", "value"):
        _tensor_keys(obj.get(name, {}), name, where, f"layers[{i}].")  # merged: `_check_layer`
    return LayerOverride(layers, obj.get("key", {}), obj.get("value", {}))


def _check_overlaps(overrides: tuple[LayerOverride, ...], where: str) -> None:
    """RecipeError when two [[layers]] entries set the same field of one layer: the later
    would win silently, and the recipe would not say what the layer gets. Entries that set
    different fields of a layer merge."""
    first = {}  # (layer, "key.bits") -> the index of the entry that set it
    for i, o in enumerate(overrides):
        fields = [f"{name}.{k}" for name in ("key", "value") for k in getattr(o, name)]
        for layer in o.layers:
            for field in fields:
                j = first.setdefault((layer, field), i)
                if j != i:
                    raise RecipeError(
                        f"{where}: layers[{j}] and layers[{i}] both set {field} of layer "
                        f"{layer}; set each layer's {field} in one [[layers]] entry"
                    )


def _check_tokens(counts: dict[str, int], where: str) -> None:
    for name, n in counts.items():
        if not 0 <= n <= MAX_TOKENS:
            raise RecipeError(
                f"{where}: {name} = {n} tokens: use 0 to {MAX_TOKENS} (the model's context "
                "bounds it further)"
            )


def _check_combinations(r: Recipe, where: str) -> None:
    def fail(msg):
        raise RecipeError(f"{where}: {msg}")

    if r.quantized_layers not in QUANTIZED_LAYERS:
        allowed = ", ".join(QUANTIZED_LAYERS)
        fail(f"'quantized_layers' = {r.quantized_layers!r}; use one of {allowed}")
    _check_tokens(
        {"residual": r.residual, "sinks.first": r.sinks_first, "sinks.budget": r.sink_budget},
        where,
    )
    if r.sinks_predicted and r.sink_budget == 0:
        fail("sinks.predicted needs sinks.budget > 0 (slots for predicted sinks)")
    if r.sink_budget and not r.sinks_predicted:
        fail("sinks.budget reserves slots for predicted sinks: set sinks.predicted = true")
    if r.rotation_seed is not None and not 0 <= r.rotation_seed < 2**63:
        fail(f"rotation_seed = {r.rotation_seed}: use an integer in [0, 2**63)")
    if r.allocation and not 1 <= r.allocation.budget <= 16:
        fail(f"allocation.budget = {r.allocation.budget} bits is out of range")
    named = r.override_layers
    for key, value in r.layer_variants():
        layers = [i for i in named if (r.tensor("key", i), r.tensor("value", i)) == (key, value)]
        at = f"{where}, layers {_span(layers)}" if layers else where
        _check_layer(r, key, value, at)


def _span(layers: list[int]) -> str:
    return ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")


def _check_layer(r: Recipe, k: TensorRecipe, v: TensorRecipe, where: str) -> None:
    """The cross-field rules of one layer's merged key and value recipes, at every bit width
    an allocation may give them: what the planner builds, minus the model's shapes."""

    def fail(msg):
        raise RecipeError(f"{where}: {msg}")

    if k.rotation == "hadamard" and k.position != "post_rope":
        fail(
            "key.rotation = 'hadamard' is the online rotation after RoPE: set key.position = "
            "'post_rope'"
        )
    for name, t in (("key", k), ("value", v)):
        static = t.layout.calibrated_range and (t.quantized or r.allocation is not None)
        if static and t.rotation != "none":
            fail(
                f"{name}: static ranges are calibrated unrotated; use rotation 'none' or a "
                "dynamic granularity"
            )
    if k.smooth and k.rotation != "none":
        fail("key.smooth scales channels, which a Hadamard rotation would mix: pick one")
    for name, t in (("key", k), ("value", v)):
        own = t.codebook_scope != "layer" or t.codebook_weight == "plain"
        if own and not t.layout.vectors:
            fail(
                f"{name}: codebook_scope and codebook_weight 'plain' choose a 'vq' codebook: "
                "set method 'vq', or leave them at 'layer' and 'fisher'"
            )
        if t.codebook_weight == "fisher+answer" and not (
            t.layout.vectors or t.codebook == "calibrated"
        ):
            fail(f"{name}: codebook_weight 'fisher+answer' weighs a calibrated codebook's k-means")
        if t.split_fraction and t.split_channels:
            fail(f"{name}: give split_channels or split_fraction, not both")
        if not 0 <= t.split_fraction < 1:
            fail(f"{name}.split_fraction = {t.split_fraction}: use a fraction in (0, 1)")
    if not 0 <= k.smooth <= 1:
        fail(f"key.smooth = {k.smooth}: use an exponent alpha in [0, 1]")
    widths = r.allocation.choices if r.allocation else (None,)
    for bits in widths:
        key = k if bits is None else with_bits(k, bits)
        value = v if bits is None else with_bits(v, bits)
        try:
            layer = layer_scheme(key, value, r.residual)
            KVScheme((layer,), r.residual, r.sinks_first, r.sink_budget, r.rotation_seed)
        except ValueError as e:
            fail(f"{'' if bits is None else f'at {bits} bits, '}{e}")


def layer_scheme(
    key: TensorRecipe, value: TensorRecipe, residual: int, head_dim: int | None = None
) -> LayerScheme:
    """The runtime's LayerScheme of a layer's key and value recipes (ValueError where the specs
    are inconsistent); `head_dim` resolves a `split_fraction`."""
    return LayerScheme(
        key=key.spec(head_dim),
        value=value.spec(head_dim),
        key_position=key.position,
        key_rotation=key.rotation == "hadamard",
        value_rotation=value.rotation == "hadamard",
        key_flush=flush_of(key, residual),
        value_flush=flush_of(value, residual),
    )


def with_bits(t: TensorRecipe, bits: int) -> TensorRecipe:
    """An allocated width: calibrated codebooks of levels exist for 2-4 bits only, so a wider
    layer of a codebook recipe takes uniform levels (vector codes keep their codebook)."""
    codebook = t.codebook if bits <= MAX_CODEBOOK_BITS or t.layout.vectors else "uniform"
    return dataclasses.replace(t, bits=bits, codebook=codebook)


def flush_of(t: TensorRecipe, residual: int) -> int:
    """The flush block: as the recipe says, else R for token groups (KIVI's keys), else 1."""
    if t.flush:
        return t.flush
    return residual if t.layout.kind == Kind.CHANNEL and residual else 1
