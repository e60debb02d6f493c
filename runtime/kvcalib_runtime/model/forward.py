"""The runtime's own transformer for every family of the architecture table (archs.py):
llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3.

Parameters carry exactly the Hugging Face names (`model.layers.{i}.self_attn.q_proj.weight`,
...), so an HF safetensors checkpoint loads 1:1 (`from_folder`; model/weights.py reads it) and
kvcalib's converted checkpoints need no renaming. The model owns no K/V storage: every attention
layer hands q, k, v to a cache object (see `FullPrecisionCache` for the interface) and gets the
attention output back, which is how a quantized cache plugs in. Sliding windows (Mistral's
`sliding_window`, Qwen2's `use_sliding_window`, `layer_types`) are the caches' business:
`new_cache` hands them `Geometry.windows`, and they keep and attend to the last W positions of a
windowed layer.

What the families change, here:
    RMSNorm          x / rms(x) * w, or Gemma's x / rms(x) * (1 + w) computed in fp32
    embedding        Gemma scales it by sqrt(hidden_size) (rounded to the weights' dtype)
    block            pre-norm h + f(norm(h)); Gemma also normalizes f's output (sandwich)
    MLP              down(act(gate(x)) * up(x)), act silu or GELU-tanh; phi3's gate_up_proj
                     holds [gate; up]
    attention        phi3's qkv_proj holds [q; k; v]; q/k RMSNorm per head (qwen3, gemma3);
                     scores scaled by query_pre_attn_scalar^-1/2 (Gemma) instead of
                     head_dim^-1/2 (queries are pre-multiplied so that the cache's 1/sqrt(D) gives
                     it); scores soft-capped, cap * tanh(s / cap), where attn_logit_softcapping
                     is set (Gemma 2; the quantized cache then decodes without its kernel)
    RoPE             one parameter set per layer type (Gemma 3: local 1e4, global 1e6), partial
                     rotary (phi3's partial_rotary_factor)
    logits           soft-capped where final_logit_softcapping is set (Gemma 2)
"""

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvcalib_runtime.cache.fpcache import FullPrecisionCache
from kvcalib_runtime.errors import FormatError, KvcalibRuntimeError
from kvcalib_runtime.generate import generate as _generate
from kvcalib_runtime.model import archs, weights
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.rope import Rope, layer_ropes

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, normalized in fp32 like HF: [..., n] -> [..., n].

    offset: Gemma's form, x / rms(x) * (1 + weight), multiplied in fp32 before the cast back.
    """

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def _softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class Attention(nn.Module):
    """GQA self-attention whose K/V history lives in the cache passed to `forward`."""

    def __init__(self, config: dict, geo: Geometry, layer_idx: int):
        super().__init__()
        arch, hidden = geo.arch, geo.hidden
        self.num_heads, self.num_kv_heads, self.head_dim = geo.heads, geo.kv_heads, geo.head_dim
        head_dim = geo.head_dim
        self.layer_idx = layer_idx
        qkv_bias = arch.has_qkv_bias(config)
        # `attention_bias` covers all four projections; families with fixed q/k/v biases
        # (qwen2: on, mistral: off) never bias o_proj.
        o_bias = arch.qkv_bias is None and qkv_bias
        q_out, kv_out = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.fused = arch.fused
        if arch.fused:
            self.qkv_proj = nn.Linear(hidden, q_out + 2 * kv_out, bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=qkv_bias)
            self.k_proj = nn.Linear(hidden, kv_out, bias=qkv_bias)
            self.v_proj = nn.Linear(hidden, kv_out, bias=qkv_bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=o_bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(head_dim, eps, arch.gemma) if arch.qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, arch.gemma) if arch.qk_norm else None
        # The cache scales scores by head_dim^-1/2; Gemma wants query_pre_attn_scalar^-1/2.
        scalar = config.get("query_pre_attn_scalar") if arch.gemma else None
        self.q_scale = 1.0 if scalar is None else math.sqrt(head_dim / scalar)

    def forward(self, x: torch.Tensor, cache, rope: Rope, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden], positions LongTensor[B, T] -> [B, T, hidden]."""
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused:
            q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k = q.view(B, T, H, D), k.view(B, T, Hkv, D)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope.apply(q.transpose(1, 2), positions)  # [B, H, T, D] post-RoPE
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = k.transpose(1, 2)  # [B, Hkv, T, D] pre-RoPE: the cache decides where RoPE goes
        out = cache.attend(self.layer_idx, q, k, v, rope, positions)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), [B, T, hidden] -> [B, T, hidden]."""

    def __init__(self, config: dict, arch: archs.Arch):
        super().__init__()
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        bias = bool(config.get("mlp_bias", False))
        self.act = ACTIVATIONS[arch.activation(config)]
        self.fused = arch.fused
        if arch.fused:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h)); Gemma's sandwich block also
    normalizes each output before adding it. [B, T, hidden] both ways."""

    def __init__(self, config: dict, geo: Geometry, layer_idx: int):
        super().__init__()
        arch, eps, hidden = geo.arch, config.get("rms_norm_eps", 1e-6), geo.hidden
        self.self_attn = Attention(config, geo, layer_idx)
        self.mlp = MLP(config, arch)
        self.gemma = arch.gemma
        for name in arch.norms:
            setattr(self, name, RMSNorm(hidden, eps, arch.gemma))

    def forward(self, h: torch.Tensor, cache, rope: Rope, positions: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cache, rope, positions)
        if not self.gemma:
            h = h + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def _check_config(config: dict) -> Geometry:
    geo = Geometry.from_config(config)
    arch = geo.require_arch()
    act = arch.activation(config)
    if act not in ACTIVATIONS:
        raise FormatError(
            f"{'hidden_activation' if arch.gemma else 'hidden_act'} {act!r} in config.json is not "
            f"supported: use one of {', '.join(ACTIVATIONS)}"
        )
    if config.get("use_bidirectional_attention"):
        raise FormatError(
            "use_bidirectional_attention in config.json: the runtime serves causal models only"
        )
    return geo


