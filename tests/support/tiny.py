"""Tiny random transformers models of every family in the architecture table (and of one
outside it), for architecture coverage. Sliding windows are 8 tokens, shorter than the tests'
sequences; Gemma 2's soft-caps are low enough to bend these scores; Gemma 3 has one sliding and
one global layer with their own RoPE bases, and one KV head (MQA, as the 270M)."""

import torch

WINDOW = 8
BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
GEMMA = dict(BASE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW)
IDS = dict(pad_token_id=0, bos_token_id=2, eos_token_id=1)  # defaults lie outside vocab 128
TINY_CONFIGS = {
    "llama": dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    ),
    "mistral": dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    ),
    "qwen2": dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "llama-hd80": dict(
        hidden_size=160,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=80,
    ),
    "mistral-sliding": dict(BASE, sliding_window=WINDOW),
    "gemma2": dict(GEMMA, attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    "gemma3_text": dict(
        GEMMA,
        num_key_value_heads=1,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    ),
    "phi3": dict(BASE, **IDS),
    "phi3-partial": dict(
        BASE, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}, **IDS
    ),
    # outside the table: keys through a k_norm over all heads, norms after attention and MLP;
    # head_dim 32 fits the presets' groups
    "olmo2": dict(BASE, num_attention_heads=2, **IDS),
}


class CharTokenizer:
    """Characters as token ids below 128: a tokenizer for the tiny models' vocabulary."""

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [ord(c) % 128 for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random transformers model of a supported family, fp32, eval mode, 2 layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(TINY_CONFIGS[arch], num_hidden_layers=2, vocab_size=128)
    kwargs.update(overrides)
    config = AutoConfig.for_model(arch.split("-")[0], **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return model


def save_with_tokenizer(model, path):
    """Save a tiny model as a Hugging Face folder with an ASCII tokenizer: one token per
    character (ids = code points), decoded back by concatenation, loaded by transformers as a
    plain fast tokenizer (not the family's own class, which expects its special tokens).
    Returns the folder."""
    import json

    from tokenizers import Regex, Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    model.save_pretrained(path)
    vocab = {chr(i): i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="?"))
    tokenizer.pre_tokenizer = Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def fused_kinds(ckpt) -> set[str]:
    """The transforms a converted checkpoint's weights hold, on any layer (and the residual
    rotation, which is the model's)."""
    from kvcalib_runtime.model.transforms import FUSED, KINDS

    kinds = {k for t in ckpt.transforms.layers for k in KINDS if getattr(t, k) == FUSED}
    return kinds | (
        {"residual_rotation"} if ckpt.meta["residual_rotation_seed"] is not None else set()
    )


class ShapeProfile:
    """The Profile API kvcalib's plan() calls, with tensors of the right shapes and dummy values
    (memory and layout tests: a profile decides values, never sizes). `sensitive` maps
    (tensor, layer) to a factor on the default sensitivity 2^-bits; `answer` does the same for
    the answer-loss sensitivity (None: the profile has none)."""

    def __init__(self, kv_heads: int, head_dim: int, sensitive=None, answer=None):
        self.kv_heads, self.head_dim, self.sensitive = kv_heads, head_dim, sensitive or {}
        self.answer = answer

    def range(self, tensor, layer, *, position="post_rope", outliers=0.0):
        shape = (self.kv_heads, self.head_dim)
        return -torch.ones(shape), torch.ones(shape)

    def codebook(self, variant, layer, bits):
        return torch.linspace(-1.0 if variant.endswith(":symmetric") else 0.0, 1.0, 2**bits)

    def vector_codebook(self, variant, layer, bits):
        w = int(variant.split(":")[1].removeprefix("vq"))
        return torch.rand(self.kv_heads if ":head:" in variant else 1, 2**bits, w)

    def smoothing(self, layer, alpha, *, position):
        return torch.ones(self.kv_heads, self.head_dim)

    def outlier_channels(self, tensor, layer, n, *, position="post_rope"):
        return torch.arange(n).expand(self.kv_heads, n).contiguous()

    def sink_predictor(self):
        from kvcalib_runtime.cache.scheme import SinkPredictor

        return SinkPredictor(layer=0, dims=(0,), threshold=38.0)

    def has_sensitivity(self, loss="text"):
        return loss == "text" or self.answer is not None

    def sensitivity(self, tensor, layer, bits, loss="text"):
        factors = self.sensitive if loss == "text" else self.answer
        return float(2.0**-bits * factors.get((tensor, layer), 1.0))


def text_key_ranges(model, ids, shrink: float = 0.8) -> dict:
    """Per layer, static per-channel pre-RoPE key ranges (lo, hi), each [Hkv, D]: the min and max
    over the tokens of ids [1, T], shrunk by `shrink` so that some keys fall outside."""
    from kvcalib.sim.hooks import Hooks, capture_keys, key_module

    keys = {}
    with Hooks(model) as hooks, torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            hooks.forward(key_module(model, i), capture_keys(model, keys, i))
        model(ids)
    return {i: (k[0].amin(1) * shrink, k[0].amax(1) * shrink) for i, k in keys.items()}
