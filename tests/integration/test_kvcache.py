"""The quantized KV cache inside the runtime's Transformer, with kernels on (Triton's
interpreter) and off (the reference path).

Decoding a prompt prefilled in one chunk, then one token at a time, must give the logits that
kvcalib's one-pass Simulator computes in decode mode with prefill = the prompt length: the two
implement the same rule. Bound 1e-5 relative, as in tests/toolkit/sim/test_simulate.py: the same
numerics in a different fp32 summation order move logits by ~1e-7, far below what quantization
does (> 1e-3, checked second so the equality is not vacuous). A code flipped by a wrong
rounding, a wrong flush boundary or a sink read from the body would move them by > 1e-3.
Sliding windows are checked the same way on a tiny Mistral (transformers' own sliding mask).

A decode step is device work only: on the CPU no tensor is read back (.item(), .tolist(),
.cpu(), int(), bool() raise inside it), on CUDA torch's sync debug mode errors on any sync.
"""

import contextlib

import pytest
import torch
from support.tiny import text_key_ranges, tiny_model

from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.cache import memory
from kvcalib_runtime.cache.fpcache import FullPrecisionCache
from kvcalib_runtime.cache.kvcache import QuantizedCache
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme, SinkPredictor
from kvcalib_runtime.errors import CapacityError
from kvcalib_runtime.layouts.quant import QuantSpec
from kvcalib_runtime.model.forward import Transformer
from kvcalib_runtime.model.rope import Rope
from kvcalib_runtime.model.transforms import Transforms

RTOL = 1e-5
T, PROMPT = 24, 9

