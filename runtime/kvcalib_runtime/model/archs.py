"""The one table of supported architectures and where their tensors live.

Every family here names its weights like Llama (`model.layers.{i}.self_attn.q_proj`, ...); what
differs is a handful of facts, one field each:

    llama, mistral, qwen2, qwen3   pre-norm blocks, SwiGLU; q/k/v biases (qwen2) and a per-head
                                   q/k RMSNorm before RoPE (qwen3)
    gemma2                         RMSNorm as x/rms(x) * (1 + w), embeddings times sqrt(hidden),
                                   norms before AND after attention and MLP, GELU-tanh MLP,
                                   scores scaled by query_pre_attn_scalar^-1/2, soft-capped
                                   attention scores and logits, alternating sliding layers
    gemma3_text                    gemma2's block with a per-head q/k RMSNorm, no soft-capping,
                                   one sliding-window layer pattern of 6 with local and global
                                   RoPE bases (transformers loads a GGUF "gemma3" as this)
    phi3                           Llama's block with q/k/v fused into `qkv_proj` ([q; k; v]
                                   rows) and gate/up into `gate_up_proj` ([gate; up] rows)

Code that touches weights reads names from here (an `Arch`'s `q_proj`, `reads_after`, ...),
never from an isinstance chain. `gguf` is the GGUF `general.architecture` that transformers
loads as the family (the GGUF files kvcalib accepts).
"""

from dataclasses import dataclass

# Names inside decoder layer i (prefix LAYER.format(i)); ".weight"/".bias" are appended.
LAYER = "model.layers.{}"
Q_PROJ, K_PROJ = "self_attn.q_proj", "self_attn.k_proj"
V_PROJ, O_PROJ = "self_attn.v_proj", "self_attn.o_proj"
QKV_PROJ = "self_attn.qkv_proj"
Q_NORM, K_NORM = "self_attn.q_norm", "self_attn.k_norm"
GATE_PROJ, UP_PROJ, DOWN_PROJ = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
GATE_UP_PROJ = "mlp.gate_up_proj"
ATTN_NORM, MLP_NORM = "input_layernorm", "post_attention_layernorm"
PRE_MLP_NORM, POST_MLP_NORM = "pre_feedforward_layernorm", "post_feedforward_layernorm"
EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens", "model.norm", "lm_head"
WRITES = (O_PROJ, DOWN_PROJ)  # linears that write back to the residual stream


@dataclass(frozen=True)
class Arch:
    """One architecture family (see the module docstring).

    hf_class:      the transformers class `config.json` names in `architectures`
    gguf:          the GGUF general.architecture transformers loads as this family
    qkv_bias:      True / False, or None to read `config.attention_bias`
    qk_norm:       keys and queries are RMS-normalized per head after projection
    gemma:         Gemma's block: (1 + w) norms, sqrt(hidden) embedding scale, post-attention
                   and post-MLP norms, query_pre_attn_scalar, soft-capping where configured
    fused:         q/k/v in one `qkv_proj` and gate/up in one `gate_up_proj` (phi3)
    sliding_every: without `layer_types`, every n-th layer is global and the others slide
                   (`sliding_window_pattern` in the config overrides n); None: the config's
                   sliding_window keys decide alone
    """

    hf_class: str
    gguf: str
    qkv_bias: bool | None = False
    qk_norm: bool = False
    gemma: bool = False
    fused: bool = False
    sliding_every: int | None = None

    def has_qkv_bias(self, config: dict) -> bool:
        return bool(config.get("attention_bias", False)) if self.qkv_bias is None else self.qkv_bias

    @property
    def mlp_norm(self) -> str:
        """The norm whose output the MLP reads."""
        return PRE_MLP_NORM if self.gemma else MLP_NORM

    @property
    def post_norms(self) -> tuple[str, ...]:
        """Norms applied to the attention and MLP outputs before they join the residual."""
        return (MLP_NORM, POST_MLP_NORM) if self.gemma else ()

    @property
    def reads_after(self) -> dict[str, tuple[str, ...]]:
        """Per norm that reads the residual stream, the linears that read its output."""
        if self.fused:
            return {ATTN_NORM: (QKV_PROJ,), MLP_NORM: (GATE_UP_PROJ,)}
        return {ATTN_NORM: (Q_PROJ, K_PROJ, V_PROJ), self.mlp_norm: (GATE_PROJ, UP_PROJ)}

    @property
    def norms(self) -> tuple[str, ...]:
        """Every norm of a decoder layer (q/k norms aside)."""
        return (*self.reads_after, *self.post_norms)

    @property
    def linears(self) -> tuple[str, ...]:
        return (*(r for rs in self.reads_after.values() for r in rs), *WRITES)

    def activation(self, config: dict) -> str:
        """The MLP's activation name (Gemma configs call the key hidden_activation)."""
        return config.get("hidden_activation" if self.gemma else "hidden_act") or "silu"


ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", "llama", qkv_bias=None),
    "mistral": Arch("MistralForCausalLM", "mistral"),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    "qwen3": Arch("Qwen3ForCausalLM", "qwen3", qkv_bias=None, qk_norm=True),
    "gemma2": Arch("Gemma2ForCausalLM", "gemma2", qkv_bias=None, gemma=True, sliding_every=2),
    "gemma3_text": Arch(
        "Gemma3ForCausalLM", "gemma3", qkv_bias=None, qk_norm=True, gemma=True, sliding_every=6
    ),
    "phi3": Arch("Phi3ForCausalLM", "phi3", fused=True),
}


def supported() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def gguf_names() -> dict[str, str]:
    """GGUF general.architecture -> model_type, for the families in the table."""
    return {a.gguf: name for name, a in ARCHITECTURES.items()}


def lookup(model_type: str) -> Arch | None:
    """The architecture of a config's model_type; None for anything else (any JSON value)."""
    return ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
