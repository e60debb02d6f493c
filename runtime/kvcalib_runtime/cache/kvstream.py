"""One layer's keys or values in the quantized cache: body + residual ring, and how tokens move
between them (`kvcalib_runtime.cache.kvcache` owns one per layer and tensor).

    body     what the spec's layout allocates (a layouts.body.Body: written by the packed
             writer, kernels.quant_pack, or by its own); exact
             dtype [B, Hkv, S, D] for a tensor left in full precision,
             S = scheme.body_slots: position t in slot t % S
             (every position, or a ring for a sliding-window layer)
    tail     dtype [B, Hkv, max(R, 1), D]  the residual ring, position t in slot t % R
    n_body   int64 [B] on the device: positions [0, n_body) are in the body; always the decode
             rule's n_q(length), which the host knows from the length alone (`host_body`)

Two ways in: `write` stores dense blocks (a prefill, per sequence); `append` is a decode
step's store for every sequence at once, on the device only (no host synchronization): the
flush of the positions the next token must see quantized, then the new token into the ring.
"""

import copy

import torch

from kvcalib_runtime.cache.scheme import (
    KVParams,
    KVScheme,
    body_slots,
    quantized_prefix,
    quantized_prefix_int,
)
from kvcalib_runtime.kernels import quant_pack as qp
from kvcalib_runtime.kernels.operands import Stored


def kernel_layout(spec) -> bool:
    """Whether a tensor stored with spec (None: full precision) is laid out as the decode
    attention and its references read it (`layout.decoded`: an affine PackedBody, a CodeBody);
    `supports()` of each kernel decides the rest. Peers' own numerics
    (llama.cpp's, TurboQuant's) are not."""
    return spec is None or spec.layout.decoded


