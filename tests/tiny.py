"""Tiny random transformers models of every supported family, for architecture coverage."""

import torch

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
}


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
    character (ids = code points), decoded back by concatenation. Returns the folder."""
    from tokenizers import Regex, Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    model.save_pretrained(path)
    vocab = {chr(i): i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="?"))
    tokenizer.pre_tokenizer = Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def fused_kinds(ckpt) -> set[str]:
    """The transforms a converted checkpoint's weights hold, on any layer (and the residual
    rotation, which is the model's)."""
    from kvcalib_runtime.transforms import FUSED, KINDS

    kinds = {k for t in ckpt.transforms.layers for k in KINDS if getattr(t, k) == FUSED}
    return kinds | (
        {"residual_rotation"} if ckpt.meta["residual_rotation_seed"] is not None else set()
    )


class ShapeProfile:
    """The Profile API kvcalib's plan() calls, with tensors of the right shapes and dummy values
    (memory and layout tests: a profile decides values, never sizes). `sensitive` maps
    (tensor, layer) to a factor on the default sensitivity 2^-bits."""

    def __init__(self, kv_heads: int, head_dim: int, sensitive: dict | None = None):
        self.kv_heads, self.head_dim, self.sensitive = kv_heads, head_dim, sensitive or {}

    def range(self, tensor, layer, *, position="post_rope", outliers=0.0):
        shape = (self.kv_heads, self.head_dim)
        return -torch.ones(shape), torch.ones(shape)

    def codebook(self, variant, layer, bits):
        return torch.linspace(-1.0 if variant.endswith(":symmetric") else 0.0, 1.0, 2**bits)

    def smoothing(self, layer, alpha, *, position):
        return torch.ones(self.kv_heads, self.head_dim)

    def outlier_channels(self, tensor, layer, n, *, position="post_rope"):
        return torch.arange(n).expand(self.kv_heads, n).contiguous()

    def sink_predictor(self):
        from kvcalib_runtime.scheme import SinkPredictor

        return SinkPredictor(layer=0, dims=(0,), threshold=38.0)

    def sensitivity(self, tensor, layer, bits):
        return float(2.0**-bits * self.sensitive.get((tensor, layer), 1.0))
