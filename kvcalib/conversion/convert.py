"""`kvcalib convert`: a recipe's weight transforms fused into a plain HF checkpoint + side-car.

    kvcalib.convert("smollm2-135m", recipe="quarot-kv4", output="out/", rotate_residual=True)

The source is streamed one group at a time — the embedding, each decoder layer, the head — through
the transforms of `kvcalib.conversion.rotate` and into shards written as they fill (`shards`), so
peak memory is about one layer whatever the model's size. Everything is written into a temporary
sibling folder (`atomic`), validated with the runtime's one validator
(`kvcalib_runtime.checkpoint.format.read_checkpoint`), then renamed into place. Every
decision — what is fused, which tensors go where — is made before the first byte is written. The
layout is FORMAT.md's (`kvcalib inspect` summarizes it).
"""

import dataclasses
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvcalib.conversion import export as exports
from kvcalib.conversion import rotate
from kvcalib.core import models, options
from kvcalib.core.plan import plan
from kvcalib.core.profile import Profile
from kvcalib.core.recipe import Recipe, load_recipe
from kvcalib.errors import ModelError, OptionError, ProfileError, RecipeError
from kvcalib.io import atomic
from kvcalib.io.shards import ShardWriter, SourceWeights, TensorSpec, ahead, parse_size
from kvcalib_runtime.checkpoint import format
from kvcalib_runtime.errors import FormatError
from kvcalib_runtime.loader import check_servable, read_tokenizer
from kvcalib_runtime.model import archs
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.hadamard import is_supported
from kvcalib_runtime.model.transforms import Transforms

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Copied byte for byte from the source when present (tokenizer.json is required).
COPIED = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip
AHEAD = 16  # tensors the producer may hold ready: one or two decoder layers
EMBED, NORM, LM_HEAD = (n + ".weight" for n in (archs.EMBED, archs.FINAL_NORM, archs.LM_HEAD))
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _known(arch: archs.Arch) -> set[str]:
    """The tensor names of a decoder layer that the architecture table places."""
    return {p + s for p in arch.linears for s in (".weight", ".bias")} | {
        n + ".weight" for n in (*arch.norms, archs.Q_NORM, archs.K_NORM)
    }


@dataclass(frozen=True)
class _Job:
    """What one conversion does: the decisions, made before any byte is written."""

    geo: Geometry
    transforms: Transforms
    value_seed: int | None
    value_layers: frozenset[int]
    smooth: dict[int, torch.Tensor]
    residual_seed: int | None
    tied: bool
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def untie(self) -> bool:
        return self.tied and self.residual_seed is not None


