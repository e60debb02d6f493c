"""A hub id downloads as transformers does, with no network here: huggingface_hub's own
snapshot_download runs against a cache laid out as the library lays it out, its offline switch
and its Hub calls replaced where a test needs them; the CLI reads HF_HUB_OFFLINE and HF_HOME
from the environment as the library does."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.utils import filter_repo_objects
from support.tiny import save_with_tokenizer, tiny_model

from kvcalib.core import hub, models
from kvcalib.errors import ModelError

REPO = "someone/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
URL = f"https://huggingface.co/{REPO}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny model folder as the Hub would serve it (config, safetensors, tokenizer)."""
    return save_with_tokenizer(tiny_model("llama"), tmp_path_factory.mktemp("hub") / "tiny")


def _cache(root: Path, folder: Path) -> Path:
    """REPO in a hub cache at root, laid out as huggingface_hub writes it: the snapshot folder."""
    repo = root / "models--someone--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return Path(shutil.copytree(folder, repo / "snapshots" / COMMIT))


@pytest.fixture
def hub_cache(monkeypatch, tmp_path):
    """huggingface_hub's cache moved to tmp_path (what HF_HUB_CACHE does at its import)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def _offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets


def _no_network(monkeypatch):
    """Every Hub call fails as a machine without a network fails: a refused connection."""

    def refused(*args, **kwargs):
        raise httpx2.ConnectError("[Errno 101] Network is unreachable")

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", refused)


def test_offline_and_cached(monkeypatch, hub_cache, folder):
    snapshot = _cache(hub_cache, folder)
    _offline(monkeypatch)
    source = models.resolve(REPO)
    assert (source.spec, source.path) == (REPO, Path(snapshot))


def test_offline_and_not_cached(monkeypatch, hub_cache):
    _offline(monkeypatch)
    with pytest.raises(ModelError) as e:
        models.resolve(REPO)
    assert str(e.value) == (
        f"model {REPO}: offline mode is on (HF_HUB_OFFLINE) and the Hugging Face cache "
        f"({hub_cache}) lacks it: download it once with HF_HUB_OFFLINE unset, or pass a local "
        "folder"
    )


def test_no_network_and_not_cached(monkeypatch, hub_cache):
    _no_network(monkeypatch)
    with pytest.raises(ModelError) as e:
        models.resolve(REPO)
    assert str(e.value) == (
        f"model {REPO}: the Hugging Face Hub cannot be reached (ConnectError) and the cache "
        f"({hub_cache}) lacks it: connect, or set HF_HUB_OFFLINE=1 with the model cached, or "
        "pass a local folder"
    )


def test_no_network_and_cached_uses_the_cache(monkeypatch, hub_cache, folder):
    """As transformers does: a cached model loads when the Hub cannot be reached."""
    snapshot = _cache(hub_cache, folder)
    _no_network(monkeypatch)
    assert models.resolve(REPO).path == Path(snapshot)


def _hub_answers(status: int, error):
    """The Hub answers every call with `status`, as huggingface_hub raises it (`error`)."""

    def answer(*args, **kwargs):
        request = httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO}")
        raise error("refused", response=httpx2.Response(status, request=request))

    return answer


@pytest.mark.parametrize(
    "status, error, message",
    [
        (404, RepositoryNotFoundError, "no such local path, and the Hugging Face Hub has no"),
        (401, RepositoryNotFoundError, "no such local path, and the Hugging Face Hub has no"),
        (403, GatedRepoError, f"gated on the Hugging Face Hub: accept its terms at {URL}"),
        (401, HfHubHTTPError, "the Hugging Face Hub refused access (401): log in"),
        (503, HfHubHTTPError, "the Hugging Face Hub answered 503 and the cache ("),
    ],
)
def test_what_the_hub_answers(monkeypatch, hub_cache, status, error, message):
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", _hub_answers(status, error))
    with pytest.raises(ModelError) as e:
        models.resolve(REPO)
    assert str(e.value).startswith(f"model {REPO}: {message}")
    assert "\n" not in str(e.value)


def test_neither_a_path_nor_a_hub_id(hub_cache):
    """A typo'd path that looks like owner/name but is no valid repository id: refused by the
    library's own validation before any request."""
    with pytest.raises(ModelError, match=r"^model runs/my model: no such local path, nor a valid"):
        models.resolve("runs/my model")


@pytest.mark.parametrize("trust", [False, True])
def test_download_asks_for_the_model_files_only(monkeypatch, tmp_path, folder, trust):
    """What the library is asked for: the model's files (its code only with trust_remote_code),
    neither local_files_only nor a cache folder of kvcalib's own (the library's settings
    decide); the folder it returns loads."""
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(shutil.copytree(folder, tmp_path / "snapshot"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model, _ = models.load_model(REPO, trust_remote_code=trust)
    code = ["*.py"] if trust else []
    assert calls == [(REPO, {"allow_patterns": hub.MODEL_FILES + code})]
    assert model.kvcalib_source.path == tmp_path / "snapshot"
    assert model.config.num_hidden_layers == 2


# A repository as the Hub lists it, with the copies kvcalib must not fetch: pickles, GGUF,
# ONNX, consolidated and original/ weights, README and licence, code without trust.
LISTING = {
    "config.json": True,
    "generation_config.json": True,
    "model.safetensors": True,
    "model-00001-of-00002.safetensors": True,
    "model.safetensors.index.json": True,
    "tokenizer.json": True,
    "tokenizer_config.json": True,
    "tokenizer.model": True,
    "special_tokens_map.json": True,
    "added_tokens.json": True,
    "vocab.json": True,
    "merges.txt": True,
    "chat_template.jinja": True,
    "pytorch_model.bin": False,
    "pytorch_model.bin.index.json": False,
    "training_args.pt": False,
    "consolidated.safetensors": False,
    "original/consolidated.00.pth": False,
    "original/tokenizer.model": False,
    "model.gguf": False,
    "onnx/model.onnx": False,
    "modeling_custom.py": False,
    "README.md": False,
    "LICENSE": False,
}


def test_patterns_select_what_a_model_needs():
    """The allow patterns, through huggingface_hub's own filter, on a repository's listing."""
    kept = set(filter_repo_objects(LISTING, allow_patterns=hub.MODEL_FILES))
    assert kept == {name for name, wanted in LISTING.items() if wanted}


def test_a_repository_of_pickles_only(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # what the patterns leave of such a repository
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(tmp_path))
    with pytest.raises(ModelError, match=r"no model\*\.safetensors weights at its top level"):
        models.resolve(REPO)


CLI = "import sys; from kvcalib.cli import main; main(sys.argv[1:], prog_name='kvcalib')"


def _cli(args, **env):
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS"))}
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**run_env, **env},
    )


def test_cli_reads_the_hub_settings_from_the_environment(tmp_path):
    """HF_HUB_OFFLINE=1 and HF_HOME, as a user sets them (read by huggingface_hub at its
    import: a fresh process), with no copy of the model: exit 2, one line naming the cache
    under HF_HOME and both ways out. (Offline and cached: test_offline_and_cached.)"""
    home = tmp_path / "home"
    result = _cli(["inspect", REPO], HF_HUB_OFFLINE="1", HF_HOME=str(home))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: model {REPO}: offline mode is on (HF_HUB_OFFLINE)")
    assert f"the Hugging Face cache ({home / 'hub'}) lacks it" in line
