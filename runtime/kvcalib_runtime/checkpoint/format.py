"""The converted-checkpoint format (FORMAT.md) and its one validator.

The writer (`kvcalib convert`) runs `read_checkpoint` on its temporary folder before renaming it
into place; the loader runs it before touching a weight. Everything here reads bytes and JSON —
no string from a checkpoint is ever evaluated, and no pickle is ever loaded.

    ckpt = read_checkpoint(path)     # FormatError naming the file when anything is off
    ckpt.config, ckpt.meta, ckpt.geometry, ckpt.scheme, ckpt.params, ckpt.transforms

Version 3 binds the side-car to its weights (`binding`: the sha256 of kv_params.safetensors and
one over the weight files); version 2 files, without it, and version 1 files, which list the
fused transforms (`fused`) instead of `transforms`, are still read.
"""

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvcalib_runtime.cache.scheme import KVParams, KVScheme
from kvcalib_runtime.checkpoint import checks
from kvcalib_runtime.checkpoint.closed import closed
from kvcalib_runtime.checkpoint.header import ints, read_header
from kvcalib_runtime.checkpoint.params import read_params
from kvcalib_runtime.errors import FormatError
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.transforms import FUSED, NONE, ONLINE, LayerTransforms, Transforms

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
CONFIG, META, TOKENIZER = "config.json", "kvcalib.json", "tokenizer.json"
PARAMS, MANIFEST = "kv_params.safetensors", "manifest.json"
DOCUMENTS = ("README", "LICENSE", "NOTICE", "COPYING")  # stems of files beside a checkpoint
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
FUSED_V1 = ("key_smooth", "residual_rotation", "value_rotation")  # version 1 `fused`
EXPORTS = ("vllm-fp8",)
# Tensors an export adds beside the model's (vLLM's FP8 KV-cache scales); the runtime skips them.
EXPORT_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.[kv]_scale")
_META_KEYS_V2 = {
    "format_version": int, "source": dict, "recipe": dict, "profile": (dict, type(None)),
    "transforms": dict, "residual_rotation_seed": (int, type(None)), "untied_embeddings": bool,
    "export": (str, type(None)), "scheme": dict,
}  # fmt: skip
_META_KEYS_V1 = {**{k: v for k, v in _META_KEYS_V2.items() if k != "transforms"}, "fused": list}
_META_KEYS = {1: _META_KEYS_V1, 2: _META_KEYS_V2, 3: {**_META_KEYS_V2, "binding": dict}}
# The keys of kvcalib.json's nested objects (transforms and scheme: their own from_json).
_META_OBJECTS = {
    "source": ("spec", "fingerprint"),
    "recipe": ("name", "toml"),
    "profile": ("fingerprint", "path"),
    "binding": (PARAMS, "weights"),
}


