"""method "turboquant": TurboQuant_mse (Zandieh et al., ICLR 2026, arXiv:2504.19874,
Algorithm 1) as the quantizer of KV rows, with the paper's split of a head's channels into an
outlier set and a normal set (§4.3: "two independent instances of TurboQuant", the outliers at
more bits).

A row x of one head (D channels) is cut into S sets: with `split_channels` = n_o, the outlier
set (the channels `split[h]` names for KV head h) at `split_bits` bits and the other D - n_o
channels at `bits`; without, one set (the whole head) at `bits`. Each set of n channels is
quantized on its own:

    r     = ||x_s||                      the set's norm, stored in fp16 (the paper keeps norms in
                                         floating point and quantizes the unit vector)
    y     = (x_s / r) @ R_n              R_n = codebooks.random_rotation(n): random orthogonal
    c_j   = the level of codebooks.lloyd_max(n, bits_s) nearest to y_j (ties to the lower level)
    x_s_hat = r * level[c] @ R_n.T

so every coordinate of y follows the known density of a unit vector's coordinate, whatever the
data: no calibration of the levels or the rotation. QTensor layout: codes uint8 [..., T, D], the
outlier set's n_o codes first, then the rest's (codes of rotated coordinates, not of channels);
scale [..., T, S, 1], the sets' norms rounded to x's dtype; offset None.

`TurboBody` stores rows of a cache in that layout, each set's codes packed at its own width.
"turboquant" quantizes whole heads: granularity "token", group_size 0, symmetric, the other
fields at their defaults. The kernels do not read it.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvcalib_runtime.layouts.base import Calibrated, Kind, Layout, QTensor, register
from kvcalib_runtime.layouts.body import flush_by_write
from kvcalib_runtime.layouts.codebooks import lloyd_max, random_rotation
from kvcalib_runtime.layouts.packing import pack, packed_size, unpack

if TYPE_CHECKING:
    from kvcalib_runtime.layouts.spec import QuantSpec

TURBO_BITS = (1, 2, 3, 4, 5)  # Lloyd-Max tables TurboQuant's sets use
# the outlier set's channels of each KV head (KVParams.key_split / value_split)
SPLIT = Calibrated("split", "split", "[Hkv, n]", (2,), torch.int64)


def _sets(x: torch.Tensor, spec, split: torch.Tensor | None) -> list[torch.Tensor]:
    """x [..., H, T, D] -> the sets' channels [..., H, T, n_s], outlier set first."""
    d = x.shape[-1]
    if not spec.split_channels:
        spec.layout.sets(d)
        return [x]
    outlier = _outlier_mask(spec, split, x.shape[-3], d, x.device)
    order = torch.argsort(~outlier, dim=-1, stable=True)[:, None, :]  # [H, 1, D]: outliers first
    permuted = x.gather(-1, order.expand(x.shape))
    (n_o, _), _ = spec.layout.sets(d)
    return [permuted[..., :n_o], permuted[..., n_o:]]


def _outlier_mask(spec, split, heads: int, d: int, device) -> torch.Tensor:
    """bool [H, D]: the outlier set's channels of each head."""
    if split is None:
        raise ValueError(
            "this turboquant spec splits channels: pass split (the outlier channels per head, "
            "KVParams.key_split / value_split)"
        )
    if tuple(split.shape) != (heads, spec.split_channels):
        raise ValueError(
            f"split has shape {list(split.shape)}, expected [{heads}, {spec.split_channels}]"
        )
    mask = torch.zeros(heads, d, dtype=torch.bool, device=device)
    mask.scatter_(1, split.to(device=device, dtype=torch.long), True)
    if int(mask.sum()) != heads * spec.split_channels:
        raise ValueError("split names a channel twice within a head: give distinct channels")
    return mask


def quantize(x: torch.Tensor, spec, split: torch.Tensor | None = None) -> QTensor:
    """x [..., H, T, D] (float) -> QTensor (module docstring); split int64 [H, n_o]."""
    codes, norms = [], []
    for part, (n, bits) in zip(
        _sets(x.float(), spec, split), spec.layout.sets(x.shape[-1]), strict=True
    ):
        scale = part.norm(dim=-1, keepdim=True).to(x.dtype)
        s = scale.float()
        rotation = random_rotation(n).to(device=x.device, dtype=torch.float32)
        y = torch.where(s > 0, part / torch.where(s > 0, s, 1.0), 0.0) @ rotation
        levels = lloyd_max(n, bits).to(x.device)
        codes.append(torch.searchsorted((levels[1:] + levels[:-1]) / 2, y.contiguous()))
        norms.append(scale)
    return QTensor(torch.cat(codes, -1).to(torch.uint8), torch.stack(norms, -2), None)


