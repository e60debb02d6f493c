"""Decode attention in torch ops, for a cache on the CPU: `decode_attention_reference`'s result
at a fraction of its work.

The reference (the spec) dequantizes every slot of every body and scatters body, ring and sinks
into a buffer indexed by position, whatever the lengths. Here each sequence is read where it
lies: the positions both its key and value bodies hold (dequantized up to its own n_body, or an
exact body read in place), then in one span the few after them in order (body or ring), the
sink slots and the new token, each span scored against the query separately and one softmax
taken over both; RoPE and the mask follow each span's positions. Attention does not depend on
the order of its keys, so the result is the reference's to rounding. A body that wraps (a
sliding window's ring of fewer slots than the sequence has positions) goes to the reference.

`dequantize` reads a body as `PackedBody.dequantize` does, bit for bit, with one table lookup per
window of a packed row — a byte (1, 2, 4 or 8-bit codes), or a quarter of a 3-byte word (3 or
6-bit codes) — for static channels and groups of a head's row: the levels of every window
value's codes (the layout's own levels), per head (and for static channels per window, scale
and offset folded in), built once per body, instead of unpacking codes one by one; exact slots
are added in place. The positions both bodies hold are scored without rotating their keys
(RoPE moves onto the query, `_scores_rotated`), where nothing rounds the rotated keys (float32
and float64); the few others are rotated as the reference rotates them.

In float32 (the CPU cache's dtype), where a table reads both bodies, a sequence's attention runs
in C instead (`decode_native`, through `_attend_native`): each row is read, rotated and used in
one pass, none written out. Elsewhere, or without a C compiler, the torch ops below.
"""

import math
import threading
import weakref

import torch
import torch.nn.functional as F

from kvcalib_runtime.kernels import decode_native, native
from kvcalib_runtime.kernels.decode_reference import decode_attention_reference
from kvcalib_runtime.kernels.operands import Sinks, Stored
from kvcalib_runtime.layouts import Kind, fp8, metabyte
from kvcalib_runtime.layouts.body import as_body
from kvcalib_runtime.layouts.packed_body import PackedBody


def _window(body: PackedBody) -> int:
    """The bits of the windows a table reads a stored row's codes by: 8, a byte (1, 2, 4 or
    8-bit codes), or 6 (3 or 6-bit codes, rows of whole 3-byte words: four windows a word), for
    static channels or groups of a head's own row; 0 where no table reads the body."""
    spec, layout = body.spec, body.layout
    if layout.joins_heads or layout.kind == Kind.CHANNEL:
        return 0
    if 8 % spec.bits == 0:
        return 8
    return 6 if 6 % spec.bits == 0 and body.codes.shape[-1] % 3 == 0 else 0