SCHEMES = {
    # KIVI: keys per channel in groups of 4 tokens flushed 8 at a time, values sliding
    "kivi": dict(
        key=QuantSpec(2, "channel", 4),
        value=QuantSpec(2, "token", 8),
        residual=8,
        layer=dict(key_flush=8, value_flush=1),
    ),
    "per-token": dict(key=QuantSpec(3), value=QuantSpec(3, symmetric=True), residual=0),
    # kvcalib's own: calibrated per-channel pre-RoPE keys, per-token values, a kept first token
    "pre-rope-static": dict(
        key=QuantSpec(2, "static"),
        value=QuantSpec(4, "token", 8),
        residual=6,
        sinks_first=1,
        layer=dict(key_position="pre_rope", key_flush=3, value_flush=3),
    ),
    "rotated": dict(
        key=QuantSpec(2),
        value=QuantSpec(2, symmetric=True),
        residual=4,
        sinks_first=2,
        rotation_seed=3,
        layer=dict(key_rotation=True, key_flush=2, value_flush=2),
    ),
    # exact slots: the largest error of each key vector, two outliers per value group of 8
    "outlier-slots": dict(
        key=QuantSpec(2, "static", outliers=0.01, outlier_slots=2, slot_rule="error"),
        value=QuantSpec(2, "token", 8, outliers=0.1),
        residual=4,
        sinks_first=1,
        layer=dict(key_position="pre_rope", key_flush=2, value_flush=1),
    ),
    "predicted-sinks": dict(
        key=QuantSpec(2, "channel", 4),
        value=QuantSpec(2),
        residual=8,
        sinks_first=1,
        sink_budget=3,
        layer=dict(key_flush=8, value_flush=4),
    ),
    # kvcalib-2's layout: static pre-RoPE codebook keys with one exact slot (largest error),
    # symmetric codebook values, first and predicted sinks
    "kvcalib": dict(
        key=QuantSpec(
            2, "static", codebook=True, outliers=0.01, outlier_slots=1, slot_rule="error"
        ),
        value=QuantSpec(2, symmetric=True, codebook=True),
        residual=4,
        sinks_first=1,
        sink_budget=2,
        layer=dict(key_position="pre_rope"),
    ),
    # KVQuant's values: every head of a token joined into one row, 5% exact slots
    "vector": dict(
        key=QuantSpec(3, "static", codebook=True, outliers=0.01, outlier_slots=1),
        value=QuantSpec(3, "vector", outliers=0.05),
        residual=0,
        sinks_first=1,
        layer=dict(key_position="pre_rope"),
    ),
    # kvcalib-1.5's layout: vector codes of RoPE-pair quads for pre-RoPE keys (a codebook per KV
    # head), of adjacent pairs for values (one per layer), first and predicted sinks
    "vq": dict(
        key=QuantSpec(6, "static", 4, codebook=True, method="vq", pairing="rope"),
        value=QuantSpec(3, "static", 2, codebook=True, method="vq"),
        residual=4,
        sinks_first=1,
        sink_budget=2,
        layer=dict(key_position="pre_rope", key_flush=2),
    ),
    # kvcalib-1.5s's layout: coarser vector codes with exact slots, kvcalib-2's one-byte slot for
    # keys, two exact (cache dtype) slots per value row
    "vq-slots": dict(
        key=QuantSpec(
            5,
            "static",
            4,
            codebook=True,
            method="vq",
            pairing="rope",
            outlier_slots=1,
            slot_rule="error",
            slot_code="fp8",
        ),
        value=QuantSpec(
            3, "static", 2, codebook=True, method="vq", outlier_slots=2, slot_rule="error"
        ),
        residual=4,
        sinks_first=1,
        sink_budget=2,
        layer=dict(key_position="pre_rope", key_flush=2),
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, the runtime Transformer loaded from its save_pretrained folder)."""
    hf = tiny_model("llama")
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder)
    return hf, Transformer.from_folder(folder)


def _ids(batch, length, seed=1):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _scheme_and_params(hf, name, ids):
    kw = dict(SCHEMES[name])
    key, value, layer = kw.pop("key"), kw.pop("value"), kw.pop("layer", {})
    n = hf.config.num_hidden_layers
    scheme = KVScheme(tuple(LayerScheme(key, value, **layer) for _ in range(n)), **kw)
    params = KVParams()
    if key.granularity == "static":  # per-channel pre-RoPE ranges of this text, shrunk a bit
        params.key_range = text_key_ranges(hf, ids)
    if value.granularity == "static":  # fixed ranges that leave some values outside
        one = torch.ones(hf.config.num_key_value_heads, 16)
        params.value_range = {i: (-0.1 * one, 0.1 * one) for i in range(n)}
    gen = torch.Generator().manual_seed(7)
    for name, spec in (("key", key), ("value", value)):
        if spec.codebook and spec.layout.vectors:  # random entries: keys' per KV head, values'
            rows = hf.config.num_key_value_heads if name == "key" else 1  # per layer
            shape = (rows, spec.levels, spec.group_size)
            books = {i: torch.rand(shape, generator=gen) for i in range(n)}
            getattr(params, f"{name}_codebook").update(books)
        elif spec.codebook:  # sorted levels per layer, in [0, 1] or [-1, 1]
            books = {i: torch.rand(spec.levels, generator=gen).sort().values for i in range(n)}
            if spec.symmetric:
                books = {i: b * 2 - 1 for i, b in books.items()}
            getattr(params, f"{name}_codebook").update(books)
    if scheme.sink_budget:  # flags about 20% of tokens: channel 5 after layer 0
        with torch.no_grad():
            hidden = hf(ids, output_hidden_states=True).hidden_states[1][0]
        threshold = float(hidden[:, 5].abs().quantile(0.8))
        params.sink_predictor = SinkPredictor(layer=0, dims=(5,), threshold=threshold)
    return scheme, params


def _cache(model, scheme, params, batch, max_len, kernels):
    transforms = Transforms.online(scheme, params)
    return model.new_cache(batch, max_len, scheme, params, transforms, use_kernels=kernels)


@torch.no_grad()
def _decode(model, cache, ids, prefill):
    """Logits [B, T, vocab]: ids[:, :prefill] in one chunk, then one token at a time."""
    out = [model(ids[:, :prefill], cache)]
    out += [model(ids[:, t : t + 1], cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(out, 1)


def _rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_decoding_equals_the_one_pass_simulation(models, name, kernels):
    hf, model = models
    ids = _ids(1, T)
    scheme, params = _scheme_and_params(hf, name, ids)
    with torch.no_grad():
        simulated = Simulator(hf, scheme, params, mode="decode", prefill=PROMPT)(ids)
        full_precision = hf(ids).logits
    decoded = _decode(model, _cache(model, scheme, params, 1, T, kernels), ids, PROMPT)
    assert _rel_err(decoded, simulated) < RTOL
    assert _rel_err(simulated, full_precision) > 1e-3


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
def test_a_batch_of_prompts_equals_each_alone(models, kernels):
    """Prompts of 5, 11 and 8 tokens prefilled alone (views), then decoded together: each
    sequence flushes and keeps sinks at its own positions, as when decoded alone."""
    hf, model = models
    ids = _ids(3, 16, seed=4)
    scheme, params = _scheme_and_params(hf, "predicted-sinks", ids)
    prompts = (5, 11, 8)
    steps = 16 - max(prompts)
    batch = _cache(model, scheme, params, 3, 16, kernels)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            model(ids[b : b + 1, :p], batch.view(b))
        nxt = [torch.stack([ids[b, p + s] for b, p in enumerate(prompts)]) for s in range(steps)]
        together = torch.cat([model(tokens[:, None], batch) for tokens in nxt], 1)
    for b, p in enumerate(prompts):
        alone = _cache(model, scheme, params, 1, 16, kernels)
        logits = _decode(model, alone, ids[b : b + 1, : p + steps], p)[:, p:]
        assert _rel_err(together[b : b + 1], logits) < RTOL
    assert batch.lengths.tolist() == [p + steps for p in prompts]
    assert (batch.sink_pos[:, 1:] >= 0).any()  # predicted sinks were kept, not only token 0


def test_kernels_and_reference_store_the_same_bits(models):
    """Layer 0's keys and values are the same tensors on both paths (deeper layers see attention
    outputs that differ in the last bits), so its body must be bit-identical."""
    hf, model = models
    ids = _ids(1, 18)
    scheme, params = _scheme_and_params(hf, "kivi", ids)
    caches = [_cache(model, scheme, params, 1, 18, kernels) for kernels in (True, False)]
    for cache in caches:
        _decode(model, cache, ids, 5)
    ours, ref = caches
    for a, b in ((ours.keys[0], ref.keys[0]), (ours.values[0], ref.values[0])):
        assert int(a.n_body[0]) == int(b.n_body[0]) > 8  # several flushes
        for name in ("codes", "scale", "offset"):
            assert torch.equal(getattr(a.body, name), getattr(b.body, name))


def _odd_head_steps(kernels: bool) -> torch.Tensor:
    """A 9-token prefill and two decode steps on 72-channel heads of 3-bit codes."""
    scheme = KVScheme((LayerScheme(QuantSpec(3), QuantSpec(3)),), residual=2, sinks_first=1)
    cache = QuantizedCache(scheme, KVParams(), Transforms.none(1), num_layers=1, batch=1,
                           kv_heads=1, head_dim=72, max_len=16, device="cpu",
                           dtype=torch.float32, use_kernels=kernels)  # fmt: skip
    gen, rope = torch.Generator().manual_seed(0), Rope({}, 72)
    q, k, v = (torch.randn(1, h, 9, 72, generator=gen) for h in (2, 1, 1))
    cache.attend(0, q, k, v, rope, cache.positions(9))
    cache.commit(9)
    outs = []
    for _ in range(2):
        q, k, v = (torch.randn(1, h, 1, 72, generator=gen) for h in (2, 1, 1))
        outs.append(cache.attend(0, q, k, v, rope, cache.positions(1)))
        cache.commit(1)
    return torch.cat(outs, 2)


def test_a_layout_the_kernel_does_not_read_decodes_through_the_reference_with_one_warning():
    """3-bit codes of a 72-channel head: half a head is 108 bits, not whole bytes."""
    with pytest.warns(UserWarning, match="torch reference") as record:
        ours = _odd_head_steps(kernels=True)
    assert len(record) == 1
    assert torch.equal(ours, _odd_head_steps(kernels=False))


def test_capacity_errors(models, monkeypatch):
    hf, model = models
    scheme, params = _scheme_and_params(hf, "kivi", _ids(1, 8))
    cache = _cache(model, scheme, params, 1, 8, False)
    with pytest.raises(CapacityError, match="max_len = 8"):
        model.generate([list(range(6))], 4, cache=cache)
    # a cache larger than the device's free memory is refused before anything is allocated
    monkeypatch.setattr(memory, "free_bytes", lambda device: 10_000)
    with pytest.raises(CapacityError, match="GiB"):
        _cache(model, scheme, params, 4, 4096, False)


def test_use_kernels_needs_somewhere_to_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    scheme = KVScheme((LayerScheme(QuantSpec(2), QuantSpec(2)),))
    shape = dict(num_layers=1, batch=1, kv_heads=1, head_dim=16, max_len=8)
    where = dict(device="cpu", dtype=torch.float32)
    none = Transforms.none(1)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        QuantizedCache(scheme, KVParams(), none, **shape, **where, use_kernels=True)
    auto = QuantizedCache(scheme, KVParams(), none, **shape, **where)
    assert not auto.kernels


# -- sliding windows -----------------------------------------------------------------------------

WINDOW = 5


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny Mistral whose every layer slides a window of 5 over its keys."""
    hf = tiny_model("mistral", sliding_window=WINDOW)
    folder = tmp_path_factory.mktemp("tiny-mistral")
    hf.save_pretrained(folder)
    return hf, Transformer.from_folder(folder)


