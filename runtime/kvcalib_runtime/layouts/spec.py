"""`QuantSpec`, the closed description of how one KV tensor is quantized (its fields are defined
in layouts.quant's module docstring). A spec's `layout` is what its fields select in the
registry (layouts.base): the stored layout that checks them, quantizes, stores and is read by
the kernels. A leaf of the package: it imports only layouts.base."""

import functools
import math
from dataclasses import dataclass

from kvcalib_runtime.layouts.base import (
    MAX_SLOTS,
    PAIRINGS,
    Layout,
    bind,
    granularities,
    methods,
)

SLOT_RULES = ("outside", "error")
SLOT_CODES = ("exact", "fp8")
METADATA_CODES = ("dtype", "byte")

__all__ = ["METADATA_CODES", "SLOT_CODES", "SLOT_RULES", "QuantSpec", "choices"]


def choices() -> dict[str, tuple[str, ...]]:
    """The values each enumerated QuantSpec field takes: the registry's granularities and
    methods, and the tables above."""
    return {
        "granularity": granularities(),
        "slot_rule": SLOT_RULES,
        "slot_code": SLOT_CODES,
        "method": methods(),
        "pairing": PAIRINGS,
        "metadata_code": METADATA_CODES,
    }


@dataclass(frozen=True)
class QuantSpec:
    """How one KV tensor (keys or values of one layer) is quantized; see the module docstring.

    outlier_slots: "static" only, the K exact slots per vector (required when outliers > 0);
    dynamic groups derive K from `outliers` (`layout.slots`). slot_rule: which elements get
    them. slot_code: how a slot's delta is stored, "exact" (the cache's dtype) or "fp8" (one
    E4M3 byte in steps of its channel's scale, layouts.fp8; "static" only). method: "affine",
    "ggml", "turboquant" or "vq" (quant's module docstring). split_channels, split_bits:
    "turboquant" only, the outlier set's size and bits (0, 0: the whole head is one set).
    pairing: "vq" only, which channels form a vector of group_size ("adjacent" or "rope":
    RoPE's pairs, layouts.vq). metadata_code: how a group's scale and offset are stored,
    "dtype" (the cache's) or "byte" (one byte each, layouts.metabyte; per-token groups only).
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
    slot_code: str = "exact"
    method: str = "affine"
    split_channels: int = 0
    split_bits: int = 0
    pairing: str = "adjacent"
    metadata_code: str = "dtype"

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
        layout = self.layout
        if self.bits not in layout.bits:
            raise ValueError(f"bits = {self.bits} is not supported: use one of {layout.bits}")
        if self.group_size < 0:
            raise ValueError(f"group_size = {self.group_size} must be >= 0")
        if not 0.0 < self.clip <= 1.0:
            raise ValueError(f"clip = {self.clip} must be in (0, 1]")
        if self.pairing not in PAIRINGS:
            raise ValueError(f"pairing = {self.pairing!r} is unknown: use one of {PAIRINGS}")
        if self.codebook and self.bits > 4 and not layout.vectors:
            raise ValueError(f"codebook with bits = {self.bits}: codebooks are for 2-4 bits")
        if not 0.0 <= self.outliers < 0.5:
            raise ValueError(f"outliers = {self.outliers} is a fraction: use 0 <= outliers < 0.5")
        if self.slot_rule not in SLOT_RULES:
            raise ValueError(f"slot_rule = {self.slot_rule!r} is unknown: use one of {SLOT_RULES}")
        if self.slot_code not in SLOT_CODES:
            raise ValueError(f"slot_code = {self.slot_code!r} is unknown: use one of {SLOT_CODES}")
        if self.metadata_code not in METADATA_CODES:
            raise ValueError(
                f"metadata_code = {self.metadata_code!r} is unknown: use one of {METADATA_CODES}"
            )
        if self.outlier_slots > MAX_SLOTS:
            raise ValueError(f"outlier_slots = {self.outlier_slots}: use at most {MAX_SLOTS}")
        layout.check()

    @functools.cached_property
    def layout(self) -> Layout:
        """The stored layout these fields select, bound to this spec."""
        return bind(self)

    @property
    def levels(self) -> int:
        return 2**self.bits
