"""A hub id ("owner/name") as a local folder, downloaded as transformers downloads it.

huggingface_hub decides where and whether, from its own settings: HF_HUB_OFFLINE (or
TRANSFORMERS_OFFLINE) reads the cache only, HF_HUB_CACHE / HF_HOME say where the cache is, HF_TOKEN
or `hf auth login` opens gated and private repositories, HF_ENDPOINT names a mirror. A model
already cached is used when the Hub cannot be reached. kvcalib only narrows what is fetched:
the files a model folder needs, at the repository's top level (`MODEL_FILES`) - never pickles
(*.bin, *.pt), GGUF or ONNX copies, nor the consolidated or original/ weights some repositories
keep beside transformers'.

    path = download("HuggingFaceTB/SmolLM2-135M-Instruct")
"""

from pathlib import Path

from kvcalib.errors import ModelError

MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",  # model.safetensors, or the shards save_pretrained names model-*
    "model.safetensors.index.json",
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, tokenizer.model (SentencePiece)
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
]
CODE_FILES = ["*.py"]  # the repository's own modeling code: fetched with trust_remote_code only
_LOCAL = "pass a local folder"


def download(repo_id: str, *, trust_remote_code: bool = False) -> Path:
    """The local snapshot folder of hub model `repo_id` (downloaded, or found in the cache).

    ModelError, in one line, when it cannot be had: the id names nothing, the model is gated
    or private, the Hub cannot be reached (or HF_HUB_OFFLINE is set) and the cache lacks it.
    """
    import huggingface_hub
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    patterns = MODEL_FILES + (CODE_FILES if trust_remote_code else [])
    cache = huggingface_hub.constants.HF_HUB_CACHE
    where = f"model {repo_id}: no such local path"
    try:
        path = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns))
    except HFValidationError:
        raise ModelError(f"{where}, nor a valid hub id (owner/name); check the path") from None
    except GatedRepoError:
        raise ModelError(
            f"model {repo_id}: gated on the Hugging Face Hub: accept its terms at "
            f"https://huggingface.co/{repo_id} and log in (hf auth login, or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"{where}, and the Hugging Face Hub has no model {repo_id} (or it is private): "
            "check the path or id, or log in (hf auth login, or set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError as e:
        if huggingface_hub.is_offline_mode():
            raise ModelError(
                f"model {repo_id}: offline mode is on (HF_HUB_OFFLINE) and the Hugging Face cache "
                f"({cache}) lacks it: download it once with HF_HUB_OFFLINE unset, or {_LOCAL}"
            ) from None
        raise _unreachable(repo_id, e.__cause__ or e, cache) from None
    except HfHubHTTPError as e:  # a refusal the library does not answer from its cache
        raise _unreachable(repo_id, e, cache) from None
    if not any(path.glob("model*.safetensors")):
        raise ModelError(
            f"model {repo_id}: the repository holds no model*.safetensors weights at its top "
            "level; kvcalib reads safetensors only (never pickles): save it with transformers' "
            f"save_pretrained on a trusted machine and {_LOCAL}"
        )
    return path


def _unreachable(repo_id: str, error: Exception, cache: str) -> ModelError:
    """The one line for a Hub that could not serve the model (no network, or an HTTP error)."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status in (401, 403):
        return ModelError(
            f"model {repo_id}: the Hugging Face Hub refused access ({status}): log in "
            "(hf auth login, or set HF_TOKEN) with access to it"
        )
    why, fix = (
        (f"answered {status}", "try again later")
        if status is not None
        else (f"cannot be reached ({type(error).__name__})", "connect")
    )
    return ModelError(
        f"model {repo_id}: the Hugging Face Hub {why} and the cache ({cache}) lacks it: {fix}, "
        f"or set HF_HUB_OFFLINE=1 with the model cached, or {_LOCAL}"
    )
