"""vLLM's model classes for the architectures the plugin serves, taking a side-car's attention.

`plugin.register` registers these under the architectures' names. Built on a folder with a
side-car (`sidecar.activate`), a model is changed in three places, all before vLLM reads a
weight or sizes its cache:

- every attention layer's `rotary_emb` becomes the identity: q and k reach the backend
  pre-RoPE, and `Serving` applies kvcalib's RoPE (the runtime's, bit for bit) where the scheme
  puts keys (pre-RoPE keys are stored as they are and rotated when read);
- layers 1.. share layer 0's cache (`kv_sharing_target_layer_name`): one page holds every
  layer's packed row (`pages.PageLayout`), which differs in size from layer to layer;
- the side-car's own tensors are left out of `load_weights`: vLLM's loader globs
  `kv_params.safetensors` with the weights in a folder without `model.safetensors.index.json`
  (converted before the index was always written);
- a forward hook after the sink predictor's decoder layer hands the residual stream
  (hidden_states + residual, vLLM's deferred add) to `Serving.observe`, and the model's
  forward ends with `Serving.commit`, as the runtime's forward ends with `cache.commit`.

Without a side-car the classes are vLLM's own.
"""

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from kvcalib_vllm.sidecar import activate


class _NoRope(torch.nn.Module):
    """vLLM's rotary call, left to the backend: (positions, q, k) -> (q, k)."""

    def forward(self, positions, q, k):
        return q, k


class _Served:
    """The side-car's changes to a vLLM causal LM (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        serving = activate(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._kvcalib = serving
        if serving is None:
            return
        layers = self.model.layers
        owner = layers[0].self_attn.attn.layer_name
        for i, layer in enumerate(layers):
            layer.self_attn.rotary_emb = _NoRope()
            if i:
                layer.self_attn.attn.kv_sharing_target_layer_name = owner
        if serving.predictor is not None:
            layers[serving.predictor.layer].register_forward_hook(self._observe)

    def _observe(self, module, args, output) -> None:
        hidden, residual = output
        self._kvcalib.observe(hidden + residual)

    def load_weights(self, weights):
        if self._kvcalib is None:
            return super().load_weights(weights)
        side_car = set(self._kvcalib.params.tensors())
        return super().load_weights((name, t) for name, t in weights if name not in side_car)

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self._kvcalib is not None:
            self._kvcalib.commit()
        return out


class KvcalibLlamaForCausalLM(_Served, LlamaForCausalLM):
    pass


class KvcalibQwen2ForCausalLM(_Served, Qwen2ForCausalLM):
    pass