@dataclass(frozen=True)
class Checkpoint:
    """A validated converted checkpoint's side-car (the weights stay on disk).

    config: config.json; meta: kvcalib.json; geometry: the config's shapes; scheme, params:
    the KV cache it runs; transforms: where each layer's smoothing and rotations are
    """

    config: dict
    meta: dict
    geometry: Geometry
    scheme: KVScheme
    params: KVParams
    transforms: Transforms


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _json(path: Path) -> dict:
    if path.exists() and not path.is_file():  # a FIFO would block the read
        raise FormatError(f"{path.name}: not a regular file; pass the folder kvcalib convert wrote")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(
            f"{path.name}: missing from {path.parent}; pass a folder that kvcalib convert wrote"
        ) from None
    except OSError as e:
        raise FormatError(f"{path.name}: cannot be read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"{path.name}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{path.name}: expected a JSON object")
    return obj


def manifest_entry(path: Path, sha256: str | None = None) -> dict:
    """{"sha256", "size"} of one file (pass sha256 when the writer hashed the bytes it wrote)."""
    return {"sha256": sha256 or sha256_file(path), "size": path.stat().st_size}


def verify_manifest(path: Path, *, hashes: bool = True) -> dict[str, dict]:
    """Check that the folder holds exactly the manifest's files, with its sizes and sha256.

    `hashes=False` checks names and sizes only: the writer uses it on the folder it has just
    written and hashed on the way out, so that validation does not read every byte twice.
    """
    path = Path(path)
    manifest = _json(path / MANIFEST)
    try:
        closed(manifest, ("format_version", "files"), "manifest")
    except ValueError as e:
        raise FormatError(f"{MANIFEST}: {e}; convert the model again") from None
    files = manifest.get("files")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool) or not isinstance(files, dict):
        raise FormatError(
            f"{MANIFEST}: expected format_version {FORMAT_VERSION} (or "
            f"{', '.join(map(str, READABLE_VERSIONS[:-1]))}) and a files map"
        )
    for name, entry in files.items():
        if not _plain_name(name) or name == MANIFEST:
            raise FormatError(f"{MANIFEST}: entry {name!r} is not a plain file name of the folder")
        if not isinstance(entry, dict) or set(entry) != {"sha256", "size"}:
            raise FormatError(f"{MANIFEST}: entry {name!r} needs exactly sha256 and size")
        size, digest = entry["size"], entry["sha256"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FormatError(
                f"{MANIFEST}: entry {name!r} has size {size!r}, not a byte count; convert the "
                "model again"
            )
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise FormatError(
                f"{MANIFEST}: entry {name!r} has sha256 {str(digest)[:70]!r}, not 64 hex "
                "digits; convert the model again"
            )
    present = {p.name for p in path.iterdir() if not beside_checkpoint(p.name)} - {MANIFEST}
    if missing := sorted(set(files) - present):
        raise FormatError(f"{missing[0]}: listed in {MANIFEST} but missing from {path}")
    if extra := sorted(present - set(files)):
        raise FormatError(f"{extra[0]}: in {path} but not in {MANIFEST} (extra file)")
    for name in sorted(files):
        file, entry = path / name, files[name]
        if not file.is_file():
            raise FormatError(f"{name}: not a regular file; convert the model again")
        changed = file.stat().st_size != entry["size"]
        if changed or (hashes and sha256_file(file) != entry["sha256"]):
            raise FormatError(
                f"{name}: changed since it was written (size or sha256 differs "
                f"from {MANIFEST}); convert the model again"
            )
    return files


def beside_checkpoint(name: str) -> bool:
    """A file a hub clone adds beside a checkpoint, which no loader reads and the manifest
    does not list: hidden names (.git/, .gitattributes, .cache/) and documents (*.md, *.rst,
    LICENSE or LICENSE.txt, NOTICE, ...). Any other file is part of the checkpoint and must be
    in the manifest."""
    path = Path(name)
    suffix = path.suffix.lower()
    document = path.stem.upper() in DOCUMENTS and suffix in ("", ".txt")
    return name.startswith(".") or suffix in (".md", ".rst") or document


def _plain_name(name) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
    )


