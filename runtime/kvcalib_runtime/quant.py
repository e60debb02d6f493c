"""Reference quantizers for KV tensors — the single source of truth for kvcalib's numerics.

Every tensor here is laid out [..., T, D]: T tokens, D channels of one head (typically
[B, H, T, D]). One `QuantSpec` says how such a tensor is cut into groups, each group getting
its own range:

    granularity "token"    groups of `group_size` consecutive channels inside one token
                           (group_size 0 = the whole head: per-token quantization)
    granularity "channel"  groups of `group_size` consecutive tokens inside one channel
                           (KIVI's keys), aligned to absolute token index
    granularity "static"   one range per channel, calibrated offline (KVQuant's keys)

Every group is dequantized as  x_hat = offset + scale * level[code]:

    uniform, asymmetric  (KIVI)   scale = (max - min) / (2^b - 1), code = round((x - min) / scale),
                                  level[c] = c, offset = min (a float, not an integer zero point)
    uniform, symmetric            scale = absmax / (2^(b-1) - 1), level[c] = c - (2^(b-1) - 1),
                                  no offset
    codebook, asymmetric          scale = max - min, offset = min, level = sorted table in [0, 1]
    codebook, symmetric           scale = absmax, level = sorted table in [-1, 1]

`clip` shrinks min/max (or absmax) towards zero before the scale is taken (QuaRot's clip
ratio). With `outliers = f > 0` (dense-and-sparse, KVQuant) the extremes of each group are kept
exactly and the range is taken over the rest: ceil(f * n / 2) elements at each end of a dynamic
group of n, or everything outside the calibrated [min, max] for "static".

Scale and offset are rounded to the input's dtype before codes are computed (fp16 metadata in
an fp16 cache, as KIVI does); codes are computed in fp32 from the rounded metadata.
"""

import math
from dataclasses import dataclass

import torch

GRANULARITIES = ("token", "channel", "static")
BITS = (2, 3, 4, 5, 6, 8)
METADATA_BITS = 16  # scales, offsets, codebook levels and exact values are stored as fp16/bf16
OUTLIER_BITS = 24  # one kept outlier: fp16 value + 8-bit position in its group or token row
OUTLIER_COUNT_BITS = 8  # "static" outliers vary per token: one count per token and head


@dataclass(frozen=True)
class QuantSpec:
    """How one KV tensor (keys or values of one layer) is quantized; see the module docstring."""

    bits: int
    granularity: str = "token"
    group_size: int = 0
    symmetric: bool = False
    clip: float = 1.0
    codebook: bool = False
    outliers: float = 0.0

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"bits = {self.bits} is not supported: use one of {BITS}")
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
        if self.outliers and self.group_size > 256:
            raise ValueError("outliers are indexed by one byte: use group_size <= 256 with them")

    @property
    def levels(self) -> int:
        return 2**self.bits

    def channel_group(self, head_dim: int) -> int:
        """Channels per group for "token" granularity (the whole head when group_size is 0)."""
        g = self.group_size or head_dim
        if head_dim % g:
            raise ValueError(f"group_size = {g} does not divide head_dim = {head_dim}")
        return g

    def outliers_per_side(self, group_numel: int) -> int:
        return math.ceil(self.outliers * group_numel / 2) if self.outliers > 0 else 0

    def bits_per_element(self, head_dim: int, tokens: int, outlier_fraction: float = 0.0) -> float:
        """Storage per element of a body of `tokens` tokens: codes + metadata + codebook + outliers.

        `outlier_fraction` is the measured fraction for "static" (it depends on the data); dynamic
        groups keep a fixed count, computed here.
        """
        meta = METADATA_BITS * (1 if self.symmetric else 2)
        if self.granularity == "token":
            group = self.channel_group(head_dim)
        elif self.granularity == "channel":
            group = self.group_size
        else:
            group = max(tokens, 1)
        total = self.bits + meta / group
        if self.codebook:
            total += self.levels * METADATA_BITS / (max(tokens, 1) * head_dim)
        if self.granularity == "static":
            if self.outliers > 0:
                total += outlier_fraction * OUTLIER_BITS + OUTLIER_COUNT_BITS / head_dim
        else:
            total += 2 * self.outliers_per_side(group) * OUTLIER_BITS / group
        return total