def convert(
    model: str | os.PathLike | None = None,
    *,
    recipe: str | os.PathLike | Recipe,
    output: str | os.PathLike,
    profile=None,
    force: bool = False,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    rotate_residual: bool = False,
    export: str | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """Write the converted checkpoint of `model` under `recipe` to `output`; returns its path.

    profile:         a profile folder (or a loaded Profile) when the recipe or export needs one
    dtype:           "float32", "float16" or "bfloat16" (or the torch dtype) for the floating
                     weights (default: keep)
    max_shard_size:  bytes per weight file, as "5GB", "500MiB" or an int
    rotate_residual: also fuse a Hadamard rotation of the residual stream (QuaRot's R1)
    export:          "vllm-fp8" adds compressed-tensors FP8 KV-cache scales for vLLM
    trust_remote_code: accept a source whose config names custom code (auto_map); no code runs
                     here either way (the weights are read as the stock architecture of its
                     model_type) and the output's config.json drops the auto_map
    """
    out = Path(output).expanduser()
    out_dtype = None if dtype is None else options.dtype("--dtype", dtype)
    if export is not None and export not in format.EXPORTS:
        raise OptionError(f"--export {export!r}: use one of {', '.join(format.EXPORTS)}")
    max_bytes = parse_size(max_shard_size)
    source = models.resolve(model, trust_remote_code=trust_remote_code)
    if (source.path / format.META).exists():
        raise ModelError(
            f"model {source.spec}: already a kvcalib-converted checkpoint; "
            "convert the original model instead"
        )
    config = json.loads((source.path / format.CONFIG).read_text())
    if archs.lookup(config.get("model_type")) is None:
        raise ModelError(
            f"model {source.spec}: architecture {config.get('model_type')!r} is not supported by "
            f"convert and the runtime; supported: {archs.supported()} (kvcalib eval and "
            "calibrate run it through transformers)"
        )
    if not (source.path / format.TOKENIZER).is_file():
        raise ModelError(
            f"model {source.spec}: no {format.TOKENIZER} in {source.path}; the "
            "runtime tokenizes with it - save a fast tokenizer there"
        )
    geo = Geometry.from_config(config)
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    profile_path = str(profile) if isinstance(profile, str | os.PathLike) else None
    inputs = [source.path] + ([Path(profile_path)] if profile_path else [])
    inputs += [Path(recipe.source)] if Path(recipe.source).is_file() else []
    atomic.check_output(out, force, inputs, kind="converted checkpoint")
    profile = _load_profile(profile, source)
    if export and profile is None:
        raise ProfileError(
            f"--export {export} takes its FP8 scales from calibrated key and "
            "value ranges: pass --profile DIR"
        )
    scheme, params = plan(recipe, geometry=geo, profile=profile)
    weights = SourceWeights(source.path)
    job = _decide(recipe, scheme, params, config, geo, weights, rotate_residual)
    if export:
        scales = exports.kv_scales(profile, scheme, params, job.transforms)
        job = dataclasses.replace(job, extra=scales)
    groups = _groups(weights, job, out_dtype)
    out_config = _out_config(config, job, out_dtype, export)
    _check_servable(source, recipe, out_config, groups, scheme, params, job)
    meta = {
        "format_version": format.FORMAT_VERSION,
        "source": {"spec": source.spec, "fingerprint": source.fingerprint},
        "recipe": {"name": recipe.name, "toml": _recipe_text(recipe)},
        "profile": None if profile is None else {
            "fingerprint": profile.fingerprint,
            "path": profile_path or _str(getattr(profile, "path", None)),
        },
        "transforms": job.transforms.to_json(),
        "residual_rotation_seed": job.residual_seed,
        "untied_embeddings": job.untie,
        "export": export,
        "scheme": scheme.to_json(),
    }  # fmt: skip
    with atomic.staging(out, force) as tmp:
        hashes = _write_weights(tmp, weights, groups, job, max_bytes)
        hashes[format.CONFIG] = _write_json(tmp / format.CONFIG, out_config)
        for name in COPIED:
            if (source.path / name).is_file():
                shutil.copyfile(source.path / name, tmp / name)
        save_file(params.tensors(), tmp / format.PARAMS, metadata={"format": "pt"})
        hashes[format.PARAMS] = format.sha256_file(tmp / format.PARAMS)
        meta["binding"] = format.binding(hashes)  # the side-car belongs to these weights
        hashes[format.META] = _write_json(tmp / format.META, meta)
        files = {p.name: format.manifest_entry(p, hashes.get(p.name)) for p in tmp.iterdir()}
        manifest = {"format_version": format.FORMAT_VERSION, "files": dict(sorted(files.items()))}
        _write_json(tmp / format.MANIFEST, manifest)
        format.read_checkpoint(tmp, hashes=False)  # hashed while writing: no second read
    return out


def _check_servable(source, recipe, config: dict, groups, scheme, params, job: _Job) -> None:
    """Refuse, before a byte is written, what kvcalib_runtime.load or generate would refuse
    in the output: its tokenizer, its weights against its config.json, its KV cache."""
    try:
        read_tokenizer(source.path, job.geo.vocab)
    except FormatError as e:
        raise ModelError(f"model {source.spec}: {e}") from None
    shapes = {s.name: s.shape for g in groups for s in g.specs}
    try:
        check_servable(config, shapes, scheme, params, job.transforms)
    except (FormatError, ValueError) as e:
        raise RecipeError(
            f"recipe {recipe.name} on model {source.spec}: the runtime could not serve the "
            f"result ({e}); pick a recipe and model it serves"
        ) from None


def _out_config(config: dict, job: _Job, dtype: torch.dtype | None, export: str | None) -> dict:
    """The source's config.json, with what the conversion changed."""
    config = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    if job.untie:
        config["tie_word_embeddings"] = False
    if dtype is not None:
        config["dtype"] = options.DTYPE_NAMES[dtype]
        if "torch_dtype" in config:
            config["torch_dtype"] = options.DTYPE_NAMES[dtype]
    if export:
        config["quantization_config"] = exports.quantization_config()
    return config


def _decide(recipe, scheme, params, config, geo, weights, rotate_residual) -> _Job:
    """Which transforms apply, refusing what cannot be fused before anything is written."""
    arch = geo.arch
    value_layers = frozenset(i for i, layer in enumerate(scheme.layers) if layer.value_rotation)
    if value_layers and not is_supported(geo.head_dim):
        raise RecipeError(
            f"recipe {recipe.name}: no Hadamard matrix of order head_dim = "
            f"{geo.head_dim} for the value rotation; set value.rotation = 'none'"
        )
    if params.key_smooth and geo.partial_rotary:
        raise RecipeError(
            f"recipe {recipe.name}: key.smooth scales RoPE pairs of whole heads, and "
            f"{geo.model_type} rotates part of each head (partial_rotary_factor); set "
            "key.smooth = 0"
        )
    for i, s in params.key_smooth.items():
        if why := rotate.check_smoothing(s, geo):
            raise ProfileError(f"key smoothing of layer {i}: {why}; calibrate the profile again")
    # A shared q/k norm (Qwen3, Gemma 3) holds one scale per channel: per-head scales stay
    # online, in kv_params.safetensors, and "key_smooth" is not listed as fused.
    fusable = all(rotate.fusable_smoothing(s, arch.qk_norm) for s in params.key_smooth.values())
    if rotate_residual and arch.post_norms:
        raise ModelError(
            f"model: {geo.model_type} normalizes the attention and MLP outputs ("
            f"{', '.join(arch.post_norms)}) before they join the residual stream, and a "
            "rotation of the stream cannot pass those per-channel weights; convert without "
            "--rotate-residual"
        )
    if rotate_residual and not is_supported(geo.hidden):
        raise ModelError(
            f"model: no Hadamard matrix of order hidden_size = {geo.hidden} for the "
            "residual rotation; convert without --rotate-residual"
        )
    if EMBED not in weights.entries or NORM not in weights.entries:
        raise ModelError(f"model {weights.folder}: no {EMBED} or {NORM} in its weights")
    smooth = dict(params.key_smooth) if fusable else {}
    fused = {"value_rotation"} | ({"key_smooth"} if smooth else set())
    return _Job(
        geo=geo,
        transforms=Transforms.online(scheme, params).fuse(fused),
        value_seed=scheme.rotation_seed,
        value_layers=value_layers,
        smooth=smooth,
        residual_seed=(recipe.rotation_seed or 0) if rotate_residual else None,
        tied=bool(config.get("tie_word_embeddings")) or LM_HEAD not in weights.entries,
    )


@dataclass(frozen=True)
class _Group:
    """Tensors transformed together: kind "embed", "layer", "head" or "other"."""

    kind: str
    layer: int | None
    reads: list[str]
    specs: list[TensorSpec]


def _groups(weights: SourceWeights, job: _Job, out_dtype) -> list[_Group]:
    """Every output tensor, grouped and in write order: embedding, layers, head, the rest."""
    entries = weights.entries
    known = _known(job.geo.arch)
    layers = {i: [] for i in range(job.geo.layers)}
    rest = []
    for name in sorted(entries):
        m = _LAYER.fullmatch(name)
        if m and int(m.group(1)) in layers:
            layers[int(m.group(1))].append(name)
            if m.group(2) not in known and job.residual_seed is not None:
                raise ModelError(
                    f"model {weights.folder}: tensor {name} is not in the "
                    "architecture table, so a residual rotation cannot place it"
                )
        elif name not in (EMBED, NORM, LM_HEAD):
            rest.append(name)
    if rest and job.residual_seed is not None:
        raise ModelError(
            f"model {weights.folder}: tensor {rest[0]} is not in the architecture "
            "table, so a residual rotation cannot place it"
        )
    if clash := sorted(set(job.extra) & set(entries)):
        raise ModelError(f"model {weights.folder}: already holds {clash[0]}")

    def spec(name, like=None):
        _, shape, dt = entries[like or name]
        return TensorSpec(name, shape, out_dtype if out_dtype and dt in FLOATS else dt)

    head_reads = [NORM] + ([EMBED] if job.untie else [LM_HEAD] if LM_HEAD in entries else [])
    head = [spec(NORM)] + ([spec(LM_HEAD, head_reads[1])] if len(head_reads) > 1 else [])
    groups = [_Group("embed", None, [EMBED], [spec(EMBED)])]
    for i, names in layers.items():
        extra = sorted(n for n in job.extra if _LAYER.fullmatch(n).group(1) == str(i))
        specs = sorted([spec(n) for n in names] + [
            TensorSpec(n, tuple(job.extra[n].shape), job.extra[n].dtype) for n in extra
        ], key=lambda s: s.name)  # fmt: skip
        groups.append(_Group("layer", i, names, specs))
    groups.append(_Group("head", None, head_reads, head))
    groups += [_Group("other", None, [n], [spec(n)]) for n in rest]
    for g in groups:
        touched = g.kind != "other" and (g.kind == "layer" or job.residual_seed is not None)
        for name in g.reads if touched else ():
            if entries[name][2] not in FLOATS:
                raise ModelError(
                    f"model {weights.folder}: {name} is {entries[name][2]}; kvcalib "
                    "converts unquantized checkpoints (float32, float16, bfloat16)"
                )
    return groups


def _transform(group: _Group, tensors: dict, job: _Job) -> dict[str, torch.Tensor]:
    """The output tensors of one group (in compute precision where a transform touched them)."""
    seed = job.residual_seed
    if group.kind == "layer":
        prefix = archs.LAYER.format(group.layer) + "."
        t = {n.removeprefix(prefix): v for n, v in tensors.items()}
        try:
            if group.layer in job.value_layers:
                rotate.rotate_values(t, job.geo, job.value_seed)
            if group.layer in job.smooth:
                rotate.smooth_keys(t, job.geo, job.smooth[group.layer])
            if seed is not None:
                rotate.rotate_residual(t, job.geo, seed)
        except KeyError as e:
            raise ModelError(
                f"model: layer {group.layer} has no tensor {prefix}{e.args[0]}, "
                "which the transform needs"
            ) from None
        out = {prefix + n: v for n, v in t.items()}
        out.update({n: job.extra[n] for n in job.extra if n.startswith(prefix)})
        return out
    if seed is not None and group.kind == "embed":
        return {EMBED: rotate.rotate_embedding(tensors[EMBED], seed)}
    if seed is not None and group.kind == "head":
        norm = tensors[NORM]
        lm = tensors[EMBED if job.untie else LM_HEAD]
        return {NORM: torch.ones_like(norm), LM_HEAD: rotate.rotate_lm_head(lm, norm, seed)}
    return tensors


def _write_weights(tmp: Path, weights, groups, job: _Job, max_bytes: int) -> dict[str, str]:
    """Every group read, transformed and cast on a producer thread (up to AHEAD tensors ahead),
    written and hashed as it arrives: the transforms stay off the write path. A tensor that
    comes back from `_transform` as it was read (the same object, never written to: see
    `rotate`) in its own dtype is written as the Span of its source bytes. Torch runs one
    thread meanwhile (restored after): the writer and the hasher hold the other cores."""

    def produce():
        for group in groups:
            source = weights.read(group.reads)
            out = _transform(group, source, job)
            for s in group.specs:
                read, tensor = source.get(s.name), out.pop(s.name)  # out may be source itself
                if tensor is read and tensor.dtype == s.dtype:
                    yield s.name, weights.span(s.name)  # untouched: its bytes, copied unread
                else:
                    yield s.name, tensor.to(s.dtype)

    writer = ShardWriter(tmp, [s for g in groups for s in g.specs], max_bytes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # also the producer's: a new thread starts with the last setting
    try:
        with ahead(produce(), AHEAD) as tensors:
            for name, tensor in tensors:
                writer.write(name, tensor)
    finally:
        torch.set_num_threads(threads)
        writer.close()
    return writer.finish()


def _write_json(path: Path, obj: dict) -> str:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _recipe_text(recipe: Recipe) -> str | None:
    path = Path(recipe.source)
    return path.read_text() if recipe.source and path.is_file() else None


def _str(x) -> str | None:
    return None if x is None else str(x)


def _load_profile(profile, source: models.ModelSource):
    if profile is None:
        return None
    if isinstance(profile, str | os.PathLike):
        return Profile.load(profile, source)
    profile.check_model(source)
    return profile
