"""The types of kvcalib_runtime.quant: `QuantSpec`, the closed description of how one KV tensor
is quantized (its fields are defined in quant's module docstring), and `QTensor`, a quantized
tensor in reference form."""

import math
from dataclasses import dataclass

import torch

GRANULARITIES = ("token", "channel", "static", "vector")
SLOT_RULES = ("outside", "error")
METHODS = ("affine", "ggml", "turboquant")
GGML_GROUP = 32  # llama.cpp's QK4_0 = QK8_0
TURBO_BITS = (1, 2, 3, 4, 5)  # Lloyd-Max tables TurboQuant's sets use
BITS = (2, 3, 4, 5, 6, 8)
METADATA_BITS = 16  # scales, offsets and exact values in an fp16/bf16 cache
MAX_SLOTS = 64  # exact slots per vector: beyond this dense storage is cheaper


def slot_index_dtype(n: int) -> torch.dtype:
    """The dtype of a slot's channel index in a vector of n channels."""
    return torch.uint8 if n <= 256 else torch.int16


@dataclass(frozen=True)
class QuantSpec:
    """How one KV tensor (keys or values of one layer) is quantized; see the module docstring.

    outlier_slots: "static" only, the K exact slots per vector (required when outliers > 0);
    dynamic groups derive K from `outliers` (`slots`). slot_rule: which elements get them.
    method: "affine", "ggml" or "turboquant" (module docstring). split_channels, split_bits:
    "turboquant" only, the outlier set's size and bits (0, 0: the whole head is one set).
    """

    bits: int
    granularity: str = "token"
    group_size: int = 0
    symmetric: bool = False
    clip: float = 1.0
    codebook: bool = False
    outliers: float = 0.0
    outlier_slots: int = 0
    slot_rule: str = "outside"
    method: str = "affine"
    split_channels: int = 0
    split_bits: int = 0

    def __post_init__(self):
        for name in ("bits", "group_size", "outlier_slots", "split_channels", "split_bits"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} = {v!r} must be an integer")
        for name in ("symmetric", "codebook"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} = {getattr(self, name)!r} must be true or false")
        for name in ("clip", "outliers"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} = {v!r} must be a finite number")
        allowed = TURBO_BITS if self.method == "turboquant" else BITS
        if self.bits not in allowed:
            raise ValueError(f"bits = {self.bits} is not supported: use one of {allowed}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"granularity = {self.granularity!r} is unknown: use one of {GRANULARITIES}"
            )
        if self.granularity == "channel" and self.group_size <= 0:
            raise ValueError("granularity 'channel' groups tokens: set group_size > 0 (KIVI: 32)")
        if self.granularity == "static" and self.group_size != 0:
            raise ValueError("granularity 'static' has one range per channel: drop group_size")
        if self.group_size < 0:
            raise ValueError(f"group_size = {self.group_size} must be >= 0")
        if not 0.0 < self.clip <= 1.0:
            raise ValueError(f"clip = {self.clip} must be in (0, 1]")
        if self.codebook and self.bits > 4:
            raise ValueError(f"codebook with bits = {self.bits}: codebooks are for 2-4 bits")
        if not 0.0 <= self.outliers < 0.5:
            raise ValueError(f"outliers = {self.outliers} is a fraction: use 0 <= outliers < 0.5")
        if self.outliers and self.granularity == "channel":
            raise ValueError(
                "outliers are kept in slots per token: use granularity 'token', 'vector' or "
                "'static' with them, or outliers = 0 for 'channel'"
            )
        if self.outliers and self.group_size > 256:
            raise ValueError("outliers are indexed by one byte: use group_size <= 256 with them")
        if self.granularity == "static" and self.outliers and not self.outlier_slots >= 1:
            raise ValueError(
                "static outliers are kept in outlier_slots exact slots per vector: set "
                "outlier_slots >= 1 (recipes set it as outlier_slots)"
            )
        if self.outlier_slots and (self.granularity != "static" or not self.outliers):
            raise ValueError(
                "outlier_slots is for 'static' granularity with outliers > 0; dynamic groups "
                "keep ceil(outliers * group / 2) at each end"
            )
        if self.slot_rule not in SLOT_RULES:
            raise ValueError(f"slot_rule = {self.slot_rule!r} is unknown: use one of {SLOT_RULES}")
        if self.outlier_slots > MAX_SLOTS:
            raise ValueError(f"outlier_slots = {self.outlier_slots}: use at most {MAX_SLOTS}")
        self._check_method()

    def _check_method(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method = {self.method!r} is unknown: use one of {METHODS}")
        if (self.split_channels or self.split_bits) and self.method != "turboquant":
            raise ValueError("split_channels / split_bits are TurboQuant's: set method turboquant")
        if self.method == "affine":
            return
        changed = [
            name
            for name in ("clip", "codebook", "outliers", "outlier_slots", "slot_rule")
            if getattr(self, name) != QuantSpec.__dataclass_fields__[name].default
        ]
        if not self.symmetric or changed:
            raise ValueError(
                f"method {self.method!r} has its own numerics: set symmetric = true and leave "
                f"{', '.join(changed) or 'clip, codebook, outliers'} at the default"
            )
        if self.method == "ggml" and (
            self.bits not in (4, 8) or self.granularity != "token" or self.group_size != GGML_GROUP
        ):
            raise ValueError(
                f"method 'ggml' is llama.cpp's q4_0 / q8_0: bits 4 or 8, granularity 'token', "
                f"group_size {GGML_GROUP}"
            )
        if self.method == "turboquant":
            if self.granularity != "token" or self.group_size:
                raise ValueError(
                    "method 'turboquant' quantizes whole heads: granularity 'token', group_size 0"
                )
            if (self.split_channels > 0) != (self.split_bits > 0) or self.split_channels < 0:
                raise ValueError("an outlier set needs both split_channels >= 1 and split_bits")
            more = self.split_bits in TURBO_BITS and self.split_bits > self.bits
            if self.split_bits and not more:
                raise ValueError(
                    f"split_bits = {self.split_bits}: the outlier set gets more bits than the "
                    f"rest ({self.bits}), one of {TURBO_BITS}"
                )

    def sets(self, n: int) -> tuple[tuple[int, int], ...]:
        """ "turboquant": ((channels, bits), ...) of each set of a vector of n channels, the
        outlier set first."""
        if not self.split_channels:
            return ((n, self.bits),)
        if not 2 <= self.split_channels <= n - 2:
            raise ValueError(
                f"split_channels = {self.split_channels}: leave at least 2 channels in each set "
                f"of a vector of {n}"
            )
        return ((self.split_channels, self.split_bits), (n - self.split_channels, self.bits))

    @property
    def levels(self) -> int:
        return 2**self.bits

    def channel_group(self, head_dim: int) -> int:
        """Channels per group for "token" / "vector" granularity (the whole vector when
        group_size is 0); head_dim is the vector's length."""
        g = self.group_size or head_dim
        if head_dim % g:
            raise ValueError(f"group_size = {g} does not divide head_dim = {head_dim}")
        return g

    def outliers_per_side(self, group_numel: int) -> int:
        return math.ceil(self.outliers * group_numel / 2) if self.outliers > 0 else 0

    def vector_size(self, head_dim: int, kv_heads: int = 1) -> int:
        """Channels of one vector: one head's, or every head's for "vector"."""
        return head_dim * kv_heads if self.granularity == "vector" else head_dim

    def slots(self, n: int) -> int:
        """K, the exact slots of a vector of n channels (see the module docstring)."""
        if not self.outliers:
            return 0
        if self.granularity == "static":
            return self.outlier_slots
        g = self.channel_group(n)
        return n // g * 2 * self.outliers_per_side(g)

    def bits_per_element(self, head_dim: int, tokens: int, kv_heads: int = 1) -> float:
        """Storage per element of a body of `tokens` tokens in an fp16 cache: codes, metadata
        (per group; "static" ranges amortized over the tokens) and outlier slots (index +
        delta). Codebooks are per-layer constants: `scheme.storage_bits` counts those."""
        n = self.vector_size(head_dim, kv_heads)
        meta = METADATA_BITS * (1 if self.symmetric else 2)
        if self.method == "turboquant":
            sets = self.sets(n)
            return sum(c * b + METADATA_BITS for c, b in sets) / n
        if self.granularity in ("token", "vector"):
            total = self.bits + meta / self.channel_group(n)
        elif self.granularity == "channel":
            total = self.bits + meta / self.group_size
        else:
            total = self.bits + meta / max(tokens, 1)
        index_bits = torch.empty((), dtype=slot_index_dtype(n)).element_size() * 8
        return total + self.slots(n) * (index_bits + METADATA_BITS) / n


@dataclass
class QTensor:
    """A quantized [..., T, D] tensor in reference (unpacked) form.

    codes:       uint8 [..., T, D], values < 2**bits ("vector": [..., 1, T, H * D]; "turboquant":
                 the outlier set's codes first, see kvcalib_runtime.turboquant)
    scale:       x.dtype, group-shaped: [..., T, D/g, 1] ("token", "vector"; "turboquant":
                 [..., T, S, 1], the norms of the S sets),
                 [..., ceil(T/g), D, 1] ("channel"), or broadcastable to [..., 1, D] ("static")
    offset:      like scale, or None when symmetric
    slot_index:  [..., T, K] channel of each exact slot (see the module docstring), or None
    slot_delta:  x.dtype [..., T, K] what the slot adds back, or None
    heads:       H for "vector" (codes hold the heads joined), else None
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    slot_index: torch.Tensor | None = None
    slot_delta: torch.Tensor | None = None
    heads: int | None = None
