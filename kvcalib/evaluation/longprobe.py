"""Where a long-context failure comes from, in the signals a production team watches: at the
answer's first decode step through a recipe's cache, how much attention goes to the needle tokens
and to token 0 (the sink), and how far the cache's keys at the needle positions are from full
precision, against the haystack's typical key error.

    with Probe(model, prefill.keys, needles, context) as probe:
        model(answer_tokens, cache=cache)   # the answer's first step is the forward's first query
    probe.record()  -> {"needle_mass", "sink_mass", "needle_key_error", "layers": {...}}

needle_mass        attention mass of the step's query on the needle tokens, averaged over
                   heads and layers (probabilities as eager attention computes them)
sink_mass          the same on position 0
needle_key_error   the relative key error ||k_hat - k|| / ||k|| (post-RoPE, per position,
                   averaged over KV heads) at the needle tokens, over its median on the
                   haystack's other tokens, averaged over layers: about 1 when the needles are
                   coded like any token, well above 1 when their keys are clamped; None for a
                   cache that stores keys exactly

`diagnose(record, reference)` names the failure of a prompt the recipe gets wrong and full
precision right: "needle keys clamped" (needle_key_error >= CLAMPED), "sink attention lost"
(sink mass below SINK_LOST of full precision's), "needle attention lost" (needle mass below
NEEDLE_LOST of full precision's), or "neither".
"""

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvcalib.sim.hooks import Hooks
from kvcalib_runtime.cache.attention import attention

ATTENTION = "kvcalib_probe"
CLAMPED = 2.0
EXACT = 1e-4  # a relative key error below this everywhere: the keys are stored exactly
SINK_LOST = 0.75
NEEDLE_LOST = 0.5
_ACTIVE: list = []


class Probe:
    """Records the attention of the next forward's first query; `reference_keys[i]`: layer i's
    full-precision post-RoPE keys [1, Hkv, T, D] over the prompt; `needles`: token spans
    [start, end); `context`: the haystack's span."""

    def __init__(self, model, reference_keys, needles, context):
        self.model, self.reference = model, reference_keys
        self.needles = [p for a, b in needles for p in range(a, b)]
        inside = set(self.needles)
        self.haystack = [p for p in range(*context) if p not in inside]
        self.layers: dict[int, tuple[float, float, float | None]] = {}
        self._hooks = Hooks(model)

    def __enter__(self) -> "Probe":
        _ACTIVE.append(self)
        self._hooks.attention(ATTENTION)
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.remove()
        _ACTIVE.remove(self)

    def observe(self, layer: int, probs: torch.Tensor, keys: torch.Tensor) -> None:
        """probs [B, H, q, N] of the step; keys [B, Hkv, N, D] as the cache gave them."""
        first = probs[0, :, 0].float().mean(0)  # [N], averaged over query heads
        needle = float(first[self.needles].sum()) if self.needles else None
        ref = self.reference[layer][0].float()
        T = ref.shape[1]
        err = (keys[0, :, :T].float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
        err = err.mean(0)  # [T], averaged over KV heads
        ratio = None  # also for keys stored exactly (float noise of RoPE applied twice)
        if self.needles and self.haystack and float(err.max()) > EXACT:
            median = float(err[self.haystack].median())
            ratio = float(err[self.needles].mean()) / max(median, 1e-12)
        self.layers[layer] = (needle, float(first[0]), ratio)

    def record(self) -> dict:
        needle, sink, ratio = zip(*(self.layers[i] for i in sorted(self.layers)), strict=True)
        known = [r for r in ratio if r is not None]
        return {
            "needle_mass": sum(needle) / len(needle) if self.needles else None,
            "sink_mass": sum(sink) / len(sink),
            "needle_key_error": sum(known) / len(known) if known else None,
            "layers": {"needle_mass": list(needle), "sink_mass": list(sink), "key_error": ratio},
        }


def diagnose(record: dict, reference: dict) -> str:
    """What a failed answer's first step shows, against full precision's on the same prompt."""
    causes = []
    if (record.get("needle_key_error") or 0) >= CLAMPED:
        causes.append("needle keys clamped")
    if record["sink_mass"] < SINK_LOST * reference["sink_mass"]:
        causes.append("sink attention lost")
    fp_needle = reference.get("needle_mass")
    if fp_needle and record["needle_mass"] < NEEDLE_LOST * fp_needle:
        causes.append("needle attention lost")
    return ", ".join(causes) or "neither"


def _attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs
):
    """transformers' attention interface over kvcalib_runtime.cache.attention's eager path
    ([B, H, q, D] queries over [B, Hkv, N, D] keys), handing the active probe the
    probabilities, which it also returns as the attention weights."""
    del dropout, kwargs
    seen = []

    def observe(probs: torch.Tensor) -> None:
        seen.append(probs)
        if _ACTIVE:
            _ACTIVE[-1].observe(module.layer_idx, probs, key)

    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    mask = None if attention_mask is None else attention_mask.float()
    out = attention(query, key, value, mask, scaling=scaling, softcap=softcap, observer=observe)
    return out.transpose(1, 2).contiguous(), seen[0]


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, eager_mask)
