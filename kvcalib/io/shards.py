"""Stream safetensors: read a source folder a few tensors at a time, write shards as they fill.

    source = SourceWeights(folder)            # name -> (file, shape, dtype); nothing loaded
    tensors = source.read(names)              # mapped from the files, copy-on-write
    span = source.span(name)                  # where its bytes are, to copy them unread

    writer = ShardWriter(out, specs, max_bytes)    # specs: every output tensor, in write order
    writer.write(name, tensor or span)        # in that order; each shard's header is known up
    files = writer.finish()                   # front, so bytes go straight to disk -> sha256

    with ahead(produce(), depth) as items:    # produce() runs on a thread, `depth` items ahead
        for name, tensor in items: ...

The writer plans the shards from the specs before any data exists (HF's rule: a shard takes
tensors until the next would pass max_bytes; a larger tensor gets a shard of its own), writes
each header, then the tensor bytes as they arrive, PIECE bytes at a time: each piece is hashed on
a second thread while it is written (hashlib and file writes release the GIL). The hasher may
fall up to DEPTH pieces behind before the writer waits for it, so that neither thread waits on
the other's every turn on a busy machine. A tensor that passes through unchanged is a `Span` of
its source file, written and hashed from the file's mapped pages: its bytes are copied exactly,
with no float round-trip, no fresh memory and no copy in user space. Peak memory is what the
caller holds, never a shard. `ahead` runs the producer of the tensors (reading and transforming
them) on its own thread, so that it never waits for a write.
"""

import collections
import contextlib
import hashlib
import json
import math
import mmap
import queue
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvcalib.errors import ModelError, OptionError
from kvcalib_runtime.checkpoint.format import INDEX, SINGLE
from kvcalib_runtime.checkpoint.header import DTYPE_NAMES, DTYPES, read_header
from kvcalib_runtime.errors import FormatError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
PIECE = 1 << 22  # bytes written and hashed at a time
DEPTH = 8  # pieces written and not yet hashed, at most


