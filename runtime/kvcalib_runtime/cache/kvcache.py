"""The quantized KV cache: [sinks | packed quantized body | full-precision residual window].

It implements the cache interface of `FullPrecisionCache` (positions / attend / observe_hidden /
commit / view / reset) and follows the decode rule of `kvcalib_runtime.cache.scheme`. Storage, per
layer, for B sequences of up to N tokens, Hkv KV heads of D channels (`kvstream.Stream`):

    body         what the spec's layout allocates (a layouts.body.Body), e.g. a PackedBody:
                 codes uint8 [B, Hkv, S, ceil(D * bits / 8)] and
                 scale/offset per group of channels of a token [B, Hkv, S, D/g], per group of
                 tokens of a channel [B, Hkv, S/G, D], or per channel ("static", from the
                 calibrated range); K outlier slots per row (index + delta) when the scheme
                 keeps outliers. S = N, or for a sliding-window layer a ring (scheme.body_slots)
    exact        dtype [B, Hkv, S, D] instead of a body, for a tensor left in full precision
    tail         dtype [B, Hkv, max(R, 1), D]  ring of the residual window, slot = position % R
    sink slots   dtype [L, B, Hkv, S', D], S' = sinks_first + sink_budget, and per sequence the
                 positions they hold (int64 [B, S'], -1 while empty); a sink's body slot is
                 masked out of ranges and attention (is_sink bool [B, N])
    lengths      int64 [B] on the device (and its host mirror, Python ints, for capacity
                 checks and the prefill path); n_body int64 [2L, B] on the device

Keys and values are stored in the scheme's domain (`kvcalib_runtime.model.transforms`): keys
pre-RoPE (RoPE is applied when they are read), or post-RoPE; queries meet them in that domain, and
an attention output over values kept in a rotated domain is rotated back.

Memory is what the buffers hold: `allocated_bytes` walks them, and a plan (`memory.planned_memory`,
the capacity check, every bit count) walks the same buffers of a cache built on the meta device.

New tokens are held exact until `commit`, when every layer has seen them and the sink predictor
has flagged them: sinks are decided then (in position order), and each tensor flushes the
positions the next token must see quantized: [n_body, n_q(lengths + T)).

A decode step (T = 1) runs on the device alone — the decode kernel (or its torch reference)
reads lengths and body sizes there, sinks and flushes are decided there — so it issues no host
synchronization and a CUDA graph can capture it (`capture`, `replayed`). Without the kernel, a
cache on the CPU decodes through `kernels.decode_torch` (the reference's result from the
positions each sequence holds, read on the host), any other through the reference. A prefill (T > 1)
takes the reference path (`_gather` + `attention.causal_attention`, per sequence); flushes go
through the quant_pack kernel where it runs. Sinks are decided in `sinks`.
"""

import contextlib
import copy
import warnings

import torch

from kvcalib_runtime.cache import memory, sinks
from kvcalib_runtime.cache.attention import causal_attention
from kvcalib_runtime.cache.held import HeldBodies
from kvcalib_runtime.cache.kvstream import Stream, kernel_layout
from kvcalib_runtime.cache.scheme import KVParams, KVScheme
from kvcalib_runtime.errors import CapacityError, FormatError
from kvcalib_runtime.kernels import (
    commit_native,
    decode_native,
    decode_reference,
    decode_torch,
    native,
    use_triton,
)
from kvcalib_runtime.kernels import decode_attention as dec
from kvcalib_runtime.kernels.operands import Sinks
from kvcalib_runtime.model.rope import Rope
from kvcalib_runtime.model.transforms import Transforms


