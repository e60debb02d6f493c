"""`kvcalib recipes`: every preset with its one-line description and its bits per element.

"At 4K" is the memory issue's number: the bytes a runtime QuantizedCache for one sequence of 4096
tokens allocates (codes, group metadata, outlier slots, per-layer constants, the residual window,
sink slots and bookkeeping), walked from the buffers of a cache built on the meta device
(kvcalib_runtime.cache.memory.planned_memory), per key or value element it holds (2 x layers x KV
heads x head_dim x 4096). "body" is the quantized body alone (what `kvcalib eval` reports as
bits/element). The geometry is the default model's, so no model is loaded. A recipe that needs
calibrated tensors gets `PlaceholderProfile`'s, which have the calibrated tensors' shapes; only
a per-layer bit allocation depends on their values (its sensitivities), so an allocating recipe
(kvcalib-*) is listed as uniform sensitivities allocate it: a calibrated profile allocates a
little differently (on smollm2-135m's default profile kvcalib-4 holds 4.44 bits of body at 4K,
not 4.39). `kvcalib eval` reports the body at the context it evaluates (1024 tokens by default),
where per-layer constants weigh more than at 4K: the README's tables (kvcalib-2 2.48, kvcalib-4
4.49) are that. External peers (hf-quanto) are counted as kvcalib.evaluation.external counts
them.
"""

import torch

from kvcalib.core.plan import plan
from kvcalib.core.recipe import load_recipe, preset_problems, presets
from kvcalib.errors import RecipeError
from kvcalib.evaluation.external import external_bits
from kvcalib_runtime.cache.memory import planned_bits
from kvcalib_runtime.cache.scheme import SinkPredictor
from kvcalib_runtime.layouts.quant import uniform_codebook
from kvcalib_runtime.model.transforms import Transforms

DEFAULT_GEOMETRY = {"num_layers": 30, "kv_heads": 3, "head_dim": 64}  # SmolLM2-135M
CONTEXT = 4096


class PlaceholderProfile:
    """What kvcalib.core.plan asks of a profile, with the shapes of a real one and placeholder
    values: ranges [-1, 1], uniform codebooks (random entries of vector codebooks), unit
    smoothing scales, the first channels as outlier channels, a sink predictor that never fires,
    sensitivities 2**-bits everywhere."""

    def __init__(self, kv_heads: int, head_dim: int):
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def range(self, tensor, layer, *, position="post_rope", outliers=0.0):
        ones = torch.ones(self.kv_heads, self.head_dim)
        return -ones, ones

    def codebook(self, variant, layer, bits):
        return uniform_codebook(bits, symmetric=":symmetric" in variant)

    def vector_codebook(self, variant, layer, bits):
        w = int(variant.split(":")[1].removeprefix("vq"))
        rows = self.kv_heads if ":head:" in variant else 1
        return torch.rand(rows, 2**bits, w, generator=torch.Generator().manual_seed(0))

    def smoothing(self, layer, alpha, *, position):
        return torch.ones(self.kv_heads, self.head_dim)

    def outlier_channels(self, tensor, layer, count, *, position="post_rope"):
        return torch.arange(count).expand(self.kv_heads, count).contiguous()

    def sink_predictor(self):
        return SinkPredictor(0, (0,), float("inf"))

    def has_sensitivity(self, loss="text"):
        return True

    def sensitivity(self, tensor, layer, bits, loss="text"):
        return 2.0**-bits


def recipe_bits(recipe, *, num_layers: int, kv_heads: int, head_dim: int, context: int = CONTEXT):
    """(bits per element of everything allocated, of the quantized body alone) for one
    sequence of `context` tokens; `recipe` is a Recipe, a preset name or a path."""
    recipe = load_recipe(recipe) if isinstance(recipe, str) else recipe
    if recipe.external:
        return external_bits(recipe, context, residual=True), external_bits(recipe, context)
    profile = PlaceholderProfile(kv_heads, head_dim) if recipe.needs_profile else None
    scheme, params = plan(recipe, num_layers=num_layers, head_dim=head_dim, profile=profile)
    transforms = Transforms.online(scheme, params)
    sizes = dict(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, context=context)
    return planned_bits(scheme, params, transforms, **sizes)


def format_recipes() -> tuple[str, list[str]]:
    """The `kvcalib recipes` table (name, version, bits/element at 4K and of the body,
    description) and one warning per entry of the presets folders left out of it: an entry that
    is no file (`preset_problems`) or a preset that does not load. One bad entry does not hide the
    others: the table is what a user picks a recipe from, and the warning names the entry."""
    g = DEFAULT_GEOMETRY
    lines = [
        f"Bits per element at {CONTEXT} tokens, walked from the runtime cache's buffers for the "
        f"default model's geometry (smollm2-135m: {g['num_layers']} layers, {g['kv_heads']} KV "
        f"heads, head_dim {g['head_dim']}); fp16 is 16. 'at 4K' counts everything the cache "
        "allocates (residual window and kept sinks too), 'body' the quantized tokens alone.",
        "",
        "| recipe | version | at 4K | body | description |",
        "|---|---|---|---|---|",
    ]
    allocating, warnings = [], preset_problems()
    for name in presets():
        try:
            recipe = load_recipe(name)
            total, body = recipe_bits(recipe, **g)
        except RecipeError as e:
            warnings.append(f"preset {name} left out: {e}")
            continue
        row = f"| {name} | {recipe.version} | {total:.2f} | {body:.2f} | {recipe.description} |"
        lines.append(row)
        allocating += [name] if recipe.allocation is not None else []
    lines += [
        "",
        f"{', '.join(allocating)} allocate bits per layer by sensitivity: listed as uniform "
        "sensitivities allocate them, so a calibrated profile's allocation differs a little. "
        "kvcalib eval reports the body at the context it evaluates (1024 tokens by default), "
        "where per-layer constants weigh more than at 4K.",
    ]
    return "\n".join(lines), warnings