def _windows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., W]: the `bits`-bit windows of uint8 rows [..., bytes], in stream order (the bytes
    themselves, or int32)."""
    if bits == 8:
        return packed
    word = packed.view(*packed.shape[:-1], packed.shape[-1] // 3, 3).int()  # little-endian
    word = word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16
    shifts = torch.arange(0, 24, bits, dtype=torch.int32, device=packed.device)
    return ((word[..., None] >> shifts) & (1 << bits) - 1).flatten(-2)


_WINDOW_TABLES: dict = {}


def _window_table(body: PackedBody, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(table fp32 [R * 2**bits, per], rows int32 [H, 1, W]): row rows[h, 0, j] + v of the table
    holds the levels of the `per` codes of value v in window j of head h's stored row, as the
    layout reads them (static channels: scale and offset folded in, R = H * W; else R = H).
    Built once per body and kept while the tensors it reads (codebook, static scale and offset)
    live unchanged."""
    spec, layout = body.spec, body.layout
    static = layout.kind == Kind.STATIC
    heads, dev = body.codes.shape[1], body.codes.device
    count, per = body.codes.shape[3] * 8 // bits, bits // spec.bits
    read = (body.levels, *((body.scale, body.offset) if static else ()))
    deps = [t for t in read if t is not None]
    key = (spec, heads, count, body.width, dev, *(id(t) for t in deps))
    versions = [t._version for t in deps]
    found = _WINDOW_TABLES.get(key)
    alive = found and all(r() is t for r, t in zip(found[1], deps, strict=True))
    if alive and found[0] == versions:
        return found[2]
    size = 1 << bits
    value = torch.arange(size, device=dev)
    codes = (value[:, None] >> (torch.arange(per, device=dev) * spec.bits)) & spec.levels - 1
    # [H, size, per]: the levels of each window value's codes, as the layout reads them
    table = layout.levels(codes.expand(heads, -1, -1), body.levels).expand(heads, -1, -1)
    if static:  # the channels' scale and offset folded into the table
        padded = count * per - body.width  # a row's last window may hold fewer codes

        def per_code(t):  # [H, D] -> [H, W, 1, per]
            return F.pad(t.float(), (0, padded)).view(heads, count, 1, per)

        table = table[:, None] * per_code(body.scale)
        if body.offset is not None:
            table = table + per_code(body.offset)  # [H, W, size, per]
        rows = torch.arange(heads * count, device=dev).view(heads, 1, count) * size
    else:
        rows = torch.arange(heads, device=dev).view(heads, 1, 1) * size
    rows = rows.int()
    made = (table.reshape(-1, per).contiguous(), rows)
    _WINDOW_TABLES[key] = (versions, [weakref.ref(t) for t in deps], made)
    if deps:  # else uniform levels: the table is the spec's own, kept for good
        weakref.finalize(deps[0], _WINDOW_TABLES.pop, key, None)
    return made


_SCRATCH = threading.local()


