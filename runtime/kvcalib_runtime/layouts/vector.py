"""granularity "vector": one token of every KV head joined into one row of H * D channels
(KVQuant's values), then grouped as "token" groups are; a body stores one row per token
(heads = 1). Reference form: codes [..., 1, T, H * D], QTensor.heads = H."""

import torch

from kvcalib_runtime.layouts.base import register
from kvcalib_runtime.layouts.token import TokenGroups


def to_vector(x: torch.Tensor) -> torch.Tensor:
    """[..., H, T, D] -> [..., 1, T, H * D]: every head of a token as one vector."""
    h, t, d = x.shape[-3:]
    return x.transpose(-3, -2).reshape(*x.shape[:-3], 1, t, h * d)


def from_vector(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `to_vector`: [..., 1, T, H * D] -> [..., H, T, D]."""
    t, n = x.shape[-2:]
    return x.reshape(*x.shape[:-3], t, heads, n // heads).transpose(-3, -2)


@register
class VectorGroups(TokenGroups):
    name = "vector"
    joins_heads = True

    def width(self, head_dim: int, kv_heads: int = 1) -> int:
        return head_dim * kv_heads

    def row_heads(self, kv_heads: int) -> int:
        return 1

    def to_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        return to_vector(x.float()), x.shape[-3]

    def dequantize(self, q, *, codebook=None, split=None) -> torch.Tensor:
        return from_vector(super().dequantize(q, codebook=codebook), q.heads)
