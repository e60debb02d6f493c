"""method "vq": vector codes, one index per vector of a few channels into a calibrated codebook
(kvcalib-1.5; KVQuant's Fisher-weighted codebooks, Hooper et al. 2024, taken from scalars to
vectors as in product quantization, Jégou et al. 2011).

A head's D channels are cut into V = D / w vectors of w = `group_size` channels. `pairing`
"adjacent" takes channels [j*w, (j+1)*w) for vector j; "rope" takes w/2 RoPE pairs (c, c + D/2),
the channels rotate_half rotates together: vector j holds channels c0 .. c0 + w/2 - 1 and
c0 + D/2 .. c0 + D/2 + w/2 - 1, c0 = j*w/2 (keys stored pre-RoPE: RoPE is applied after the
lookup, as for "static"). Each channel c of head h is normalized by its calibrated range
(KVParams.key_range / value_range, float32 [Hkv, D], granularity "static"): scale = hi - lo and
offset = lo, rounded to the cache's dtype. A codebook of E = 2**bits entries of w coordinates in
that normalized domain, float [Hc, E, w] (Hc = 1: one per layer, or Hkv: one per KV head; rounded
to the cache's dtype), gives every vector j of a token

    x_hat[c_i] = offset[c_i] + scale[c_i] * book[h, code_j, i]    (c_i: its i-th channel)
    code_j     = argmin_e  sum_i (x[c_i] - offset[c_i] - scale[c_i] * book[h, e, i])^2

the entry nearest in x's own units, the lowest index on ties; computed in fp32. No per-token
metadata: bits / w code bits per element, plus the per-layer constants.

Exact slots (`outlier_slots` = K >= 1, kvcalib-2's rule, layouts.quant's docstring): after the
lookup, each row of a head (one token's D channels) keeps its K elements the codes get most
wrong (slot_rule "error": the largest |x - x_hat|, the lower channel on ties), their channel in
natural order and their delta x - x_hat, in x's dtype (slot_code "exact") or as one E4M3 byte in
steps of the channel's scale hi - lo ("fp8", layouts.fp8). A slot costs (8 + 8) / D bits per
element with "fp8": 0.25 at head_dim 64.

QTensor: codes uint8 [..., H, T, V] (vector j's index), scale and offset x.dtype [H, 1, D],
slot_index uint8 [..., H, T, K] and slot_delta [..., H, T, K] (or None without slots).
`CodeBody` stores a cache's rows; `CodeBody.dequantize` is the decode path's lookup
(kernels.decode_torch and decode_attention_reference read it), held bit-equal to `dequantize`
here.
"""

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvcalib_runtime.layouts import fp8
from kvcalib_runtime.layouts.affine import select_slots
from kvcalib_runtime.layouts.base import (
    CODEBOOK,
    RANGE,
    Kind,
    Layout,
    QTensor,
    register,
    slot_index_dtype,
)
from kvcalib_runtime.layouts.body import (
    NONE,
    StreamArgs,
    Unit,
    flush_by_write,
    replace_rows,
    rows,
)
from kvcalib_runtime.layouts.packing import pack, packed_size, unpack

if TYPE_CHECKING:
    from kvcalib_runtime.layouts.spec import QuantSpec

VQ_BITS = (1, 2, 3, 4, 5, 6, 7, 8)  # index bits per vector: E = 2**bits entries
# QuantSpec fields a "vq" spec leaves at their defaults
FIXED = ("symmetric", "clip", "outliers", "split_channels", "split_bits")
CHUNK = 256  # tokens whose distances to every entry are taken at once (bounds the memory)


def channel_order(d: int, width: int, pairing: str) -> torch.Tensor:
    """int64 [D]: the channels of vector j at [j*width, (j+1)*width) (module docstring)."""
    if pairing == "adjacent":
        return torch.arange(d)
    half, pairs = d // 2, width // 2
    first = torch.arange(0, half, pairs)[:, None] + torch.arange(pairs)  # [V, w/2]
    return torch.cat([first, first + half], -1).reshape(-1)


