"""Layer-by-layer calibration gives the in-memory profile bit for bit, holds one decoder layer
at a time, is chosen when the model does not fit, and `--device auto` reaches the loader.

Why bit for bit (torch.equal, not a tolerance): both run the same passes over a LayerSource —
in memory window by window, from shards every window through each layer as it is loaded — so
what differs is where the weights come from (the shards, by the model's own parameter names)
and the order in which (window, layer) steps feed the accumulators (observe.StatsAccumulator,
codebooks.Codebooks, sensitivity.FisherSensitivity), which must not matter. The same layer
modules see the same inputs with the same arguments (mask, RoPE) at the same batch shapes, so
every kernel sees the same operands. A tolerance would hide a wrong mask, a skipped layer, a
misread weight or an order-dependent accumulator. That a layer source computes what the whole
model computes is held below (logits) and in test_calibrate.py (the backward).
"""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.tiny import save_with_tokenizer, tiny_model
from transformers import AutoTokenizer

from kvcalib.calibration import Settings, calibrate, calibrate_model, layerwise
from kvcalib.calibration.layerwise import ActivationStore, InMemory, LayerwiseModel
from kvcalib.cli import main
from kvcalib.core.models import load_model, resolve
from kvcalib.errors import ModelError, NumericsError, OutputError
from kvcalib.sim.hooks import decoder_layers

FAST = Settings(sensitivity_windows=1, sensitivity_tokens=16, codebook_windows=1)
SMALL = dict(num_samples=2, seq_len=32, progress=False, settings=FAST)


def _folder(tmp_path, arch="llama", **overrides) -> Path:
    return save_with_tokenizer(tiny_model(arch, **overrides), tmp_path / f"src-{arch}")


def _assert_same(a, b):
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:  # NaN marks "no later sinks" in position_error.key_groups
        x, y = a.tensors[k], b.tensors[k]
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=k)


# qwen3: keys pass through k_norm, and tied embeddings make the head read the input embedding;
# gemma3_text: a sliding and a global layer, each with its own mask and RoPE, scaled embeddings
@pytest.mark.parametrize("arch", ["llama", "qwen3-tied", "gemma3_text"])
def test_sequential_profile_equals_in_memory(tmp_path, arch):
    family = arch.removesuffix("-tied")
    src = _folder(tmp_path, family, tie_word_embeddings=arch.endswith("-tied"))
    memory = calibrate(src, tmp_path / "memory", sequential=False, **SMALL)
    offload = tmp_path / "offload"
    if arch == "llama":
        offload.mkdir()  # a folder the user made stays; one that calibrate made goes
    layered = calibrate(src, tmp_path / "layered", sequential=True, offload_dir=offload, **SMALL)
    assert not memory.meta["sequential"] and layered.meta["sequential"]
    assert {"sensitivity.key", "sensitivity.answer.value"} <= layered.tensors.keys()
    assert any(k.startswith("codebook.") for k in layered.tensors)
    _assert_same(memory, layered)
    assert memory.meta["sink_predictor"] == layered.meta["sink_predictor"]
    if arch == "llama":
        assert list(offload.iterdir()) == []  # the spill folder is removed
    else:
        assert not offload.exists()


@pytest.mark.parametrize("where", ["memory", "shards"])
def test_a_layer_source_computes_the_model_forward(tmp_path, where):
    src = _folder(tmp_path, "qwen3", tie_word_embeddings=True)
    model, _ = load_model(src)
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        lm = InMemory(model) if where == "memory" else LayerwiseModel(resolve(src))
        with lm.embedding():
            hidden, kwargs = lm.inputs(ids)
        for i in range(lm.config.num_hidden_layers):
            with lm.layer(i) as layer:
                hidden = layer(hidden, **kwargs[i])
        with lm.head():
            got = lm.logits(hidden)
    assert torch.equal(got, want)


def test_one_decoder_layer_in_memory_at_a_time(tmp_path):
    src = _folder(tmp_path)
    lm = LayerwiseModel(resolve(src))
    layers = decoder_layers(lm.model)
    ends = (lm.model.get_input_embeddings(), lm.model.get_output_embeddings())
    ran = []

    def loaded(module) -> bool:
        return any(p.device.type != "meta" for p in module.parameters())

    def check(i):
        def hook(module, args, kwargs):
            if not loaded(module):
                return  # the model's own forward passing through (inputs, head)
            assert [j for j, layer in enumerate(layers) if loaded(layer)] == [i]
            assert not any(loaded(m) for m in ends)
            ran.append(i)

        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(check(i), with_kwargs=True)
    tokenizer = AutoTokenizer.from_pretrained(src)
    calibrate_model(lm, tokenizer, tmp_path / "p", source=lm.kvcalib_source, **SMALL)
    assert sorted(set(ran)) == [0, 1]
    assert all(p.device.type == "meta" for p in lm.model.parameters())  # everything freed


