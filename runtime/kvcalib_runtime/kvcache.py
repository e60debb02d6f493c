"""The quantized KV cache: [sinks | packed quantized body | full-precision residual window].

It implements the cache interface of `FullPrecisionCache` (positions / attend / observe_hidden /
commit / view / reset) and follows the decode rule of `kvcalib_runtime.scheme`. Storage, per
layer, for B sequences of up to N tokens, Hkv KV heads of D channels:

    body         kernels.layout.PackedBody (turboquant.TurboBody for "turboquant" specs):
                 codes uint8 [B, Hkv, N, ceil(D * bits / 8)] (slot t =
                 position t) and scale/offset per group of channels of a token [B, Hkv, N, D/g],
                 per group of tokens of a channel [B, Hkv, N/G, D], or per channel ("static",
                 from the calibrated range); K outlier slots per row (index + delta) when the
                 scheme keeps outliers
    exact        dtype [B, Hkv, N, D] instead of a body, for a tensor left in full precision
    tail         dtype [B, Hkv, max(R, 1), D]  ring of the residual window, slot = position % R
    sink slots   dtype [B, Hkv, S, D], S = sinks_first + sink_budget, and per sequence the
                 positions they hold; a sink's body slot is masked out of ranges and attention

Keys and values are stored in the scheme's domain (`kvcalib_runtime.transforms`: smoothing,
the key rotation and the value rotation, each fused in the weights or applied here): keys
pre-RoPE (RoPE is applied when they are read), or post-RoPE; queries meet them in that domain,
and an attention output over values kept in a rotated domain is rotated back.

Memory is what the buffers hold: `allocated_bytes` walks them; `storage_bits` is the formula
that plans them (a test holds the two equal for every preset).

New tokens are held exact until `commit`, when every layer has seen them and the sink predictor
has flagged them: sinks are decided then (in position order), and each tensor flushes the
positions the next token must see quantized: [n_body, n_q(lengths + T)).

Two paths compute the same thing. The reference (`_gather` + `_attention`, quant.quantize +
packing.pack) is the spec and the CPU fallback; the Triton kernels (kvcalib_runtime.kernels)
serve decode steps (T = 1) and flushes on CUDA, or anywhere under TRITON_INTERPRET=1.
"""

import copy
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcalib_runtime.errors import CapacityError, FormatError
from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels import quant_pack as qp
from kvcalib_runtime.kernels.layout import PackedBody, Sinks, Stored, use_triton
from kvcalib_runtime.rope import Rope
from kvcalib_runtime.scheme import KVParams, KVScheme, quantized_prefix, storage_bits
from kvcalib_runtime.transforms import Transforms
from kvcalib_runtime.turboquant import TurboBody


