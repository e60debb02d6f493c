"""Reference quantizers for KV tensors — the single source of truth for kvcalib's numerics.

Every tensor here is laid out [..., T, D]: T tokens, D channels of one head (typically
[B, H, T, D]). One `QuantSpec` says how such a tensor is cut into groups, each group getting
its own range:

    granularity "token"    groups of `group_size` consecutive channels inside one token
                           (group_size 0 = the whole head: per-token quantization)
    granularity "channel"  groups of `group_size` consecutive tokens inside one channel
                           (KIVI's keys), aligned to absolute token index
    granularity "static"   one range per channel, calibrated offline (KVQuant's keys)
    granularity "vector"   one group per token over every KV head (KVQuant's values): the heads
                           at dim -3 are joined into one vector of H * D channels first

Every group is dequantized as  x_hat = offset + scale * level[code]:

    uniform, asymmetric  (KIVI)   scale = (max - min) / (2^b - 1), code = round((x - min) / scale),
                                  level[c] = c, offset = min (a float, not an integer zero point)
    uniform, symmetric            scale = absmax / (2^(b-1) - 1), level[c] = c - (2^(b-1) - 1),
                                  no offset
    codebook, asymmetric          scale = max - min, offset = min, level = sorted table in [0, 1]
    codebook, symmetric           scale = absmax, level = sorted table in [-1, 1]

`clip` shrinks min/max (or absmax) towards zero before the scale is taken (QuaRot's clip
ratio).

Outliers (dense-and-sparse, KVQuant). With `outliers = f > 0` the range of a dynamic group of n
elements leaves out k = ceil(f * n / 2) elements at each end; a "static" range is calibrated
with the fraction f left out. Elements outside their group's range are clamped by the codes,
and a fixed number K of slots per vector (one token of one head, or of every head for
"vector") keeps K elements exactly:

    slot_index  [..., T, K]  channel within the vector (uint8, int16 past 256 channels)
    slot_delta  [..., T, K]  x - x_hat at that channel, in x's dtype; x_hat += delta restores it

Which elements (`slot_rule`; ties go to the lower channel):
    "outside"  the K farthest outside their range (KVQuant's outliers); a vector with fewer
               leaves the other slots at index 0 with delta 0, one with more has them clamped
    "error"    the K with the largest |x - x_hat| (kvcalib's): the clamped outliers first,
               then the worst-rounded elements inside the range, so every slot is used
K is (D / g) * 2k for dynamic groups (under "outside" none is ever clamped); for "static" it
is `outlier_slots`. That one rule is what the cache stores, what kvcalib's simulation computes
and what the bit count charges (the slots whether used or not).

Scale and offset are rounded to the input's dtype before codes are computed (fp16 metadata in
an fp16 cache, as KIVI does); codes are computed in fp32 from the rounded metadata.
"""

import math
from dataclasses import dataclass

import torch

GRANULARITIES = ("token", "channel", "static", "vector")
SLOT_RULES = ("outside", "error")
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

    def __post_init__(self):
        for name in ("bits", "group_size", "outlier_slots"):
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

    codes:       uint8 [..., T, D], values < 2**bits ("vector": [..., 1, T, H * D])
    scale:       x.dtype, group-shaped: [..., T, D/g, 1] ("token", "vector"),
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


def to_vector(x: torch.Tensor) -> torch.Tensor:
    """[..., H, T, D] -> [..., 1, T, H * D]: every head of a token as one vector."""
    h, t, d = x.shape[-3:]
    return x.transpose(-3, -2).reshape(*x.shape[:-3], 1, t, h * d)


