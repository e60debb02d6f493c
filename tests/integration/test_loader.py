"""`kvcalib_runtime.load`: a converted checkpoint, validated, generating through its KV cache.

Tiny checkpoints are converted from a random llama (head_dim 32, so KIVI's value groups of 32
channels fit) with a one-character-per-token tokenizer. Bounds:
- logits against transformers on the same folder: 1e-4 relative in fp32 (the same ops in
  another order move them ~1e-6; a wrong weight, rotation or mask moves them > 1e-3);
- generated tokens against kvcalib's one-pass decode simulation: exact, since the runtime
  stores what the simulation computes (logits agree to ~1e-6 relative, test_kvcache.py) and
  the simulation is fed the runtime's own tokens, so one step cannot derail the next;
- bytes per token: exact, it is arithmetic.
"""

import dataclasses
import json
import shutil

import pytest
import torch
from support.corpus import rebind, remanifest
from support.tiny import save_with_tokenizer, tiny_model
from transformers import AutoModelForCausalLM

import kvcalib_runtime
from kvcalib import convert
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.cache.scheme import quantized_prefix_int
from kvcalib_runtime.checkpoint.format import read_checkpoint, sha256_file
from kvcalib_runtime.errors import CapacityError, FormatError, KvcalibRuntimeError
from kvcalib_runtime.model.transforms import FUSED, ONLINE, LayerTransforms, Transforms

RTOL = 1e-4
VOCAB = 128
# The key test's recipe: 2-bit pre-RoPE keys per channel, 2-bit Hadamard-rotated values, a
# residual window of 32 flushed 32 at a time, token 0 kept exact. Needs no profile.
KV2_TOML = """\
name = "kv2-test"
residual = 32
[key]
bits = 2
granularity = "channel"
group_size = 32
position = "pre_rope"
flush = 32
[value]
bits = 2
rotation = "hadamard"
flush = 32
[sinks]
first = 1
"""


def save_tiny_source(path):
    """A random tiny llama (head_dim 32) saved with an ASCII tokenizer, one token per char."""
    return save_with_tokenizer(tiny_model("llama", head_dim=32), path)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """recipe name -> converted folder of the same tiny source."""
    root = tmp_path_factory.mktemp("loader")
    source = save_tiny_source(root / "source")
    return {
        name: convert(source, recipe=name, output=root / name)
        for name in ("fp16", "kivi-2", "quarot-kv4")
    }