class _Stream:
    """Keys or values of one layer: quantized body + residual ring (exact if spec is None)."""

    def __init__(self, kind: str, i: int, scheme: KVScheme, params: KVParams, shape, device, dtype):
        """Layer i's keys or values (kind "key" / "value"), shape (B, Hkv, N, D)."""
        b, h, _, d = shape
        spec = self.spec = getattr(scheme.layers[i], kind)
        self.flush, self.residual = getattr(scheme.layers[i], f"{kind}_flush"), scheme.residual
        self.n_body = torch.zeros(b, dtype=torch.long)
        self.tail = torch.zeros(b, h, max(self.residual, 1), d, device=device, dtype=dtype)
        self.exact = self.body = None
        if spec is None:
            self.exact = torch.zeros(shape, device=device, dtype=dtype)
        elif spec.method == "turboquant":
            split = getattr(params, f"{kind}_split").get(i)
            self.body = TurboBody.allocate(spec, shape, device, dtype, split)
        else:
            static_range = getattr(params, f"{kind}_range").get(i)
            codebook = getattr(params, f"{kind}_codebook").get(i)
            self.body = PackedBody.allocate(spec, shape, device, dtype, static_range, codebook)
        self.packs = spec is not None and kernel_layout(spec) and qp.supports(spec, d)

    def targets(self, stored: torch.Tensor) -> torch.Tensor:
        """Body sizes once `stored` tokens are in (LongTensor[B]): what the next token must see
        quantized (everything, for a tensor left in full precision)."""
        if self.spec is None:
            return stored
        return quantized_prefix(stored, self.residual, self.flush)

    def write(self, seq, start, x: torch.Tensor, is_sink: torch.Tensor, kernel: bool) -> None:
        """Move x [M, Hkv, n, D] to body slots [start[m], start[m] + n) of sequence seq[m]
        (seq, start: LongTensor[M] on x's device); is_sink bool [B, N] masks kept sinks;
        through the quant_pack kernel when `kernel` and it handles the spec."""
        if self.spec is None:
            pos = start[:, None] + torch.arange(x.shape[2], device=x.device)
            self.exact[seq[:, None], :, pos] = x.transpose(1, 2)
        elif isinstance(self.body, TurboBody):
            self.body.write(x, seq, start)
        elif kernel and self.packs:
            qp.quant_pack(x, self.body, seq, start, is_sink)
        else:
            qp.quant_pack_reference(x, self.body, seq, start, is_sink)

    def read(self, b: int, n: int, dtype) -> torch.Tensor:
        """Positions [0, n) of sequence b's body, dequantized: [Hkv, n, D]."""
        if self.spec is None:
            return self.exact[b, :, :n]
        return self.body.dequantize(b, n, dtype)

    def stored(self, n_body: torch.Tensor) -> Stored:
        return Stored(self.body if self.body is not None else self.exact, self.tail, n_body)

    def view(self, b: int) -> "_Stream":
        v = copy.copy(self)
        v.tail = self.tail[b : b + 1]
        v.exact = self.exact[b : b + 1] if self.exact is not None else None
        v.body = self.body.view(b) if self.body is not None else None
        v.n_body = self.n_body[b : b + 1]  # a view: the parent sees the update
        return v


@dataclass
class _Moves:
    """What one decode step (T = 1) does to every stream sharing a flush rule.

    n_body, target   LongTensor[B] on the CPU: body sizes before and after the step
    groups           per flushed block size k: (seq [M], start [M], ring slot [M, k], is_new
                     bool [M, k]) on the device; the flushed positions start + arange(k) are
                     in the ring, or the new token itself
    ring             (seq, slot) on the device: sequences whose new token enters the ring
    """

    n_body: torch.Tensor
    target: torch.Tensor
    groups: list
    ring: tuple


