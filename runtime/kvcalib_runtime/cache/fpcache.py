"""The full-precision KV cache: the reference implementation of the cache interface.

The model never touches K/V storage itself: each attention layer hands its fresh q, k, v to
the cache and gets the attention output back. A quantized cache implements the same five
calls and is compared against this one.
"""

import copy

import torch

from kvcalib_runtime.cache.attention import attention
from kvcalib_runtime.errors import CapacityError
from kvcalib_runtime.model.rope import Rope


class FullPrecisionCache:
    """Keys and values of B sequences, stored as they are (post-RoPE keys), up to max_len each.

    Storage (B sequences, Hkv KV heads of D channels, L layers), per layer l:

        keys[l]    dtype [B, Hkv, S_l, D]  post-RoPE keys; position t in slot t % S_l, S_l =
                                           max_len, or for a sliding window W < max_len a ring
                                           of W slots (`windows`, as Geometry.windows)
        values[l]  dtype [B, Hkv, S_l, D]
        lengths    LongTensor[B] on the CPU  tokens stored per sequence (so capacity checks and
                                             slicing never wait for the device)

    The cache interface — what `Transformer.forward` calls, in this order, for T new tokens:

        positions(T) -> LongTensor[B, T] on the cache's device
            absolute positions of the new tokens: lengths[:, None] + arange(T).
        attend(layer, q, k, v, rope, positions) -> out [B, H, T, D], q's dtype
            q [B, H, T, D] post-RoPE queries, k [B, Hkv, T, D] PRE-RoPE keys (after k_norm where
            the architecture has one), v [B, Hkv, T, D], rope the model's `Rope`, positions the
            tensor positions(T) returned. Stores k (with RoPE applied) and v at slots
            lengths[b] .. lengths[b] + T - 1 of sequence b and returns softmax(q K^T / sqrt(D)) V
            over the keys at slots <= positions[b, t] (earlier tokens and causal within the
            new ones), and, in a layer with a sliding window W, > positions[b, t] - W. H is a
            multiple of Hkv (GQA: query head h reads KV head h // (H / Hkv)). With `softcap`
            the scores s = q K^T / sqrt(D) are capped to softcap * tanh(s / softcap) first.
            Raises CapacityError, before storing anything, when lengths + T > max_len.
        observe_hidden(layer, hidden [B, T, hidden_size])
            the residual stream after decoder layer `layer` (for caches that predict sinks from
            it); a no-op here.
        commit(T)
            the forward is done: lengths += T. Until then `lengths` counts only earlier tokens.

    Also: `view(b)` a cache over sequence b alone (B = 1) sharing this storage and `lengths`
    (per-prompt prefill without padding), `reset()` (forget every sequence; storage is kept)
    and `bytes_per_token()` (allocated bytes per token slot of one sequence, all layers).
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        windows: tuple[int | None, ...] | None = None,
        softcap: float | None = None,
    ):
        """windows: per layer, the sliding window (None: global; default all global); softcap:
        Gemma 2's attention-score soft cap (None: none)."""
        self.windows = tuple(windows) if windows is not None else (None,) * num_layers
        if len(self.windows) != num_layers:
            raise ValueError(f"windows has {len(self.windows)} entries for {num_layers} layers")
        self.softcap = softcap
        sizes = [min(w or max_len, max_len) for w in self.windows]
        shapes = [(batch, kv_heads, s, head_dim) for s in sizes]
        self.keys = [torch.zeros(s, device=device, dtype=dtype) for s in shapes]
        self.values = [torch.zeros(s, device=device, dtype=dtype) for s in shapes]
        self.lengths = torch.zeros(batch, dtype=torch.long, device="cpu")
        self.max_len = max_len

    def positions(self, T: int) -> torch.Tensor:
        """LongTensor[B, T] on the cache's device: lengths[:, None] + arange(T)."""
        pos = self.lengths[:, None] + torch.arange(T, device="cpu")
        return pos.to(self.keys[0].device)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: Rope,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Store k (after RoPE), v and attend q over the stored keys; see the class docstring.

        q [B, H, T, D], k/v [B, Hkv, T, D], positions LongTensor[B, T] -> [B, H, T, D].
        """
        B, _, T, _ = q.shape
        longest = int(self.lengths.max())
        if longest + T > self.max_len:
            raise CapacityError(
                f"the KV cache holds {self.lengths.tolist()} tokens per sequence and {T} more "
                f"do not fit in max_len = {self.max_len}: build a larger cache or shorten the input"
            )
        keys, values = self.keys[layer], self.values[layer]  # [B, Hkv, S, D]
        k = rope.apply(k, positions)
        if keys.shape[2] < self.max_len:  # a sliding window's ring
            return self._ring(layer, q, k, v, positions)
        if B == 1:
            start = int(self.lengths[0])
            keys[:, :, start : start + T] = k
            values[:, :, start : start + T] = v
        else:
            rows = torch.arange(B, device=positions.device)[:, None]  # [B, 1]
            keys[rows, :, positions] = k.transpose(1, 2)  # indexed view is [B, T, Hkv, D]
            values[rows, :, positions] = v.transpose(1, 2)
        S = longest + T  # no sequence has a key at slot >= S
        keys, values = keys[:, :, :S], values[:, :, :S]
        mask, causal = None, False
        if self.softcap is None and longest == 0:
            causal = T > 1  # all sequences empty before: plain causal attention over T keys
        elif self.softcap is not None or not (T == 1 and (self.lengths == longest).all()):
            slots = torch.arange(S, device=positions.device)
            mask = (slots <= positions[..., None])[:, None]  # [B, 1, T, S]
        return attention(q, keys, values, mask, softcap=self.softcap, causal=causal)

    def _ring(self, layer, q, k, v, positions) -> torch.Tensor:
        """attend on a ring of W slots: the ring (each slot's newest position before this
        forward) and the new tokens, masked to p - W < j <= p; then the newest W stored."""
        keys, values = self.keys[layer], self.values[layer]
        B, _, T, _ = q.shape
        W = keys.shape[2]
        n = self.lengths.to(q.device)[:, None]
        held = n - 1 - torch.remainder(n - 1 - torch.arange(W, device=q.device), W)  # [B, W]
        pos = torch.cat([held, positions], 1)  # [B, W + T]
        p = positions[:, :, None]
        mask = (pos[:, None, :] <= p) & (pos[:, None, :] > p - W) & (pos[:, None, :] >= 0)
        keys_in, values_in = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        out = attention(q, keys_in, values_in, mask[:, None], softcap=self.softcap)
        m = min(T, W)
        rows = torch.arange(B, device=q.device)[:, None]
        slots = positions[:, T - m :] % W
        keys[rows, :, slots] = k[:, :, T - m :].transpose(1, 2)
        values[rows, :, slots] = v[:, :, T - m :].transpose(1, 2)
        return out

    def observe_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden [B, T, hidden_size]: unused by the full-precision cache."""

    def commit(self, T: int) -> None:
        """The T tokens of this forward are stored in every layer: count them."""
        self.lengths += T

    def view(self, b: int) -> "FullPrecisionCache":
        """Sequence b alone (B = 1), sharing storage and lengths with this cache."""
        view = copy.copy(self)
        view.keys = [k[b : b + 1] for k in self.keys]
        view.values = [v[b : b + 1] for v in self.values]
        view.lengths = self.lengths[b : b + 1]
        return view

    def reset(self) -> None:
        """Forget every sequence (in place, so views stay attached)."""
        self.lengths.zero_()

    def allocated_bytes(self) -> int:
        """The bytes of the key and value buffers, walked."""
        return sum(t.untyped_storage().nbytes() for t in self.keys + self.values)

    def bytes_per_token(self) -> float:
        """Allocated bytes per token slot of one sequence: allocated_bytes / (B * max_len)."""
        return self.allocated_bytes() / (len(self.lengths) * self.max_len)
