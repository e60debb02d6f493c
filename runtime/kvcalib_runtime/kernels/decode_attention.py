"""Decode attention over the quantized cache, the launcher of kernels.decode_kernel (one new token
per sequence, dequantization fused: the algorithm and what each stream may hold are in that
module's docstring). It gathers each stream's buffers from the cache's bodies
(`Body.stream_args`), takes the launch configuration and the split count from
kernels.decode_config, and launches the split kernel and the combine.

Its spec in plain torch is kernels.decode_reference (the fallback off the CPU where the kernel does
not run; on the CPU the cache decodes through kernels.decode_torch, held to it); the tests hold
the kernel to it.
"""

from typing import NamedTuple

import torch

from kvcalib_runtime.kernels import decode_config as config
from kvcalib_runtime.kernels import decode_gluon, tiles
from kvcalib_runtime.kernels.decode_kernel import _combine_kernel, _decode_split_kernel
from kvcalib_runtime.kernels.operands import Sinks, Stored
from kvcalib_runtime.layouts import Kind
from kvcalib_runtime.layouts.body import as_body

LOG2E = 1.4426950408889634


def supports(spec, head_dim: int, kv_heads: int = 1) -> bool:
    """Whether `decode_attention` reads a tensor stored with spec (None: full precision): every
    layout kvcalib's presets and its peers use, vector codes included; odd head widths (a half
    row of codes that does not start on a byte) and non-power-of-two "channel" groups go to the
    reference."""
    if spec is None or spec.layout.kind == Kind.VECTORS:
        return True
    return spec.layout.affine and tiles.readable(spec, head_dim, kv_heads)


class SinkBuffers(NamedTuple):
    """operands.Sinks as the decode kernel reads it (a field may not be named `values` there):
    k, v dtype [B, Hkv, S, D], positions int64 [B, S], is_sink uint8 [B, P]."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    is_sink: torch.Tensor


class Strides(NamedTuple):
    """Element strides (block or sequence, head row, slot) of a body's per-token buffers, as
    `tiles.at` reads them: a contiguous body's, or a page view's (its fields interleaved in
    one row per token). (0, 0, 0) where a buffer is absent or per layer."""

    codes: tuple[int, int, int]
    meta: tuple[int, int, int]
    index: tuple[int, int, int]
    delta: tuple[int, int, int]


class StreamBuffers(NamedTuple):
    """One stream's (keys' or values') tensors and sizes as the decode kernel reads them;
    pointers a layout does not use repeat the codes.

    codes, scale, offset, levels, slot_index, slot_delta  the PackedBody's (codes as int32
                  words when the layout's UNIT is 32), a CodeBody's (levels: its codebook
                  [Hc, E, w]), or the exact body dtype [B, Hkv, S, D];
                  B: sequences, or blocks of a paged body
    tail          dtype [B, Hkv, R, D] the residual ring (B: sequences)
    n_body        int64 [B] body sizes (B: sequences)
    slots         body slots per row (per block when paged), at least 1
    meta_rows     metadata rows of a "channel" body, else 1
    strides       Strides of codes, scale (and offset), slot_index, slot_delta
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    levels: torch.Tensor
    slot_index: torch.Tensor
    slot_delta: torch.Tensor
    tail: torch.Tensor
    n_body: torch.Tensor
    slots: int
    meta_rows: int
    strides: Strides


class StreamLayout(NamedTuple):
    """What the decode kernel compiles for one stream (a constexpr argument: one compiled kernel
    per layout pair).

    BITS    code width (16 for an exact body)
    GRAN    the layout's Kind: tiles.TOKEN, CHANNEL, STATIC, VECTORS or EXACT (left in full
            precision)
    GROUP   channels per group of a row (TOKEN), tokens per group (CHANNEL), channels per
            vector (VECTORS), else 1
    SYM     symmetric levels (no offset)
    CB      codebook levels
    K       exact slots per row
    FP8     the slots' deltas are E4M3 bytes in steps of the static scale (slot_code "fp8")
    VEC     a row joins every KV head ("vector")
    UNIT    bits of one code load (tiles.unit; 8 where a page's rows do not start on a word)
    RING    fewer body slots than positions: a sliding window's ring (never paged)
    BOOK    elements of one KV head's codebook row (0: every head reads the first row)
    PAIRS   VECTORS: a vector is GROUP / 2 RoPE pairs (c, c + D/2), not GROUP adjacent channels
    BYTE    TOKEN: one-byte scale and zero point (metadata_code "byte", layouts.metabyte)
    """

    BITS: int
    GRAN: int
    GROUP: int
    SYM: bool
    CB: bool
    K: int
    FP8: bool
    VEC: bool
    UNIT: int
    RING: bool
    BOOK: int
    PAIRS: bool
    BYTE: bool = False