@dataclass
class QTensor:
    """A quantized [..., T, D] tensor in reference (unpacked) form.

    codes:   uint8 [..., T, D], values < 2**bits
    scale:   x.dtype, group-shaped: [..., T, D/g, 1] ("token"), [..., ceil(T/g), D, 1]
             ("channel"), or broadcastable to [..., 1, D] ("static")
    offset:  like scale, or None when symmetric
    exact:   bool [..., T, D] marking outliers kept exactly, or None
    values:  x.dtype [..., T, D], the exact values where `exact` (zero elsewhere), or None
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    exact: torch.Tensor | None
    values: torch.Tensor | None


def _group(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View x [..., T, D] as its groups, elements last: [..., T, D/g, g] ("token") or
    [..., ceil(T/g), D, g] ("channel", T zero-padded to a multiple of g)."""
    t, d = x.shape[-2:]
    if spec.granularity == "token":
        g = spec.channel_group(d)
        return x.reshape(*x.shape[:-1], d // g, g)
    g = spec.group_size
    x = torch.nn.functional.pad(x, (0, 0, 0, (-t) % g))
    return x.reshape(*x.shape[:-2], -1, g, d).transpose(-1, -2)


def _ungroup(y: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    """Inverse of `_group` for a full group-shaped tensor (padding dropped)."""
    t, d = shape[-2:]
    if spec.granularity == "token":
        return y.reshape(shape)
    return y.transpose(-1, -2).reshape(*shape[:-2], -1, d)[..., :t, :]


def _expand(param: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    """Broadcast a group-shaped parameter back to the element shape [..., T, D]."""
    if spec.granularity == "static":
        return param.expand(shape)
    g = spec.channel_group(shape[-1]) if spec.granularity == "token" else spec.group_size
    return _ungroup(param.expand(*param.shape[:-1], g), spec, shape)


def _lookup(codebook: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Levels of per-layer [L] or per-head [H, L] codebooks; codes [..., H, T, D]."""
    codes = codes.long()
    if codebook.dim() == 1:
        return codebook[codes]
    heads, n = codebook.shape
    base = torch.arange(heads, device=codes.device).view(heads, 1, 1) * n
    return codebook.reshape(-1)[codes + base]


def _group_range(x: torch.Tensor, spec: QuantSpec, exclude: torch.Tensor | None):
    """Per-group (lo, hi) in group shape, and the outlier mask in element shape (or None).

    "channel" groups take their range over kept tokens only: excluded (kept-exact sinks) and
    padded tokens neither widen it nor count as outliers."""
    g = _group(x, spec)
    k = spec.outliers_per_side(g.shape[-1])
    if spec.granularity != "channel":
        if k == 0:
            return g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), None
        lo = g.kthvalue(k + 1, dim=-1, keepdim=True).values
        hi = g.kthvalue(g.shape[-1] - k, dim=-1, keepdim=True).values
        return lo, hi, _ungroup((g < lo) | (g > hi), spec, x.shape)
    keep = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    if exclude is not None:
        keep = keep & ~exclude
    keep = _group(keep.unsqueeze(-1).expand(x.shape).to(x.dtype), spec).bool()  # padding: False
    up, down = torch.where(keep, g, torch.inf), torch.where(keep, g, -torch.inf)
    lo, hi = up.amin(-1, keepdim=True), down.amax(-1, keepdim=True)
    exact = None
    if k > 0:  # the (k+1)-th smallest and largest kept values, where enough tokens are kept
        lo_k = up.topk(k + 1, -1, largest=False).values[..., -1:]
        hi_k = down.topk(k + 1, -1).values[..., -1:]
        lo = torch.where(lo_k.isfinite(), lo_k, lo)
        hi = torch.where(hi_k.isfinite(), hi_k, hi)
        exact = _ungroup(keep & ((g < lo) | (g > hi)), spec, x.shape)
    empty = ~keep.any(-1, keepdim=True)
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0), exact


def range_metadata(spec: QuantSpec, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype):
    """(scale, offset or None) of groups whose data range is [lo, hi], rounded to `dtype`:
    the clip ratio shrinks the range towards zero first."""
    lo, hi = lo.float() * spec.clip, hi.float() * spec.clip
    if spec.symmetric:
        absmax = torch.maximum(lo.abs(), hi.abs())
        qmax = 2 ** (spec.bits - 1) - 1
        return (absmax if spec.codebook else absmax / qmax).to(dtype), None
    scale = (hi - lo) / (1 if spec.codebook else spec.levels - 1)
    return scale.to(dtype), lo.to(dtype)


def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    static_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    codebook: torch.Tensor | None = None,
    exclude: torch.Tensor | None = None,
) -> QTensor:
    """Quantize x [..., T, D] (float) as `spec` says.

    static_range: (lo, hi), each broadcastable to [..., 1, D] — required for "static".
    codebook:     float [L] or [H, L] sorted levels (heads at dim -3 of x) — required when
                  spec.codebook; levels in [0, 1] (asymmetric) or [-1, 1] (symmetric).
    exclude:      bool [..., T], tokens left out of "channel" ranges (kept sinks); they still get
                  codes, which the caller ignores.
    """
    xf = x.float()
    if spec.granularity == "static":
        if static_range is None:
            raise ValueError("granularity 'static' needs calibrated ranges: pass static_range")
        lo, hi = (r.float() for r in static_range)
        exact = ((xf < lo) | (xf > hi)) if spec.outliers > 0 else None
    else:
        lo, hi, exact = _group_range(xf, spec, exclude)
    if spec.codebook and codebook is None:
        raise ValueError("spec.codebook is set: pass the calibrated codebook")
    scale, offset = range_metadata(spec, lo, hi, x.dtype)
    qmax = 2 ** (spec.bits - 1) - 1
    s = _expand(scale.float(), spec, x.shape)
    s = torch.where(s > 0, s, torch.ones_like(s))
    t = xf - _expand(offset.float(), spec, x.shape) if offset is not None else xf
    t = t / s
    if spec.codebook:
        mids = (codebook[..., 1:] + codebook[..., :-1]).float() / 2
        if mids.dim() == 2:
            mids = mids.view(mids.shape[0], 1, 1, -1)
        codes = (t.unsqueeze(-1) > mids).sum(-1)
    elif spec.symmetric:
        codes = t.round().clamp(-qmax, qmax) + qmax
    else:
        codes = t.round().clamp(0, spec.levels - 1)
    values = torch.where(exact, x, torch.zeros_like(x)) if exact is not None else None
    return QTensor(codes.to(torch.uint8), scale, offset, exact, values)


def dequantize(
    q: QTensor, spec: QuantSpec, *, codebook: torch.Tensor | None = None, dtype=None
) -> torch.Tensor:
    """x_hat = offset + scale * level[code], outliers restored exactly. Returns `dtype`
    (default: the metadata's dtype)."""
    dtype = dtype or q.scale.dtype
    shape = q.codes.shape
    if spec.codebook:
        level = _lookup(codebook.float(), q.codes)
    elif spec.symmetric:
        level = q.codes.float() - (2 ** (spec.bits - 1) - 1)
    else:
        level = q.codes.float()
    x = level * _expand(q.scale.float(), spec, shape)
    if q.offset is not None:
        x = x + _expand(q.offset.float(), spec, shape)
    if q.exact is not None:
        x = torch.where(q.exact, q.values.float(), x)
    return x.to(dtype)


def fake_quantize(x: torch.Tensor, spec: QuantSpec, **kwargs) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype; keyword arguments as for `quantize`."""
    codebook = kwargs.get("codebook")
    return dequantize(quantize(x, spec, **kwargs), spec, codebook=codebook, dtype=x.dtype)


def uniform_codebook(bits: int, symmetric: bool = False) -> torch.Tensor:
    """The levels a uniform grid puts in the normalized domain (a codebook's starting point)."""
    n = 2**bits
    levels = torch.linspace(0.0, 1.0, n)
    return levels * 2 - 1 if symmetric else levels