def entries(book: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, order: torch.Tensor):
    """Every entry in x's units, fp32 [H, V, E, w]: book [Hc, E, w], scale and offset [H, D]."""
    heads, d = scale.shape
    width = book.shape[-1]
    s, o = (t.float()[:, order].view(heads, d // width, 1, width) for t in (scale, offset))
    return o + s * book.float()[:, None]  # Hc = 1 broadcasts over the heads


def nearest(xv: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 [..., H, T, V]: the index of the entry of table [H, V, E, w] nearest to each vector
    of xv [..., H, T, V, w] (squared distance in fp32, the lowest index on ties)."""
    out = []
    for part in xv.split(CHUNK, dim=-3):
        dist = (part.unsqueeze(-2) - table[:, None]).square().sum(-1)  # [..., H, t, V, E]
        out.append(dist.argmin(-1).to(torch.uint8))
    return torch.cat(out, -2)


def lookup(codes: torch.Tensor, table: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """fp32 [..., H, T, D] from codes [..., H, T, V] and table [H, V, E, w]: each vector's entry,
    channels back in their place."""
    heads, v, e, w = table.shape
    at = torch.arange(heads * v, device=codes.device).view(heads, 1, v) * e  # [H, 1, V]
    rows = codes.long() + at
    x = table.reshape(-1, w)[rows].flatten(-2)  # [..., H, T, D] in vector order
    return torch.empty_like(x).index_copy_(-1, order.to(x.device), x)


def encode(x: torch.Tensor, spec, table: torch.Tensor, order: torch.Tensor, scale: torch.Tensor):
    """(codes uint8 [..., H, T, V], slot_index, slot_delta or None, None) of x [..., H, T, D]
    against table [H, V, E, w] (`entries`); scale [H, D] is what "fp8" deltas count steps of."""
    layout = spec.layout
    xf = x.float()
    codes = nearest(xf[..., order].unflatten(-1, (-1, layout.width_of_vector)), table)
    k = layout.slots(x.shape[-1])
    if not k:
        return codes, None, None
    base = lookup(codes, table, order)
    index, delta = select_slots(xf, base, (xf - base).abs(), k)
    if spec.slot_code == "fp8":
        return codes, index, fp8.encode(delta / _steps(scale, base.shape, index))
    return codes, index, delta.to(x.dtype)


def _steps(scale: torch.Tensor, shape: torch.Size, index: torch.Tensor) -> torch.Tensor:
    """fp32 [..., H, T, K]: the "fp8" step (layouts.fp8.step) of scale [H, D] at each slot's
    channel, for rows of `shape` [..., H, T, D]."""
    return fp8.step(scale[:, None, :]).expand(shape).gather(-1, index.long())


def add_slots(x: torch.Tensor, spec, index, delta, scale: torch.Tensor) -> torch.Tensor:
    """x fp32 [..., H, T, D] with each slot's delta added at its channel, in place (x is
    returned; unchanged where index is None); scale [H, D] as `encode` takes it."""
    if index is None:
        return x
    if spec.slot_code == "fp8":
        return x.scatter_add_(-1, index.long(), fp8.decode(delta) * _steps(scale, x.shape, index))
    return x.scatter_add_(-1, index.long(), delta.float())


def quantize(x: torch.Tensor, spec, static_range, codebook) -> QTensor:
    """x [..., H, T, D] (float) -> QTensor (module docstring); static_range (lo, hi), each
    [H, D] (or that with leading and token dims of 1); codebook [Hc, E, w]."""
    layout = spec.layout
    if static_range is None:
        raise ValueError("method 'vq' normalizes by calibrated ranges: pass static_range")
    if codebook is None:
        raise ValueError("method 'vq' codes vectors with a calibrated codebook: pass codebook")
    heads, d = x.shape[-3], x.shape[-1]
    layout.check_codebook(codebook, heads)
    lo, hi = (r.float().reshape(-1, d) for r in static_range)
    if lo.shape[0] != heads or hi.shape[0] != heads:
        raise ValueError(
            f"method 'vq' keeps one range per channel of each head: pass [{heads}, {d}]"
        )
    scale, offset = (hi - lo).to(x.dtype), lo.to(x.dtype)  # [H, D]
    order = layout.order(d).to(x.device)
    table = entries(codebook.to(x.dtype), scale, offset, order)
    codes, index, delta = encode(x, spec, table, order, scale)
    return QTensor(codes, scale[:, None], offset[:, None], index, delta)


def dequantize(q: QTensor, spec, codebook) -> torch.Tensor:
    """float32 [..., H, T, D] from a QTensor of `quantize` (same spec and codebook)."""
    heads, d = q.codes.shape[-3], q.scale.shape[-1]
    scale, offset = (t.reshape(heads, d) for t in (q.scale, q.offset))
    order = spec.layout.order(d).to(q.codes.device)
    x = lookup(q.codes, entries(codebook.to(q.scale.dtype), scale, offset, order), order)
    return add_slots(x, spec, q.slot_index, q.slot_delta, scale)


@dataclass
class CodeBody:
    """The quantized body of one layer's keys or values under a "vq" spec: B sequences of N slots
    (slot t % N holds position t) of Hkv heads of D channels in V = D / w vectors, in `dtype`.

    spec      QuantSpec (method "vq")
    head_dim  D
    codes     uint8 [B, Hkv, N, packed_size(V, bits)]  a row's V indices (layouts.packing)
    scale     dtype [Hkv, D]      hi - lo of each channel's calibrated range
    offset    dtype [Hkv, D]      lo
    book      dtype [Hc, E, w]    the codebook (Hc = 1 or Hkv), in the normalized domain
    slot_index  uint8 [B, Hkv, N, K]  each exact slot's channel (natural order), or None (K = 0)
    slot_delta  [B, Hkv, N, K]        its delta: dtype ("exact") or uint8 E4M3 ("fp8"), or None

    A layouts.body.Body with its own writer.
    """

    kind: ClassVar[Kind] = Kind.VECTORS
    packed: ClassVar[bool] = False

    spec: "QuantSpec"
    head_dim: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    book: torch.Tensor
    slot_index: torch.Tensor | None = None
    slot_delta: torch.Tensor | None = None

    @classmethod
    def allocate(cls, spec, shape, device, dtype, static_range, codebook) -> "CodeBody":
        """Zeroed codes for `shape` = (B, Hkv, N, D) and the layer's constants."""
        b, hkv, n, d = shape
        if static_range is None or codebook is None:
            raise ValueError(
                "a 'vq' spec needs this layer's calibrated ranges and codebook: put them in "
                "KVParams.key_range / value_range and key_codebook / value_codebook"
            )
        spec.layout.check_codebook(codebook, hkv)
        lo, hi = (r.to(device=device, dtype=torch.float32) for r in static_range)
        vectors = d // spec.layout.width_of_vector
        codes = torch.zeros(b, hkv, n, packed_size(vectors, spec.bits), device=device,
                            dtype=torch.uint8)  # fmt: skip
        book = codebook.to(device=device, dtype=dtype).contiguous()
        index = delta = None
        k = spec.layout.slots(d)
        if k:
            index = torch.zeros(b, hkv, n, k, device=device, dtype=slot_index_dtype(d))
            stored = torch.uint8 if spec.slot_code == "fp8" else dtype
            delta = torch.zeros(b, hkv, n, k, device=device, dtype=stored)
        return cls(spec, d, codes, (hi - lo).to(dtype), lo.to(dtype), book, index, delta)

    @property
    def slots(self) -> int:
        return self.codes.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this body holds (what its memory is)."""
        found = [self.codes, self.scale, self.offset, self.book, self.slot_index, self.slot_delta]
        return [t for t in found if t is not None]

    def per_token(self) -> dict[str, torch.Tensor]:
        """The codes and exact slots: the ranges and the codebook are per layer."""
        rows = {"codes": self.codes, "slot_index": self.slot_index, "slot_delta": self.slot_delta}
        return {name: t for name, t in rows.items() if t is not None}

    with_rows = replace_rows

    def stream_args(self, head_dim: int, unit: Unit) -> StreamArgs:
        """levels: the codebook [Hc, E, w]; BOOK: one KV head's entries where Hc > 1; the exact
        slots (K of them) as the kernel reads any layout's, "fp8" steps of the static scale."""
        spec, codes, book = self.spec, self.codes, self.book.contiguous()
        index, delta = self.slot_index, self.slot_delta
        fields = dict(BITS=spec.bits, GRAN=Kind.VECTORS.value, GROUP=spec.group_size, SYM=False,
                      CB=True, K=spec.layout.slots(head_dim), FP8=spec.slot_code == "fp8",
                      VEC=False, UNIT=8, BOOK=book[0].numel() if book.shape[0] > 1 else 0,
                      PAIRS=spec.pairing == "rope")  # fmt: skip
        buffers = (codes, self.scale, self.offset, book, *(t if t is not None else codes
                                                           for t in (index, delta)))  # fmt: skip
        return StreamArgs(buffers, (rows(codes), NONE, rows(index), rows(delta)), 1, fields)

    def view(self, b: int) -> "CodeBody":
        """Sequence b alone (B = 1), sharing storage."""
        index, delta = (None if t is None else t[b : b + 1]
                        for t in (self.slot_index, self.slot_delta))  # fmt: skip
        return CodeBody(self.spec, self.head_dim, self.codes[b : b + 1], self.scale, self.offset,
                        self.book, index, delta)  # fmt: skip

    def write(self, x: torch.Tensor, seq: torch.Tensor, start: torch.Tensor, active=None) -> None:
        """Quantize x [M, Hkv, n, D] into positions [start[m], start[m] + n) of sequence seq[m]
        (slot = position % N); `active` bool [M] (default all) says which blocks write."""
        n, slots = x.shape[2], self.codes.shape[2]
        active = [True] * len(x) if active is None else active.tolist()
        for xm, b, s, on in zip(x, seq.tolist(), start.tolist(), active, strict=True):
            if not on:
                continue
            order = self.spec.layout.order(self.head_dim).to(x.device)
            table = entries(self.book, self.scale, self.offset, order)
            codes, index, delta = encode(xm, self.spec, table, order, self.scale)
            where = torch.arange(s, s + n, device=x.device) % slots
            self.codes[b, :, where] = pack(codes, self.spec.bits)
            if index is not None:
                self.slot_index[b, :, where] = index
                self.slot_delta[b, :, where] = delta.to(self.slot_delta.dtype)

    flush = flush_by_write

    def dequantize(
        self, dtype: torch.dtype, b: int | None = None, n: int | None = None, start: int = 0
    ):
        """Slots [start, n) (default all) of sequence b (default every sequence):
        [B, Hkv, n - start, D] ([Hkv, n - start, D] for one sequence) — the lookup of one entry
        per stored index, the same whatever the span it is read in."""
        rows = slice(None) if b is None else slice(b, b + 1)
        n = self.codes.shape[2] if n is None else n
        vectors = self.head_dim // self.spec.layout.width_of_vector
        codes = unpack(self.codes[rows, :, start:n], self.spec.bits, vectors)
        order = self.spec.layout.order(self.head_dim).to(codes.device)
        out = lookup(codes, entries(self.book, self.scale, self.offset, order), order)
        index, delta = (None if t is None else t[rows, :, start:n]
                        for t in (self.slot_index, self.slot_delta))  # fmt: skip
        out = add_slots(out, self.spec, index, delta, self.scale).to(dtype)
        return out if b is None else out[0]


@register
class VectorCodes(Layout):
    name = method = "vq"
    kind = Kind.VECTORS
    affine = False
    decoded = True
    calibrates = (RANGE, CODEBOOK)
    vectors = True
    bits = VQ_BITS

    def check(self) -> None:
        spec = self.spec
        if spec.granularity != "static":
            raise ValueError("method 'vq' normalizes by calibrated ranges: granularity 'static'")
        if spec.group_size < 1:
            raise ValueError("method 'vq' codes vectors of group_size channels: set group_size")
        if spec.pairing == "rope" and spec.group_size % 2:
            raise ValueError(
                f"pairing 'rope' takes whole RoPE pairs: use an even group_size, not "
                f"{spec.group_size}"
            )
        if not spec.codebook:
            raise ValueError("method 'vq' indexes a calibrated codebook: set codebook")
        default = {f.name: f.default for f in dataclasses.fields(spec)}
        changed = [name for name in FIXED if getattr(spec, name) != default[name]]
        if changed:
            raise ValueError(
                f"method 'vq' keeps no outliers, clip or symmetric levels: leave "
                f"{', '.join(changed)} at the default"
            )
        if spec.outlier_slots and spec.slot_rule != "error":
            raise ValueError(
                "method 'vq' keeps in its exact slots the elements its codes get most wrong: "
                "set slot_rule 'error'"
            )
        if not spec.outlier_slots and (spec.slot_rule, spec.slot_code) != ("outside", "exact"):
            raise ValueError(
                "slot_rule and slot_code describe exact slots: set outlier_slots >= 1, or leave "
                "them at the default"
            )

    @property
    def width_of_vector(self) -> int:
        """w, the channels of one vector."""
        return self.spec.group_size

    def order(self, d: int) -> torch.Tensor:
        self.check_head(d)
        return channel_order(d, self.width_of_vector, self.spec.pairing)

    def check_head(self, head_dim: int, kv_heads: int | None = None) -> None:
        w = self.width_of_vector
        whole = 2 * w if self.spec.pairing == "rope" else w
        if head_dim % whole:
            raise ValueError(
                f"group_size = {w} (pairing {self.spec.pairing!r}) does not cut head_dim = "
                f"{head_dim} into whole vectors"
            )
        if self.spec.outlier_slots > head_dim:
            raise ValueError(
                f"outlier_slots = {self.spec.outlier_slots} exceeds head_dim = {head_dim}: use "
                "at most one slot per channel"
            )

    def check_codebook(self, book: torch.Tensor, kv_heads: int) -> None:
        """ValueError unless `book` is [1 or kv_heads, 2**bits, group_size] (checkpoint.checks
        checks the numbers)."""
        want = (self.spec.levels, self.width_of_vector)
        if book.dim() != 3 or tuple(book.shape[1:]) != want or book.shape[0] not in (1, kv_heads):
            raise ValueError(
                f"codebook of {self.spec.bits} bits and group_size {self.width_of_vector} "
                f"(method 'vq') has shape [1 or {kv_heads}, {want[0]}, {want[1]}], "
                f"not {list(book.shape)}"
            )

    def codebook_shape(self, kv_heads: int) -> tuple[int, ...]:
        return (kv_heads, self.spec.levels, self.width_of_vector)

    def row_group(self, width: int) -> int:
        return width

    def slots(self, n: int) -> int:
        return self.spec.outlier_slots

    def quantize(self, x, *, static_range=None, codebook=None, exclude=None, split=None):
        return quantize(x, self.spec, static_range, codebook)

    def dequantize(self, q: QTensor, *, codebook=None, split=None) -> torch.Tensor:
        return dequantize(q, self.spec, codebook)

    def allocate(self, shape, device, dtype, *, static_range=None, codebook=None, split=None):
        return CodeBody.allocate(self.spec, shape, device, dtype, static_range, codebook)