def _stream_args(stored: Stored, head_dim: int, positions: int, paged: bool):
    """One stream's (StreamBuffers, StreamLayout), from what its body gives the kernel
    (layouts.body's `stream_args`); RING: fewer body slots than `positions` (a paged body holds
    every position in its blocks)."""
    body = as_body(stored.body)
    args, slots = body.stream_args(head_dim, tiles.unit), body.slots
    buffers = StreamBuffers(*args.buffers, stored.tail, stored.n_body, max(slots, 1),
                            args.meta_rows, Strides(*args.strides))  # fmt: skip
    return buffers, StreamLayout(**args.layout, RING=not paged and slots < positions)


def _page_size(keys: Stored, values: Stored, block_table, batch: int, window) -> int:
    """The slots per block of paged bodies (vLLM's block_size), after the checks."""
    bodies = [as_body(s.body) for s in (keys, values)]
    sizes, kinds = {b.slots for b in bodies}, [b.kind for b in bodies]
    if block_table.dim() != 2 or block_table.shape[0] != batch or len(sizes) != 1:
        raise ValueError(
            f"decode_attention: block_table {tuple(block_table.shape)} must be [B={batch}, "
            f"blocks] over key and value bodies of one block size (theirs: {sorted(sizes)})"
        )
    if window is not None or Kind.CHANNEL in kinds:
        raise ValueError(
            "decode_attention: pages hold every position of per-token and static layouts: "
            "read a sliding window or a 'channel' body from a contiguous cache"
        )
    return sizes.pop()