def parse_size(size: int | str) -> int:
    """Bytes in "5GB" (10^9), "500MiB" (2^20) or a plain integer, as transformers reads them."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    size_bytes = int(float(m.group(1)) * _UNITS[m.group(2) or ""]) if m else 0
    if size_bytes < 1:
        raise OptionError(f"--max-shard-size {size!r}: use a size such as 5GB, 500MB or 2GiB")
    return size_bytes


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: name, shape, torch dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Span:
    """The bytes of one stored tensor: `nbytes` from byte `offset` of the file at `path`."""

    path: Path
    offset: int
    nbytes: int


class SourceWeights:
    """The tensors of a Hugging Face folder (single file or index + shards), read on demand."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if (self.folder / INDEX).is_file():
            try:
                files = sorted(
                    set(json.loads((self.folder / INDEX).read_text())["weight_map"].values())
                )
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ModelError(f"model {self.folder}: {INDEX} is malformed ({e})") from None
        elif (self.folder / SINGLE).is_file():
            files = [SINGLE]
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        self.entries: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
        self._offsets: dict[str, int] = {}  # name -> its first byte in its file
        for file in files:
            try:
                self._offsets |= _offsets(self.folder / file)
                with safe_open(self.folder / file, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                        if name in self.entries:
                            raise ModelError(
                                f"model {self.folder}: tensor {name} is in both "
                                f"{self.entries[name][0]} and {file}"
                            )
                        sl = f.get_slice(name)
                        dtype = DTYPES.get(sl.get_dtype())
                        if dtype is None:
                            raise ModelError(
                                f"model {self.folder}: tensor {name} in {file} has dtype "
                                f"{sl.get_dtype()}, which kvcalib does not read"
                            )
                        self.entries[name] = (file, tuple(sl.get_shape()), dtype)
            except (SafetensorError, FormatError, OSError) as e:
                raise ModelError(f"model {self.folder}: cannot read {file} ({e})") from None

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, mapped from their files: no byte is copied until used, and
        copy-on-write (writing to a tensor leaves the file alone). A file stays mapped until
        the last of its tensors is freed."""
        out = {}
        for file in sorted({self.entries[n][0] for n in names}):
            with open(self.folder / file, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            for name in (n for n in names if self.entries[n][0] == file):
                _, shape, dtype = self.entries[name]
                count, offset = math.prod(shape), self._offsets[name]
                flat = (
                    torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
                    if count
                    else torch.empty(0, dtype=dtype)
                )
                out[name] = flat.view(shape)
        return out

    def span(self, name: str) -> Span:
        file, shape, dtype = self.entries[name]
        nbytes = math.prod(shape) * dtype.itemsize
        return Span(self.folder / file, self._offsets[name], nbytes)


def _offsets(path: Path) -> dict[str, int]:
    """name -> the offset of its first byte in the safetensors file `path`."""
    tensors, _ = read_header(path, fix="save the model again")
    with open(path, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")  # the data section follows the header
    return {name: start + info.begin for name, info in tensors.items()}


def plan_shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    shards, size = [[]], 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def header_bytes(specs: list[TensorSpec]) -> bytes:
    """The 8-byte length + JSON header of a safetensors file holding `specs` in that order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for s in specs:
        header[s.name] = {
            "dtype": DTYPE_NAMES[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned, as safetensors pads
    return len(text).to_bytes(8, "little") + text


class ShardWriter:
    """Writes planned tensors into model-0000i-of-0000n shards + index, also when n is 1: vLLM
    reads a folder without an index as every *.safetensors in it, kv_params.safetensors
    included (FORMAT.md)."""

    def __init__(self, folder: Path, specs: list[TensorSpec], max_bytes: int):
        self.folder = Path(folder)
        self.shards = plan_shards(specs, max_bytes)
        self.order = [(i, s) for i, shard in enumerate(self.shards) for s in shard]
        self.next = 0
        self.file = None
        self.hash = None
        self.hashes: dict[str, str] = {}
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kvcalib-sha256")
        self._pending = collections.deque()  # the hashes of written pieces, oldest first

    def write(self, name: str, data: torch.Tensor | Span) -> None:
        """The next planned tensor: its values, or the Span of a source file holding its bytes
        (the source's dtype and shape are the plan's: the caller checks)."""
        i, spec = self.order[self.next]
        assert name == spec.name, f"wrote {name}, planned {spec.name}"
        if isinstance(data, Span):
            assert data.nbytes == spec.nbytes, name
        else:
            assert tuple(data.shape) == spec.shape and data.dtype == spec.dtype, name
        if self.file is None:
            self.file = open(self.folder / shard_name(i, len(self.shards)), "wb")  # noqa: SIM115
            self.hash = hashlib.sha256()
            self._put(header_bytes(self.shards[i]))
        if isinstance(data, Span):
            self._copy(data)
        else:
            self._put(data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        self.next += 1
        if self.next == len(self.order) or self.order[self.next][0] != i:
            self.file.close()
            self.file = None
            self._wait()
            self.hashes[shard_name(i, len(self.shards))] = self.hash.hexdigest()

    def _put(self, data) -> None:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), PIECE):
            piece = view[i : i + PIECE]
            self._pending.append(self._hasher.submit(self.hash.update, piece))  # in order
            self.file.write(piece)
            self._wait(DEPTH)

    def _copy(self, span: Span) -> None:
        """Write and hash the span's bytes straight from the source's pages (mapped: no copy
        into a buffer first); the mapping closes when its last piece is hashed."""
        if not span.nbytes:
            return
        start = span.offset - span.offset % mmap.ALLOCATIONGRANULARITY
        with open(span.path, "rb") as f:
            data = mmap.mmap(
                f.fileno(), span.offset + span.nbytes - start, access=mmap.ACCESS_READ, offset=start
            )
        self._put(memoryview(data)[span.offset - start :])

    def _wait(self, depth: int = 0) -> None:
        """Until at most `depth` written pieces are not yet hashed."""
        while len(self._pending) > depth:
            self._pending.popleft().result()

    def close(self) -> None:
        """Release the file and the hashing thread (also on failure; then the caller removes
        the folder)."""
        if self.file is not None:
            self.file.close()
            self.file = None
        self._hasher.shutdown(wait=True)

    def finish(self) -> dict[str, str]:
        """file name -> sha256 of every weight file written (the index included)."""
        assert self.next == len(self.order), "not every planned tensor was written"
        weight_map = {s.name: shard_name(i, len(self.shards)) for i, s in self.order}
        index = {
            "metadata": {"total_size": sum(s.nbytes for _, s in self.order)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        data = (json.dumps(index, indent=2) + "\n").encode()
        (self.folder / INDEX).write_bytes(data)
        self.hashes[INDEX] = hashlib.sha256(data).hexdigest()
        return self.hashes


_END = object()


@contextlib.contextmanager
def ahead(items: Iterator, depth: int):
    """Yield an iterator over `items`, which a worker thread draws up to `depth` items ahead of
    the consumer. An exception in the worker is raised in the consumer (as it was raised);
    leaving the context early stops the worker before it draws another item."""
    ready = queue.Queue(depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put((None, item)):
                    return
            put((None, _END))
        except BaseException as e:  # handed over: the consumer raises it
            put((e, None))

    def consume():
        while True:
            error, item = ready.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item

    worker = threading.Thread(target=work, name="kvcalib-ahead", daemon=True)
    worker.start()
    try:
        yield consume()
    finally:
        stop.set()
        worker.join()