class Stream:
    """Layer i's keys or values (kind "key" / "value") for shape (B, Hkv, max_len, D)."""

    def __init__(self, kind: str, i: int, scheme: KVScheme, params: KVParams, shape, device,
                 dtype, window: int | None, n_body: torch.Tensor):  # fmt: skip
        b, h, max_len, d = shape
        spec = self.spec = getattr(scheme.layers[i], kind)
        self.flush, self.residual = getattr(scheme.layers[i], f"{kind}_flush"), scheme.residual
        self.window = window
        self.slots = body_slots(spec, self.flush, self.residual, window, max_len)
        self.n_body = n_body
        self.tail = torch.zeros(b, h, max(self.residual, 1), d, device=device, dtype=dtype)
        self.exact = self.body = None
        if spec is None:
            self.exact = torch.zeros(b, h, self.slots, d, device=device, dtype=dtype)
        else:
            self.body = spec.layout.allocate(
                (b, h, self.slots, d),
                device,
                dtype,
                static_range=getattr(params, f"{kind}_range").get(i),
                codebook=getattr(params, f"{kind}_codebook").get(i),
                split=getattr(params, f"{kind}_split").get(i),
            )
        # quant_pack handles spec
        self.packs = spec is not None and spec.layout.affine and qp.supports(spec, d, h)

    def host_body(self, stored: int) -> int:
        """Body size once `stored` tokens are in: what the next token must see quantized
        (everything, for a tensor left in full precision)."""
        if self.spec is None:
            return stored
        return quantized_prefix_int(stored, self.residual, self.flush)

    def targets(self, stored: torch.Tensor) -> torch.Tensor:
        """`host_body` on the device: LongTensor [B]."""
        if self.spec is None:
            return stored
        return quantized_prefix(stored, self.residual, self.flush)

    def write(self, seq, start, x: torch.Tensor, is_sink: torch.Tensor, kernel: bool) -> None:
        """Move x [M, Hkv, n, D] to positions [start[m], start[m] + n) of sequence seq[m] (seq,
        start: LongTensor[M] on x's device); is_sink bool [B, P] masks kept sinks; through the
        quant_pack kernel when `kernel` and it handles the spec."""
        if not self.slots:
            return
        if self.spec is None:
            pos = start[:, None] + torch.arange(x.shape[2], device=x.device)
            self.exact[seq[:, None], :, pos % self.slots] = x.transpose(1, 2)
        elif not self.body.packed:  # a body that quantizes and stores rows itself
            self.body.write(x, seq, start)
        elif kernel and self.packs:
            qp.quant_pack(x, self.body, seq, start, is_sink)
        else:
            qp.quant_pack_reference(x, self.body, seq, start, is_sink)

    def store(self, b: int, n: int, new: torch.Tensor, is_sink, kernel: bool) -> None:
        """A prefill's store for sequence b, which holds n positions (host): new [Hkv, T, D] are
        positions [n, n + T); the body grows to host_body(n + T) (from the ring and new; a ring
        body keeps its last `slots` only), the positions past it enter the ring."""
        T = new.shape[1]
        nb, target = self.host_body(n), self.host_body(n + T)
        ring = self.tail.shape[2]
        if target > nb:
            old = self.tail[b][:, torch.arange(nb, n) % ring] if n > nb else new[:, :0]
            first = max(nb, target - self.slots)
            block = torch.cat([old, new], dim=1)[:, first - nb : target - nb]
            where = torch.tensor([[b], [first]], device=new.device)
            self.write(where[0], where[1], block[None], is_sink, kernel)
            self.n_body[b] = target
        start = max(n, target)
        if start < n + T and self.residual:
            slots = torch.arange(start, n + T) % ring
            self.tail[b][:, slots] = new[:, start - n :]

    def append(self, new: torch.Tensor, n: torch.Tensor, is_sink, kernel: bool) -> None:
        """A decode step's store for every sequence: new [B, Hkv, D] is the token at position
        n [B] (device); the body grows to targets(n + 1) (0 or `flush` positions, read from the
        ring and new), new enters the ring, n_body follows. Device work only."""
        target = torch.maximum(self.targets(n + 1), self.n_body)
        if self.spec is None:
            if self.slots:
                self.exact[torch.arange(len(n), device=n.device), :, n % self.slots] = new
        elif self.slots and not self.body.packed:
            self.body.flush(self.tail, new, n, self.n_body, target, self.flush)
        elif self.slots:
            flush = qp.flush if kernel and self.packs else qp.flush_reference
            flush(self.tail, new, n, self.body, self.n_body, target, self.flush, is_sink)
        self._enter(new, n, target)

    def _enter(self, new: torch.Tensor, n: torch.Tensor, target: torch.Tensor) -> None:
        """After the flush: new into the ring, n_body to target."""
        if self.spec is not None and self.residual:
            self.tail[torch.arange(len(n), device=n.device), :, n % self.tail.shape[2]] = new
        self.n_body.copy_(target)

    def batch_key(self):
        """Streams with equal keys flush as one through `append_many`; None: `append` alone."""
        if self.spec is None or not self.body.packed:
            return None
        return qp.batch_key(self.body, self.flush)

    @staticmethod
    def append_many(streams: list[tuple["Stream", torch.Tensor]], n: torch.Tensor) -> None:
        """`append` (its torch path) of several streams with one `batch_key`, each with its new
        token [B, Hkv, D]: their flushes quantized in one call (`quant_pack.flush_many`)."""
        targets = [torch.maximum(s.targets(n + 1), s.n_body) for s, _ in streams]
        pairs = list(zip(streams, targets, strict=True))
        flushes = [(s.tail, new, s.body, s.n_body, t) for (s, new), t in pairs]
        qp.flush_many(flushes, n, streams[0][0].flush)
        for (s, new), t in pairs:
            s._enter(new, n, t)

    @property
    def token_group(self) -> int:
        """Positions that share metadata: a `read` starts at a multiple of it."""
        return self.spec.layout.token_group() if self.spec is not None else 1

    def read(self, b: int, nb: int, dtype, start: int = 0) -> tuple[int, torch.Tensor]:
        """The body positions of sequence b that are still held, in [start, nb): (first position,
        [Hkv, nb - first, D] dequantized). A start past 0 needs nb within the body's slots and
        start a multiple of `token_group`; each position is read as in a read from 0, bit for
        bit, except in a TurboBody (its `levels` and `finish` are)."""
        first = max(nb - self.slots, start)
        if self.spec is None:
            x = self.exact[b]
        elif nb <= self.slots:
            return start, self.body.dequantize(dtype, b, nb, start)
        else:
            x = self.body.dequantize(dtype, b)
        return first, x[:, torch.arange(first, nb, device=x.device) % max(self.slots, 1)]

    def stored(self) -> Stored:
        return Stored(self.body if self.body is not None else self.exact, self.tail, self.n_body)

    def tensors(self) -> list[torch.Tensor]:
        """The body's buffers (codes, metadata, slots, per-layer constants) or the exact one."""
        return self.body.tensors() if self.body is not None else [self.exact]

    def view(self, b: int) -> "Stream":
        v = copy.copy(self)
        v.tail = self.tail[b : b + 1]
        v.exact = self.exact[b : b + 1] if self.exact is not None else None
        v.body = self.body.view(b) if self.body is not None else None
        v.n_body = self.n_body[b : b + 1]  # a view: the parent sees the update
        return v