def _hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _ids(length, seed=1):
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def _decode(rm, ids, prefill):
    """The runtime's logits [1, T, vocab]: ids[:, :prefill] as one chunk, then token by token."""
    cache = rm.new_cache(1, ids.shape[1])
    out = [rm.model(ids[:, :prefill], cache)]
    out += [rm.model(ids[:, t : t + 1], cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(out, 1)


def test_full_precision_checkpoint_gives_the_logits_of_transformers(converted):
    rm = kvcalib_runtime.load(converted["fp16"], device="cpu")
    assert all(layer.key is None and layer.value is None for layer in rm.scheme.layers)
    ids = _ids(37)
    with torch.no_grad():
        ref = _hf(converted["fp16"])(ids).logits
    assert _rel_err(_decode(rm, ids, 9), ref) < RTOL


def test_rotated_checkpoint_prefill_is_exact(converted):
    """quarot-kv4: values rotated in the weights, keys rotated online with the queries. A prompt
    prefilled in one chunk attends to itself exactly, so the logits are transformers' on the
    same folder; a rotation missing on either side would move them by far more than 1e-4."""
    rm = kvcalib_runtime.load(converted["quarot-kv4"], device="cpu")
    assert {(t.value_rotation, t.key_rotation) for t in rm.transforms.layers} == {(FUSED, ONLINE)}
    ids = _ids(37)
    with torch.no_grad():
        ref = _hf(converted["quarot-kv4"])(ids).logits
        ours = rm.model(ids, rm.new_cache(1, 37))
    assert _rel_err(ours, ref) < RTOL


def _simulate(folder, rm, prompt: list[int], new: list[int]):
    """(eval's decode simulation of prompt + new through rm's scheme, the exact logits), both
    [1, T, V], from transformers' model of the same folder."""
    hf = _hf(folder)
    ids = torch.tensor([prompt + new])
    with torch.no_grad():
        simulated = Simulator(
            hf,
            rm.scheme,
            rm.params,
            mode="decode",
            transforms=rm.transforms,
            prefill=len(prompt),
        )(ids)
        return simulated, hf(ids).logits


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
def test_generated_tokens_equal_the_decode_simulation(converted, kernels):
    folder = converted["quarot-kv4"]
    rm = kvcalib_runtime.load(folder, device="cpu", use_kernels=kernels)
    prompt = _ids(9)[0].tolist()
    [new] = rm.generate([prompt], 16, eos_token_id=[])
    simulated, full_precision = _simulate(folder, rm, prompt, new)
    assert simulated[0, len(prompt) - 1 : -1].argmax(-1).tolist() == new
    assert _rel_err(simulated, full_precision) > 1e-3  # the cache does quantize


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
def test_a_batch_of_prompts_equals_each_alone(converted, kernels):
    rm = kvcalib_runtime.load(converted["quarot-kv4"], device="cpu", use_kernels=kernels)
    prompts = [_ids(n, seed=n)[0].tolist() for n in (5, 13, 1)]
    together = rm.generate(prompts, 8, eos_token_id=[])
    assert together == [rm.generate(p, 8, eos_token_id=[])[0] for p in prompts]
    assert [len(t) for t in together] == [8, 8, 8]


def test_text_prompts_go_through_the_tokenizer(converted):
    rm = kvcalib_runtime.load(converted["quarot-kv4"], device="cpu")
    assert rm.encode("Hi!") == [ord(c) for c in "Hi!"]
    by_text = rm.generate("Hello", 6, eos_token_id=[])
    assert by_text == rm.generate(["Hello"], 6, eos_token_id=[])
    assert by_text == rm.generate(rm.encode("Hello"), 6, eos_token_id=[])
    as_tensor = torch.tensor([rm.encode("Hello"), rm.encode("Hi!?!")])  # [B, T], as in transformers
    assert rm.generate(as_tensor, 6, eos_token_id=[]) == [
        by_text[0],
        rm.generate("Hi!?!", 6, eos_token_id=[])[0],
    ]
    with pytest.raises(KvcalibRuntimeError, match="integer token ids"):
        rm.generate(torch.rand(1, 3), 2)
    assert rm.decode(by_text[0]) == "".join(map(chr, by_text[0]))
    with pytest.raises(KvcalibRuntimeError, match="token ids in"):
        rm.generate([[1, VOCAB]], 2)


def test_generation_stops_at_the_config_eos_token(converted):
    rm = kvcalib_runtime.load(converted["quarot-kv4"], device="cpu")
    [[first, *_]] = rm.generate("Hello", 4, eos_token_id=[])
    assert rm.generate("Hello", 4, eos_token_id=first) == [[first]]
    rm.config = {**rm.config, "eos_token_id": first}  # the default is config.json's
    assert rm.generate("Hello", 4) == [[first]]


def test_fused_key_smoothing_is_not_applied_again(converted):
    """Smoothing scales in kv_params are applied by the cache only where the side-car places
    them online: placed "fused" (in the weights), the logits are bit for bit those of no
    smoothing at all; placed online, the cache quantizes k / s (other logits)."""
    folder = converted["kivi-2"]
    rm = kvcalib_runtime.load(folder, device="cpu", use_kernels=False)
    ckpt = read_checkpoint(folder)
    ids = _ids(150)
    with torch.no_grad():
        plain = rm.model(ids, rm.new_cache(1, 150))
    smooth = {i: torch.linspace(0.5, 2.0, 16).repeat(2).expand(2, 32) for i in range(2)}
    params = dataclasses.replace(ckpt.params, key_smooth=smooth)
    logits = {}
    for place in (FUSED, ONLINE):
        layers = tuple(LayerTransforms(key_smooth=place) for _ in range(2))
        edited = dataclasses.replace(ckpt, params=params, transforms=Transforms(layers))
        model = kvcalib_runtime.RuntimeModel(rm.model, rm.tokenizer, edited, max_len=None)
        with torch.no_grad():
            logits[place] = model.model(ids, model.new_cache(1, 150))
    assert torch.equal(logits[FUSED], plain)
    assert not torch.equal(logits[ONLINE], plain)
    assert _rel_err(logits[ONLINE], plain) < 0.2  # the same attention, quantized differently


def test_a_changed_or_missing_file_is_named(converted, tmp_path):
    folder = shutil.copytree(converted["kivi-2"], tmp_path / "copy")
    weights = folder / "model-00001-of-00001.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # same size, other sha256
    weights.write_bytes(data)
    with pytest.raises(FormatError, match=r"^model-00001-of-00001\.safetensors: changed since"):
        kvcalib_runtime.load(folder, device="cpu")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FormatError, match=r"^tokenizer\.json: listed in manifest\.json but miss"):
        kvcalib_runtime.load(folder, device="cpu")


def test_a_folder_converted_before_the_index_still_loads(converted, tmp_path):
    """Converters before the index was always written left one model.safetensors and no index
    (same format version): the runtime reads that layout to the same logits, bit for bit."""
    new = converted["kivi-2"]
    old = shutil.copytree(new, tmp_path / "without-index")
    (old / "model-00001-of-00001.safetensors").rename(old / "model.safetensors")
    (old / "model.safetensors.index.json").unlink()
    rebind(old)
    remanifest(old)
    ids = _ids(40)
    assert torch.equal(
        _decode(kvcalib_runtime.load(old, device="cpu"), ids, 9),
        _decode(kvcalib_runtime.load(new, device="cpu"), ids, 9),
    )


def test_another_format_version_is_refused(converted, tmp_path):
    folder = shutil.copytree(converted["kivi-2"], tmp_path / "copy")
    meta = json.loads((folder / "kvcalib.json").read_text())
    meta["format_version"] = 4
    (folder / "kvcalib.json").write_text(json.dumps(meta))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["kvcalib.json"] = {
        "sha256": sha256_file(folder / "kvcalib.json"),
        "size": (folder / "kvcalib.json").stat().st_size,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=r"kvcalib\.json: format_version 4.*convert the model"):
        kvcalib_runtime.load(folder, device="cpu")


def test_a_prompt_longer_than_the_cache_is_refused_before_any_work(converted, monkeypatch):
    rm = kvcalib_runtime.load(converted["kivi-2"], device="cpu", max_len=16)

    def no_cache(*args):
        raise AssertionError("a cache was built for a request that cannot fit")

    monkeypatch.setattr(rm, "new_cache", no_cache)
    with pytest.raises(CapacityError, match=r"12 tokens.*needs 19 cache slots.*max_len = 16"):
        rm.generate([list(range(12))], 8)
    monkeypatch.undo()
    # 12 + 5 tokens fill exactly 16 slots: the last token is returned, never stored
    assert len(rm.generate([list(range(12))], 5, eos_token_id=[])[0]) == 5


def test_bad_devices_and_impossible_kernel_requests_are_refused(converted, monkeypatch):
    folder = converted["kivi-2"]
    with pytest.raises(KvcalibRuntimeError, match="device 'gpu' is not one the runtime serves on"):
        kvcalib_runtime.load(folder, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(KvcalibRuntimeError, match="no CUDA device"):
            kvcalib_runtime.load(folder, device="cuda")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(KvcalibRuntimeError, match="use_kernels=True needs a CUDA device"):
            kvcalib_runtime.load(folder, device="cpu", use_kernels=True)


@pytest.mark.parametrize("context", [100, 4096])
def test_kv_bytes_per_token_counts_every_buffer(converted, context):
    """kivi-2 on the tiny model (2 layers, 2 KV heads, D = 32, residual R = 128), fp16, counted
    by hand: per layer and head, 2-bit codes (8 bytes a token) for keys and values, an fp16
    scale and offset per group (keys: 32 tokens of a channel, values: 32 channels of a token),
    rings of 128 exact tokens, one (unused) sink slot each; per sequence its sink position,
    is-sink bytes, length and the four body sizes."""
    rm = kvcalib_runtime.load(converted["kivi-2"], device="cpu")
    n, heads, d = context, 2, 32
    keys = heads * (n * 8 + -(-n // 32) * d * 4 + 128 * d * 2)
    values = heads * (n * 8 + n * 4 + 128 * d * 2)
    sinks = 2 * heads * d * 2
    total = 2 * (keys + values + sinks) + 8 + n + 8 + 4 * 8
    assert rm.kv_bytes_per_token(context) == total / context
    fp16 = 2 * 2 * heads * d * 2  # keys and values, 2 layers, 2 bytes
    assert rm.fp16_bytes_per_token(context) == fp16
    if context == 4096:
        assert rm.kv_bytes_per_token(context) < 0.25 * fp16  # ~3 bits of 16
    full = kvcalib_runtime.load(converted["fp16"], device="cpu")
    assert full.kv_bytes_per_token(context) > full.fp16_bytes_per_token(context)  # + rings


@pytest.mark.slow
def test_real_model_greedy_tokens_equal_the_decode_simulation(tmp_path):
    """THE runtime contract on SmolLM2-135M with a 2-bit recipe: 40 greedy tokens from a
    150-token prompt, through the reference path (the Triton interpreter needs ~10 minutes for
    this; tests/integration/test_kvcache.py holds kernels to the reference), are the argmax of
    kvcalib's one-pass decode simulation at every generated position."""
    from pydoc_data.topics import topics

    recipe = tmp_path / "kv2.toml"
    recipe.write_text(KV2_TOML)
    folder = convert("smollm2-135m", recipe=recipe, output=tmp_path / "kv2")
    rm = kvcalib_runtime.load(folder, device="cpu", dtype=torch.float32, use_kernels=False)
    prompt = rm.encode(topics["assert"])[:150]
    steps = 40
    assert len(prompt) == 150
    # the body grows during generation (128 -> 160 positions), not only in the prefill
    assert quantized_prefix_int(150 + steps - 1, 32, 32) > quantized_prefix_int(150, 32, 32)
    [new] = rm.generate([prompt], steps, eos_token_id=[])
    assert len(new) == steps
    simulated, full_precision = _simulate(folder, rm, prompt, new)
    predicted = simulated[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert predicted == new
    assert _rel_err(simulated, full_precision) > 1e-2  # 2 bits do change the logits (~0.2)
