"""An HF-layout folder read into the runtime's transformer: config.json, the weights of
model*.safetensors (one file, or the shards of model.safetensors.index.json) and tokenizer.json.

Every tensor is read straight onto the model's device by its HF name, checked against the
parameters the config implies (none missing, none extra, each of its shape); tensors an export
adds beside the weights (vLLM's FP8 KV-cache scales, `format.EXPORT_TENSOR`) are skipped, and a
tied LM head is tied again whether the folder saved it or not. kvcalib's converted checkpoints
are such folders; their side-car is checkpoint.format's business.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn

from kvcalib_runtime.checkpoint.format import EXPORT_TENSOR
from kvcalib_runtime.errors import FormatError
from kvcalib_runtime.model import archs

INDEX_FILE = "model.safetensors.index.json"


def read_config(folder: Path) -> dict:
    """The folder's config.json."""
    return _read_json(Path(folder) / "config.json")


def load(model: nn.Module, folder: Path, device: str | torch.device, dtype) -> None:
    """Read the folder's weights into `model` (a `forward.Transformer` built on the meta device
    from its config), each onto `device` in `dtype` (None: the checkpoint's), not requiring
    grad. FormatError naming the tensor that is missing, extra or of the wrong shape."""
    folder = Path(folder)
    config = model.config
    files = _weight_files(folder)
    expected = dict(model.named_parameters())  # tied lm_head.weight appears once, as embed
    found = {
        name: file
        for file in files
        for name in _tensor_names(file)
        if not EXPORT_TENSOR.fullmatch(name)  # vLLM's FP8 scales, beside the weights
    }
    if model.tied:
        found.pop(f"{archs.LM_HEAD}.weight", None)  # HF ties it whether saved or not
    missing, unexpected = expected.keys() - found.keys(), found.keys() - expected.keys()
    if missing:
        raise FormatError(
            f"{folder} lacks tensor(s) {sorted(missing)} that {config['model_type']} needs: "
            "the checkpoint is incomplete"
        )
    if unexpected:
        name = min(unexpected)
        raise FormatError(
            f"tensor {name!r} in {found[name]} is not part of a {config['model_type']} model "
            f"with this config.json (and {len(unexpected) - 1} more)"
        )
    device = str(torch.device(device))
    for file in files:
        with safe_open(file, framework="pt", device=device) as f:
            for name in (name for name, where in found.items() if where == file):
                _assign(model, name, f.get_tensor(name), expected[name].shape, dtype)
    if model.tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def _assign(model: nn.Module, name: str, tensor: torch.Tensor, shape: torch.Size, dtype) -> None:
    if tensor.shape != shape:
        raise FormatError(
            f"tensor {name!r} has shape {list(tensor.shape)}, config.json implies {list(shape)}"
        )
    module, attr = name.rsplit(".", 1)
    param = nn.Parameter(tensor if dtype is None else tensor.to(dtype), requires_grad=False)
    setattr(model.get_submodule(module), attr, param)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FormatError(f"{path} does not exist: point at a folder with an HF config.json")
    return json.loads(path.read_text())


def _weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those of the shard index, else model*.safetensors.

    Other safetensors in the folder (kvcalib's kv_params.safetensors) are not weights.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        files = [folder / f for f in sorted(set(_read_json(index)["weight_map"].values()))]
        for file in files:
            if not file.is_file():
                raise FormatError(f"{file} is listed in {index} but does not exist")
        return files
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise FormatError(f"{folder} has no model*.safetensors: it is not an HF checkpoint")
    return files


def _tensor_names(file: Path) -> list[str]:
    with safe_open(file, framework="pt") as f:
        return list(f.keys())


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder, from its tokenizer.json."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise FormatError(f"{file} does not exist: the folder needs an HF tokenizer.json")
    return Tokenizer.from_file(str(file))
