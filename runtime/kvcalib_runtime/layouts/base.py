"""What every stored layout shares: `Layout` (one layout bound to its QuantSpec), the registry
layouts enter with `register` (`layout_class` and `bind` read it), `Kind` (the switch the kernels
compile on), `QTensor` (a quantized tensor in reference form) and the constants of the
numerics. It imports no other module of the package: spec.py and every layout sit on it."""

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

BITS = (2, 3, 4, 5, 6, 8)
METADATA_BITS = 16  # scales, offsets and exact values in an fp16/bf16 cache
MAX_SLOTS = 64  # exact slots per vector: beyond this dense storage is cheaper
PAIRINGS = ("adjacent", "rope")  # how vector codes group channels (layouts.vq)


def slot_index_dtype(n: int) -> torch.dtype:
    """The dtype of a slot's channel index in a vector of n channels."""
    return torch.uint8 if n <= 256 else torch.int16


class Calibrated(NamedTuple):
    """A tensor a layout needs calibrated, per layer, for keys and for values: KVParams'
    `{kind}_{name}` (kind "key" or "value"), the side-car's layers.{i}.{kind}_{name} (a `pair`:
    _lo and _hi), `argument` of `Layout.allocate`. checkpoint.format checks its rank and dtype
    family, cache.shard gives each rank its heads' rows (all of them where `shared` says the
    tensor is the layer's for every head)."""

    name: str
    argument: str
    shape: str  # as FORMAT.md writes it
    ranks: tuple[int, ...]
    dtype: torch.dtype
    pair: bool = False
    shared: bool = False  # one row ([L] or [1, ...]) is shared by every head


RANGE = Calibrated("range", "static_range", "[Hkv, D]", (2,), torch.float32, pair=True)
CODEBOOK = Calibrated(
    "codebook", "codebook", "[L], [Hkv, L] or [Hkv, L, w]", (1, 2, 3), torch.float32, shared=True
)


class Kind(enum.IntEnum):
    """Where a layout keeps its metadata, as the kernels switch on it."""

    TOKEN = 0  # per group of channels of a stored row
    CHANNEL = 1  # per group of tokens of a channel
    STATIC = 2  # per channel, from a calibrated range
    EXACT = 3  # no metadata: a tensor left in full precision
    VECTORS = 4  # per channel, from a calibrated range; a code indexes a vector's codebook entry