def test_a_sliding_window_in_full_precision_equals_transformers(mistral):
    """Transformers' own sliding mask is the masked full-attention reference: the runtime's
    full-precision cache keeps a ring of 5 slots per layer and must give its logits, for a
    batch prefilled in one chunk (longer than the window) then decoded token by token."""
    hf, model = mistral
    assert model.geometry.windows == (WINDOW, WINDOW)
    ids = _ids(2, T)
    with torch.no_grad():
        ref = hf(ids).logits
    cache = model.new_cache(2, T)
    assert all(k.shape[2] == WINDOW for k in cache.keys)
    assert _rel_err(_decode(model, cache, ids, PROMPT), ref) < RTOL
    unwindowed = FullPrecisionCache(2, 2, 2, 16, T, "cpu", torch.float32)
    assert _rel_err(_decode(model, unwindowed, ids, PROMPT), ref) > 1e-3  # the window matters


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
@pytest.mark.parametrize("name", ["kivi", "pre-rope-static", "per-token", "kvcalib"])
def test_sliding_window_decoding_equals_the_one_pass_simulation(mistral, name, kernels):
    """The windowed layers' bodies are rings (kivi's values never reach theirs: the residual
    window holds the last 5 positions), and decoding still gives the Simulator's logits."""
    hf, model = mistral
    ids = _ids(1, T)
    scheme, params = _scheme_and_params(hf, name, ids)
    with torch.no_grad():
        simulated = Simulator(hf, scheme, params, mode="decode", prefill=PROMPT)(ids)
        full_precision = hf(ids).logits
    cache = _cache(model, scheme, params, 1, T, kernels)
    assert max(s.slots for s in cache.keys + cache.values) < T
    assert _rel_err(_decode(model, cache, ids, PROMPT), simulated) < RTOL
    assert _rel_err(simulated, full_precision) > 1e-3


