"""`kvcalib convert`: a fused transform is correct only when the converted model's logits match.

Every tiny model gets random norm weights and biases (tiny_model leaves them at 1 and 0), so
folding and bias rotation are exercised, and every test checks that the weights did change, so
a no-op could not pass. The transforms compute in float32, so an fp32 conversion differs from
its source by float32 rounding in the weights and the forward (~1e-6 relative in the logits),
far inside the 1e-4 bound.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from support.tiny import TINY_CONFIGS, fused_kinds, save_with_tokenizer, tiny_model
from transformers import AutoModelForCausalLM

import kvcalib.conversion.convert as conv
from kvcalib.calibration import calibrate
from kvcalib.cli import main
from kvcalib.conversion import rotate
from kvcalib.errors import ModelError, OptionError, OutputError, ProfileError
from kvcalib.io import atomic, shards
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.checkpoint import format
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.hadamard import orthogonal_hadamard
from kvcalib_runtime.model.transforms import ONLINE

REPO = Path(conv.__file__).parents[2]
FP32_BOUND = 1e-4  # relative max error of logits: fp32 forward rounding is ~1e-6
T = 37
VALUE_TOML = 'name = "v-rot"\n[value]\nbits = 4\nrotation = "hadamard"\n'
SMOOTH_TOML = 'name = "k-smooth"\n[key]\nbits = 4\nsmooth = 0.5\n'
BOTH_TOML = SMOOTH_TOML.replace("k-smooth", "both") + '[value]\nbits = 4\nrotation = "hadamard"\n'


class FakeProfile:
    """What convert and plan ask of a profile: fingerprint, check_model, smoothing, and the
    all-token absmax tensors of profile.safetensors (for the FP8 export)."""

    def __init__(self, model, *, uniform=False, fingerprint="fake-profile", reject=False):
        self.kv_heads, self.d = (
            model.config.num_key_value_heads,
            Geometry.from_config(model.config).head_dim,
        )
        self.uniform, self.fingerprint, self.reject = uniform, fingerprint, reject
        self.path = None
        g = torch.Generator().manual_seed(7)
        shape = (model.config.num_hidden_layers, self.kv_heads, self.d)
        self.tensors = {
            name: torch.rand(shape, generator=g) + 0.5
            for name in ("key_post_rope.all.absmax", "value.all.absmax")
        }

    def check_model(self, source):
        if self.reject:
            raise ProfileError(f"profile {self.fingerprint} is of another model than {source.spec}")

    def smoothing(self, layer, alpha, position="post_rope"):
        g = torch.Generator().manual_seed(100 + layer)
        heads = 1 if self.uniform else self.kv_heads
        half = torch.exp(torch.randn(heads, self.d // 2, generator=g))
        return torch.cat([half, half], -1).expand(self.kv_heads, -1).contiguous()


def _randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


def _source(tmp_path, arch="llama", seed=0, **overrides):
    model = _randomize(tiny_model(arch, seed, **overrides))
    return model, save_with_tokenizer(model, tmp_path / f"src-{arch}-{seed}")


def _recipe(tmp_path, toml: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(toml)
    return path


def _load(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _ids(vocab=128, t=T, seed=1):
    return torch.randint(0, vocab, (1, t), generator=torch.Generator().manual_seed(seed))


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _weights(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    return out


def _hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


# -- equivalence: every family, every transform, alone and combined -----------------------------

ARCHS = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "llama-hd80": {},  # hidden 160 = 5·32
    "llama-tied": {"tie_word_embeddings": True},
}  # fmt: skip
TRANSFORMS = {
    "value": (VALUE_TOML, False, {"value_rotation"}),
    "smooth": (SMOOTH_TOML, False, {"key_smooth"}),
    "residual": ("per-token-4", True, {"residual_rotation"}),
    "all": (BOTH_TOML, True, {"value_rotation", "key_smooth", "residual_rotation"}),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_converted_logits_match(tmp_path, arch, transform):
    family = arch.removesuffix("-tied")
    model, src = _source(tmp_path, family, **ARCHS[arch])
    toml, residual, fused = TRANSFORMS[transform]
    recipe = toml if not toml.startswith("name") else _recipe(tmp_path, toml)
    profile = FakeProfile(model, uniform=family == "qwen3")  # Qwen3 fuses shared scales only
    out = conv.convert(
        src,
        recipe=recipe,
        output=tmp_path / "out",
        rotate_residual=residual,
        profile=profile if "key_smooth" in fused else None,
    )
    ckpt = format.read_checkpoint(out)
    assert fused_kinds(ckpt) == fused
    converted = _load(out)
    ids = _ids()
    with torch.no_grad():
        assert _rel(converted(ids).logits, model(ids).logits) < FP32_BOUND
    before, after = _weights(src), _weights(out)
    layer = "model.layers.1.self_attn."
    changed = {
        "value_rotation": layer + "v_proj.weight",
        "residual_rotation": "model.norm.weight",
        "key_smooth": layer + ("k_norm.weight" if family == "qwen3" else "k_proj.weight"),
    }
    for name in fused:  # the transform really happened: a no-op cannot pass
        assert (after[changed[name]] - before[changed[name]]).abs().max() > 1e-2, name
    untied = "residual_rotation" in fused and arch == "llama-tied"
    assert ckpt.meta["untied_embeddings"] == untied
    assert ("lm_head.weight" in after) == (untied or "lm_head.weight" in before)
    assert not ckpt.config.get("tie_word_embeddings") or not untied


@pytest.mark.parametrize(
    "n",
    [
        576,  # SmolLM2-135M hidden
        896,  # Qwen2-0.5B hidden (7·128: a Paley base)
        2048,  # Llama-3.2-1B hidden
        4096,  # Llama-3-8B hidden
        5120,  # Qwen2.5-14B hidden
    ],
)
def test_chunked_rotation_is_the_hadamard(n, monkeypatch):
    """The residual rotation applies Q a row block at a time: it must be exactly
    orthogonal_hadamard(n, seed) (fp32 sums of Kronecker factors: ~1e-6 relative)."""
    monkeypatch.setattr(rotate, "CHUNK", 3 * n)  # several row blocks
    x = torch.randn(10, n, generator=torch.Generator().manual_seed(n))
    reference = x.double() @ orthogonal_hadamard(n, seed=5, dtype=torch.float64)
    assert _rel(rotate.rotate_embedding(x, 5).double(), reference) < 1e-5


def test_qwen3_per_head_smoothing_stays_online(tmp_path):
    """One k_norm weight serves every head: per-head scales cannot be fused, so they stay in
    kv_params for the cache to apply, and the weights are untouched."""
    model, src = _source(tmp_path, "qwen3")
    out = conv.convert(
        src,
        recipe=_recipe(tmp_path, SMOOTH_TOML),
        output=tmp_path / "out",
        profile=FakeProfile(model),
    )
    ckpt = format.read_checkpoint(out)
    assert fused_kinds(ckpt) == set() and len(ckpt.params.key_smooth) == 2
    assert {t.key_smooth for t in ckpt.transforms.layers} == {ONLINE}
    assert all(torch.equal(_weights(src)[k], v) for k, v in _weights(out).items())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_simulation_of_converted_equals_simulation_of_source(tmp_path, arch):
    """What `kvcalib eval CONVERTED_DIR` relies on: the fused weights + `fused` reproduce the
    online simulation. Same quantizer inputs up to fp32 rounding; a rounding flip at a level
    boundary is the only way to differ, rare at this size."""
    model, src = _source(tmp_path, arch)
    profile = FakeProfile(model, uniform=True)
    out = conv.convert(
        src,
        recipe=_recipe(tmp_path, BOTH_TOML),
        output=tmp_path / "out",
        profile=profile,
        rotate_residual=True,
    )
    ckpt = format.read_checkpoint(out)
    ids = _ids()
    with torch.no_grad():
        online = Simulator(model, ckpt.scheme, ckpt.params, mode="fake")(ids)
        fused = Simulator(
            _load(out),
            ckpt.scheme,
            ckpt.params,
            mode="fake",
            transforms=ckpt.transforms,
        )(ids)
        exact = model(ids).logits
    assert _rel(fused, online) < FP32_BOUND
    assert _rel(online, exact) > 1e-3  # the 4-bit cache does change the logits


PROMPTS = [
    "The capital of France is Paris. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Water boils at 100 degrees Celsius at sea level, but on a high mountain it boils at",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.mark.slow
def test_real_model_fp32_and_bf16(tmp_path, real_model):
    """The default model with value + residual rotation. fp32: 1e-4. bf16 (flash-attention's
    rule): its error against the fp32 reference, over the logits of every position of four
    prompts, is at most twice the plain bf16 model's. One prompt alone is too few: moving a
    random 0.04% of the converted bf16 weights by one ulp (rounding noise) spread that ratio
    over 1.3-2.2 on the first prompt, 0.8-1.4 on the four (benchmarks/RESULTS.md, issue 27)."""
    model, tokenizer = real_model
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]

    def logits(m):
        return torch.cat([m(ids).logits[0].double() for ids in prompts])

    out = conv.convert(None, recipe="quarot-kv4", output=tmp_path / "fp32", rotate_residual=True)
    with torch.no_grad():
        reference = logits(model)
        assert _rel(logits(_load(out)), reference) < FP32_BOUND
        bf16 = conv.convert(
            None,
            recipe="quarot-kv4",
            output=tmp_path / "bf16",
            rotate_residual=True,
            dtype="bfloat16",
        )
        rotated = logits(_load(bf16, torch.bfloat16))
        plain = logits(_load(model.kvcalib_source.path, torch.bfloat16))
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert _rel(rotated, reference) <= 2 * _rel(plain, reference)


# -- determinism, sources untouched, sharding --------------------------------------------------


def test_same_inputs_give_identical_files_and_source_is_untouched(tmp_path):
    _, src = _source(tmp_path)
    before = _hashes(src)
    recipe = _recipe(tmp_path, VALUE_TOML)
    a = conv.convert(src, recipe=recipe, output=tmp_path / "a", rotate_residual=True)
    b = conv.convert(src, recipe=recipe, output=tmp_path / "b", rotate_residual=True)
    assert _hashes(a) == _hashes(b)
    assert _hashes(src) == before
    meta = json.loads((a / "kvcalib.json").read_text())
    assert meta["recipe"] == {"name": "v-rot", "toml": VALUE_TOML}
    assert meta["source"]["spec"] == str(src) and meta["residual_rotation_seed"] == 0


def test_small_shards_index_and_sharded_source(tmp_path):
    model, src = _source(tmp_path)
    recipe = _recipe(tmp_path, VALUE_TOML)
    single = conv.convert(src, recipe=recipe, output=tmp_path / "single", rotate_residual=True)
    out = conv.convert(
        src, recipe=recipe, output=tmp_path / "sharded", max_shard_size="20KB", rotate_residual=True
    )
    index = json.loads((out / format.INDEX).read_text())
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 3 and not (out / format.SINGLE).exists()
    tensors = _weights(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.itemsize for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    for name, file in index["weight_map"].items():
        with safe_open(out / file, "pt") as f:
            assert name in f.keys()  # noqa: SIM118
    ids = _ids()
    with torch.no_grad():
        assert _rel(_load(out)(ids).logits, model(ids).logits) < FP32_BOUND
    expected = _weights(single)
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    # A sharded source streams the same tensors out.
    sharded_src = tmp_path / "src-sharded"
    model.save_pretrained(sharded_src, max_shard_size="20KB")
    shutil.copy(src / "tokenizer.json", sharded_src)
    assert (sharded_src / format.INDEX).exists()
    again = conv.convert(
        sharded_src, recipe=recipe, output=tmp_path / "again", rotate_residual=True
    )
    assert all(torch.equal(t, expected[k]) for k, t in _weights(again).items())


def test_the_index_names_the_weights_and_not_the_side_car(tmp_path):
    """vLLM reads every *.safetensors of a folder without model.safetensors.index.json as
    weights and fails on kv_params.safetensors ("no module or parameter named 'layers'"); with
    an index it reads only the files the index names (`filter_duplicate_safetensors_files` in
    its weight_utils.py). So the converter writes the index also for one shard, and it names
    exactly the weight files: the model's tensors and the export's FP8 scales."""
    model, src = _source(tmp_path)
    out = conv.convert(
        src,
        recipe=_recipe(tmp_path, BOTH_TOML),
        output=tmp_path / "out",
        profile=FakeProfile(model),
        export="vllm-fp8",
    )
    with safe_open(out / format.PARAMS, "pt") as f:
        assert f.keys(), "the side-car holds calibrated tensors, which vLLM failed to load"
    weight_map = json.loads((out / format.INDEX).read_text())["weight_map"]
    read = sorted(p.name for p in out.glob("*.safetensors") if p.name in weight_map.values())
    assert read == ["model-00001-of-00001.safetensors"]  # what vLLM keeps of the glob
    tensors = _weights(out)
    assert set(weight_map) == set(tensors)
    assert {n for n in tensors if not format.EXPORT_TENSOR.fullmatch(n)} == set(model.state_dict())


def test_bf16_output_from_fp32_source(tmp_path):
    _, src = _source(tmp_path)
    out = conv.convert(src, recipe="per-token-4", output=tmp_path / "out", dtype="bfloat16")
    assert {t.dtype for t in _weights(out).values()} == {torch.bfloat16}


# -- atomic writes -----------------------------------------------------------------------------


def _strays(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if atomic.TMP_MARK in p.name]


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    _, src = _source(tmp_path)
    calls = []
    real = shards.ShardWriter.write

    def failing(self, name, tensor):
        calls.append(name)
        if len(calls) == 5:
            raise RuntimeError("disk on fire")
        real(self, name, tensor)

    monkeypatch.setattr(shards.ShardWriter, "write", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        conv.convert(src, recipe="per-token-4", output=tmp_path / "out", max_shard_size="20KB")
    assert not (tmp_path / "out").exists() and _strays(tmp_path) == []


def test_existing_output_needs_force(tmp_path):
    _, src = _source(tmp_path)
    out = conv.convert(src, recipe="per-token-4", output=tmp_path / "out")
    with pytest.raises(OutputError, match="exists; pass --force"):
        conv.convert(src, recipe="quarot-kv4", output=out)
    assert format.read_checkpoint(out).meta["recipe"]["name"] == "per-token-4"
    conv.convert(src, recipe="quarot-kv4", output=out, force=True)
    assert format.read_checkpoint(out).meta["recipe"]["name"] == "quarot-kv4"
    assert _strays(tmp_path) == []


def test_output_overlapping_the_source_is_refused(tmp_path):
    """Even with --force: the source itself (a model folder, not an earlier conversion), a
    folder inside it, a folder holding it (and other files)."""
    _, src = _source(tmp_path)
    for out, message in (
        (src, "is a model folder, not a converted checkpoint: pick another output"),
        (src / "converted", "overlaps the input"),
        (tmp_path, "is a folder of other files, not a converted checkpoint"),
    ):
        with pytest.raises(OutputError, match=message):
            conv.convert(src, recipe="per-token-4", output=out, force=True)


_KILLED = """
import sys, time
import kvcalib.io.shards as shards
from kvcalib.conversion.convert import convert
real = shards.ShardWriter.write
def slow(self, name, tensor):
    real(self, name, tensor)
    open(sys.argv[3], "w").close()
    time.sleep(60)