def test_chosen_automatically_when_the_model_does_not_fit(tmp_path, monkeypatch, capsys):
    src = _folder(tmp_path)
    params = sum(p.numel() for p in tiny_model("llama").parameters())
    assert layerwise.weight_bytes(src, torch.float32) == 4 * params
    assert layerwise.weight_bytes(src, torch.bfloat16) == 2 * params
    kw = {**SMALL, "phases": ("stats",), "progress": True}
    monkeypatch.setattr(layerwise, "available_bytes", lambda device: 4 * params)  # < 1.25x
    assert calibrate(src, tmp_path / "small", **kw).meta["sequential"]
    assert "calibrating layer by layer" in capsys.readouterr().err
    monkeypatch.setattr(layerwise, "available_bytes", lambda device: 5 * params)
    assert not calibrate(src, tmp_path / "large", **kw).meta["sequential"]


def test_nan_stops_with_the_layer_named(tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[3, 5] = float("nan")
    src = save_with_tokenizer(model, tmp_path / "src")
    with pytest.raises(NumericsError, match=r"^layer 1: NaN or Inf in the keys before RoPE"):
        calibrate(src, tmp_path / "p", sequential=True, **SMALL)
    assert not (tmp_path / "p").exists()


def test_a_checkpoint_missing_a_tensor_is_refused_before_any_work(tmp_path):
    src = _folder(tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"no tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        LayerwiseModel(resolve(src))


def test_offload_needs_sequential(tmp_path):
    src = _folder(tmp_path)
    with pytest.raises(OutputError, match="drop --in-memory or --offload-dir"):
        calibrate(src, tmp_path / "p", sequential=False, offload_dir=tmp_path / "o", **SMALL)


def test_store_round_trips_through_files(tmp_path):
    x = torch.randn(3, 97, 5).to(torch.bfloat16)
    with ActivationStore(tmp_path) as store:
        store.put("a", x)
        store.put("a", x * 2)  # replaced: one file
        assert torch.equal(store.get("a"), x * 2) and len(list(store.dir.iterdir())) == 1
        assert torch.equal(store.pop("a"), x * 2) and list(store.dir.iterdir()) == []
    assert list(tmp_path.iterdir()) == []


def test_cli_sequential_with_offload(tmp_path):
    src = _folder(tmp_path)
    out = tmp_path / "p"
    args = ["calibrate", str(src), "-o", str(out), "--num-samples", "2", "--seq-len", "32"]
    result = CliRunner().invoke(main, [*args, "--sequential", "--offload-dir", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "profile.json").read_text())["sequential"] is True
    refused = CliRunner().invoke(main, [*args, "--in-memory", "--offload-dir", "o", "--force"])
    assert refused.exit_code == 2 and "drop --in-memory" in refused.output


# -- --device auto -----------------------------------------------------------------------------


def test_device_auto_is_the_cpu_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, _ = load_model(_folder(tmp_path), device="auto")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert layerwise.resolve_device("auto") == "cpu"


def test_device_auto_spreads_over_the_gpus(tmp_path, monkeypatch):
    import transformers

    src = _folder(tmp_path)
    calls = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(path, **kwargs):
        calls.append(kwargs)
        model = real(path, **{k: v for k, v in kwargs.items() if k != "device_map"})
        model.to = lambda *a, **k: pytest.fail("a dispatched model must not be moved")
        return model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    load_model(src, device="auto")
    assert calls[0]["device_map"] == "auto"


def test_cli_calibrate_passes_device_auto(tmp_path, monkeypatch):
    import kvcalib.calibration

    seen = {}

    def fake(model, output, **kwargs):
        seen.update(kwargs)
        raise ModelError("stop here")

    monkeypatch.setattr(kvcalib.calibration, "calibrate", fake)
    args = ["calibrate", str(tmp_path), "-o", str(tmp_path / "p"), "--device", "auto"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen["device"] == "auto" and seen["sequential"] is None
