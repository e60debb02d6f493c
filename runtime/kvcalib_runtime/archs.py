"""The one table of supported architectures and where their tensors live.

Every Llama-family model Hugging Face ships names its weights the same way; what differs is
whether q/k/v carry biases and whether keys and queries pass through a per-head RMSNorm
(Qwen3) before RoPE. Code that touches weights reads the names from here, never from an
isinstance chain.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """One architecture family.

    hf_class:  the transformers class `config.json` names in `architectures`
    qkv_bias:  True / False, or None to read `config.attention_bias`
    qk_norm:   keys and queries are RMS-normalized per head after projection (Qwen3)
    """

    hf_class: str
    qkv_bias: bool | None
    qk_norm: bool

    def has_qkv_bias(self, config: dict) -> bool:
        return bool(config.get("attention_bias", False)) if self.qkv_bias is None else self.qkv_bias


ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", qkv_bias=None, qk_norm=False),
    "mistral": Arch("MistralForCausalLM", qkv_bias=False, qk_norm=False),
    "qwen2": Arch("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "qwen3": Arch("Qwen3ForCausalLM", qkv_bias=None, qk_norm=True),
}

# Names inside decoder layer i (prefix LAYER.format(i)); ".weight"/".bias" are appended.
LAYER = "model.layers.{}"
Q_PROJ, K_PROJ = "self_attn.q_proj", "self_attn.k_proj"
V_PROJ, O_PROJ = "self_attn.v_proj", "self_attn.o_proj"
Q_NORM, K_NORM = "self_attn.q_norm", "self_attn.k_norm"
GATE_PROJ, UP_PROJ, DOWN_PROJ = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
ATTN_NORM, MLP_NORM = "input_layernorm", "post_attention_layernorm"
EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens", "model.norm", "lm_head"

# Linears that read the residual stream after each norm, and those that write back to it.
READS_AFTER = {ATTN_NORM: (Q_PROJ, K_PROJ, V_PROJ), MLP_NORM: (GATE_PROJ, UP_PROJ)}
WRITES = (O_PROJ, DOWN_PROJ)


def supported() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def lookup(model_type: str) -> Arch | None:
    """The architecture of a config's model_type; None for anything else (any JSON value)."""
    return ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