shards.ShardWriter.write = slow
convert(sys.argv[1], recipe="per-token-4", output=sys.argv[2])
"""


def test_sigkilled_conversion_is_cleaned_by_the_next(tmp_path):
    """SIGKILL runs no cleanup: the temporary folder stays until the next conversion into the
    same output sees that its process is gone and removes it."""
    _, src = _source(tmp_path)
    out, marker = tmp_path / "out", tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(src), str(out), str(marker)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "runtime")])},
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "subprocess did not start"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(_strays(tmp_path)) == 1 and not out.exists()
    live = tmp_path / f"{atomic.tmp_prefix(out)}{os.getppid()}-keep"  # a live process's folder
    live.mkdir()
    conv.convert(src, recipe="per-token-4", output=out)
    assert _strays(tmp_path) == [live.name]
    format.read_checkpoint(out)


# -- inputs that are refused -------------------------------------------------------------------


def test_refusals(tmp_path):
    model, src = _source(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ProfileError, match="another model"):
        conv.convert(
            src,
            recipe=_recipe(tmp_path, SMOOTH_TOML),
            output=out,
            profile=FakeProfile(model, reject=True),
        )
    with pytest.raises(ProfileError, match="pass --profile"):
        conv.convert(src, recipe="quarot-kv4", output=out, export="vllm-fp8")
    with pytest.raises(OptionError, match="--dtype 'int8'"):
        conv.convert(src, recipe="per-token-4", output=out, dtype="int8")
    with pytest.raises(OptionError, match="--max-shard-size 'lots'"):
        conv.convert(src, recipe="per-token-4", output=out, max_shard_size="lots")
    (src / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"no tokenizer\.json"):
        conv.convert(src, recipe="per-token-4", output=out)
    assert not out.exists()


def test_converted_checkpoint_is_not_converted_again(tmp_path):
    _, src = _source(tmp_path)
    out = conv.convert(src, recipe="per-token-4", output=tmp_path / "out")
    with pytest.raises(ModelError, match="already a kvcalib-converted checkpoint"):
        conv.convert(out, recipe="per-token-4", output=tmp_path / "again")


# -- vLLM export -------------------------------------------------------------------------------


def _exported(tmp_path):
    model, src = _source(tmp_path)
    profile = FakeProfile(model)
    out = conv.convert(
        src, recipe="quarot-kv4", output=tmp_path / "out", profile=profile, export="vllm-fp8"
    )
    return profile, out


def test_vllm_fp8_export(tmp_path):
    profile, out = _exported(tmp_path)
    ckpt = format.read_checkpoint(out)
    quant = ckpt.config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["config_groups"] == {}
    assert quant["kv_cache_scheme"] == {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    }
    tensors = _weights(out)
    d = TINY_CONFIGS["llama"]["hidden_size"] // TINY_CONFIGS["llama"]["num_attention_heads"]
    for i in range(2):
        k, v = (tensors[f"model.layers.{i}.self_attn.{n}_scale"] for n in "kv")
        assert k.dtype == v.dtype == torch.float32 and k.shape == v.shape == (1,)
        key_absmax = profile.tensors["key_post_rope.all.absmax"][i]  # keys are not rotated
        value_absmax = profile.tensors["value.all.absmax"][i]
        rotated_bound = (value_absmax.sum(-1) / d**0.5).max()  # |(v Q)_j| <= sum_i |v_i| / sqrt(D)
        torch.testing.assert_close(k, key_absmax.max().reshape(1) / 448, rtol=1e-6, atol=0)
        torch.testing.assert_close(v, rotated_bound.reshape(1) / 448, rtol=1e-6, atol=0)


def test_vllm_fp8_config_parses_with_compressed_tensors(tmp_path):
    ct = pytest.importorskip("compressed_tensors.quantization")
    _, out = _exported(tmp_path)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    config = ct.QuantizationConfig.model_validate(quant)
    assert config.kv_cache_scheme.num_bits == 8 and config.kv_cache_scheme.type == "float"
    assert config.kv_cache_scheme.strategy == "tensor" and not config.kv_cache_scheme.dynamic


def test_with_a_real_profile(tmp_path):
    """The calibrated Profile end to end: key smoothing from it fused, FP8 scales from its
    all-token absmax, and a profile of another model refused by its fingerprint."""
    model, src = _source(tmp_path)
    profile_dir = tmp_path / "profile"
    profile = calibrate(
        src, profile_dir, num_samples=2, seq_len=32, phases=("stats",), progress=False
    )
    recipe = _recipe(tmp_path, BOTH_TOML)
    out = conv.convert(src, recipe=recipe, output=tmp_path / "out", profile=profile_dir)
    ckpt = format.read_checkpoint(out)
    assert fused_kinds(ckpt) == {"key_smooth", "value_rotation"}
    assert ckpt.meta["profile"] == {"fingerprint": profile.fingerprint, "path": str(profile_dir)}
    ids = _ids()
    with torch.no_grad():
        assert _rel(_load(out)(ids).logits, model(ids).logits) < FP32_BOUND
    exported = conv.convert(
        src, recipe=recipe, output=tmp_path / "fp8", profile=profile_dir, export="vllm-fp8"
    )
    k0 = _weights(exported)["model.layers.0.self_attn.k_scale"]
    absmax = profile.tensors["key_post_rope.all.absmax"][0] / ckpt.params.key_smooth[0]
    torch.testing.assert_close(k0, absmax.max().reshape(1) / 448, rtol=1e-6, atol=0)
    _, other_src = _source(tmp_path, seed=1)  # fingerprints are of the weights
    with pytest.raises(ProfileError, match="recalibrate"):
        conv.convert(other_src, recipe=recipe, output=tmp_path / "other", profile=profile_dir)


# -- CLI and inspect ---------------------------------------------------------------------------


def test_cli_convert_and_inspect(tmp_path):
    _, src = _source(tmp_path)
    out = tmp_path / "out"
    args = ["convert", str(src), "--recipe", "quarot-kv4", "-o", str(out), "--rotate-residual"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "pass --force" in again.output
    assert "Traceback" not in again.output
    summary = CliRunner().invoke(main, ["inspect", str(out)]).output
    assert "quarot-kv4" in summary and "residual_rotation, value_rotation" in summary
    assert "online       key_rotation" in summary
    assert "0-1" in summary and "4-bit token asym, Hadamard (online)" in summary
    assert "bytes/token allocated for one sequence of 4096 tokens" in summary
