"""Owned hooks: everything kvcalib attaches to a model goes through one owner that removes it.

with Hooks(model) as hooks:
    hooks.forward(module, fn)            # fn(module, args, output)
    hooks.pre_forward(module, fn)        # fn(module, args, kwargs)
    hooks.attention("kvcalib")           # route attention through kvcalib's function
    model(ids)
# the model is exactly as before: no hooks, its own attention implementation
"""

import torch

from kvcalib_runtime import archs
from kvcalib_runtime.geometry import Geometry


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
    return model.model.layers


def hidden_of(output) -> torch.Tensor:
    """The residual stream [B, T, hidden] out of a decoder layer's forward output."""
    return output[0] if isinstance(output, tuple) else output


def capture_keys(model, store: dict, layer: int):
    """A forward hook for `key_module(model, layer)` that puts its output, the pre-RoPE keys, in
    store[layer] as [B, Hkv, T, D]."""

    d = Geometry.from_config(model.config).head_dim

    def hook(module, args, output):
        b, t = output.shape[:2]
        store[layer] = output.view(b, t, -1, d).transpose(1, 2)

    return hook


def key_module(model, layer: int) -> torch.nn.Module:
    """The module whose output is the pre-RoPE key: k_norm where keys are normalized, else
    k_proj."""
    arch = archs.lookup(model.config.model_type)
    attn = decoder_layers(model)[layer].self_attn
    return attn.k_norm if arch.qk_norm else attn.k_proj