def dequantize(q: QTensor, spec, split: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [..., H, T, D] from a QTensor of `quantize` (same spec and split)."""
    sets = spec.layout.sets(q.codes.shape[-1])
    starts = [sum(n for n, _ in sets[:i]) for i in range(len(sets))]
    codes = [q.codes[..., start : start + n] for start, (n, _) in zip(starts, sets, strict=True)]
    return from_levels(set_levels(codes, spec), q.scale, spec, split)


def set_levels(codes: list[torch.Tensor], spec) -> list[torch.Tensor]:
    """Per set, its codes [..., n_s] as the Lloyd-Max levels they index (float32): exact, each
    row alone."""
    sets = spec.layout.sets(sum(c.shape[-1] for c in codes))
    levels = [lloyd_max(n, bits).to(c.device) for c, (n, bits) in zip(codes, sets, strict=True)]
    return [table[c.long()] for c, table in zip(codes, levels, strict=True)]


def from_levels(ys: list[torch.Tensor], scale, spec, split: torch.Tensor | None = None):
    """float32 [..., H, T, D] from every set's levels (`set_levels`) and the norms (`quantize`'s
    scale, [..., H, T, S, 1]): each set rotated back and scaled, the outlier channels put back
    in place. The rotation is a matrix product over every row at once, whose BLAS rounding
    depends on how many rows it takes: a row's result is the same only within equal calls."""
    parts = []
    for i, y in enumerate(ys):
        rotation = random_rotation(y.shape[-1]).to(device=y.device, dtype=torch.float32)
        parts.append(scale[..., i, :].float() * (y @ rotation.T))
    x = torch.cat(parts, -1)
    d = x.shape[-1]
    if not spec.split_channels:
        return x
    outlier = _outlier_mask(spec, split, x.shape[-3], d, x.device)
    order = torch.argsort(~outlier, dim=-1, stable=True)[:, None, :]
    return torch.empty_like(x).scatter_(-1, order.expand(x.shape), x)


@dataclass
class TurboBody:
    """The quantized body of one layer's keys or values under a "turboquant" spec: B sequences
    of N slots (slot t holds position t) of Hkv heads of D channels, stored in `dtype`.

    spec       QuantSpec (method "turboquant")
    head_dim   D
    codes      per set s (outlier set first): uint8 [B, Hkv, N, packed_size(n_s, bits_s)]
               (kvcalib_runtime.layouts.packing's row layout)
    scale      dtype [B, Hkv, N, S]  the sets' norms
    split      int64 [Hkv, n_o], the outlier channels of each head, or None without a split

    A layouts.body.Body with its own writer, which neither the decode kernels nor vLLM's pages
    read (`per_token`, `stream_args` refuse).
    """

    packed: ClassVar[bool] = False

    spec: "QuantSpec"
    head_dim: int
    codes: tuple[torch.Tensor, ...]
    scale: torch.Tensor
    split: torch.Tensor | None

    @classmethod
    def allocate(cls, spec, shape, device, dtype, split=None) -> "TurboBody":
        """Zeroed storage for `shape` = (B, Hkv, N, D)."""
        b, hkv, n, d = shape
        sets = spec.layout.sets(d)
        if spec.split_channels:
            if split is None:
                raise ValueError(
                    "a turboquant spec with split_channels needs this layer's outlier channels: "
                    "put them in KVParams.key_split / value_split"
                )
            split = split.to(device=device, dtype=torch.int64).contiguous()
        codes = tuple(
            torch.zeros(b, hkv, n, packed_size(c, bits), device=device, dtype=torch.uint8)
            for c, bits in sets
        )
        scale = torch.zeros(b, hkv, n, len(sets), device=device, dtype=dtype)
        return cls(spec, d, codes, scale, split if spec.split_channels else None)

    @property
    def kind(self) -> Kind:
        return self.spec.layout.kind

    @property
    def slots(self) -> int:
        return self.scale.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this body holds (what its memory is)."""
        return [*self.codes, self.scale, *([self.split] if self.split is not None else [])]

    def per_token(self) -> dict[str, torch.Tensor]:
        raise ValueError("a 'turboquant' body is read by the reference path only: it is not paged")

    def with_rows(self, rows: dict[str, torch.Tensor]) -> "TurboBody":
        raise ValueError("a 'turboquant' body is read by the reference path only: it is not paged")

    def stream_args(self, head_dim: int, unit) -> None:
        raise ValueError("the decode kernel does not read TurboQuant's numerics (layout.decoded)")

    def view(self, b: int) -> "TurboBody":
        """Sequence b alone (B = 1), sharing storage."""
        codes = tuple(c[b : b + 1] for c in self.codes)
        return TurboBody(self.spec, self.head_dim, codes, self.scale[b : b + 1], self.split)

    def write(self, x: torch.Tensor, seq: torch.Tensor, start: torch.Tensor, active=None) -> None:
        """Quantize x [M, Hkv, n, D] into positions [start[m], start[m] + n) of sequence seq[m]
        (slot = position % N: a ring for a sliding-window layer); `active` bool [M] (default
        all) says which blocks write. A reference path: it reads seq/start on the host."""
        n, slots = x.shape[2], self.scale.shape[2]
        active = [True] * len(x) if active is None else active.tolist()
        for xm, b, s, on in zip(x, seq.tolist(), start.tolist(), active, strict=True):
            if not on:
                continue
            q = quantize(xm, self.spec, self.split)
            where = torch.arange(s, s + n, device=x.device) % slots
            first = 0
            for buf, (c, bits) in zip(
                self.codes, self.spec.layout.sets(self.head_dim), strict=True
            ):
                buf[b, :, where] = pack(q.codes[..., first : first + c], bits)
                first += c
            self.scale[b, :, where] = q.scale[..., 0]

    flush = flush_by_write

    def dequantize(
        self, dtype: torch.dtype, b: int | None = None, n: int | None = None, start: int = 0
    ):
        """Slots [start, n) (default all) of sequence b (default every sequence) in plain torch:
        [B, Hkv, n - start, D] ([Hkv, n - start, D] for one sequence). The inverse rotation is
        a matrix product (`from_levels`): a slot read in another span may round differently
        in the last bit; `levels` and `finish` read a span as a read of [0, n) does."""
        rows = slice(None) if b is None else slice(b, b + 1)
        n = self.scale.shape[2] if n is None else n
        sets = zip(self.codes, self.spec.layout.sets(self.head_dim), strict=True)
        codes = [unpack(buf[rows, :, start:n], bits, c) for buf, (c, bits) in sets]
        q = QTensor(torch.cat(codes, -1), self.scale[rows, :, start:n, :, None], None)
        out = dequantize(q, self.spec, self.split).to(dtype)
        return out if b is None else out[0]

    def levels(self, b: int, n: int, start: int = 0) -> list[torch.Tensor]:
        """Per set, slots [start, n) of sequence b as the levels their codes index, float32
        [Hkv, n - start, n_s]: each slot alone, the same whatever the span (`finish` ends the
        read)."""
        sets = zip(self.codes, self.spec.layout.sets(self.head_dim), strict=True)
        return set_levels([unpack(buf[b, :, start:n], bits, c) for buf, (c, bits) in sets],
                          self.spec)  # fmt: skip

    def finish(self, ys: list[torch.Tensor], b: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots [0, n) of sequence b from every set's levels of those slots (`levels`, each
        [Hkv, n, n_s]): bit for bit `dequantize(dtype, b, n)` (the same products, over the
        same rows)."""
        n = ys[0].shape[1]
        scale = self.scale[b : b + 1, :, :n, :, None]
        out = from_levels([y[None] for y in ys], scale, self.spec, self.split)
        return out.to(dtype)[0]


