"""The measured answer-loss sensitivity is what it says: the answer's NLL through a cache whose
context holds one layer's keys (or values) quantized, the prompt prefilled exact — checked
against transformers' own attention over a cache edited by hand, on families with biases,
sliding windows, key norms and score caps."""

import pytest
import torch
from support.tiny import CharTokenizer, tiny_model
from transformers import DynamicCache

from kvcalib.calibration import answerprobe, retrieval
from kvcalib.calibration.layerwise import InMemory
from kvcalib.calibration.sensitivity import BITS
from kvcalib.core.data import calibration_tokens
from kvcalib.sim.hooks import Hooks, capture_keys, key_module
from kvcalib_runtime.layouts.quant import QuantSpec, fake_quantize
from kvcalib_runtime.model.rope import rotate


def _pre_rope_keys(model, ids, cache=None) -> dict:
    keys = {}
    with Hooks(model) as hooks:
        for i in range(model.config.num_hidden_layers):
            hooks.forward(key_module(model, i), capture_keys(model, keys, i))
        model(ids, cache=cache, use_cache=cache is not None)
    return keys


def _brute(model, prompts, quantized, key_range, tensor, layer, bits) -> float:
    """Summed answer NLL (after its first token) over the prompts: the prompt prefilled into
    transformers' DynamicCache, `layer`'s `tensor` overwritten where `quantized` says, the answer
    teacher-forced through it (nothing quantized when `tensor` is None)."""
    total = 0.0
    for w, ids in enumerate(prompts.ids):
        p = int(prompts.answer[w].nonzero()[0])
        cache = DynamicCache(config=model.config)
        pre = _pre_rope_keys(model, ids[None, :p], cache)
        kept = cache.layers[layer]  # a sliding layer keeps only its window's last positions
        n = kept.keys.shape[2]
        where = quantized[w, :p][None, None, -n:, None]
        if tensor == "key":
            lo, hi = (r[layer][None, :, None, :] for r in key_range)
            k = fake_quantize(pre[layer], QuantSpec(bits, "static"), static_range=(lo, hi))
            kind = getattr(model.config, "layer_types", None)
            kw = {"layer_type": kind[layer]} if model.config.model_type == "gemma3_text" else {}
            cos, sin = model.model.rotary_emb(k, torch.arange(p)[None], **kw)
            k = rotate(k, cos[:, None], sin[:, None])[:, :, -n:]
            kept.keys = torch.where(where, k, kept.keys)
        elif tensor == "value":
            v = fake_quantize(kept.values, QuantSpec(bits))
            kept.values = torch.where(where, v, kept.values)
        logits = model(ids[None, p:], cache=cache, use_cache=True).logits[0, :-1]
        total -= float(logits.log_softmax(-1).gather(-1, ids[p + 1 :, None]).sum())
    return total


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "gemma2"])
def test_the_probe_is_the_answer_nll_through_a_cache_quantized_in_one_layer(arch):
    model = tiny_model(arch)
    prompts = retrieval.build(CharTokenizer(), calibration_tokens(CharTokenizer()), 2, 700, 0)
    keys = _pre_rope_keys(model, prompts.ids)
    # ranges narrower than the keys: the probe clamps, so every width moves the answer
    key_range = tuple(
        torch.stack([f(keys[i]) * 0.7 for i in sorted(keys)])
        for f in (lambda k: k.amin((0, 2)), lambda k: k.amax((0, 2)))
    )
    quantized = prompts.context.clone()
    quantized[:, prompts.context.float().argmax(1)] = False  # a kept sink: stays exact
    with torch.no_grad():
        got, _ = answerprobe.answer_pass(
            InMemory(model), prompts, quantized, key_range, lambda w: 0
        )
        answers = int(prompts.answer.sum())
        reference = _brute(model, prompts, quantized, key_range, None, 0, 0)
        moved = 0.0
        for tensor in ("key", "value"):
            s = got[f"sensitivity.answer.{tensor}"]
            assert s.shape == (model.config.num_hidden_layers, len(BITS))
            for layer in range(len(s)):
                for j, bits in enumerate(BITS):
                    want = _brute(model, prompts, quantized, key_range, tensor, layer, bits)
                    want = (want - reference) / answers
                    # float32 rounding of two paths through 2 layers: ~1e-6 nats per token
                    assert float(s[layer, j]) == pytest.approx(want, abs=2e-5), (tensor, layer, j)
                    moved = max(moved, abs(want))
    assert moved > 1e-3  # the bound above is far below what quantizing does to the answer


# (batch, query rows, window): the prompt's own causal forward; branches folded into one query
# block (no mask); a batch of versions, each its own keys, under a sliding-window mask
@pytest.mark.parametrize("b, rows, window", [(1, 300, 300), (1, 80, None), (5, 16, 100)])
def test_the_fused_attention_is_the_one_with_the_scores_in_memory(b, rows, window):
    """The probe's attention parts through torch's fused CPU kernel (log-sum-exp, z = 1) equal
    those computed with the scores in memory (`_part`): float32 rounding over 300 keys is
    ~1e-7."""
    torch.manual_seed(0)
    hkv, g, keys, d = 2, 3, 300, 16
    q = torch.randn(b, hkv, g, rows, d) * 2
    kv = [torch.randn(b, hkv, keys, d) for _ in range(2)]
    mask = None
    if window is not None:
        pos = torch.arange(rows)[:, None] + (keys - rows)
        cols = torch.arange(keys)[None]
        keep = (cols <= pos) & (cols > pos - window)
        mask = torch.zeros(1, 1, rows, keys).masked_fill(~keep, torch.finfo(torch.float32).min)
    m, z, o = answerprobe._over(q, *kv, mask, 0.25, None)
    assert bool((z == 1).all())  # the fused kernel's parts: log-sum-exp and normalized values
    in_memory = None if mask is None else mask[:, :, None]
    m2, z2, o2 = answerprobe._part(q, *(x[:, :, None] for x in kv), in_memory, 0.25, None)
    torch.testing.assert_close(o, o2 / z2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m, m2 + z2.log(), atol=1e-5, rtol=1e-5)
    assert float((o2 / z2).abs().mean()) > 0.1  # the bound is far below the values compared
