"""What the CLI can judge from the file system alone, before torch and transformers import (tens
of seconds on a small machine): every local path a command names exists. The refusals read as
the library's own later checks do, only sooner; this module imports nothing heavy.

    paths.check(model=..., data=..., profile=..., recipes=..., checkpoint=...)
"""

import os
from pathlib import Path

from kvcalib.errors import DataError, ModelError, OptionError, ProfileError, RecipeError

DEFAULT_MODEL = "smollm2-135m"
GEMMA3 = "gemma3-270m"
QWEN25 = "qwen2.5-0.5b"
NAMED_MODELS = (DEFAULT_MODEL, GEMMA3, QWEN25)  # resolved by name (kvcalib.core.models)


def is_hub_id(spec: str) -> bool:
    """A spec that names a model on the hub ("owner/name") rather than a local path."""
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~"))


def is_recipe_file(name_or_path: str | Path) -> bool:
    """The one rule between a preset name and a recipe file: a Path, or a string that holds a
    path separator or ends in .toml, names a file; any other string names a preset, whatever
    the working directory holds (a folder `kvcalib-2` there does not hide the preset)."""
    text = str(name_or_path)
    return isinstance(name_or_path, Path) or text.endswith(".toml") or "/" in text or os.sep in text


def check(*, model=None, data=None, profile=None, recipes=(), checkpoint=None) -> None:
    """A KvcalibError for the first local path named here that does not exist."""
    spec = None if model is None else str(model)
    named = spec is None or spec in NAMED_MODELS or is_hub_id(spec)
    if not named and not _exists(spec):
        raise ModelError(f"model {spec}: no such file or folder; pass a local path or a hub id")
    if data is not None and not str(data).startswith("builtin:") and not _exists(data):
        raise DataError(f"--data {data}: no such file; pass a .txt or .jsonl file")
    if profile is not None and not _exists(profile):
        raise ProfileError(
            f"profile {profile}: no such folder; create it with kvcalib calibrate [MODEL] "
            f"-o {profile}"
        )
    for r in recipes:
        if is_recipe_file(r) and not _exists(r):
            raise RecipeError(f"recipe {r}: no such file; pass a TOML file or a preset name")
    if checkpoint is not None and not _exists(checkpoint):
        raise OptionError(
            f"checkpoint {checkpoint}: no such file or folder; pass a folder kvcalib convert wrote"
        )


def _exists(path) -> bool:
    return os.path.lexists(Path(path).expanduser())