def from_vector(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `to_vector`: [..., 1, T, H * D] -> [..., H, T, D]."""
    t, n = x.shape[-2:]
    return x.reshape(*x.shape[:-3], t, heads, n // heads).transpose(-3, -2)


def _group(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View x [..., T, D] as its groups, elements last: [..., T, D/g, g] ("token", "vector") or
    [..., ceil(T/g), D, g] ("channel", T zero-padded to a multiple of g)."""
    t, d = x.shape[-2:]
    if spec.granularity != "channel":
        g = spec.channel_group(d)
        return x.reshape(*x.shape[:-1], d // g, g)
    g = spec.group_size
    x = torch.nn.functional.pad(x, (0, 0, 0, (-t) % g))
    return x.reshape(*x.shape[:-2], -1, g, d).transpose(-1, -2)


def _ungroup(y: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    """Inverse of `_group` for a full group-shaped tensor (padding dropped)."""
    t, d = shape[-2:]
    if spec.granularity != "channel":
        return y.reshape(shape)
    return y.transpose(-1, -2).reshape(*shape[:-2], -1, d)[..., :t, :]


def _expand(param: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    """Broadcast a group-shaped parameter back to the element shape [..., T, D]."""
    if spec.granularity == "static":
        return param.expand(shape)
    g = spec.group_size if spec.granularity == "channel" else spec.channel_group(shape[-1])
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
    """Per-group (lo, hi) in group shape: min and max, or with k = outliers_per_side the
    (k+1)-th smallest and largest. "channel" groups take their range over kept tokens only:
    excluded (kept-exact sinks) and padded tokens never widen it."""
    g = _group(x, spec)
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
    keep = _group(keep.unsqueeze(-1).expand(x.shape).to(x.dtype), spec).bool()  # padding: False
    lo = torch.where(keep, g, torch.inf).amin(-1, keepdim=True)
    hi = torch.where(keep, g, -torch.inf).amax(-1, keepdim=True)
    empty = ~keep.any(-1, keepdim=True)
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


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


def _levels(spec: QuantSpec, codes: torch.Tensor, codebook) -> torch.Tensor:
    """level[code] in fp32."""
    if spec.codebook:
        return _lookup(codebook.float(), codes)
    if spec.symmetric:
        return codes.float() - (2 ** (spec.bits - 1) - 1)
    return codes.float()


def _base(spec: QuantSpec, codes, scale, offset, codebook) -> torch.Tensor:
    """offset + scale * level[code] in fp32, element-shaped like codes."""
    shape = codes.shape
    x = _levels(spec, codes, codebook) * _expand(scale.float(), spec, shape)
    if offset is not None:
        x = x + _expand(offset.float(), spec, shape)
    return x


def select_slots(xf: torch.Tensor, base: torch.Tensor, excess: torch.Tensor, k: int, dtype):
    """The k elements of each vector (last dim) with the largest excess > 0, lower channel first
    on ties -> (slot_index, slot_delta = x - base in dtype)."""
    order = excess.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    used = excess.gather(-1, order) > 0
    index = torch.where(used, order, 0)
    delta = torch.where(used, (xf - base).gather(-1, order), 0.0)
    return index.to(slot_index_dtype(xf.shape[-1])), delta.to(dtype)


def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    static_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    codebook: torch.Tensor | None = None,
    exclude: torch.Tensor | None = None,
) -> QTensor:
    """Quantize x [..., T, D] (float; "vector": [..., H, T, D]) as `spec` says.

    static_range: (lo, hi), each broadcastable to [..., 1, D] — required for "static".
    codebook:     float [L] or [H, L] sorted levels (heads at dim -3 of x) — required when
                  spec.codebook; levels in [0, 1] (asymmetric) or [-1, 1] (symmetric).
    exclude:      bool [..., T], tokens left out of "channel" ranges (kept sinks); they still get
                  codes, which the caller ignores.
    """
    heads = x.shape[-3] if spec.granularity == "vector" else None
    xf = to_vector(x.float()) if heads else x.float()
    if spec.granularity == "static":
        if static_range is None:
            raise ValueError("granularity 'static' needs calibrated ranges: pass static_range")
        lo, hi = (r.float() for r in static_range)
        lo_e, hi_e = lo, hi
    else:
        lo, hi = _group_range(xf, spec, exclude)
        lo_e, hi_e = (_expand(r, spec, xf.shape) for r in (lo, hi))
    if spec.codebook and codebook is None:
        raise ValueError("spec.codebook is set: pass the calibrated codebook")
    scale, offset = range_metadata(spec, lo, hi, x.dtype)
    qmax = 2 ** (spec.bits - 1) - 1
    s = _expand(scale.float(), spec, xf.shape)
    s = torch.where(s > 0, s, torch.ones_like(s))
    t = xf - _expand(offset.float(), spec, xf.shape) if offset is not None else xf
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
    codes = codes.to(torch.uint8)
    q = QTensor(codes, scale, offset, heads=heads)
    k = spec.slots(xf.shape[-1])
    if k:
        base = _base(spec, codes, scale, offset, codebook)
        if spec.slot_rule == "error":
            excess = (xf - base).abs()
        else:
            excess = (xf - torch.minimum(torch.maximum(xf, lo_e), hi_e)).abs()
        q.slot_index, q.slot_delta = select_slots(xf, base, excess, k, x.dtype)
    return q


def dequantize(
    q: QTensor, spec: QuantSpec, *, codebook: torch.Tensor | None = None, dtype=None
) -> torch.Tensor:
    """x_hat = offset + scale * level[code], plus the exact slots' deltas. Returns `dtype`
    (default: the metadata's dtype), in x's layout ([..., H, T, D] again for "vector")."""
    dtype = dtype or q.scale.dtype
    x = _base(spec, q.codes, q.scale, q.offset, codebook)
    if q.slot_index is not None:
        x = x.scatter_add(-1, q.slot_index.long(), q.slot_delta.float())
    if q.heads:
        x = from_vector(x, q.heads)
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