class QuantizedCache:
    """A KV cache following a KVScheme; see the module docstring for the layout.

    transforms: where each layer's smoothing and rotations are (`Transforms`): the cache applies
    the online ones and never applies a fused one again.
    windows: per layer, the sliding window (None: global attention), as `Geometry.windows`.
    use_kernels: True / False forces the Triton kernels on or off; None (auto) uses them where
    they run (`kernels.use_triton`); the attribute `kernels` may be flipped between steps
    (both paths store the same bits). Layers the decode kernel does not read (`dec.supports`)
    use its torch reference, with one warning. softcap: Gemma 2's attention-score cap (scores s
    become softcap * tanh(s / softcap)); the decode kernel does not cap, so such a model attends
    through the dequantize-then-attend path. keep_dequantized: the reference read of the history
    (`materialize`, a prefill's gather) keeps each body dequantized and extends it by what was
    committed since (`held.HeldBodies`: the same bits, scratch memory of up to one dtype copy of
    every body); for a cache read whole at every step, as a transformers cache is.
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
        windows: tuple[int | None, ...] | None = None,
        softcap: float | None = None,
        keep_dequantized: bool = False,
    ):
        if len(scheme.layers) != num_layers:
            raise FormatError(
                f"the KV scheme has {len(scheme.layers)} layers, the model {num_layers}"
            )
        windows = tuple(windows) if windows is not None else (None,) * num_layers
        if len(windows) != num_layers:
            raise FormatError(f"windows has {len(windows)} entries, the model {num_layers} layers")
        self.kernels = use_triton(device) if use_kernels is None else use_kernels
        if self.kernels and not use_triton(device):
            raise ValueError(
                f"use_kernels=True needs a CUDA device or TRITON_INTERPRET=1 (device is {device})"
            )
        if len(transforms.layers) != num_layers:
            raise FormatError(
                f"the transforms cover {len(transforms.layers)} layers, the model {num_layers}"
            )
        sizes = dict(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        memory.check_fits(scheme, params, transforms, batch, max_len, device, windows, sizes)
        on_meta = torch.device(device).type == "meta"
        if not on_meta and params.key_smooth:  # queries meet them every step: keep them here
            smooth = {i: s.to(device) for i, s in params.key_smooth.items()}
            params = copy.copy(params)
            params.key_smooth = smooth
        self.scheme, self.params, self.transforms = scheme, params, transforms
        self.max_len, self.dtype, self.windows = max_len, dtype, windows
        self.softcap = softcap
        shape = (batch, kv_heads, max_len, head_dim)
        self._n_body = torch.zeros(2 * num_layers, batch, dtype=torch.long, device=device)
        alloc = (scheme, params, shape, device, dtype)
        self.keys = [
            Stream("key", i, *alloc, windows[i], self._n_body[i]) for i in range(num_layers)
        ]
        self.values = [
            Stream("value", i, *alloc, windows[i], self._n_body[num_layers + i])
            for i in range(num_layers)
        ]
        slots = max(scheme.num_sink_slots, 1)
        sinks = (num_layers, batch, kv_heads, slots, head_dim)
        self.sink_k = torch.zeros(sinks, device=device, dtype=dtype)
        self.sink_v = torch.zeros(sinks, device=device, dtype=dtype)
        self.sink_pos = torch.full((batch, slots), -1, dtype=torch.long, device=device)
        self.is_sink = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self._filled = [0] * batch  # the host's copy of lengths, shared with views
        self._rows = list(range(batch))  # the entries of _filled this cache (or view) covers
        sp = params.sink_predictor
        self._sink_dims = None
        if sp is not None and scheme.sink_budget and not on_meta:
            self._sink_dims = torch.tensor(sp.dims, device=device)
        self._pending = {}
        self._pending_flags = None
        self._plan, self._plan_made = None, False  # _commit_plan's
        self._sequences: dict = {}  # _prepared's, by layer
        self._held = HeldBodies(dtype) if keep_dequantized else None
        pairs = list(zip(self.keys, self.values, strict=True))
        # layers whose storage the decode kernel's layout describes (its reference reads it too)
        self._layouts = [kernel_layout(k.spec) and kernel_layout(v.spec) for k, v in pairs]
        self._decodable = [
            layout
            and dec.supports(k.spec, head_dim, kv_heads)
            and dec.supports(v.spec, head_dim, kv_heads)
            for layout, (k, v) in zip(self._layouts, pairs, strict=True)
        ]
        self._warned = False

    # -- the cache interface -------------------------------------------------------------------

    def positions(self, T: int) -> torch.Tensor:
        return self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def attend(self, layer, q, k, v, rope: Rope, positions) -> torch.Tensor:
        """q [B, H, T, D] post-RoPE, k [B, Hkv, T, D] pre-RoPE, v -> out [B, H, T, D]."""
        self.stage(layer, k, v, rope, positions)
        q = self.transforms.query(layer, q, self.params)
        if q.shape[2] == 1 and self._layouts[layer] and self.softcap is None:
            out = self._decode(layer, q, rope)
        else:
            if q.shape[2] == 1 and self.kernels and not self._layouts[layer] and not self._warned:
                self._warned = True
                pair = (self.keys[layer].spec, self.values[layer].spec)
                names = sorted({s.layout.name for s in pair if not kernel_layout(s)})
                warnings.warn(
                    f"layer {layer} stores layout {' and '.join(names)}, whose own numerics the "
                    "decode kernel and its reference do not read: it decodes through the slower "
                    "dequantize-then-attend path",
                    stacklevel=2,
                )
            keys, values, valid = self._gather(layer, rope)
            window = self.windows[layer]
            causal = max(self._host()) == 0
            out = causal_attention(q, keys, values, valid, causal, window, self.softcap)
        return self.transforms.value_out(layer, out)

    def observe_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        sp = self.params.sink_predictor
        if sp is not None and self.scheme.sink_budget and layer == sp.layer:
            self._pending_flags = sp(hidden, self._sink_dims)  # [B, T]

    def commit(self, T: int) -> None:
        if T == 1:
            self._commit_one(self._pending_flags)
        else:
            flags = self._pending_flags
            flags = flags.cpu() if flags is not None else None
            s = self.scheme
            sink_pos = sinks.decide(self.sink_pos, self.is_sink, self._host(), T, flags,
                                    s.sinks_first, s.sink_budget)  # fmt: skip
            for b, n in enumerate(self._host()):
                for layer, (k, v) in self._pending.items():
                    sides = ((self.keys, k, self.sink_k), (self.values, v, self.sink_v))
                    for streams, new, slots in sides:
                        sinks.store(slots[layer, b], sink_pos[b], n, new[b])
                        streams[layer].store(b, n, new[b], self.is_sink, self.kernels)
        self.lengths += T
        self.replayed(T)
        self._pending.clear()
        self._pending_flags = None

    def view(self, b: int) -> "QuantizedCache":
        view = copy.copy(self)
        view.keys = [s.view(b) for s in self.keys]
        view.values = [s.view(b) for s in self.values]
        view.sink_k, view.sink_v = self.sink_k[:, b : b + 1], self.sink_v[:, b : b + 1]
        view.sink_pos, view.is_sink = self.sink_pos[b : b + 1], self.is_sink[b : b + 1]
        view.lengths, view._n_body = self.lengths[b : b + 1], self._n_body[:, b : b + 1]
        view._rows = [self._rows[b]]
        view._pending, view._pending_flags = {}, None
        view._plan, view._plan_made = None, False
        view._sequences = {}
        return view

    def reset(self) -> None:
        self.lengths.zero_()
        self.sink_pos.fill_(-1)
        self.is_sink.zero_()
        self._n_body.zero_()
        for r in self._rows:
            self._filled[r] = 0
        self._rewound()

    def snapshot(self) -> memory.Snapshot:
        """A copy of everything the cache holds (every buffer of `parts` and the lengths), for
        `restore`: forwards in between (a teacher-forced score of a continuation not kept) are
        undone."""
        buffers = {id(t): t for ts in self.parts().values() for t in ts}
        return memory.Snapshot(self, [(t, t.clone()) for t in buffers.values()], self._host())

    def restore(self, snap: memory.Snapshot) -> None:
        """Put back what `snapshot` copied (this cache's own); tokens staged and not committed
        are dropped."""
        if snap.owner is not self:
            raise ValueError("a snapshot is restored into the cache (or view) that took it")
        for t, saved in snap.buffers:
            t.copy_(saved)
        for r, n in zip(self._rows, snap.lengths, strict=True):
            self._filled[r] = n
        self._pending.clear()
        self._pending_flags = None
        self._rewound()

    def _rewound(self) -> None:
        """After the lengths went back: the dequantized copies keep what is still stored."""
        if self._held is not None:
            lengths = {r: self._filled[r] for r in self._rows}
            self._held.rewind(lengths, (self.keys, self.values))

    # -- CUDA graphs ---------------------------------------------------------------------------

    @property
    def capturable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph: on CUDA (the step is device
        work only on the kernel and the reference path alike)."""
        return self.lengths.device.type == "cuda"

    @contextlib.contextmanager
    def capture(self):
        """Around the capture of one decode step: the host side of its commit (the lengths'
        mirror) is undone afterwards; call `replayed(1)` after each replay instead."""
        saved = list(self._filled)
        try:
            yield self
        finally:
            self._filled[:] = saved

    def replayed(self, T: int) -> None:
        """The host side of commit(T): the lengths' mirror moves on."""
        for r in self._rows:
            self._filled[r] += T

    def check_capacity(self, T: int) -> None:
        """CapacityError unless T more tokens fit in every sequence."""
        if max(self._host()) + T > self.max_len:
            raise CapacityError(
                f"the KV cache holds {self._host()} tokens per sequence and {T} more do not fit "
                f"in max_len = {self.max_len}: build a larger cache or shorten the input"
            )

    # -- memory --------------------------------------------------------------------------------

    def parts(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the cache holds, by part: "body" (the quantized bodies with their
        per-layer constants, and tensors left in full precision), "ring" (the residual
        windows), "sinks" (sink slots and their positions), "bookkeeping" (lengths, body sizes,
        the is-sink map)."""
        streams = self.keys + self.values
        return {
            "body": [t for s in streams for t in s.tensors()],
            "ring": [s.tail for s in streams],
            "sinks": [self.sink_k, self.sink_v, self.sink_pos],
            "bookkeeping": [self.is_sink, self.lengths, self._n_body],
        }

    def memory(self) -> dict[str, int]:
        """Bytes per part (`parts`), walked over the buffers, each storage counted once."""
        return memory.walk(self.parts())

    def allocated_bytes(self) -> int:
        """The bytes of every buffer the cache holds, walked."""
        return sum(self.memory().values())

    def bytes_per_token(self) -> float:
        """Allocated bytes per token slot of one sequence: allocated_bytes / (B * max_len)."""
        return self.allocated_bytes() / (len(self._rows) * self.max_len)

    def stage(self, layer: int, k, v, rope: Rope, positions) -> None:
        """Hold one layer's new tokens (k [B, Hkv, T, D] pre-RoPE, v) exact until `commit`.

        Both go into the layer's domain first (`transforms`)."""
        self.check_capacity(k.shape[2])
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

    def _host(self) -> list[int]:
        return [self._filled[r] for r in self._rows]

    def _gather(self, layer: int, rope: Rope):
        """Every position as stored, and the new ones: ([B, Hkv, N, D] x 2, valid bool [B, N]);
        positions a sliding window's ring no longer holds are zeros (outside every window)."""
        k_new, v_new = self._pending[layer]
        B, hkv, T, d = v_new.shape
        lengths = self._host()
        N = max(lengths) + T
        keys = torch.zeros(B, hkv, N, d, device=v_new.device, dtype=self.dtype)
        values = torch.zeros_like(keys)
        valid = torch.zeros(B, N, dtype=torch.bool, device=v_new.device)
        sink_pos = self.sink_pos.tolist()
        for b, n in enumerate(lengths):
            self._read(0, layer, b, n, sink_pos, keys[b])
            self._read(1, layer, b, n, sink_pos, values[b])
            keys[b, :, n : n + T], values[b, :, n : n + T] = k_new[b], v_new[b]
            valid[b, : n + T] = True
        if self.scheme.layers[layer].key_position == "pre_rope":
            keys = rope.apply(keys, torch.arange(N, device=keys.device).expand(B, N))
        return keys, values, valid

    def _read(self, side: int, layer: int, b: int, n: int, sink_pos, out):
        """Positions [0, n) of sequence b's keys (side 0) or values (1) as stored into
        out [Hkv, >= n, D]: body dequantized (or its held copy), sinks exact, tail exact."""
        stream = (self.keys, self.values)[side][layer]
        sink_slots = (self.sink_k, self.sink_v)[side]
        nb = stream.host_body(n)
        if self._held is not None:
            first, body = self._held.read(stream, (side, layer, self._rows[b]), b, nb)
        else:
            first, body = stream.read(b, nb, self.dtype)
        out[:, first:nb] = body
        for slot, pos in enumerate(sink_pos[b]):
            if 0 <= pos < nb:
                out[:, pos] = sink_slots[layer, b, :, slot]
        if n > nb:
            slots = torch.arange(nb, n, device=out.device) % stream.tail.shape[2]
            out[:, nb:n] = stream.tail[b][:, slots]

    def _decode(self, layer: int, q: torch.Tensor, rope: Rope) -> torch.Tensor:
        """One new token per sequence: the decode kernel, or its torch reference."""
        keys, values = self.keys[layer].stored(), self.values[layer].stored()
        sinks = Sinks(self.sink_k[layer], self.sink_v[layer], self.sink_pos, self.is_sink)
        pre_rope = self.scheme.layers[layer].key_position == "pre_rope"
        inv_freq = rope.inv_freq.to(q.device) if pre_rope else None
        k_new, v_new = self._pending[layer]
        args = (q, k_new, v_new, keys, values, sinks, self.lengths)
        options = dict(inv_freq=inv_freq, window=self.windows[layer])
        if self.kernels and self._decodable[layer]:
            return dec.decode_attention(*args, **options)
        if self.kernels and not self._warned:
            self._warned = True
            warnings.warn(
                f"layer {layer} stores what the decode kernel does not read (a half head of "
                "codes that is not whole bytes, or token groups of a non-power-of-two size "
                "per channel): such layers decode through the slower torch reference",
                stacklevel=3,
            )
        if q.device.type == "cpu":
            prepared = self._prepared(layer)
            host = self._host()
            if (
                prepared is not None
                and q.dtype == torch.float32
                and max(host) <= min(self.keys[layer].slots, self.values[layer].slots)
            ):
                bodies = (self.keys[layer].n_body.tolist(), self.values[layer].n_body.tolist())
                return decode_torch.attend_prepared(prepared, q, k_new, v_new, host, bodies,
                                                    **options)  # fmt: skip
            return decode_torch.decode_attention_torch(*args, **options)
        return decode_reference.decode_attention_reference(*args, **options)

    def _prepared(self, layer: int) -> "list[decode_native.Sequence] | None":
        """The CPU decode kernel's prepared sequences of this layer (`decode_torch.prepare`),
        made on first use; None where it does not read the layer in place (or there is no C
        library)."""
        if native.library() is None:
            return None
        if layer not in self._sequences:
            keys, values = self.keys[layer].stored(), self.values[layer].stored()
            sinks = Sinks(self.sink_k[layer], self.sink_v[layer], self.sink_pos, self.is_sink)
            found = [decode_torch.prepare(keys, values, sinks, b) for b in range(len(self._rows))]
            self._sequences[layer] = None if None in found else found
        return self._sequences[layer]

    # -- writing ---------------------------------------------------------------------------------

    def _to_domain(self, layer: int, k: torch.Tensor, rope: Rope, positions) -> torch.Tensor:
        scheme = self.scheme.layers[layer]
        if scheme.key_position == "pre_rope":
            return k
        return self.transforms.key_rotate(layer, rope.apply(k, positions))

    def _commit_one(self, flags) -> None:
        """commit(1) for every sequence at once, on the device: the new token's sink decision
        (first-N, then predicted while the budget lasts), its sink slots in every layer, each
        stream's flush and ring write."""
        s, n = self.scheme, self.lengths
        sink, slot = sinks.decide_step(self.sink_pos, self.is_sink, n, flags, s.sinks_first,
                                       s.sink_budget, self.max_len)  # fmt: skip
        sinks.store_step(self.sink_k, self.sink_v, self._pending, sink, slot)
        written = set()
        plan = self._commit_plan()
        if plan is not None and plan.run(self._pending, n):
            written = plan.streams
        batches: dict = {}  # the torch path flushes the streams of one spec as one
        for layer, (k, v) in self._pending.items():
            for j, new in enumerate((k[:, :, 0], v[:, :, 0])):
                if (layer, j) in written:
                    continue
                stream = (self.keys, self.values)[j][layer]
                key = None if self.kernels and stream.packs else stream.batch_key()
                if key is None:
                    stream.append(new, n, self.is_sink, self.kernels)
                else:
                    batches.setdefault(key, []).append((stream, new))
        for streams in batches.values():
            Stream.append_many(streams, n)

    def _commit_plan(self) -> "commit_native.Plan | None":
        """The C writer's plan for the streams it takes (`commit_native.takes`), made on first
        use; None where it does not run: the Triton kernels write, no C library, or no stream it
        takes."""
        if self.kernels or native.library() is None:
            return None
        if not self._plan_made:
            self._plan_made = True
            self._plan = commit_native.plan((self.keys, self.values), len(self._rows))
        return self._plan
