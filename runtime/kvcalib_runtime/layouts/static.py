"""granularity "static": one range per channel, calibrated offline (KVQuant's keys;
KVParams.key_range / value_range, float32 [Hkv, D] each); exact slots are `outlier_slots` per
row. A body holds the range and its metadata (dtype [Hkv, D]) once per layer; reference-form
metadata broadcasts to [..., 1, D]."""

import torch

from kvcalib_runtime.layouts.affine import AffineLayout
from kvcalib_runtime.layouts.base import CODEBOOK, RANGE, Kind, register


@register
class StaticChannels(AffineLayout):
    name = "static"
    kind = Kind.STATIC
    calibrates = (RANGE, CODEBOOK)

    def check(self) -> None:
        super().check()
        spec = self.spec
        if spec.group_size != 0:
            raise ValueError("granularity 'static' has one range per channel: drop group_size")
        if spec.outliers and not spec.outlier_slots >= 1:
            raise ValueError(
                "static outliers are kept in outlier_slots exact slots per vector: set "
                "outlier_slots >= 1 (recipes set it as outlier_slots)"
            )

    def metadata_group(self, width: int) -> int:
        return 0

    def slots(self, n: int) -> int:
        return self.spec.outlier_slots if self.spec.outliers else 0

    def expand(self, param: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return param.expand(shape)

    def ranges(self, xf, static_range, exclude):
        if static_range is None:
            raise ValueError("granularity 'static' needs calibrated ranges: pass static_range")
        lo, hi = (r.float() for r in static_range)
        return lo, hi, lo, hi

    def metadata_index(self, body, start, pos, n):
        return None

    def read_metadata(self, t: torch.Tensor, rows: slice, n: int, start: int = 0) -> torch.Tensor:
        return t[None, :, None, :]

    def metadata_buffers(self, rows, device, dtype, static_range):
        if static_range is None:
            raise ValueError(
                "granularity 'static' needs its calibrated range: put (lo, hi) for this layer in "
                "KVParams.key_range / value_range"
            )
        # Computed where the range lies, then moved: arithmetic on the meta device (every memory
        # plan) would import torch's Python meta kernels, seconds of CPU for nothing.
        lo, hi = (r.to(torch.float32) for r in static_range)
        scale, offset = self.metadata(lo, hi, dtype)
        scale, offset, lo, hi = (
            None if t is None else t.to(device).contiguous() for t in (scale, offset, lo, hi)
        )
        return scale, offset, (lo, hi)
