"""Owned hooks: everything kvcalib attaches to a model goes through one owner that removes it.

with Hooks(model) as hooks:
    hooks.forward(module, fn)            # fn(module, args, output)
    hooks.pre_forward(module, fn)        # fn(module, args, kwargs)
    hooks.attention("kvcalib")           # route attention through kvcalib's function
    model(ids)
# the model is exactly as before: no hooks, its own attention implementation
"""

import torch

from kvcalib.errors import ModelError
from kvcalib_runtime.model import archs
from kvcalib_runtime.model.geometry import Geometry


class Hooks:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._handles = []
        self._attn = None

    def forward(self, module: torch.nn.Module, fn) -> None:
        self._handles.append(module.register_forward_hook(fn))

    def pre_forward(self, module: torch.nn.Module, fn) -> None:
        self._handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))

    def attention(self, name: str) -> None:
        """Switch the model to a registered attention implementation until exit."""
        if self._attn is None:
            self._attn = self.model.config._attn_implementation
        self.model.set_attn_implementation(name)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._attn is not None:
            self.model.set_attn_implementation(self._attn)
            self._attn = None

    def __enter__(self) -> "Hooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (`model.model.layers`, as every family of
    the table and most others name them); ModelError for a model that keeps them elsewhere."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ModelError(
            f"model {model.config.model_type}: no decoder layers at model.model.layers, where "
            "kvcalib looks for them; it runs models laid out like Llama"
        )
    return layers


def hidden_of(output) -> torch.Tensor:
    """The residual stream [B, T, hidden] out of a decoder layer's forward output."""
    return output[0] if isinstance(output, tuple) else output


def _key_source(model, layer: int):
    """(projection, channels, norm): the linear whose output, sliced along its last dim to
    `channels` (None: all) and passed through `norm` (None: none), is layer `layer`'s key before
    RoPE. The projection is k_proj, or phi3's fused qkv_proj with its key rows; the norm is the
    attention's k_norm where keys are normalized (in the table: qwen3, gemma3; outside it: any
    k_norm, which transformers applies before RoPE)."""
    arch = archs.lookup(model.config.model_type)
    attn = decoder_layers(model)[layer].self_attn
    norm = getattr(attn, "k_norm", None) if arch is None or arch.qk_norm else None
    norm = norm if isinstance(norm, torch.nn.Module) else None
    if arch is not None and arch.fused:
        geo = Geometry.from_config(model.config)
        start = geo.heads * geo.head_dim
        return attn.qkv_proj, slice(start, start + geo.kv_heads * geo.head_dim), norm
    if isinstance(getattr(attn, "k_proj", None), torch.nn.Module):
        return attn.k_proj, None, norm
    raise ModelError(
        f"model {model.config.model_type}: its attention has no k_proj, so kvcalib cannot see "
        "keys before RoPE (what calibration and pre-RoPE key recipes need); families it knows: "
        f"{archs.supported()}"
    )


def key_module(model, layer: int) -> torch.nn.Module:
    """The module to hook with `capture_keys`: the projection that computes layer's keys."""
    return _key_source(model, layer)[0]


def capture_keys(model, store: dict, layer: int):
    """A forward hook for `key_module(model, layer)` that puts the layer's pre-RoPE keys in
    store[layer] as [B, Hkv, T, D]. A k_norm is applied here, to the projection's output, per
    head or over all heads as its weight's size says: transformers families call it on heads
    laid out [B, T, Hkv, D] (qwen3) or [B, Hkv, T, D] (gemma3), or flat (olmo2), and the
    projection's output has one layout."""

    d = Geometry.from_config(model.config).head_dim
    _, channels, norm = _key_source(model, layer)

    def hook(module, args, output):
        if channels is not None:
            output = output[..., channels]
        b, t = output.shape[:2]
        keys = output.reshape(b, t, -1, d)  # [B, T, Hkv, D]
        if norm is not None:
            per_head = norm.weight.numel() == d
            keys = norm(keys) if per_head else norm(output).reshape(b, t, -1, d)
        store[layer] = keys.transpose(1, 2)

    return hook
