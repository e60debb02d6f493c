"""vLLM's CPU attention backend, overridden: a side-car's layers attend through `Serving`.

On CPU, `vllm/platforms/cpu.py` returns CPU_ATTN whatever backend was asked for, so the plugin
registers this class as CPU_ATTN's override (`plugin.register`). For a model folder without a
side-car (`sidecar.active()` is None) every method is vLLM's own. With one:

- `customize_spec` publishes the page: one head slot of `PageLayout.row_bytes` bytes per token
  (every layer's packed row; the other layers share layer 0's cache, `model`), so vLLM's
  block manager counts the bytes kvcalib stores per token;
- `forward` hands the step to `Serving.attend`; nothing is written at vLLM's cache-update call
  (`do_kv_cache_update`): pages are written when the step commits.
"""

import re
from dataclasses import replace

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from kvcalib_vllm.sidecar import active

_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """'model.layers.7.self_attn.attn' -> 7."""
    found = _LAYER.search(name)
    assert found is not None, name
    return int(found.group(1))


class KvcalibBackend(CPUAttentionBackend):
    @classmethod
    def customize_spec(cls, spec):
        serving = active()
        if serving is None:
            return super().customize_spec(spec)
        return replace(spec, num_head_slots=1, state_content_bytes=serving.pages.row_bytes)

    @staticmethod
    def get_impl_cls():
        return KvcalibImpl


class KvcalibImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.serving = active()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):  # fmt: skip
        """query [tokens, H, D], key and value [tokens, Hkv, D] -> output [tokens, H, D]."""
        if self.serving is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)  # fmt: skip
        if attn_metadata is None:  # vLLM's warm-up
            return output
        n = attn_metadata.num_actual_tokens
        self.serving.attend(layer_index(layer.layer_name), query[:n], key[:n], value[:n],
                            kv_cache, attn_metadata, output[:n])  # fmt: skip
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.serving is None:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
