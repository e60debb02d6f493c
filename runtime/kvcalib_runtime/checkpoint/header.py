"""A safetensors file's header, read and validated without reading its data: every tensor's
dtype, shape and byte range (`read_header`), checked against the file as the safetensors library
checks it. The converted checkpoint's validator (checkpoint.format) and the toolkit's model and
shard readers call it before any data is read.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcalib_runtime.errors import FormatError

# safetensors dtype names -> torch dtypes (the safetensors spec's table, minus unsigned > 8 bits).
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # the safetensors library refuses larger headers too


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: dtype name, shape, byte range inside the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(
    path: Path, *, fix: str = "convert the model again"
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """A safetensors file's tensors and metadata, validated without reading the data.

    Checks the header length against the file, the JSON, every dtype and shape, and that the
    byte ranges tile the data section exactly (what the safetensors library also demands). At
    most the header's bytes are read, and only once its length fits inside the file. `fix`
    ends the FormatError's message: what the user should do about a damaged file.
    """
    path = Path(path)

    def fail(msg):
        raise FormatError(f"{path.name}: {msg}; the file is damaged - {fix}")

    if not path.is_file():  # a FIFO would block the open, a device never end
        raise FormatError(f"{path.name}: not a regular file; {fix}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            fail(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(raw, "little")
        if n > size - 8 or n > MAX_HEADER:
            fail(f"header length {n} runs past the end of the file ({size} bytes)")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        fail(f"header is not valid JSON ({e})")
    if not isinstance(header, dict):
        fail("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        fail("__metadata__ must map strings to strings")
    data = size - 8 - n
    tensors = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            fail(f"tensor {name!r} needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            fail(f"tensor {name!r} has unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not ints(shape) or not ints(offsets) or len(offsets) != 2:
            fail(f"tensor {name!r}: shape and data_offsets must be lists of integers >= 0")
        begin, end = offsets
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if not begin <= end <= data or end - begin != nbytes:
            fail(
                f"tensor {name!r}: data_offsets {offsets} out of range for {nbytes} bytes of "
                f"{dtype} {shape} in a data section of {data} bytes"
            )
        tensors[name] = TensorInfo(dtype, tuple(shape), begin, end)
    cursor = 0
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != cursor:
            fail(f"tensor {name!r} starts at byte {info.begin}, expected {cursor} (gap or overlap)")
        cursor = info.end
    if cursor != data:
        fail(f"tensors cover {cursor} bytes of a data section of {data} bytes")
    return tensors, metadata


def ints(x) -> bool:
    """x is a list of integers >= 0 (bools are not integers here)."""
    return isinstance(x, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x
    )
