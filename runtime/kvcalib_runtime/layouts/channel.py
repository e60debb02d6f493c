"""granularity "channel": groups of `group_size` consecutive tokens inside one channel (KIVI's
keys), aligned to absolute token index; a body keeps one metadata row per token group:
scale (and offset) [..., ceil(T/G), D, 1] in reference form, [B, Hkv, ceil(N/G), D] in a body.
Tokens move into the body a whole group at a time."""

import torch

from kvcalib_runtime.layouts.affine import AffineLayout
from kvcalib_runtime.layouts.base import Kind, register


@register
class ChannelGroups(AffineLayout):
    name = "channel"
    kind = Kind.CHANNEL

    def check(self) -> None:
        super().check()
        if self.spec.group_size <= 0:
            raise ValueError("granularity 'channel' groups tokens: set group_size > 0 (KIVI: 32)")
        if self.spec.outliers:
            raise ValueError(
                "outliers are kept in slots per token: use granularity 'token', 'vector' or "
                "'static' with them, or outliers = 0 for 'channel'"
            )

    def row_group(self, width: int) -> int:
        return width

    def token_group(self) -> int:
        return self.spec.group_size

    def metadata_group(self, width: int) -> int:
        return self.spec.group_size

    def slots(self, n: int) -> int:
        return 0

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """[..., T, D] -> [..., ceil(T/G), D, G], T zero-padded to a multiple of G."""
        t, d = x.shape[-2:]
        g = self.spec.group_size
        x = torch.nn.functional.pad(x, (0, 0, 0, (-t) % g))
        return x.reshape(*x.shape[:-2], -1, g, d).transpose(-1, -2)

    def ungroup(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Padding dropped."""
        t, d = shape[-2:]
        return y.transpose(-1, -2).reshape(*shape[:-2], -1, d)[..., :t, :]

    def expand(self, param: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return self.ungroup(param.expand(*param.shape[:-1], self.spec.group_size), shape)

    def group_range(self, x: torch.Tensor, exclude: torch.Tensor | None):
        """min and max over the kept tokens only: excluded (kept-exact sinks) and padded tokens
        never widen a range."""
        g = self.group(x)
        keep = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
        if exclude is not None:
            keep = keep & ~exclude
        keep = self.group(keep.unsqueeze(-1).expand(x.shape).to(x.dtype)).bool()  # padding: False
        lo = torch.where(keep, g, torch.inf).amin(-1, keepdim=True)
        hi = torch.where(keep, g, -torch.inf).amax(-1, keepdim=True)
        empty = ~keep.any(-1, keepdim=True)
        return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)

    def metadata_shape(self, b: int, heads: int, n: int, width: int) -> tuple[int, ...]:
        return (b, heads, -(-n // self.spec.group_size), width)

    def metadata_index(self, body, start: torch.Tensor, pos: torch.Tensor, n: int):
        g, rows = self.spec.group_size, body.scale.shape[2]
        return (start[:, None] // g + torch.arange(n // g, device=start.device)) % rows

    def read_metadata(self, t: torch.Tensor, rows: slice, n: int, start: int = 0) -> torch.Tensor:
        g = self.spec.group_size
        return t[rows, :, start // g : -(-n // g), :, None]