@register
class TurboSets(Layout):
    name = method = "turboquant"
    affine = False
    calibrates = (SPLIT,)
    bits = TURBO_BITS

    def check(self) -> None:
        super().check()
        spec = self.spec
        if spec.granularity != "token" or spec.group_size:
            raise ValueError(
                "method 'turboquant' quantizes whole heads: granularity 'token', group_size 0"
            )
        if (spec.split_channels > 0) != (spec.split_bits > 0) or spec.split_channels < 0:
            raise ValueError("an outlier set needs both split_channels >= 1 and split_bits")
        more = spec.split_bits in TURBO_BITS and spec.split_bits > spec.bits
        if spec.split_bits and not more:
            raise ValueError(
                f"split_bits = {spec.split_bits}: the outlier set gets more bits than the "
                f"rest ({spec.bits}), one of {TURBO_BITS}"
            )

    def kept_widths(self, head_dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """Each set's levels in float32: the inverse rotation is a matrix product whose BLAS
        rounding depends on how many rows it multiplies, so it runs over the whole body."""
        return [(n, torch.float32) for n, _ in self.sets(head_dim)]

    def kept(self, body, b: int, n: int, start: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return body.levels(b, n, start)

    def from_kept(self, body, kept: list[torch.Tensor], b: int, dtype: torch.dtype):
        return body.finish(kept, b, dtype)

    def sets(self, n: int) -> tuple[tuple[int, int], ...]:
        """((channels, bits), ...) of each set of a vector of n channels, the outlier set
        first."""
        spec = self.spec
        if not spec.split_channels:
            return ((n, spec.bits),)
        if not 2 <= spec.split_channels <= n - 2:
            raise ValueError(
                f"split_channels = {spec.split_channels}: leave at least 2 channels in each set "
                f"of a vector of {n}"
            )
        return ((spec.split_channels, spec.split_bits), (n - spec.split_channels, spec.bits))

    def calibrated(self, kv_heads: int, head_dim: int) -> dict[str, tuple]:
        n = self.spec.split_channels
        return {SPLIT.argument: ((kv_heads, n), SPLIT.dtype)} if n else {}

    def check_head(self, head_dim: int, kv_heads: int | None = None) -> None:
        self.sets(head_dim)

    def row_group(self, width: int) -> int:
        return width

    def slots(self, n: int) -> int:
        return 0

    def quantize(self, x, *, static_range=None, codebook=None, exclude=None, split=None):
        return quantize(x, self.spec, split)

    def dequantize(self, q: QTensor, *, codebook=None, split=None) -> torch.Tensor:
        return dequantize(q, self.spec, split)

    def allocate(self, shape, device, dtype, *, static_range=None, codebook=None, split=None):
        return TurboBody.allocate(self.spec, shape, device, dtype, split)