class Transformer(nn.Module):
    """A causal LM of the architecture table built from an HF config dict.

    forward(input_ids LongTensor[B, T], cache) -> logits float32 [B, T, vocab]
    ropes: per layer, its Rope (layers of one RoPE parameter set share one)
    """

    def __init__(self, config: dict):
        super().__init__()
        geo = self.geometry = _check_config(config)
        arch, hidden, vocab = geo.arch, geo.hidden, geo.vocab
        self.config = config
        self.ropes = layer_ropes(geo.rope, geo.head_dim)
        self.model = nn.Module()
        # Left uninitialized (its weights are read in): an Embedding's random init on the meta
        # device would import torch._dynamo, about 2 s of every load and conversion.
        self.model.embed_tokens = nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
        self.model.layers = nn.ModuleList(DecoderLayer(config, geo, i) for i in range(geo.layers))
        self.model.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6), arch.gemma)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embed_scale = hidden**0.5 if arch.gemma else None
        self.attn_softcap = config.get("attn_logit_softcapping") if arch.gemma else None
        self.final_softcap = config.get("final_logit_softcapping") if arch.gemma else None

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, cache, *, last_only: bool = False) -> torch.Tensor:
        """input_ids LongTensor[B, T] -> logits float32 [B, T, vocab] ([B, 1, vocab] with
        `last_only`, which skips the LM head on every earlier token).

        Appends the T tokens to `cache` (positions from `cache.positions(T)`), calling
        `cache.observe_hidden` after every layer and `cache.commit(T)` at the end.
        """
        T = input_ids.shape[1]
        positions = cache.positions(T)  # [B, T]
        h = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        if self.embed_scale is not None:  # Gemma: sqrt(hidden) in the weights' dtype, as HF
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        for i, (layer, rope) in enumerate(zip(self.model.layers, self.ropes, strict=True)):
            h = layer(h, cache, rope, positions)
            cache.observe_hidden(i, h)
        cache.commit(T)
        if last_only:
            h = h[:, -1:]
        return _softcap(self.lm_head(self.model.norm(h)), self.final_softcap).float()

    def new_cache(
        self,
        batch: int,
        max_len: int,
        scheme=None,
        params=None,
        transforms=None,
        use_kernels: bool | None = None,
        device=None,
        dtype=None,
    ):
        """A cache for `batch` sequences of up to `max_len` tokens, in the model's dtype and on
        its device unless given (device "meta" plans one without allocating): full precision,
        or a QuantizedCache following `scheme`, `params` and `transforms` (KVScheme, KVParams,
        Transforms; `use_kernels` as QuantizedCache takes it). Sliding-window layers attend to
        their window (`geometry.windows`).

        FormatError for what the quantized cache cannot run: pre-RoPE keys or key smoothing
        under partial rotary (its decode kernel rotates whole heads, smoothing must commute with
        RoPE)."""
        for name, n in (("batch", batch), ("max_len", max_len)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise KvcalibRuntimeError(f"{name} = {n!r}: use an integer >= 1")
        geo = self.geometry
        device = self.device if device is None else device
        dtype = self.dtype if dtype is None else dtype
        if scheme is None:
            return FullPrecisionCache(
                geo.layers, batch, geo.kv_heads, geo.head_dim, max_len, device, dtype,
                windows=geo.windows, softcap=self.attn_softcap,
            )  # fmt: skip
        self._check_quantized(scheme, params)
        from kvcalib_runtime.cache.kvcache import QuantizedCache  # imports triton: only when needed

        return QuantizedCache(
            scheme,
            params,
            transforms,
            num_layers=geo.layers,
            batch=batch,
            kv_heads=geo.kv_heads,
            head_dim=geo.head_dim,
            max_len=max_len,
            device=device,
            dtype=dtype,
            use_kernels=use_kernels,
            windows=geo.windows,
            softcap=self.attn_softcap,
        )

    def _check_quantized(self, scheme, params) -> None:
        partial = next((r for r in self.ropes if r.partial), None)
        needs_whole_heads = (params is not None and params.key_smooth) or any(
            layer.key_position == "pre_rope" for layer in scheme.layers
        )
        if partial and needs_whole_heads:
            raise FormatError(
                f"the model rotates {partial.rotary_dim} of {partial.head_dim} channels per "
                "head (partial_rotary_factor): keys stored before RoPE and key smoothing need "
                "whole-head RoPE; use a recipe with key.position = 'post_rope' and no key.smooth"
            )

    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, cache=None, **options):
        """`kvcalib_runtime.generate.generate` with a full-precision cache sized to the longest
        prompt + max_new_tokens when `cache` is None. Returns the new tokens per prompt."""
        if cache is None:
            cache = self.new_cache(len(prompts), max(map(len, prompts), default=0) + max_new_tokens)
        return _generate(self, prompts, max_new_tokens, cache=cache, **options)

    @classmethod
    def from_folder(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> "Transformer":
        """Load an HF-layout folder (config.json + model*.safetensors, single or sharded).

        The model is built on the meta device and every tensor is read straight onto `device`
        (`weights.load`); dtype None keeps the checkpoint's. Parameters do not require grad.
        """
        folder = Path(path)
        with torch.device("meta"):
            model = cls(weights.read_config(folder))
        weights.load(model, folder, device, dtype)
        return model.eval()