def decode_attention(q, k_new, v_new, keys: Stored, values: Stored, sinks: Sinks, lengths, *,
                     inv_freq=None, window: int | None = None, block_table=None):  # fmt: skip
    """Attention of one new token per sequence over the cache and itself.

    q [B, H, 1, D] post-RoPE (rotated, when keys are), in the cache dtype; k_new, v_new
    [B, Hkv, 1, D] the new token's key (in the key domain) and value; lengths int64 [B] on the
    device, tokens stored before the new one; inv_freq float32 [D/2] when keys are stored
    pre-RoPE (RoPE at the position); window: the layer's sliding window, None for global.
    block_table int32 [B, blocks] on the device: the bodies are pages (their B = blocks, N =
    block_size, any strides: `kernels.paged`), position p of sequence b at slot p % N of block
    block_table[b, p // N], read in place; None: contiguous bodies, one sequence a row.
    Returns out [B, H, 1, D] in q's dtype. Launches a fixed grid: nothing read on the host.
    """
    B, H, T, D = q.shape
    hkv = k_new.shape[1]
    if T != 1 or H % hkv or D % 2:
        raise ValueError(
            f"decode_attention takes one query per sequence and even head_dim: {q.shape}"
        )
    G = H // hkv
    q, k_new, v_new = (t.contiguous() for t in (q, k_new, v_new))
    positions = sinks.is_sink.shape[1]
    paged = block_table is not None
    page = _page_size(keys, values, block_table, B, window) if paged else 1
    k_buffers, k_layout = _stream_args(keys, D, positions, paged)
    v_buffers, v_layout = _stream_args(values, D, positions, paged)
    sink_buffers = SinkBuffers(sinks.keys, sinks.values, sinks.positions,
                               sinks.is_sink.view(torch.uint8))  # fmt: skip
    span = min(window or positions, positions)
    num_sinks = sinks.positions.shape[1]
    out = torch.empty_like(q)
    # per-channel key metadata folds into q (post-RoPE); keys' exact slots are scores of their
    # own, values' are added into the tile; the query heads are the products' N (BLOCK_G), at
    # least an MMA's 8 (decode_kernel: fewer instructions per position than 4 at 32/8/128)
    fold_k = inv_freq is None and k_layout.GRAN in (tiles.STATIC.value, tiles.VECTORS.value)
    fold_v = tiles.foldable(v_layout, D // 2) and v_layout.K == 0
    key = (D, G, inv_freq is not None, q.dtype, k_layout, v_layout, page)
    # the body's whole tiles by the Gluon kernel (kvcalib-2's, -3's, -4's, -1.5's layouts at 128
    # channels, on a GPU), the rest (one tile, the ring, the sinks and the new token) by the
    # Triton kernel's split
    whole = decode_gluon.applies(k_layout, v_layout, D, G, q.dtype, paged, window)
    whole = whole and decode_gluon.runs_on(q.device)
    if whole and q.device.type == "cuda" and (key, "gluon") not in config.RESIDENT:
        # its programs an SM, read off its compile before its first grid (a CUDA graph
        # captured at the first step keeps that grid)
        scratch = torch.empty(1, device=q.device, dtype=torch.float32)
        body = decode_gluon.launch(q, k_buffers, v_buffers, k_layout, v_layout, sink_buffers,
                                   inv_freq, scratch, scratch, 1, 0, 1.0, positions,
                                   warmup=True)  # fmt: skip
        config.RESIDENT[key, "gluon"] = config.resident(
            body.n_regs, decode_gluon.WARPS, body.metadata.shared, config.shared_per_sm(q.device)
        )
    body_held = config.RESIDENT.get((key, "gluon"), 1)
    body_splits = (config.num_splits(q.device, B * hkv, span, decode_gluon.BLOCK_N, body_held)
                   if whole else 0)  # fmt: skip

    def launch(choice):
        block_n, warps, stages = choice
        held = config.RESIDENT.get((key, choice), 1)
        splits = 1 if whole else config.num_splits(q.device, B * hkv, span, block_n, held)
        part = torch.empty(B, H, splits + body_splits, D, device=q.device, dtype=torch.float32)
        stats = torch.empty(B, H, splits + body_splits, 2, device=q.device, dtype=torch.float32)
        if whole:
            decode_gluon.launch(q, k_buffers, v_buffers, k_layout, v_layout, sink_buffers,
                                inv_freq, part, stats, body_splits, splits, D**-0.5 * LOG2E,
                                positions)  # fmt: skip
        # fmt: off
        kernel = _decode_split_kernel[(B, hkv, splits)](
            q, k_new, v_new, sink_buffers,
            lengths, inv_freq if inv_freq is not None else part,
            part, stats, k_buffers, v_buffers,
            block_table if paged else lengths, block_table.stride(0) if paged else 0,
            hkv, positions, num_sinks, splits, splits + body_splits, window or 0,
            D**-0.5 * LOG2E, keys.tail.shape[2],
            k_layout, v_layout,
            G=G, D=D, PRE_ROPE=inv_freq is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            BLOCK_G=max(8, tiles.next_pow2(G)), BLOCK_C=max(16, tiles.next_pow2(D // 2)),
            BLOCK_N=block_n, BLOCK_X=max(16, tiles.next_pow2(num_sinks + 1)), STAGES=stages,
            PAGED=paged, PAGE=page, FOLD_K=fold_k, FOLD_V=fold_v,
            PACKED=q.device.type == "cuda", WHOLE=decode_gluon.BLOCK_N if whole else 0,
            num_warps=warps,
        )
        # fmt: on
        # later launches split by it (Triton returns no kernel where a cache hook compiled it)
        if q.device.type == "cuda" and kernel is not None and (key, choice) not in config.RESIDENT:
            config.RESIDENT[key, choice] = config.resident(
                kernel.n_regs, warps, kernel.metadata.shared, config.shared_per_sm(q.device)
            )
        _combine_kernel[(B * H,)](
            part,
            stats,
            out,
            splits + body_splits,
            D=D,
            BLOCK_S=tiles.next_pow2(splits + body_splits),
            BLOCK_D=tiles.next_pow2(D),
            num_warps=4,
        )  # fmt: skip

    launch(config.choose(key, q.device, launch))
    return out
