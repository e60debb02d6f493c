"""The quantized KV cache: [sinks | packed quantized body | full-precision residual window].

It implements the cache interface of `FullPrecisionCache` (positions / attend / observe_hidden /
commit / view / reset) and follows the decode rule of `kvcalib_runtime.scheme`. Storage, per
layer, for B sequences of up to N tokens, Hkv KV heads of D channels:

    body codes   uint8 [B, Hkv, N, ceil(D * bits / 8)]  b-bit codes of each token, packed along
                 channels (kvcalib_runtime.packing); slot t = position t
    body scale   dtype [B, Hkv, N, D / g]   ("token": one per group of g channels of a token)
                 dtype [B, Hkv, N / G, D]   ("channel": one per group of G tokens of a channel)
                 absent for "static" (the calibrated range in KVParams); offset likewise, absent
                 when symmetric
    body exact   dtype [B, Hkv, N, D] + bool mask, only when the scheme keeps outliers (the
                 reference stores them densely; their accounted cost is 32 bits each)
    tail         dtype [B, Hkv, max(R, 1), D]  ring of the residual window, slot = position % R
    sink slots   dtype [B, Hkv, S, D], S = sinks_first + sink_budget, and per sequence the
                 positions they hold; a sink's body slot is masked out of ranges and attention

Keys are stored in the scheme's key domain: pre-RoPE (RoPE is applied when they are read), or
post-RoPE, times the online Hadamard Q when the scheme rotates keys (queries are then rotated
too). Values are stored as the model produces them (a fused value rotation is in the weights).

New tokens are held exact until `commit`, when every layer has seen them and the sink predictor
has flagged them: sinks are decided then (in position order), and each tensor flushes the
positions the next token must see quantized: [n_body, n_q(lengths + T)).
"""

import copy

import torch

from kvcalib_runtime.errors import CapacityError, FormatError
from kvcalib_runtime.hadamard import hadamard_transform
from kvcalib_runtime.packing import pack, packed_size, unpack
from kvcalib_runtime.quant import QTensor, dequantize, quantize, range_metadata
from kvcalib_runtime.rope import Rope
from kvcalib_runtime.scheme import KVParams, KVScheme, quantized_prefix_int, storage_bits