@dataclass
class QTensor:
    """A quantized [..., T, D] tensor in reference (unpacked) form; each layout's module
    docstring gives the shapes of its scale and offset.

    codes:       uint8 [..., T, D], values < 2**bits ("vector": [..., 1, T, H * D]; "turboquant":
                 the outlier set's codes first)
    scale:       x.dtype, group-shaped (uint8 codes for metadata_code "byte", layouts.metabyte)
    offset:      like scale, or None when symmetric
    slot_index:  [..., T, K] channel of each exact slot (layouts.quant's docstring), or None
    slot_delta:  x.dtype [..., T, K] what the slot adds back (uint8 E4M3 bytes in steps of the
                 channel's scale for slot_code "fp8"), or None
    heads:       H for "vector" (codes hold the heads joined), else None
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    slot_index: torch.Tensor | None = None
    slot_delta: torch.Tensor | None = None
    heads: int | None = None


class Layout:
    """One stored layout, bound to the QuantSpec that selects it (`QuantSpec.layout`).

    A layout owns its validation (`check`), its reference numerics (`quantize`, `dequantize`),
    its storage (`allocate`: the body a cache holds, whose buffers are its memory) and what the
    kernels read of it (`kind`, `affine`, `joins_heads`, `row_group`, `token_group`).

    name              the recipe's and side-car's word for it: a granularity, or a peer's method
    method            "affine" (kvcalib's numerics: `name` is a granularity), or `name` (a
                      method of its own, whatever the spec's granularity)
    kind              where its metadata lives (Kind)
    affine            kvcalib's numerics, which the kernels read (peers' own numerics are not)
    decoded           the decode attention's reference and CPU path read its body (a layer whose
                      layouts are not decodes through dequantize-then-attend)
    vectors           a code indexes a vector of group_size channels (`pairing` applies)
    joins_heads       a stored row is one token of every KV head
    calibrates        the calibrated tensors it may need (Calibrated; `calibrated` says which
                      and their shapes for its spec); every affine layout may take a codebook
    calibrated_range  its ranges come from calibration (RANGE: KVParams.key_range / ...)
    splits            its channels split into sets by calibration ("split": KVParams.key_split)
    bits              the code widths it supports
    """

    name: ClassVar[str]
    method: ClassVar[str] = "affine"
    kind: ClassVar[Kind] = Kind.TOKEN
    affine: ClassVar[bool] = True
    vectors: ClassVar[bool] = False
    joins_heads: ClassVar[bool] = False
    calibrates: ClassVar[tuple[Calibrated, ...]] = ()
    calibrated_range: ClassVar[bool] = False
    splits: ClassVar[bool] = False
    bits: ClassVar[tuple[int, ...]] = BITS

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.calibrated_range = RANGE in cls.calibrates
        cls.splits = any(c.argument == "split" for c in cls.calibrates)

    def __init__(self, spec):
        self.spec = spec

    def check(self) -> None:
        """ValueError unless the spec's fields make sense for this layout."""
        spec = self.spec
        if spec.outlier_slots and not (self.calibrated_range and spec.outliers):
            raise ValueError(
                "outlier_slots is for 'static' granularity with outliers > 0; dynamic groups "
                "keep ceil(outliers * group / 2) at each end"
            )
        if spec.slot_code != "exact" and not (self.kind == Kind.STATIC and spec.outlier_slots):
            raise ValueError(
                f"slot_code = {spec.slot_code!r} codes a slot in steps of its channel's static "
                "scale: it is for 'static' granularity with outlier_slots >= 1"
            )
        if spec.metadata_code != "dtype" and not (self.affine and self.kind == Kind.TOKEN):
            raise ValueError(
                f"metadata_code = {spec.metadata_code!r} is for per-token groups: use "
                "granularity 'token' or 'vector' with it"
            )
        if spec.pairing != "adjacent" and not self.vectors:
            raise ValueError("pairing groups the channels of vector codes: set method 'vq'")
        if (spec.split_channels or spec.split_bits) and not self.splits:
            raise ValueError("split_channels / split_bits are TurboQuant's: set method turboquant")
        if self.affine:
            return
        own = ("clip", "codebook", "outliers", "outlier_slots", "slot_rule", "slot_code")
        default = {f.name: f.default for f in dataclasses.fields(spec)}
        changed = [name for name in own if getattr(spec, name) != default[name]]
        if not spec.symmetric or changed:
            raise ValueError(
                f"method {spec.method!r} has its own numerics: set symmetric = true and leave "
                f"{', '.join(changed) or 'clip, codebook, outliers'} at the default"
            )

    @property
    def decoded(self) -> bool:
        return self.affine

    def check_codebook(self, book: torch.Tensor, kv_heads: int) -> None:
        """ValueError unless `book` holds 2**bits levels, [L] or [rows, L] (rows 1 or this
        layout's rows per token of kv_heads heads); checkpoint.checks checks the levels."""
        rows, levels = self.row_heads(kv_heads), self.spec.levels
        if (
            book.dim() not in (1, 2)
            or book.shape[-1] != levels
            or (book.dim() == 2 and book.shape[0] not in (1, rows))
        ):
            raise ValueError(
                f"codebook has shape {list(book.shape)}; {self.spec.bits} bits need "
                f"[{levels}] or [{rows}, {levels}] levels"
            )

    def codebook_shape(self, kv_heads: int) -> tuple[int, ...]:
        """The shape of a codebook of this layout for kv_heads heads (one per layer)."""
        return (self.spec.levels,)

    def calibrated(self, kv_heads: int, head_dim: int) -> dict[str, tuple]:
        """The calibrated tensors this spec needs for a layer of kv_heads heads of head_dim
        channels: allocate's argument -> (shape, dtype) of the tensor (of each end of a pair)."""
        spec, need = self.spec, {}
        if RANGE in self.calibrates:
            need[RANGE.argument] = ((kv_heads, head_dim), RANGE.dtype)
        if spec.codebook and CODEBOOK in self.calibrates:
            need[CODEBOOK.argument] = (self.codebook_shape(kv_heads), CODEBOOK.dtype)
        return need

    def check_head(self, head_dim: int, kv_heads: int | None = None) -> None:
        """ValueError unless rows of heads of head_dim channels (kv_heads of them, where the
        layout joins heads and they are known) can be stored."""

    def width(self, head_dim: int, kv_heads: int = 1) -> int:
        """Channels of one stored row (one vector): one head's."""
        return head_dim

    def row_heads(self, kv_heads: int) -> int:
        """Stored rows per token: one per KV head."""
        return kv_heads

    def row_group(self, width: int) -> int:
        """Channels per metadata group of a row of `width` channels (0: not grouped by row)."""
        g = self.spec.group_size or width
        if width % g:
            raise ValueError(f"group_size = {g} does not divide head_dim = {width}")
        return g

    def token_group(self) -> int:
        """Tokens that share metadata and move into the body together (1: any token alone)."""
        return 1

    def outliers_per_side(self, group_numel: int) -> int:
        f = self.spec.outliers
        return math.ceil(f * group_numel / 2) if f > 0 else 0

    def slots(self, n: int) -> int:
        """K, the exact slots of a row of n channels (kvcalib_runtime.layouts.quant's docstring)."""
        if not self.spec.outliers:
            return 0
        g = self.row_group(n)
        return n // g * 2 * self.outliers_per_side(g)

    def quantize(self, x, *, static_range=None, codebook=None, exclude=None, split=None):
        raise NotImplementedError

    def dequantize(self, q: QTensor, *, codebook=None, split=None) -> torch.Tensor:
        """float32 x_hat in x's layout."""
        raise NotImplementedError

    def allocate(self, shape, device, dtype, *, static_range=None, codebook=None, split=None):
        """Zeroed storage of a cache's body for `shape` = (B, Hkv, N, D) with the calibrated
        tensors it needs; its `tensors()` are what it allocates."""
        raise NotImplementedError

    def kept_widths(self, head_dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """(channels, dtype) of each buffer a reader keeps of a slot between reads of the
        history (cache.held): the slot dequantized, unless the read ends with a step over the
        whole body (`kept` and `from_kept`)."""
        return [(head_dim, dtype)]

    def kept(self, body, b: int, n: int, start: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """What a reader keeps of slots [start, n) of sequence b: each slot alone, the same
        whatever the span (one tensor [Hkv, n - start, w] per `kept_widths` entry)."""
        return [body.dequantize(dtype, b, n, start)]

    def from_kept(self, body, kept: list[torch.Tensor], b: int, dtype: torch.dtype):
        """Slots [0, n) of sequence b from what was kept of them, bit for bit
        `body.dequantize(dtype, b, n)`."""
        return kept[0]

    def bits_per_element(
        self, head_dim: int, tokens: int, kv_heads: int = 1, dtype: torch.dtype = torch.float16
    ) -> float:
        """Bits per element of a body of `tokens` tokens of kv_heads heads in a `dtype` cache,
        walked from the buffers of one allocated on the meta device: codes, metadata, exact
        slots and the layer's calibrated constants (ranges, codebooks, split channels)."""
        body = self.meta_body(kv_heads, head_dim, tokens, dtype)
        return sum(t.nbytes for t in body.tensors()) * 8 / (tokens * kv_heads * head_dim)

    def meta_body(self, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype):
        """A body of one sequence of `tokens` tokens allocated on the meta device (no memory),
        from calibrated tensors of the shapes `calibrated` declares."""
        meta, given = torch.device("meta"), {}
        for argument, (shape, kind) in self.calibrated(kv_heads, head_dim).items():
            found = torch.zeros(shape, dtype=kind, device=meta)
            given[argument] = (found, found) if argument == RANGE.argument else found
        return self.allocate((1, kv_heads, tokens, head_dim), meta, dtype, **given)

    def paged(self, kv_heads: int, head_dim: int) -> bool:
        """vLLM's pages can hold it: the decode kernel reads it (`decoded`) and its body keeps
        one row per token (`per_token`; a ValueError where it does not)."""
        if not self.decoded:
            return False
        body = self.meta_body(kv_heads, head_dim, self.token_group(), torch.float16)
        try:
            body.per_token()
        except ValueError:
            return False
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"


_BY_GRANULARITY: dict[str, type[Layout]] = {}  # method "affine": the layout of each granularity
_BY_METHOD: dict[str, type[Layout]] = {}  # the methods of their own


def register(cls: type[Layout]) -> type[Layout]:
    """Class decorator: `cls` becomes the layout its name selects, as a granularity (method
    "affine") or as a method of its own (method = name). A name taken twice is a programming
    error."""
    if cls.method not in ("affine", cls.name):
        raise TypeError(f"layout {cls.__name__}: method is 'affine' or its name {cls.name!r}")
    table = _BY_GRANULARITY if cls.method == "affine" else _BY_METHOD
    if cls.name in table or cls.name == "affine":
        raise TypeError(f"layout {cls.__name__}: the name {cls.name!r} is taken")
    table[cls.name] = cls
    return cls


def calibrated_tensors() -> dict[str, Calibrated]:
    """Every calibrated tensor a registered layout declares, by name."""
    return {c.name: c for cls in registered().values() for c in cls.calibrates}


def granularities() -> tuple[str, ...]:
    """The registered granularities, in registration order."""
    return tuple(_BY_GRANULARITY)


def methods() -> tuple[str, ...]:
    """The method "affine" and the registered methods of their own, in registration order."""
    return ("affine", *_BY_METHOD)


def registered() -> dict[str, type[Layout]]:
    """Every registered layout by name: the granularities', then the methods'."""
    return {**_BY_GRANULARITY, **_BY_METHOD}


def layout_class(method: str, granularity: str) -> type[Layout]:
    """The Layout a spec's method and granularity select; ValueError naming the field."""
    if method not in methods():
        raise ValueError(f"method = {method!r} is unknown: use one of {methods()}")
    if granularity not in _BY_GRANULARITY:
        raise ValueError(f"granularity = {granularity!r} is unknown: use one of {granularities()}")
    return _BY_GRANULARITY[granularity] if method == "affine" else _BY_METHOD[method]


def bind(spec) -> Layout:
    """spec's layout, bound to it."""
    return layout_class(spec.method, spec.granularity)(spec)
