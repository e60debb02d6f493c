"""granularity "token": groups of `group_size` consecutive channels inside one token of one head
(group_size 0: the whole head, per-token quantization; KIVI's values). Metadata per group of a
row: scale (and offset) [..., T, D/g, 1] in reference form, [B, Hkv, N, D/g] in a body."""

import torch

from kvcalib_runtime.layouts.affine import AffineLayout
from kvcalib_runtime.layouts.base import register


@register
class TokenGroups(AffineLayout):
    name = "token"

    def check(self) -> None:
        super().check()
        if self.spec.outliers and self.spec.group_size > 256:
            raise ValueError("outliers are indexed by one byte: use group_size <= 256 with them")

    def check_head(self, head_dim: int, kv_heads: int | None = None) -> None:
        if kv_heads is not None or not self.joins_heads:
            self.row_group(self.width(head_dim, kv_heads or 1))

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """[..., T, D] -> [..., T, D/g, g]."""
        d = x.shape[-1]
        g = self.row_group(d)
        return x.reshape(*x.shape[:-1], d // g, g)

    def ungroup(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return y.reshape(shape)

    def expand(self, param: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        g = self.row_group(shape[-1])
        return self.ungroup(param.expand(*param.shape[:-1], g), shape)

    def group_range(self, x: torch.Tensor, exclude: torch.Tensor | None):
        """min and max of each group, or with k = outliers_per_side the (k+1)-th smallest and
        largest."""
        g = self.group(x)
        k = self.outliers_per_side(g.shape[-1])
        if k == 0:
            return g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        lo = g.kthvalue(k + 1, dim=-1, keepdim=True).values
        hi = g.kthvalue(g.shape[-1] - k, dim=-1, keepdim=True).values
        return lo, hi
