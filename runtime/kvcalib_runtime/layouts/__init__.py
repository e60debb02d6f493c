"""The stored layouts: how a KV tensor is cut into groups, quantized, stored and read. One
module per layout, each a `Layout` subclass that enters the registry with `base.register` and
owns its validation, its reference numerics, its storage (the body a cache allocates; memory is
walked from it) and what the kernels read of it (base.Kind and a few typed attributes):

    token       TokenGroups     per-token affine groups of channels (KIVI's values)
    channel     ChannelGroups   per-channel groups of tokens (KIVI's keys)
    static      StaticChannels  calibrated per-channel ranges (KVQuant's keys, kvcalib's)
    vector      VectorGroups    per-token groups over every KV head joined (KVQuant's values)
    ggml        GgmlBlocks      llama.cpp's q4_0 / q8_0 blocks
    turboquant  TurboSets       TurboQuant's rotated sets with Lloyd-Max levels
    vq          VectorCodes     one index per vector of channels into a calibrated codebook

A QuantSpec names its layout by `granularity` under kvcalib's affine numerics (`method`
"affine"), or by a `method` of its own (a peer's, or kvcalib's vector codes); `QuantSpec.layout`
is `bind(spec)`. Importing the package registers every layout below, in this order (the order
of `granularities()` and `methods()`, which error messages and the recipe's choices list;
they, `registered()` and `calibrated_tensors()` read the registry when called, so a layout
registered later is in them).
"""

# isort: off
from kvcalib_runtime.layouts import token, channel, static, vector, ggml, turboquant, vq
from kvcalib_runtime.layouts.base import (
    Kind,
    Layout,
    bind,
    calibrated_tensors,
    granularities,
    layout_class,
    methods,
    registered,
)
# isort: on

__all__ = ["Kind", "Layout", "bind", "calibrated_tensors", "granularities", "layout_class"]
__all__ += ["methods", "registered"]
__all__ += ["channel", "ggml", "static", "token", "turboquant", "vector", "vq"]
