"""The side-car's calibrated tensors, kv_params.safetensors (FORMAT.md): their name table, built
once at import from what the registered layouts declare (layouts.base.Calibrated), and their
reader, which checks every tensor's name, layer, shape and dtype before it reads any data.

A layout registered after import (a test's toy layout) is not in the table: a side-car holding
its tensors is refused by name.
"""

import re
from pathlib import Path

from safetensors.torch import load_file

from kvcalib_runtime.cache.scheme import KVParams
from kvcalib_runtime.checkpoint.header import read_header
from kvcalib_runtime.errors import FormatError
from kvcalib_runtime.layouts.base import calibrated_tensors

# kv_params.safetensors tensor names (KVParams.tensors()): the layouts' calibrated tensors
# (layouts.base.Calibrated; a pair's ends _lo, _hi), the key smoothing, the sink predictor.
CALIBRATED = calibrated_tensors()
LAYER_NAMES = [
    f"{kind}_{c.name}{end}"
    for c in CALIBRATED.values()
    for kind in ("key", "value")
    for end in (("_lo", "_hi") if c.pair else ("",))
]
NAMES = re.compile(
    rf"layers\.(\d+)\.({'|'.join([*LAYER_NAMES, 'key_smooth'])})|"
    r"sink_predictor\.(dims|threshold|layer)"
)
# kv_params tensors whose shape does not depend on the model: what FORMAT.md says, and a check.
SHAPES = {
    "dims": ("[n]", lambda shape: len(shape) == 1),
    "threshold": ("[1]", lambda shape: shape == (1,)),
    "layer": ("[1]", lambda shape: shape == (1,)),
} | {
    f"{kind}_{c.name}": (c.shape, lambda shape, ranks=c.ranks: len(shape) in ranks)
    for c in CALIBRATED.values()
    if not c.pair  # a pair is [Hkv, D], checked against the model below
    for kind in ("key", "value")
}
# kv_params tensors of int64 (every other one is floating point)
INTEGER = {"dims", "layer"} | {
    f"{kind}_{c.name}"
    for c in CALIBRATED.values()
    if not c.dtype.is_floating_point
    for kind in ("key", "value")
}
MODEL_SHAPED = {"key_smooth"} | {n for n in LAYER_NAMES if n.endswith(("_lo", "_hi"))}


def read_params(path: Path, num_layers: int, kv_heads: int, head_dim: int) -> KVParams:
    """kv_params.safetensors at `path`, every tensor checked by name (`NAMES`), layer, shape
    and dtype before its data is read, as KVParams. FormatError naming the tensor."""
    tensors, _ = read_header(path)

    def fail(msg: str):
        raise FormatError(f"{path.name}: {msg}; convert the model again")

    for name, info in tensors.items():
        m = NAMES.fullmatch(name)
        if m is None:
            fail(
                f"unknown tensor {name!r}; names are those of "
                "KVParams.tensors() (layers.{i}.key_range_lo, ..., sink_predictor.*)"
            )
        if m.group(1) is not None and int(m.group(1)) >= num_layers:
            fail(f"{name!r} names a layer past the model's {num_layers}")
        want, fits = SHAPES.get(m.group(2) or m.group(3), ("", None))
        if fits is not None and not fits(info.shape):
            fail(f"{name!r} has shape {list(info.shape)}, expected {want}")
        integer = (m.group(2) or m.group(3)) in INTEGER
        floating = info.dtype in ("F32", "F16", "BF16")
        if integer != (info.dtype == "I64") or not (integer or floating):
            fail(f"{name!r} has dtype {info.dtype}")
        if m.group(2) in MODEL_SHAPED and info.shape != (kv_heads, head_dim):
            fail(
                f"{name!r} has shape {list(info.shape)}, expected "
                f"[{kv_heads}, {head_dim}] (KV heads, head_dim)"
            )
    names = set(tensors)
    for name in names:
        pair = re.sub(r"_(lo|hi)$", lambda m: "_hi" if m.group(1) == "lo" else "_lo", name)
        if pair not in names:
            fail(f"{name!r} without its partner {pair!r}")
    sink = {f"sink_predictor.{k}" for k in ("dims", "threshold", "layer")}
    if names & sink and not sink <= names:
        fail(f"the sink predictor needs all of {sorted(sink)}")
    return KVParams.from_tensors(load_file(path))