def _scratch(name: str, shape, dtype, device) -> torch.Tensor:
    """A `shape` buffer for one use of `name` at a time, kept on this thread across layers and
    steps (grown by doubling: at most twice the largest asked for): a decode step's large
    temporaries (a body's levels, the keys times cos and sin) reuse memory, where each fresh
    allocation of megabytes pays its page faults again (one layer at 4K context in
    SmolLM2-135M's shapes, one thread: 8.7 ms with fresh buffers, 3.3 ms reusing them)."""
    pool = _SCRATCH.__dict__.setdefault("pool", {})
    numel, key = math.prod(shape), (name, dtype, torch.device(device))
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        size = max(numel, 2 * buf.numel() if buf is not None else 0)
        with torch.inference_mode(False):  # a normal tensor: written in and out of the mode
            buf = pool[key] = torch.empty(size, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def dequantize(body: PackedBody, dtype, b: int, n: int, scratch: str | None = None) -> torch.Tensor:
    """`body.dequantize(dtype, b, n)`: slots [0, n) of sequence b, [Hkv, n, D], bit for bit;
    read into the scratch buffer `scratch` (valid until the next read into it) where named."""
    bits = _window(body)
    if not bits:
        return body.dequantize(dtype, b, n)
    layout = body.layout
    table, rows = _window_table(body, bits)
    packed = body.codes[b, :, :n]  # [H, n, bytes]
    heads = packed.shape[0]
    windows = _windows(packed, bits)  # [H, n, W]
    index = windows + rows  # int32; index_select: 3x advanced indexing's speed
    out = None if scratch is None else _scratch(scratch, (index.numel(), table.shape[1]),
                                                table.dtype, table.device)  # fmt: skip
    x = torch.index_select(table, 0, index.view(-1), out=out)
    x = x.view(heads, n, windows.shape[-1] * table.shape[1])
    x = x[..., : body.width]
    if layout.kind != Kind.STATIC:
        groups = body.scale.shape[-1]
        x = x.reshape(heads, n, groups, body.width // groups)
        offset = None if body.offset is None else body.offset[b, :, :n, :, None]
        scale, offset = layout.metadata_values(body.scale[b, :, :n, :, None], offset)
        x.mul_(scale)
        if offset is not None:
            x.add_(offset)
        x = x.view(heads, n, body.width)
    if body.slot_index is not None:
        index, delta = body.slot_index[b, :, :n], body.slot_delta[b, :, :n]
        scale = body.scale[:, None] if layout.kind == Kind.STATIC else None  # "fp8" steps
        x = layout.add_slots(x, index, delta, scale)
    return x.to(dtype)


_TABLES: dict = {}


def _rope_table(inv_freq: torch.Tensor, wide, length: int):
    """(cos, sin) [N, D] of every position below N >= length, as the reference computes each
    angle (position * inv_freq in `wide`, both halves): one table per frequency set, dtype and
    device, shared by every layer and step and regrown by doubling."""
    key = (tuple(inv_freq.tolist()), wide, inv_freq.device)
    table = _TABLES.get(key)
    if table is None or table[0].shape[0] < length:
        size = max(1024, 1 << (length - 1).bit_length())
        pos = torch.arange(size, device=inv_freq.device, dtype=torch.int64)
        angle = pos[:, None].to(wide) * inv_freq.to(wide)
        angle = torch.cat([angle, angle], -1)
        table = _TABLES[key] = (angle.cos(), angle.sin())
    return table


def _slots(stored: Stored) -> int:
    return as_body(stored.body).slots


def _held(stored: Stored, b: int, n: int, dtype, name: str) -> tuple[torch.Tensor, int]:
    """(x, nb): sequence b's body positions [0, nb) (nb = its n_body, at most n) as [Hkv, nb,
    D] in dtype — dequantized (into the scratch buffer `name`), or a view of an exact body — and
    nb."""
    nb, body = min(int(stored.n_body[b]), n), as_body(stored.body)
    if body.packed:  # by byte tables
        return dequantize(body, dtype, b, nb, scratch=name), nb
    return body.dequantize(dtype, b, nb), nb  # its own read (a view of an exact body)


def _after(stored: Stored, b: int, body: torch.Tensor, nb: int, lo: int, n: int, dtype):
    """Positions [lo, n) of sequence b in order (lo <= nb): the body's past lo, then the ring."""
    ring = torch.arange(nb, n, device=stored.tail.device) % stored.tail.shape[2]
    return torch.cat([body[:, lo:nb], stored.tail[b][:, ring].to(dtype)], 1)


_BYTE_TABLES: dict = {}


def _byte_tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, fp8) fp32 [256]: what each byte decodes to as a one-byte scale (layouts.metabyte)
    and as an E4M3 slot delta (layouts.fp8), for the C kernel to read by table."""
    found = _BYTE_TABLES.get(device)
    if found is None:
        byte = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
        found = _BYTE_TABLES[device] = (metabyte.decode_scale(byte), fp8.decode(byte))
    return found


_READERS: dict = {}


def _native(body, b: int, n: int, copies: bool = True) -> "decode_native.Body | None":
    """decode_native's reader of sequence b's body positions [0, n), or None where the C kernel
    does not read it (no library, a layout no table reads, a row too wide). A body left in full
    precision (float32) is read as it lies. The C code reads a packed body's own buffers in the
    dtypes it knows (the CPU cache's float32, byte metadata, E4M3 slots): such a reader is
    checked once for every slot of the body and kept while the buffers and table live. Other
    metadata and slots are read into float32 copies of the first n rows (with copies=False:
    None)."""
    body = as_body(body)
    if body.kind == Kind.EXACT:  # left in full precision: read as it lies
        exact = body.values
        usable = exact.dtype == torch.float32 and exact.shape[-1] <= decode_native.MAX_ROW
        if not usable or exact.device.type != "cpu" or native.library() is None:
            return None
        return decode_native.Body.exact(exact[b], n)
    bits = _window(body) if body.packed else 0
    if not bits or body.codes.device.type != "cpu" or native.library() is None:
        return None
    table, rows = _window_table(body, bits)
    heads, per, layout = body.codes.shape[1], table.shape[1], body.layout
    if body.codes.shape[3] * 8 // bits * per > decode_native.MAX_ROW:
        return None
    static, spec = layout.kind == Kind.STATIC, layout.spec
    in_place = (static or spec.metadata_code == "byte" or body.scale.dtype == torch.float32) and (
        body.slot_index is None or spec.slot_code == "fp8" or body.slot_delta.dtype == torch.float32
    )
    buffers = (body.codes, body.scale, body.offset, body.slot_index, body.slot_delta)
    key = (id(table), b, *(None if t is None else t.data_ptr() for t in buffers))
    if in_place and key in _READERS:
        return _READERS[key][0].first(n)
    if not (in_place or copies):
        return None
    rows_read = body.codes.shape[2] if in_place else n
    scales, fp8s = _byte_tables(body.codes.device)
    meta, slots = {}, {}
    if not static:  # per-token metadata (a static layout's is in the table)
        scale, offset = body.scale[b], None if body.offset is None else body.offset[b]
        if spec.metadata_code == "byte":
            zero = metabyte.zero_step(layout.span) if offset is not None else 0.0
            meta = dict(scale_table=scales, zero_step=zero)
        elif not in_place:
            part = None if offset is None else offset[:, :n]
            scale, offset = layout.metadata_values(scale[:, :n], part)
        meta.update(scale=scale, offset=offset)
    if body.slot_index is not None:
        index, delta = body.slot_index[b], body.slot_delta[b]
        if spec.slot_code == "fp8":  # steps of a static layout's channel scale
            slots = dict(fp8_table=fp8s, step=fp8.step(body.scale))
        elif not in_place:
            index, delta = index[:, :n].contiguous(), delta[:, :n].float()
        slots.update(slot_index=index, slot_delta=delta)
    rows = rows.view(heads, -1)
    reader = decode_native.Body(table, rows, body.codes[b], bits, per, body.width, rows_read,
                                **meta, **slots, keep=not in_place)  # fmt: skip
    if in_place:  # kept with what is not the body's, dropped when a buffer of the body dies
        _READERS[key] = (reader, table, rows, slots.get("step"))
        for t in buffers:
            if t is not None:
                weakref.finalize(t, _READERS.pop, key, None)
    return reader.first(n)


def _attend_native(q, k_new, v_new, keys: Stored, values: Stored, sinks: Sinks, b: int, n: int,
                   inv_freq, window) -> torch.Tensor | None:  # fmt: skip
    """decode_native.attend for sequence b of length n (q [H, D], k_new and v_new [Hkv, 1, D]),
    fp32 [Hkv, G, D]; None where the C kernel does not read both bodies or something is not in
    float32."""
    parts = (q, k_new, v_new, keys.tail, values.tail, sinks.keys, sinks.values)
    if any(t.dtype != torch.float32 for t in parts):
        return None
    nb = [min(int(s.n_body[b]), n) for s in (keys, values)]
    readers = [_native(s.body, b, m) for s, m in zip((keys, values), nb, strict=True)]
    if None in readers:
        return None
    heads, d = keys.tail.shape[1], q.shape[-1]
    if q.numel() > decode_native.MAX_Q:
        return None
    rope = () if inv_freq is None else _rope_table(inv_freq, torch.float32, n + 1)
    size = q.numel() * (n + sinks.positions.shape[1] + 1) // d
    return decode_native.attend(
        *readers, n, q.reshape(heads, -1, d), d**-0.5, rope, (keys.tail[b], values.tail[b]),
        (sinks.keys[b], sinks.values[b], sinks.positions[b]), (k_new[:, 0], v_new[:, 0]),
        sinks.is_sink[b], window or 0, _scratch("scores", (size,), torch.float32, q.device),
    )  # fmt: skip


def prepare(keys: Stored, values: Stored, sinks: Sinks, b: int) -> "decode_native.Sequence | None":
    """Sequence b's decode attention in C prepared for every step (`attend_prepared`): both
    bodies read in place to every slot, the rings, sink slots and is-sink map checked once; None
    where the C kernel does not read both bodies in place or a buffer is not float32."""
    parts = (keys.tail, values.tail, sinks.keys, sinks.values)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in parts):
        return None
    readers = [_native(s.body, b, _slots(s), copies=False) for s in (keys, values)]
    if None in readers:
        return None
    return decode_native.Sequence(
        *readers, (keys.tail[b], values.tail[b]),
        (sinks.keys[b], sinks.values[b], sinks.positions[b]), sinks.is_sink[b],
    )  # fmt: skip


def attend_prepared(sequences, q, k_new, v_new, lengths: list[int], bodies, *, inv_freq=None,
                    window=None) -> torch.Tensor:  # fmt: skip
    """decode_attention_torch's result in float32 through sequences prepared by `prepare` (one
    per sequence, every length within the bodies' slots): q [B, H, 1, D], k_new and v_new [B,
    Hkv, 1, D] in float32; lengths and bodies (the key and value bodies' sizes, two lists) on
    the host. What a prepared sequence keeps is checked once, what changes at every step."""
    d, groups = q.shape[-1], q.shape[1] // k_new.shape[1]
    rope = () if inv_freq is None else _rope_table(inv_freq, torch.float32, max(lengths) + 1)
    size = q.shape[1] * (max(lengths) + sequences[0].count + 1)
    scratch = _scratch("scores", (size,), torch.float32, q.device)
    out = []
    for b, (n, seq) in enumerate(zip(lengths, sequences, strict=True)):
        o = seq.attend(n, min(bodies[0][b], n), min(bodies[1][b], n),
                       q[b, :, 0].view(-1, groups, d), d**-0.5, rope,
                       (k_new[b, :, 0], v_new[b, :, 0]), window or 0, scratch)  # fmt: skip
        out.append(o.view(1, -1, 1, d))
    return torch.cat(out) if len(out) > 1 else out[0]


def _rotate(k: torch.Tensor, pos, inv_freq, n: int, wide) -> torch.Tensor:
    """Pre-RoPE keys [Hkv, L, D] at positions pos (LongTensor [L]; an empty sink slot, -1, is
    masked: any angle serves) rotated as the reference rotates them, in `wide`:
    x * cos + rotate_half(x) * sin, one half at a time."""
    cos, sin = _rope_table(inv_freq, wide, n + 1)
    half = k.shape[-1] // 2
    at = pos.clamp(0, n)
    cos, sin = cos[at, :half], sin[at, :half]
    x1, x2 = k.to(wide).split(half, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _scores_rotated(qg: torch.Tensor, k: torch.Tensor, inv_freq, n: int) -> torch.Tensor:
    """qg [Hkv, G, D] . rope(k) for pre-RoPE keys k [Hkv, L, D] at positions 0..L-1, in qg's
    dtype, without rotating k: the rotation moves onto the query at each position,

        q . (k cos + rotate_half(k) sin) = (k cos) . q + (k sin) . q',   q' = [q2, -q1],

    (the angles of channels i and i + D/2 are equal), two products with q instead of the
    rotation's six passes over the keys and their concatenation."""
    cos, sin = _rope_table(inv_freq, qg.dtype, n + 1)
    length = k.shape[1]
    k = k.to(qg.dtype)
    q1, q2 = qg.chunk(2, -1)
    turned = torch.cat([q2, -q1], -1)
    kc, ks = (torch.mul(k, t[:length], out=_scratch(name, k.shape, k.dtype, k.device))
              for name, t in (("cos", cos), ("sin", sin)))  # fmt: skip
    return (qg @ kc.transpose(1, 2)).baddbmm_(turned, ks.transpose(1, 2))


def decode_attention_torch(q, k_new, v_new, keys: Stored, values: Stored, sinks: Sinks, lengths,
                           *, inv_freq=None, window=None, dtype=None):  # fmt: skip
    """`decode_attention_reference` (same arguments, same result to rounding), one sequence at
    a time over the positions it holds. Synchronizes with the host: meant for the CPU.

    Per sequence, two spans of keys: the positions both bodies hold (read in place, RoPE moved
    onto the query: `_scores_rotated`), and the few others in one set (the body's past the
    other body's end and the ring, the sink slots, the new token), rotated as the reference
    rotates them. Scores are taken in float32 at least (as SDPA accumulates), one softmax over
    both spans, the output returned in `dtype` (default q's)."""
    n_of = lengths.tolist()
    if any(n > min(_slots(keys), _slots(values)) for n in n_of):
        return decode_attention_reference(
            q, k_new, v_new, keys, values, sinks, lengths,
            inv_freq=inv_freq, window=window, dtype=dtype,
        )  # fmt: skip
    dtype = dtype or q.dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    d = q.shape[-1]
    out = []
    for b, n in enumerate(n_of):
        if dtype == torch.float32:  # the C kernel, where it reads both bodies
            o = _attend_native(q[b, :, 0], k_new[b], v_new[b], keys, values, sinks, b, n,
                               inv_freq, window)  # fmt: skip
            if o is not None:
                out.append(o.reshape(q.shape[1], 1, d))
                continue
        (kb, nbk), (vb, nbv) = (
            _held(keys, b, n, dtype, "keys"),
            _held(values, b, n, dtype, "values"),
        )
        lo = min(nbk, nbv)  # below it both bodies hold the positions: read in place
        dev, sink_pos = kb.device, sinks.positions[b]
        pos = torch.cat([torch.arange(lo, n, device=dev), sink_pos, sink_pos.new_tensor([n])])
        k = torch.cat([_after(keys, b, kb, nbk, lo, n, dtype), sinks.keys[b].to(dtype),
                       k_new[b].to(dtype)], 1)  # fmt: skip
        v = torch.cat([_after(values, b, vb, nbv, lo, n, dtype), sinks.values[b].to(dtype),
                       v_new[b].to(dtype)], 1)  # fmt: skip
        seen = ~sinks.is_sink[b, :n]
        ok = torch.cat([seen[lo:], (sink_pos >= 0) & (sink_pos < n), seen.new_ones(1)])
        held = seen[:lo]
        if window:
            held = held & (torch.arange(lo, device=dev) > n - window)
            ok = ok & (pos > n - window)
        qg = q[b, :, 0].to(wide).reshape(kb.shape[0], -1, d) * d**-0.5  # [Hkv, G, D]
        if inv_freq is None:
            body = qg @ kb[:, :lo].to(wide).transpose(1, 2)
        elif dtype == wide:  # nothing rounds the rotated keys: the query turns instead
            body = _scores_rotated(qg, kb[:, :lo], inv_freq, n)
        else:  # the reference rounds rotated keys to dtype, and so does this path
            at = torch.arange(lo, device=dev)
            body = qg @ _rotate(kb[:, :lo], at, inv_freq, n, wide).to(dtype).to(wide).mT
        if inv_freq is not None:
            k = _rotate(k, pos, inv_freq, n, wide).to(dtype)
        rest = qg @ k.to(wide).transpose(1, 2)
        scores = torch.cat([body.masked_fill_(~held, float("-inf")),
                            rest.masked_fill_(~ok, float("-inf"))], -1)  # fmt: skip
        p = torch.softmax(scores, -1)
        o = torch.baddbmm(p[..., lo:] @ v.to(wide), p[..., :lo], vb[:, :lo].to(wide))
        out.append(o.reshape(q.shape[1], 1, d).to(dtype))
    return torch.stack(out)