# -- a decode step is device work only -----------------------------------------------------------

READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def _no_reads_back():
    """Every way a tensor's value reaches the host raises inside the block."""

    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"the decode step called Tensor.{name}")

        return read

    saved = {name: getattr(torch.Tensor, name) for name in READS}
    try:
        for name in READS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
def test_a_decode_step_reads_nothing_back(models, kernels, monkeypatch):
    """kvcalib-2's layout (predicted sinks decided, slots and flushes written every step) on a
    batch of two: the steps after a prefill read no tensor back to the host, through the kernel
    and through the torch reference (what a device without the kernel decodes with; on the CPU
    the cache takes kernels.decode_torch instead, which reads the lengths by design)."""
    from kvcalib_runtime.kernels import decode_reference, decode_torch

    monkeypatch.setattr(
        decode_torch, "decode_attention_torch", decode_reference.decode_attention_reference
    )
    monkeypatch.setenv("KVCALIB_NATIVE", "0")  # the CPU's C paths read the lengths by design too
    hf, model = models
    ids = _ids(2, 12)
    scheme, params = _scheme_and_params(hf, "kvcalib", ids)
    cache = _cache(model, scheme, params, 2, 12, kernels)
    with torch.no_grad():
        model(ids[:, :8], cache)
        with _no_reads_back():
            for t in range(8, 12):
                model(ids[:, t : t + 1], cache, last_only=True)
    assert cache.lengths.tolist() == [12, 12]
    with pytest.raises(AssertionError, match=r"Tensor\.item"), _no_reads_back():
        torch.ones(1).item()  # the guard itself works


def _cuda_model(tmp_path):
    hf = tiny_model("llama")
    hf.save_pretrained(tmp_path)
    return hf, Transformer.from_folder(tmp_path, device="cuda")


@pytest.mark.gpu
def test_a_decode_step_never_synchronizes_on_cuda(tmp_path):
    hf, model = _cuda_model(tmp_path)
    ids = _ids(2, 12)
    scheme, params = _scheme_and_params(hf, "kvcalib", ids)
    cache = _cache(model, scheme, params, 2, 12, True)
    ids = ids.cuda()
    with torch.no_grad():
        model(ids[:, :8], cache)
        model(ids[:, 8:9], cache)  # compiles and tunes the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(9, 12):
                model(ids[:, t : t + 1], cache)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_generate_replays_a_cuda_graph_of_the_step(tmp_path):
    """Greedy tokens through the captured step equal those of the eager one."""
    hf, model = _cuda_model(tmp_path)
    scheme, params = _scheme_and_params(hf, "kvcalib", _ids(1, 12))
    prompts = [_ids(1, n, seed=n)[0].tolist() for n in (5, 11, 8)]
    runs = {}
    for graph in (False, True):
        cache = _cache(model, scheme, params, 3, 40, True)
        runs[graph] = model.generate(prompts, 24, cache=cache, cuda_graph=graph)
    assert runs[True] == runs[False]