class _Stream:
    """Keys or values of one layer: quantized body + residual ring (exact if spec is None)."""

    def __init__(self, spec, flush, residual, params_range, codebook, shape, device, dtype):
        b, h, n, d = shape
        self.spec, self.flush, self.residual = spec, flush, residual
        self.range, self.codebook = params_range, codebook
        self.n_body = torch.zeros(b, dtype=torch.long)
        self.tail = torch.zeros(b, h, max(residual, 1), d, device=device, dtype=dtype)
        if spec is None:
            self.exact = torch.zeros(shape, device=device, dtype=dtype)
            return
        self.codes = torch.zeros(b, h, n, packed_size(d, spec.bits), device=device, dtype=torch.uint8)
        if spec.granularity == "token":
            meta = (b, h, n, d // spec.channel_group(d))
        elif spec.granularity == "channel":
            meta = (b, h, -(-n // spec.group_size), d)
        self.scale = torch.zeros(meta, device=device, dtype=dtype) if spec.granularity != "static" else None
        has_offset = self.scale is not None and not spec.symmetric
        self.offset = torch.zeros(meta, device=device, dtype=dtype) if has_offset else None
        self.outliers = None
        if spec.outliers > 0:
            self.outliers = (torch.zeros(shape, device=device, dtype=dtype),
                             torch.zeros(shape, device=device, dtype=torch.bool))

    def target(self, stored: int) -> int:
        """Body size once `stored` tokens are in: what the next token must see quantized."""
        if self.spec is None:
            return stored
        return quantized_prefix_int(stored, self.residual, self.flush) if self.residual else stored

    def write(self, b: int, start: int, x: torch.Tensor, sinks: torch.Tensor) -> None:
        """Move positions [start, start + n) of sequence b into the body; x [Hkv, n, D]."""
        n = x.shape[1]
        if self.spec is None:
            self.exact[b, :, start : start + n] = x
            return
        spec = self.spec
        kwargs = {"codebook": self.codebook, "exclude": sinks[None, None]}
        if self.range is not None:
            kwargs["static_range"] = tuple(r[:, None, :] for r in self.range)
        q = quantize(x[None], spec, **kwargs)
        self.codes[b, :, start : start + n] = pack(q.codes[0], spec.bits)
        if spec.granularity == "token":
            self.scale[b, :, start : start + n] = q.scale[0, ..., 0]
            if self.offset is not None:
                self.offset[b, :, start : start + n] = q.offset[0, ..., 0]
        elif spec.granularity == "channel":
            g0, g1 = start // spec.group_size, (start + n) // spec.group_size
            self.scale[b, :, g0:g1] = q.scale[0, ..., 0]
            if self.offset is not None:
                self.offset[b, :, g0:g1] = q.offset[0, ..., 0]
        if self.outliers is not None:
            self.outliers[0][b, :, start : start + n] = q.values[0]
            self.outliers[1][b, :, start : start + n] = q.exact[0]

    def read(self, b: int, n: int, dtype) -> torch.Tensor:
        """Positions [0, n) of sequence b's body, dequantized: [Hkv, n, D]."""
        if self.spec is None:
            return self.exact[b, :, :n]
        spec = self.spec
        d = self.tail.shape[-1]
        codes = unpack(self.codes[b, :, :n], spec.bits, d)[None]
        if spec.granularity == "token":
            scale = self.scale[b, :, :n, :, None][None]
            offset = self.offset[b, :, :n, :, None][None] if self.offset is not None else None
        elif spec.granularity == "channel":
            ng = -(-n // spec.group_size)
            scale = self.scale[b, :, :ng, :, None][None]
            offset = self.offset[b, :, :ng, :, None][None] if self.offset is not None else None
        else:
            lo, hi = (r[None, :, None, :] for r in self.range)
            scale, offset = range_metadata(spec, lo, hi, dtype)
        exact = values = None
        if self.outliers is not None:
            values, exact = (t[b, :, :n][None] for t in self.outliers)
        q = QTensor(codes, scale, offset, exact, values)
        return dequantize(q, spec, codebook=self.codebook, dtype=dtype)[0]


class QuantizedCache:
    """A KV cache following a KVScheme; see the module docstring for the layout."""

    def __init__(
        self,
        scheme: KVScheme,
        params: KVParams,
        *,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        device,
        dtype: torch.dtype,
    ):
        if len(scheme.layers) != num_layers:
            raise FormatError(
                f"the KV scheme has {len(scheme.layers)} layers, the model {num_layers}"
            )
        self.scheme, self.params = scheme, params
        self.max_len, self.dtype = max_len, dtype
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys, self.values = [], []
        for i, layer in enumerate(scheme.layers):
            self.keys.append(_Stream(layer.key, layer.key_flush, scheme.residual,
                                     params.key_range.get(i), params.key_codebook.get(i),
                                     shape, device, dtype))
            self.values.append(_Stream(layer.value, layer.value_flush, scheme.residual,
                                       params.value_range.get(i), params.value_codebook.get(i),
                                       shape, device, dtype))
        slots = max(scheme.num_sink_slots, 1)
        self.sink_k = torch.zeros(num_layers, batch, kv_heads, slots, head_dim, device=device, dtype=dtype)
        self.sink_v = torch.zeros_like(self.sink_k)
        self.sink_pos = torch.full((batch, slots), -1, dtype=torch.long)
        self.is_sink = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.flags = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self._pending = {}
        self._pending_flags = None

    # -- the cache interface -------------------------------------------------------------------

    def positions(self, T: int) -> torch.Tensor:
        return (self.lengths[:, None] + torch.arange(T)).to(self.is_sink.device)

    def attend(self, layer, q, k, v, rope: Rope, positions) -> torch.Tensor:
        """q [B, H, T, D] post-RoPE, k [B, Hkv, T, D] pre-RoPE, v -> out [B, H, T, D]."""
        self.stage(layer, k, v, rope, positions)
        keys, values, valid = self._gather(layer, rope)
        if self.scheme.layers[layer].key_rotation:
            q = hadamard_transform(q, seed=self.scheme.rotation_seed)
        return _attention(q, keys, values, valid)

    def observe_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        sp = self.params.sink_predictor
        if sp is not None and self.scheme.sink_budget and layer == sp.layer:
            self._pending_flags = sp(hidden)  # [B, T]

    def commit(self, T: int) -> None:
        flags = self._pending_flags
        for b in range(len(self.lengths)):
            n = int(self.lengths[b])
            self._decide_sinks(b, n, T, flags[b] if flags is not None else None)
            for layer in range(len(self.keys)):
                k, v = self._pending[layer]
                self._flush(self.keys[layer], b, n, k[b], layer, self.sink_k)
                self._flush(self.values[layer], b, n, v[b], layer, self.sink_v)
        self.lengths += T
        self._pending.clear()
        self._pending_flags = None

    def view(self, b: int) -> "QuantizedCache":
        view = copy.copy(self)
        view.keys = [_view_stream(s, b) for s in self.keys]
        view.values = [_view_stream(s, b) for s in self.values]
        view.sink_k, view.sink_v = self.sink_k[:, b : b + 1], self.sink_v[:, b : b + 1]
        view.sink_pos, view.is_sink = self.sink_pos[b : b + 1], self.is_sink[b : b + 1]
        view.flags, view.lengths = self.flags[b : b + 1], self.lengths[b : b + 1]
        view._pending = {}
        return view

    def reset(self) -> None:
        self.lengths.zero_()
        self.sink_pos.fill_(-1)
        self.is_sink.zero_()
        for s in self.keys + self.values:
            s.n_body.zero_()

    def bytes_per_token(self, context: int = 4096) -> float:
        """Storage per token of one sequence of `context` tokens (storage_bits / 8 / context)."""
        _, _, hkv, _, d = self.sink_k.shape
        bits = storage_bits(self.scheme, hkv, d, context)
        return (bits["body"] + bits["sinks"] + bits["residual"]) / 8 / context

    def stage(self, layer: int, k, v, rope: Rope, positions) -> None:
        """Hold one layer's new tokens (k [B, Hkv, T, D] pre-RoPE, v) exact until `commit`."""
        self._check_capacity(k.shape[2])
        self._pending[layer] = (self._to_domain(layer, k, rope, positions), v)

    # -- reading ---------------------------------------------------------------------------------

    def materialize(self, layer: int, rope: Rope):
        """Keys and values as attention sees them, in position order, post-RoPE and unrotated:
        ([B, Hkv, N, D], [B, Hkv, N, D], valid bool [B, N]) with N = max(lengths) + T."""
        keys, values, valid = self._gather(layer, rope)
        if self.scheme.layers[layer].key_rotation:
            keys = hadamard_transform(keys, seed=self.scheme.rotation_seed, inverse=True)
        return keys, values, valid

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
        out = torch.empty(stream.tail.shape[1], n, stream.tail.shape[-1], dtype=self.dtype,
                          device=stream.tail.device)
        out[:, :nb] = stream.read(b, nb, self.dtype)
        for slot, pos in enumerate(self.sink_pos[b].tolist()):
            if 0 <= pos < nb:
                out[:, pos] = sink_slots[layer, b, :, slot]
        if n > nb:
            slots = torch.arange(nb, n) % stream.tail.shape[2]
            out[:, nb:n] = stream.tail[b][:, slots]
        return out

    # -- writing ---------------------------------------------------------------------------------

    def _to_domain(self, layer: int, k: torch.Tensor, rope: Rope, positions) -> torch.Tensor:
        scheme = self.scheme.layers[layer]
        if scheme.key_position == "pre_rope":
            return k
        k = rope.apply(k, positions)
        return hadamard_transform(k, seed=self.scheme.rotation_seed) if scheme.key_rotation else k

    def _decide_sinks(self, b: int, n: int, T: int, flags) -> None:
        """First-N positions, then predicted ones while sink slots last, in position order."""
        scheme = self.scheme
        used_predicted = int(((self.sink_pos[b] >= scheme.sinks_first)).sum())
        for i in range(T):
            pos = n + i
            if pos < scheme.sinks_first:
                slot = pos
            elif flags is not None and bool(flags[i]) and used_predicted < scheme.sink_budget:
                slot = scheme.sinks_first + used_predicted
                used_predicted += 1
            else:
                continue
            self.sink_pos[b, slot] = pos
            self.is_sink[b, pos] = True

    def _flush(self, stream: _Stream, b: int, n: int, new: torch.Tensor, layer, sink_slots) -> None:
        """Store the T new tokens of sequence b (new [Hkv, T, D]) and flush to the target."""
        T = new.shape[1]
        for slot, pos in enumerate(self.sink_pos[b].tolist()):
            if n <= pos < n + T:
                sink_slots[layer, b, :, slot] = new[:, pos - n]
        nb, target = int(stream.n_body[b]), stream.target(n + T)
        if target > nb:
            ring = stream.tail.shape[2]
            old = stream.tail[b][:, torch.arange(nb, n) % ring] if n > nb else new[:, :0]
            block = torch.cat([old, new], dim=1)[:, : target - nb]
            stream.write(b, nb, block, self.is_sink[b, nb:target])
            stream.n_body[b] = target
        start = max(n, target)
        if start < n + T and stream.residual:
            slots = torch.arange(start, n + T) % stream.tail.shape[2]
            stream.tail[b][:, slots] = new[:, start - n :]

    def _check_capacity(self, T: int) -> None:
        if int(self.lengths.max()) + T > self.max_len:
            raise CapacityError(
                f"the KV cache holds {self.lengths.tolist()} tokens per sequence and {T} more "
                f"do not fit in max_len = {self.max_len}: build a larger cache or shorten the input"
            )


def _view_stream(s: _Stream, b: int) -> _Stream:
    v = copy.copy(s)
    for name in ("tail", "exact", "codes", "scale", "offset"):
        t = getattr(s, name, None)
        if t is not None:
            setattr(v, name, t[b : b + 1])
    if s.outliers is not None:
        v.outliers = tuple(t[b : b + 1] for t in s.outliers)
    v.n_body = s.n_body[b : b + 1]
    return v


def _attention(q, keys, values, valid) -> torch.Tensor:
    """q [B, H, T, D] over keys/values [B, Hkv, N, D]; the T queries are the last valid T keys of
    each sequence (causal among them). valid bool [B, N]."""
    B, H, T, D = q.shape
    hkv, N = keys.shape[1], keys.shape[2]
    length = valid.sum(-1)  # [B]
    qpos = length[:, None] - T + torch.arange(T, device=q.device)  # [B, T]
    mask = torch.arange(N, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, T, N]
    qg = q.view(B, hkv, H // hkv, T, D)
    scores = (qg @ keys[:, :, None].transpose(-1, -2)).float() * D**-0.5
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, -1).to(values.dtype)
    return (probs @ values[:, :, None]).view(B, H, T, D)
