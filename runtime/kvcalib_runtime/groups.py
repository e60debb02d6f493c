"""How a QuantSpec cuts a KV tensor [..., T, D] into groups (kvcalib_runtime.quant's module
docstring defines them), and each group's data range. Shared by the quantizers and by the
calibration that fits codebooks in the quantizers' own normalized domain."""

import torch


def to_vector(x: torch.Tensor) -> torch.Tensor:
    """[..., H, T, D] -> [..., 1, T, H * D]: every head of a token as one vector."""
    h, t, d = x.shape[-3:]
    return x.transpose(-3, -2).reshape(*x.shape[:-3], 1, t, h * d)


def from_vector(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `to_vector`: [..., 1, T, H * D] -> [..., H, T, D]."""
    t, n = x.shape[-2:]
    return x.reshape(*x.shape[:-3], t, heads, n // heads).transpose(-3, -2)


def group(x: torch.Tensor, spec) -> torch.Tensor:
    """View x [..., T, D] as its groups, elements last: [..., T, D/g, g] ("token", "vector") or
    [..., ceil(T/g), D, g] ("channel", T zero-padded to a multiple of g)."""
    t, d = x.shape[-2:]
    if spec.granularity != "channel":
        g = spec.channel_group(d)
        return x.reshape(*x.shape[:-1], d // g, g)
    g = spec.group_size
    x = torch.nn.functional.pad(x, (0, 0, 0, (-t) % g))
    return x.reshape(*x.shape[:-2], -1, g, d).transpose(-1, -2)


def ungroup(y: torch.Tensor, spec, shape: torch.Size) -> torch.Tensor:
    """Inverse of `group` for a full group-shaped tensor (padding dropped)."""
    t, d = shape[-2:]
    if spec.granularity != "channel":
        return y.reshape(shape)
    return y.transpose(-1, -2).reshape(*shape[:-2], -1, d)[..., :t, :]


def expand(param: torch.Tensor, spec, shape: torch.Size) -> torch.Tensor:
    """Broadcast a group-shaped parameter back to the element shape [..., T, D]."""
    if spec.granularity == "static":
        return param.expand(shape)
    g = spec.group_size if spec.granularity == "channel" else spec.channel_group(shape[-1])
    return ungroup(param.expand(*param.shape[:-1], g), spec, shape)


def group_range(x: torch.Tensor, spec, exclude: torch.Tensor | None):
    """Per-group (lo, hi) in group shape: min and max, or with k = outliers_per_side the
    (k+1)-th smallest and largest. "channel" groups take their range over kept tokens only:
    excluded (kept-exact sinks) and padded tokens never widen it."""
    g = group(x, spec)
    if spec.granularity != "channel":
        k = spec.outliers_per_side(g.shape[-1])
        if k == 0:
            return g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        lo = g.kthvalue(k + 1, dim=-1, keepdim=True).values
        hi = g.kthvalue(g.shape[-1] - k, dim=-1, keepdim=True).values
        return lo, hi
    keep = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    if exclude is not None:
        keep = keep & ~exclude
    keep = group(keep.unsqueeze(-1).expand(x.shape).to(x.dtype), spec).bool()  # padding: False
    lo = torch.where(keep, g, torch.inf).amin(-1, keepdim=True)
    hi = torch.where(keep, g, -torch.inf).amax(-1, keepdim=True)
    empty = ~keep.any(-1, keepdim=True)
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
