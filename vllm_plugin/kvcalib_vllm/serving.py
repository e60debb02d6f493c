"""A converted checkpoint's KV cache served in vLLM's pages: one `Serving` per process.

It follows the runtime's `QuantizedCache` step for step, per sequence, so a sequence served here
holds what the runtime's cache holds for it and attends as it does:

- every layer's forward (`attend`) takes the step's new tokens of each sequence (vLLM's batch:
  `query_start_loc`, `seq_lens`, `block_table`), applies kvcalib's RoPE and transforms
  (`model` leaves q and k pre-RoPE), holds the new keys and values exact until
  `commit`, and attends: one new token through the runtime's CPU decode path
  (`kernels.decode_torch`, reading the sequence's pages gathered in block-table order, its ring
  and its sinks), or with `kernels` (the default for pages on a CUDA device) through the decode
  kernel reading its pages in place by its block table (`kernels.paged`); several (a prefill
  or a chunk of one) in full precision over the new tokens and the stored ones as they stand,
  as the runtime's prefill does;
- after the model's forward (`commit`, called by `model`), each sequence decides its sinks
  from the sink predictor's flags (`observe`, a hook after the predictor's layer), fills its
  sink slots, quantizes the positions the next token must see quantized into its pages
  (`quant_pack_reference`, the runtime's writer; vector codes through their body's own
  `write`) and keeps the rest in its residual ring.

Pages are laid out by `pages.PageLayout`; per-sequence state is `sequences.Sequences`.
"""

from dataclasses import dataclass

import torch

from kvcalib_runtime.cache import sinks as cache_sinks
from kvcalib_runtime.cache.attention import causal_attention
from kvcalib_runtime.cache.scheme import quantized_prefix_int
from kvcalib_runtime.cache.shard import shard_params
from kvcalib_runtime.checkpoint.format import Checkpoint
from kvcalib_runtime.kernels import decode_torch
from kvcalib_runtime.kernels.decode_attention import decode_attention
from kvcalib_runtime.kernels.operands import Sinks, Stored
from kvcalib_runtime.kernels.quant_pack import quant_pack_reference
from kvcalib_runtime.model.rope import layer_ropes
from kvcalib_vllm.pages import PageLayout, TensorPages
from kvcalib_vllm.sequences import Row, Sequences


@dataclass(frozen=True)
class Step:
    """One sequence's part of a step: its state (`Row`), its first new position n, its T new
    tokens at `tokens` of vLLM's flattened batch, and its block table (LongTensor [m])."""

    row: Row
    n: int
    T: int
    tokens: slice
    blocks: torch.Tensor


