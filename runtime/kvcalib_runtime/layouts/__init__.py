"""The registry of stored layouts: how a KV tensor is cut into groups, quantized, stored and
read. One module per layout, each a `Layout` subclass that owns its validation, its reference
numerics, its storage (the body a cache allocates; memory is walked from it) and what the
kernels read of it (base.Kind and a few typed attributes):

    token       TokenGroups     per-token affine groups of channels (KIVI's values)
    vector      VectorGroups    per-token groups over every KV head joined (KVQuant's values)
    channel     ChannelGroups   per-channel groups of tokens (KIVI's keys)
    static      StaticChannels  calibrated per-channel ranges (KVQuant's keys, kvcalib's)
    ggml        GgmlBlocks      llama.cpp's q4_0 / q8_0 blocks
    turboquant  TurboSets       TurboQuant's rotated sets with Lloyd-Max levels
    vq          VectorCodes     one index per vector of channels into a calibrated codebook

A QuantSpec names its layout by `granularity` under kvcalib's affine numerics (`method`
"affine"), or by a `method` of its own (a peer's, or kvcalib's vector codes); `QuantSpec.layout`
is `bind(spec)`. A new layout is one new
module and one line in LAYOUTS.
"""

from kvcalib_runtime.layouts.base import Kind, Layout
from kvcalib_runtime.layouts.channel import ChannelGroups
from kvcalib_runtime.layouts.ggml import GgmlBlocks
from kvcalib_runtime.layouts.static import StaticChannels
from kvcalib_runtime.layouts.token import TokenGroups
from kvcalib_runtime.layouts.turboquant import TurboSets
from kvcalib_runtime.layouts.vector import VectorGroups
from kvcalib_runtime.layouts.vq import VectorCodes

AFFINE = {cls.name: cls for cls in (TokenGroups, ChannelGroups, StaticChannels, VectorGroups)}
OWN = {cls.name: cls for cls in (GgmlBlocks, TurboSets, VectorCodes)}  # methods of their own
GRANULARITIES = tuple(AFFINE)
METHODS = ("affine", *OWN)
LAYOUTS = {**AFFINE, **OWN}

__all__ = ["GRANULARITIES", "LAYOUTS", "METHODS", "Kind", "Layout", "bind", "layout_class"]


def layout_class(method: str, granularity: str) -> type[Layout]:
    """The Layout a spec's method and granularity select; ValueError naming the field."""
    if method not in METHODS:
        raise ValueError(f"method = {method!r} is unknown: use one of {METHODS}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity = {granularity!r} is unknown: use one of {GRANULARITIES}")
    return AFFINE[granularity] if method == "affine" else OWN[method]


def bind(spec) -> Layout:
    """spec's layout, bound to it."""
    return layout_class(spec.method, spec.granularity)(spec)