class QuantizedCache:
    """A KV cache following a KVScheme; see the module docstring for the layout.

    transforms: where each layer's smoothing and rotations are (`Transforms`): the cache applies
    the online ones and never applies a fused one again.
    use_kernels: True / False forces the Triton kernels on or off; None (auto) uses them where
    they run (`kernels.layout.use_triton`); the attribute `kernels` may be flipped between steps
    (both paths store the same bits). Layers a kernel does not handle (outliers) use the
    reference path, with one warning.
    """

    def __init__(
        self,
        scheme: KVScheme,
        params: KVParams,
        transforms: Transforms,
        *,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        device,
        dtype: torch.dtype,
        use_kernels: bool | None = None,
    ):
        if len(scheme.layers) != num_layers:
            raise FormatError(
                f"the KV scheme has {len(scheme.layers)} layers, the model {num_layers}"
            )
        self.kernels = use_triton(device) if use_kernels is None else use_kernels
        if self.kernels and not use_triton(device):
            raise ValueError(
                f"use_kernels=True needs a CUDA device or TRITON_INTERPRET=1 (device is {device})"
            )
        _check_fits(scheme, batch, kv_heads, head_dim, max_len, device, dtype)
        if len(transforms.layers) != num_layers:
            raise FormatError(
                f"the transforms cover {len(transforms.layers)} layers, the model {num_layers}"
            )
        self.scheme, self.params, self.transforms = scheme, params, transforms
        self.max_len, self.dtype = max_len, dtype
        shape = (batch, kv_heads, max_len, head_dim)

        alloc = (scheme, params, shape, device, dtype)
        self.keys = [_Stream("key", i, *alloc) for i in range(num_layers)]
        self.values = [_Stream("value", i, *alloc) for i in range(num_layers)]
        slots = max(scheme.num_sink_slots, 1)
        self.sink_k = torch.zeros(
            num_layers, batch, kv_heads, slots, head_dim, device=device, dtype=dtype
        )
        self.sink_v = torch.zeros_like(self.sink_k)
        self.sink_pos = torch.full((batch, slots), -1, dtype=torch.long)
        self.is_sink = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self._pending = {}
        self._pending_flags = None
        self._step = None  # device copies of lengths / n_body / sink_pos for this forward
        self._decodable = [
            all(kernel_layout(s.spec) and dec.supports(s.spec) for s in (k, v))
            for k, v in zip(self.keys, self.values, strict=True)
        ]
        self._warned = False

    # -- the cache interface -------------------------------------------------------------------

    def positions(self, T: int) -> torch.Tensor:
        self._step = None
        return (self.lengths[:, None] + torch.arange(T)).to(self.is_sink.device)

    def attend(self, layer, q, k, v, rope: Rope, positions) -> torch.Tensor:
        """q [B, H, T, D] post-RoPE, k [B, Hkv, T, D] pre-RoPE, v -> out [B, H, T, D]."""
        self.stage(layer, k, v, rope, positions)
        q = self.transforms.query(layer, q, self.params)
        if q.shape[2] == 1 and self.kernels and self._decodable[layer]:
            out = self._decode(layer, q, rope)
        else:
            if q.shape[2] == 1 and self.kernels and not self._warned:
                self._warned = True
                warnings.warn(
                    f"layer {layer} stores what the decode kernel does not read (outlier slots, "
                    "joined heads or a peer's own numerics): such layers decode through the "
                    "slower reference path",
                    stacklevel=2,
                )
            keys, values, valid = self._gather(layer, rope)
            out = _attention(q, keys, values, valid, causal=int(self.lengths.max()) == 0)
        return self.transforms.value_out(layer, out)

    def observe_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        sp = self.params.sink_predictor
        if sp is not None and self.scheme.sink_budget and layer == sp.layer:
            self._pending_flags = sp(hidden)  # [B, T]

    def commit(self, T: int) -> None:
        flags = self._pending_flags
        rows, slots, _ = self._decide_sinks(T, flags.cpu() if flags is not None else None)
        if T == 1:
            self._append_one(rows, slots)
        else:
            for b in range(len(self.lengths)):
                n = int(self.lengths[b])
                for layer, (k, v) in self._pending.items():
                    self._flush(self.keys[layer], b, n, k[b], layer, self.sink_k)
                    self._flush(self.values[layer], b, n, v[b], layer, self.sink_v)
        self.lengths += T
        self._pending.clear()
        self._pending_flags = None
        self._step = None

    def view(self, b: int) -> "QuantizedCache":
        view = copy.copy(self)
        view.keys = [s.view(b) for s in self.keys]
        view.values = [s.view(b) for s in self.values]
        view.sink_k, view.sink_v = self.sink_k[:, b : b + 1], self.sink_v[:, b : b + 1]
        view.sink_pos, view.is_sink = self.sink_pos[b : b + 1], self.is_sink[b : b + 1]
        view.lengths = self.lengths[b : b + 1]
        view._pending, view._step = {}, None
        return view

    def reset(self) -> None:
        self.lengths.zero_()
        self.sink_pos.fill_(-1)
        self.is_sink.zero_()
        self._step = None
        for s in self.keys + self.values:
            s.n_body.zero_()

    def parts(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the cache holds, by part: "body" (the quantized bodies with their
        per-layer constants, and tensors left in full precision), "ring" (the residual
        windows), "sinks" (sink slots and their positions), "bookkeeping" (lengths, body sizes,
        the is-sink map)."""
        streams = self.keys + self.values
        return {
            "body": [t for s in streams for t in (s.body.tensors() if s.body else [s.exact])],
            "ring": [s.tail for s in streams],
            "sinks": [self.sink_k, self.sink_v, self.sink_pos],
            "bookkeeping": [self.is_sink, self.lengths, *(s.n_body for s in streams)],
        }

    def memory(self) -> dict[str, int]:
        """Bytes per part (`parts`), walked over the buffers, each storage counted once."""
        seen, out = set(), {}
        for part, tensors in self.parts().items():
            out[part] = 0
            for t in tensors:
                key = (
                    id(t) if t.device.type == "meta" else (t.device, t.untyped_storage().data_ptr())
                )
                if key not in seen:
                    seen.add(key)
                    out[part] += t.untyped_storage().nbytes()
        return out

    def allocated_bytes(self) -> int:
        """The bytes of every buffer the cache holds, walked."""
        return sum(self.memory().values())

    def bytes_per_token(self) -> float:
        """Allocated bytes per token slot of one sequence: allocated_bytes / (B * max_len)."""
        return self.allocated_bytes() / (len(self.lengths) * self.max_len)

    def stage(self, layer: int, k, v, rope: Rope, positions) -> None:
        """Hold one layer's new tokens (k [B, Hkv, T, D] pre-RoPE, v) exact until `commit`.

        Both go into the layer's domain first (`transforms`)."""
        self._check_capacity(k.shape[2])
        k = self.transforms.key_in(layer, k, self.params)
        v = self.transforms.value_in(layer, v)
        self._pending[layer] = (self._to_domain(layer, k, rope, positions), v)

    # -- reading ---------------------------------------------------------------------------------

    def materialize(self, layer: int, rope: Rope):
        """Keys and values as attention sees them, in position order, post-RoPE and back in the
        weights' domain (what the model's own attention expects): ([B, Hkv, N, D],
        [B, Hkv, N, D], valid bool [B, N]) with N = max(lengths) + T."""
        keys, values, valid = self._gather(layer, rope)
        keys = self.transforms.key_rotate(layer, keys, inverse=True)
        keys = self.transforms.key_out(layer, keys, self.params)
        return keys, self.transforms.value_out(layer, values), valid

    def _gather(self, layer: int, rope: Rope):
        k_new, v_new = self._pending[layer]
        B, hkv, T, d = v_new.shape
        N = int(self.lengths.max()) + T
        keys = torch.zeros(B, hkv, N, d, device=v_new.device, dtype=self.dtype)
        values = torch.zeros_like(keys)
        valid = torch.zeros(B, N, dtype=torch.bool, device=v_new.device)
        for b in range(B):
            n = int(self.lengths[b])
            keys[b, :, :n] = self._read(self.keys[layer], b, n, layer, self.sink_k)
            values[b, :, :n] = self._read(self.values[layer], b, n, layer, self.sink_v)
            keys[b, :, n : n + T], values[b, :, n : n + T] = k_new[b], v_new[b]
            valid[b, : n + T] = True
        if self.scheme.layers[layer].key_position == "pre_rope":
            keys = rope.apply(keys, torch.arange(N, device=keys.device).expand(B, N))
        return keys, values, valid

    def _read(self, stream: _Stream, b: int, n: int, layer: int, sink_slots) -> torch.Tensor:
        """Positions [0, n) of sequence b as stored: body dequantized, sinks exact, tail exact."""
        nb = int(stream.n_body[b])
        out = stream.tail.new_empty(
            stream.tail.shape[1], n, stream.tail.shape[-1], dtype=self.dtype
        )
        out[:, :nb] = stream.read(b, nb, self.dtype)
        for slot, pos in enumerate(self.sink_pos[b].tolist()):
            if 0 <= pos < nb:
                out[:, pos] = sink_slots[layer, b, :, slot]
        if n > nb:
            slots = torch.arange(nb, n) % stream.tail.shape[2]
            out[:, nb:n] = stream.tail[b][:, slots]
        return out

    def _decode(self, layer: int, q: torch.Tensor, rope: Rope) -> torch.Tensor:
        """One new token per sequence through the decode kernel."""
        if self._step is None:
            streams = self.keys + self.values
            host = torch.cat(
                [self.lengths[None], torch.stack([s.n_body for s in streams]), self.sink_pos.T]
            )
            dev = host.to(device=q.device, dtype=torch.int32)
            self._step = (dev[0], dev[1 : 1 + len(streams)], dev[1 + len(streams) :].T.contiguous())
        lengths, n_body, sink_pos = self._step
        keys = self.keys[layer].stored(n_body[layer])
        values = self.values[layer].stored(n_body[len(self.keys) + layer])
        sinks = Sinks(self.sink_k[layer], self.sink_v[layer], sink_pos, self.is_sink)
        pre_rope = self.scheme.layers[layer].key_position == "pre_rope"
        inv_freq = rope.inv_freq.to(q.device) if pre_rope else None
        k_new, v_new = self._pending[layer]
        longest = int(self.lengths.max())
        return dec.decode_attention(
            q, k_new, v_new, keys, values, sinks, lengths, longest, inv_freq=inv_freq
        )

    # -- writing ---------------------------------------------------------------------------------

    def _to_domain(self, layer: int, k: torch.Tensor, rope: Rope, positions) -> torch.Tensor:
        scheme = self.scheme.layers[layer]
        if scheme.key_position == "pre_rope":
            return k
        return self.transforms.key_rotate(layer, rope.apply(k, positions))

    def _decide_sinks(self, T: int, flags):
        """First-N positions, then predicted ones (flags bool [B, T] on the CPU, or None) while
        sink slots last, in position order. Returns the new sinks' (rows, slots, positions)."""
        s = self.scheme
        pos = self.lengths[:, None] + torch.arange(T)  # [B, T]
        sink, slot = pos < s.sinks_first, pos.clone()
        if flags is not None:
            candidate = flags & ~sink
            used = (self.sink_pos >= s.sinks_first).sum(1, keepdim=True)
            rank = used + candidate.cumsum(1)  # 1-based, among predicted sinks
            taken = candidate & (rank <= s.sink_budget)
            sink |= taken
            slot = torch.where(taken, s.sinks_first + rank - 1, slot)
        rows, cols = sink.nonzero(as_tuple=True)
        slots, positions = slot[rows, cols], pos[rows, cols]
        self.sink_pos[rows, slots] = positions
        device = self.is_sink.device
        self.is_sink[rows.to(device), positions.to(device)] = True
        return rows, slots, positions

    def _flush(self, stream: _Stream, b: int, n: int, new: torch.Tensor, layer, sink_slots) -> None:
        """Store the T new tokens of sequence b (new [Hkv, T, D]) and flush to the target."""
        T = new.shape[1]
        for slot, pos in enumerate(self.sink_pos[b].tolist()):
            if n <= pos < n + T:
                sink_slots[layer, b, :, slot] = new[:, pos - n]
        nb, target = int(stream.n_body[b]), int(stream.targets(torch.tensor(n + T)))
        if target > nb:
            ring = stream.tail.shape[2]
            old = stream.tail[b][:, torch.arange(nb, n) % ring] if n > nb else new[:, :0]
            block = torch.cat([old, new], dim=1)[:, : target - nb]
            where = torch.tensor([[b], [nb]], device=new.device)
            stream.write(where[0], where[1], block[None], self.is_sink, self.kernels)
            stream.n_body[b] = target
        start = max(n, target)
        if start < n + T and stream.residual:
            slots = torch.arange(start, n + T) % stream.tail.shape[2]
            stream.tail[b][:, slots] = new[:, start - n :]

    def _append_one(self, rows, slots) -> None:
        """commit(1) for every sequence at once: sink slots (new sinks at rows/slots), flushes
        batched over the sequences that flush, ring writes; no loop over sequences."""
        device = self.is_sink.device
        rows, slots = rows.to(device), slots.to(device)
        moves = {}
        for layer, (k, v) in self._pending.items():
            for stream, new, sink_slots in (
                (self.keys[layer], k[:, :, 0], self.sink_k),
                (self.values[layer], v[:, :, 0], self.sink_v),
            ):
                if len(rows):
                    sink_slots[layer][rows, :, slots] = new[rows]
                key = (stream.spec is None, stream.flush)
                if key not in moves or not torch.equal(moves[key].n_body, stream.n_body):
                    moves[key] = self._moves(stream)
                move = moves[key]
                for seq, start, ring_slot, is_new in move.groups:
                    old = stream.tail[seq[:, None], :, ring_slot]  # [M, k, Hkv, D]
                    x = torch.where(is_new[..., None, None], new[seq][:, None], old)
                    stream.write(seq, start, x.transpose(1, 2), self.is_sink, self.kernels)
                stream.n_body.copy_(move.target)
                if stream.residual:
                    seq, ring_slot = move.ring
                    stream.tail[seq, :, ring_slot] = new[seq]

    def _moves(self, stream: _Stream) -> _Moves:
        n, nb, ring = self.lengths, stream.n_body, stream.tail.shape[2]
        target = torch.maximum(stream.targets(n + 1), nb)
        count, device = target - nb, self.is_sink.device
        groups = []
        for k in count[count > 0].unique().tolist():
            seq = (count == k).nonzero()[:, 0]
            pos = nb[seq, None] + torch.arange(k)  # [M, k]
            groups.append(
                tuple(t.to(device) for t in (seq, nb[seq], pos % ring, pos >= n[seq, None]))
            )
        keep = (target <= n).nonzero()[:, 0]
        return _Moves(nb.clone(), target, groups, (keep.to(device), (n[keep] % ring).to(device)))

    def _check_capacity(self, T: int) -> None:
        if int(self.lengths.max()) + T > self.max_len:
            raise CapacityError(
                f"the KV cache holds {self.lengths.tolist()} tokens per sequence and {T} more "
                f"do not fit in max_len = {self.max_len}: build a larger cache or shorten the input"
            )


def kernel_layout(spec) -> bool:
    """Whether a tensor stored with spec (None: full precision) can be given to the Triton
    kernels at all: they implement the "affine" numerics only; `supports()` of each kernel
    decides the rest."""
    return spec is None or spec.method == "affine"


def _free_bytes(device) -> int | None:
    """Free memory of a CUDA device; None elsewhere (no check)."""
    device = torch.device(device)
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _check_fits(scheme, batch, kv_heads, head_dim, max_len, device, dtype) -> None:
    bits = torch.empty((), dtype=dtype).element_size() * 8
    need = storage_bits(scheme, kv_heads, head_dim, max_len, batch=batch, exact_bits=bits).bytes
    free = _free_bytes(device)
    if free is not None and need > free:
        raise CapacityError(
            f"a KV cache for {batch} sequences of max_len = {max_len} needs {need / 2**30:.2f} "
            f"GiB and {device} has {free / 2**30:.2f} GiB free: lower max_len or the batch"
        )


def _attention(q, keys, values, valid, causal: bool = False) -> torch.Tensor:
    """q [B, H, T, D] over keys/values [B, Hkv, N, D]; the T queries are the last valid T keys of
    each sequence (causal among them). valid bool [B, N]; `causal` when every key is valid and
    N == T (a first prefill)."""
    if causal:
        return F.scaled_dot_product_attention(
            q, keys, values, is_causal=q.shape[2] > 1, enable_gqa=True
        )
    T, N = q.shape[2], keys.shape[2]
    qpos = valid.sum(-1)[:, None] - T + torch.arange(T, device=q.device)  # [B, T]
    mask = torch.arange(N, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, T, N]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)


def planned_memory(
    scheme: KVScheme,
    params: KVParams,
    transforms: Transforms,
    *,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    context: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float16,
) -> dict[str, int]:
    """`QuantizedCache.memory()` of a cache for `batch` sequences of `context` tokens, built on
    the meta device: the buffers' real sizes, nothing allocated."""
    cache = QuantizedCache(
        scheme,
        params,
        transforms,
        num_layers=num_layers,
        batch=batch,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_len=context,
        device="meta",
        dtype=dtype,
        use_kernels=False,
    )
    return cache.memory()