def weight_files(path: Path) -> dict[str, list[str]]:
    """file -> tensor names of the model weights: the index's shards, checked against it, or
    model.safetensors alone in a folder converted before the index was always written."""
    path = Path(path)
    if (path / INDEX).exists():
        index = _json(path / INDEX)
        weight_map, meta = index.get("weight_map"), index.get("metadata")
        if not isinstance(weight_map, dict) or not isinstance(meta, dict):
            raise FormatError(f"{INDEX}: needs a weight_map and metadata.total_size")
        if not all(isinstance(s, str) for s in weight_map.values()):
            raise FormatError(f"{INDEX}: weight_map must map tensor names to file names")
        shards = sorted(set(weight_map.values()))
        if not shards or not all(SHARD.fullmatch(s) for s in shards):
            raise FormatError(f"{INDEX}: weight_map must name model-XXXXX-of-YYYYY.safetensors")
        expected = [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
        if shards != expected:
            raise FormatError(f"{INDEX}: shards {shards} are not {expected}")
        files, total = {}, 0
        for shard in shards:
            tensors, _ = read_header(path / shard)
            mapped = {k for k, v in weight_map.items() if v == shard}
            if mapped != set(tensors):
                diff = sorted(mapped ^ set(tensors))[0]
                raise FormatError(f"{shard}: tensor {diff!r} disagrees with {INDEX}")
            files[shard] = sorted(tensors)
            total += sum(t.end - t.begin for t in tensors.values())
        if meta.get("total_size") != total:
            raise FormatError(
                f"{INDEX}: metadata.total_size {meta.get('total_size')} is not "
                f"the {total} bytes of tensor data in the shards"
            )
        stray = {p.name for p in path.glob("model*.safetensors")} - set(shards)
    else:
        tensors, _ = read_header(path / SINGLE) if (path / SINGLE).exists() else ({}, {})
        if not tensors:
            raise FormatError(f"{SINGLE}: missing or empty, and there is no {INDEX}")
        files = {SINGLE: sorted(tensors)}
        stray = {p.name for p in path.glob("model*.safetensors")} - {SINGLE}
    if stray:
        raise FormatError(f"{sorted(stray)[0]}: a weight file the index does not name")
    return files


def _check_meta(meta: dict) -> None:
    def fail(msg):
        raise FormatError(f"{META}: {msg}")

    version = meta.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        fail(
            f"format_version {version!r}, but this kvcalib-runtime reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}: install the kvcalib-runtime that matches "
            "the converter, or convert the model again"
        )
    keys = _META_KEYS[version]
    for key, kind in keys.items():
        if key not in meta:
            fail(f"missing key {key!r}")
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool) != (kind is bool):
            fail(f"{key!r} has the wrong type ({type(meta[key]).__name__})")
    if extra := sorted(set(meta) - set(keys)):
        fail(f"unknown key {extra[0]!r}")
    source, recipe, profile = meta["source"], meta["recipe"], meta["profile"]
    try:
        for name, known in _META_OBJECTS.items():
            if meta.get(name) is not None:  # profile may be null; binding is version 3's
                closed(meta[name], known, name)
    except ValueError as e:
        fail(f"{e}; convert the model again")
    if not all(isinstance(source.get(k), str) for k in ("spec", "fingerprint")):
        fail("source needs string spec and fingerprint")
    if not isinstance(recipe.get("name"), str) or not isinstance(recipe.get("toml"), str | None):
        fail("recipe needs a string name and toml (a string or null)")
    if profile is not None and not isinstance(profile.get("fingerprint"), str):
        fail("profile needs a string fingerprint")
    if version == 1:
        fused = meta["fused"]
        if any(f not in FUSED_V1 for f in fused) or sorted(set(fused)) != fused:
            fail(f"fused {fused} must be a sorted list drawn from {', '.join(FUSED_V1)}")
    seed = meta["residual_rotation_seed"]
    if seed is not None and not 0 <= seed < 2**63:
        fail(f"residual_rotation_seed {seed} is outside [0, 2**63)")
    if meta["export"] not in (None, *EXPORTS):
        fail(f"export {meta['export']!r} is unknown (known: {', '.join(EXPORTS)})")


def _transforms(meta: dict, scheme: KVScheme, params: KVParams) -> Transforms:
    """The side-car's transforms (version 1: derived from its `fused` list), checked against
    the scheme and the calibrated tensors: each layer places exactly the transforms its scheme
    quantizes in, never undone (a converted checkpoint serves its own recipe)."""
    if meta["format_version"] == 1:
        fused = set(meta["fused"])
        layers = []
        for i, layer in enumerate(scheme.layers):
            smooth = NONE
            if i in params.key_smooth:
                smooth = FUSED if "key_smooth" in fused else ONLINE
            value = NONE
            if layer.value_rotation:
                value = FUSED if "value_rotation" in fused else ONLINE
            rotation = ONLINE if layer.key_rotation else NONE
            layers.append(LayerTransforms(smooth, value, rotation))
        transforms = Transforms(tuple(layers), scheme.rotation_seed)
    else:
        try:
            transforms = Transforms.from_json(meta["transforms"])
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{META}: transforms is malformed ({e})") from None
    if len(transforms.layers) != len(scheme.layers):
        raise FormatError(
            f"{META}: transforms cover {len(transforms.layers)} layers, the scheme "
            f"{len(scheme.layers)}"
        )
    if transforms.seed != scheme.rotation_seed:
        raise FormatError(f"{META}: transforms.seed differs from scheme.rotation_seed")
    for i, (t, layer) in enumerate(zip(transforms.layers, scheme.layers, strict=True)):
        want = {
            "key_smooth": i in params.key_smooth,
            "value_rotation": layer.value_rotation,
            "key_rotation": layer.key_rotation,
        }
        for kind, wanted in want.items():
            place = getattr(t, kind)
            if wanted != (place in (FUSED, ONLINE)) or (not wanted and place != NONE):
                raise FormatError(
                    f"{META}: layer {i} places {kind} {place!r}, but its scheme "
                    f"{'quantizes' if wanted else 'does not quantize'} in that domain: "
                    "convert the model again"
                )
    return transforms