class Serving:
    """The side-car of `ckpt` served in vLLM's pages (their block size read from the cache on
    the first step) for up to `rows` sequences of `max_len` positions, in `dtype` (the
    model's). kernels: decode through the paged Triton kernel (None: where the pages are on a
    CUDA device; True on the CPU needs TRITON_INTERPRET=1, as the tests run it). rank, world:
    tensor parallelism, the rank serves its share of the KV heads (`cache.shard`: vLLM hands
    its attention those heads and their query heads)."""

    def __init__(self, ckpt: Checkpoint, *, dtype: torch.dtype, rows: int, max_len: int,
                 kernels: bool | None = None, rank: int = 0, world: int = 1):  # fmt: skip
        geo = ckpt.geometry
        self.scheme, self.params, self.transforms = ckpt.scheme, ckpt.params, ckpt.transforms
        if world > 1:
            self.params = shard_params(self.scheme, self.params, kv_heads=geo.kv_heads,
                                       rank=rank, world=world)  # fmt: skip
        kv_heads = geo.kv_heads // world
        self.dtype, self.head_dim, self.kv_heads = dtype, geo.head_dim, kv_heads
        self.ropes = layer_ropes(geo.rope, geo.head_dim)
        sizes = dict(kv_heads=kv_heads, head_dim=geo.head_dim)
        self.pages = PageLayout(self.scheme, self.params, dtype=dtype, **sizes)
        self.seqs = Sequences(self.scheme, num_layers=geo.layers, rows=rows, max_len=max_len,
                              dtype=dtype, **sizes)  # fmt: skip
        sp = self.params.sink_predictor
        self.predictor = sp if sp is not None and self.scheme.sink_budget else None
        self._sink_dims = torch.tensor(sp.dims) if self.predictor else None
        self._raw_ptr, self._bodies, self.block_size, self.device = None, [], None, None
        self._steps: list[Step] = []
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._flags = None
        self.kernels = kernels

    # -- a step ----------------------------------------------------------------------------

    def attend(self, layer: int, query, key, value, kv_cache, md, output) -> None:
        """Layer `layer` of one step: query [tokens, H, D], key and value [tokens, Hkv, D]
        (pre-RoPE, as the model computed them), kv_cache vLLM's page buffer (layer 0's:
        [blocks, 1, block_size, C / itemsize]), md the step's CPU attention metadata; writes
        the attention output into output [tokens, H, D]."""
        if layer == 0:
            self._begin(md, kv_cache)
        kb, vb = self._bodies[layer]
        kp, vp = self.pages.tensors[layer]
        rope, ls = self.ropes[layer], self.scheme.layers[layer]
        pending = self._pending.setdefault(layer, [])
        for st in self._steps:
            pos = torch.arange(st.n, st.n + st.T)[None]
            q = rope.apply(query[st.tokens].transpose(0, 1)[None], pos)  # [1, H, T, D]
            k = self.transforms.key_in(layer, key[st.tokens].transpose(0, 1)[None], self.params)
            v = self.transforms.value_in(layer, value[st.tokens].transpose(0, 1)[None])
            if ls.key_position == "post_rope":
                k = self.transforms.key_rotate(layer, rope.apply(k, pos))
            pending.append((k[0], v[0]))  # [Hkv, T, D] in the layer's domain
            q = self.transforms.query(layer, q, self.params)
            if st.T == 1:
                out = self._decode(layer, st, q, k, v, (kp, kb), (vp, vb))
            else:
                keys = self._read(layer, st, kp, kb, st.row.tail_k, st.row.sink_k, k[0])
                values = self._read(layer, st, vp, vb, st.row.tail_v, st.row.sink_v, v[0])
                if ls.key_position == "pre_rope":
                    keys = rope.apply(keys, torch.arange(keys.shape[2])[None])
                valid = torch.ones(1, keys.shape[2], dtype=torch.bool)
                out = causal_attention(q, keys, values, valid, causal=st.n == 0)
            out = self.transforms.value_out(layer, out)  # [1, H, T, D]
            output[st.tokens] = out[0].transpose(0, 1).to(output.dtype)

    def observe(self, hidden: torch.Tensor) -> None:
        """The residual stream after the sink predictor's layer, [tokens, hidden]."""
        self._flags = self.predictor(hidden, self._sink_dims)  # bool [tokens]

    def commit(self) -> None:
        """After every layer has attended: sinks, flushes into the pages, rings (the runtime's
        `QuantizedCache.commit`, per sequence)."""
        for i, st in enumerate(self._steps):
            flags = self._flags[st.tokens] if self._flags is not None else None
            sink_pos = self._decide_sinks(st, flags)
            for layer, held in self._pending.items():
                k, v = held[i]
                (kp, vp), (kb, vb) = self.pages.tensors[layer], self._bodies[layer]
                self._flush(layer, st, kp, kb, st.row.tail_k, st.row.sink_k, k, sink_pos)
                self._flush(layer, st, vp, vb, st.row.tail_v, st.row.sink_v, v, sink_pos)
            st.row.length += st.T
        self._steps, self._flags = [], None
        self._pending.clear()

    def _begin(self, md, kv_cache) -> None:
        """The step's sequences and their rows; the page views on the first step."""
        raw = kv_cache.view(torch.uint8)
        assert raw.shape[1] == 1 and raw.shape[3] == self.pages.row_bytes, raw.shape
        raw = raw[:, 0]  # [blocks, block_size, C]
        if raw.data_ptr() != self._raw_ptr:
            self._raw_ptr = raw.data_ptr()
            self._bodies = [(k.body(raw), v.body(raw)) for k, v in self.pages.tensors]
        self.block_size, self.device = raw.shape[1], raw.device
        if self.kernels is None:
            self.kernels = raw.device.type == "cuda"
        self.seqs.begin_step()
        self._pending.clear()  # a step that raised before its commit leaves nothing behind
        self._flags = None
        starts, lengths = md.query_start_loc.tolist(), md.seq_lens.tolist()
        self._steps = []
        for i, length in enumerate(lengths):
            a, b = starts[i], starts[i + 1]
            if b == a:
                continue
            blocks = md.block_table[i, : -(-length // self.block_size)].long()
            row = self.seqs.row(int(blocks[0]), length - (b - a))
            self._steps.append(Step(row, length - (b - a), b - a, slice(a, b), blocks))

    # -- reading ---------------------------------------------------------------------------

    def _decode(self, layer, st: Step, q, k_new, v_new, keys, values) -> torch.Tensor:
        """One new token over the sequence's pages: read in place by the paged kernel
        (`kernels`), else gathered for the runtime's CPU decode path. The row's ring and sinks
        are copied to the pages' device (nothing to copy on the CPU)."""
        r, dev = st.row, self.device
        stored = [
            Stored(body if self.kernels else tp.gather(body, st.blocks),
                   tail[layer][None].to(dev),
                   torch.tensor([_body(tp, self.scheme.residual, st.n)], device=dev))
            for (tp, body), tail in ((keys, r.tail_k), (values, r.tail_v))
        ]  # fmt: skip
        sinks = Sinks(*(t[None].to(dev) for t in (r.sink_k[layer], r.sink_v[layer], r.sink_pos,
                                                  r.is_sink)))  # fmt: skip
        pre_rope = self.scheme.layers[layer].key_position == "pre_rope"
        inv_freq = self.ropes[layer].inv_freq.to(dev) if pre_rope else None
        lengths = torch.tensor([st.n], device=dev)
        if self.kernels:
            table = st.blocks[None].to(device=dev, dtype=torch.int32)
            return decode_attention(q, k_new, v_new, *stored, sinks, lengths, inv_freq=inv_freq,
                                    block_table=table)  # fmt: skip
        return decode_torch.decode_attention_torch(
            q, k_new, v_new, *stored, sinks, lengths, inv_freq=inv_freq
        )

    def _read(self, layer, st: Step, tp: TensorPages, body, tails, sinks, new) -> torch.Tensor:
        """Positions [0, n) of the sequence as stored (body dequantized, sinks exact, ring
        exact), then its T new ones (new [Hkv, T, D]): [1, Hkv, n + T, D] (the runtime's
        `_gather`); tails, sinks: the row's tail_* and sink_* of this tensor."""
        n = st.n
        out = torch.zeros(1, self.kv_heads, n + st.T, self.head_dim, dtype=self.dtype)
        nb = _body(tp, self.scheme.residual, n)
        if nb:
            held = tp.gather(body, st.blocks)
            out[0, :, :nb] = held.dequantize(self.dtype, 0, nb)
        for slot, p in enumerate(st.row.sink_pos.tolist()):
            if 0 <= p < nb:
                out[0, :, p] = sinks[layer, :, slot]
        if n > nb:
            tail = tails[layer]
            out[0, :, nb:n] = tail[:, torch.arange(nb, n) % tail.shape[1]]
        out[0, :, n:] = new
        return out

    # -- writing ---------------------------------------------------------------------------

    def _decide_sinks(self, st: Step, flags) -> list[int]:
        """The row's sink positions after this step's tokens: the runtime's `sinks.decide` on a
        batch of one (first-N positions, then flagged ones while the budget lasts)."""
        s, row = self.scheme, st.row
        flags = None if flags is None else flags[None]
        held = cache_sinks.decide(row.sink_pos[None], row.is_sink[None], [st.n], st.T, flags,
                                  s.sinks_first, s.sink_budget)  # fmt: skip
        return held[0]

    def _flush(self, layer, st: Step, tp: TensorPages, body, tails, sinks, new, sink_pos):
        """Store the sequence's T new tokens (new [Hkv, T, D]) of one tensor: sink slots, the
        positions the next token sees quantized into the pages, the rest into the ring (the
        runtime's `sinks.store` and `Stream.store`); tails, sinks: the row's tail_* and sink_*."""
        n, T = st.n, st.T
        cache_sinks.store(sinks[layer], sink_pos, n, new)
        residual = self.scheme.residual
        nb, target = _body(tp, residual, n), _body(tp, residual, n + T)
        tail = tails[layer]  # [Hkv, R, D]
        ring = tail.shape[1]
        if target > nb:
            old = tail[:, torch.arange(nb, n) % ring] if n > nb else new[:, :0]
            block = torch.cat([old, new], 1)[:, : target - nb].transpose(0, 1)  # [M, Hkv, D]
            pos = torch.arange(nb, target)
            where, at = st.blocks[pos // self.block_size], pos % self.block_size
            if tp.const is None:
                body[where, :, at] = block
            elif body.packed:
                quant_pack_reference(block[:, :, None], body, where, at)
            else:  # vector codes: the body's own writer
                body.write(block[:, :, None], where, at)
        start = max(n, target)
        if start < n + T and residual:
            tail[:, torch.arange(start, n + T) % ring] = new[:, start - n :]


def _body(tp: TensorPages, residual: int, stored: int) -> int:
    """Positions in the body once `stored` are in: the decode rule's n_q (all of them for a
    tensor left in full precision), as the runtime's `Stream.host_body`."""
    if tp.spec is None:
        return stored
    return quantized_prefix_int(stored, residual, tp.flush)