def binding(sha256: dict[str, str]) -> dict[str, str]:
    """kvcalib.json's `binding` (version 3) from the sha256 of the folder's files by name: that
    of kv_params.safetensors, and one sha256 over the weight files' names and sha256."""
    weights = sorted(n for n in sha256 if n == SINGLE or SHARD.fullmatch(n))
    joined = "".join(f"{n}:{sha256[n]}\n" for n in weights)
    return {PARAMS: sha256[PARAMS], "weights": hashlib.sha256(joined.encode()).hexdigest()}


def _check_binding(meta: dict, files: dict[str, dict]) -> None:
    """FormatError when kv_params.safetensors or the weights are not those kvcalib.json was
    converted with (the manifest's sha256, which verify_manifest held to the bytes)."""
    if meta["format_version"] < 3:
        return
    want = binding({n: e["sha256"] for n, e in files.items()})
    got = meta["binding"]
    if got.get(PARAMS) != want[PARAMS]:
        raise FormatError(
            f"{PARAMS}: not the file {META} was converted with (its sha256 differs from "
            f"binding.{PARAMS}: another conversion's?); convert the model again"
        )
    if set(got) != set(want) or got["weights"] != want["weights"]:
        raise FormatError(
            f"model*.safetensors: not the weights {META} and {PARAMS} were converted with "
            "(their sha256 differs from binding.weights); convert the model again"
        )


def read_checkpoint(path: Path, *, hashes: bool = True) -> Checkpoint:
    """Validate a converted checkpoint (FORMAT.md) and read its side-car.

    Raises FormatError naming the file that is missing, extra, changed or malformed.
    """
    path = Path(path)
    if not path.is_dir():
        raise FormatError(f"{path}: not a folder; pass the folder `kvcalib convert` wrote")
    files = verify_manifest(path, hashes=hashes)
    meta = _json(path / META)
    _check_meta(meta)
    _check_binding(meta, files)
    config = _json(path / CONFIG)
    geo = Geometry.from_config(config)
    geo.require_arch()
    layers, kv_heads, head_dim = geo.layers, geo.kv_heads, geo.head_dim
    if not (path / TOKENIZER).is_file():
        raise FormatError(f"{TOKENIZER}: missing; the runtime tokenizes with it")
    eos = config.get("eos_token_id")
    if not (eos is None or ints([eos]) or ints(eos)):
        raise FormatError(
            f"{CONFIG}: eos_token_id = {eos!r}; use a token id, a list of them or null (the "
            "source model's value)"
        )
    quant = config.get("quantization_config")
    if quant is not None and not (
        meta["export"] == "vllm-fp8"
        and isinstance(quant, dict)
        and quant.get("quant_method") == "compressed-tensors"
    ):
        raise FormatError(
            f"{CONFIG}: quantization_config is only written by --export vllm-fp8 "
            "(compressed-tensors); other engines reject custom quant methods"
        )
    if meta["residual_rotation_seed"] is not None and config.get("tie_word_embeddings"):
        raise FormatError(
            f"{CONFIG}: tie_word_embeddings is true, but a residual rotation "
            "makes lm_head differ from the embedding"
        )
    weights = weight_files(path)
    names = {n for tensors in weights.values() for n in tensors}
    if meta["untied_embeddings"] and "lm_head.weight" not in names:
        raise FormatError(f"{META}: untied_embeddings, but no lm_head.weight in the weights")
    try:
        scheme = KVScheme.from_json(meta["scheme"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(
            f"{META}: scheme is malformed ({type(e).__name__}: {e}); convert the model again"
        ) from None
    if len(scheme.layers) != layers:
        raise FormatError(
            f"{META}: scheme has {len(scheme.layers)} layers, {CONFIG} {layers}; convert the "
            "model again"
        )
    try:
        checks.check_scheme(scheme, geo)
    except ValueError as e:
        raise FormatError(f"{META}: scheme {e}") from None
    params = read_params(path / PARAMS, layers, kv_heads, head_dim)
    try:
        checks.check_params(scheme, params, geo)
    except ValueError as e:
        raise FormatError(f"{PARAMS}: {e}; convert the model again") from None
    for i, layer in enumerate(scheme.layers):
        for kind, spec in (("key", layer.key), ("value", layer.value)):
            if spec is None:
                continue
            try:
                spec.layout.check_head(head_dim, kv_heads)
            except ValueError as e:
                raise FormatError(f"{META}: layer {i} {kind}s: {e}") from None
    transforms = _transforms(meta, scheme, params)
    return Checkpoint(config, meta, geo, scheme, params, transforms)
