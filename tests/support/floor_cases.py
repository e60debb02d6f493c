"""The Gluon skeleton of benchmarks/kernel_floor.py: its inputs (random codes, random level
tables and kvcalib-2's per-position metadata) and the attention it computes, in fp32 torch."""

import torch

from kvcalib_runtime.layouts import fp8, metabyte


def skeleton_args(q, kc, vc, table, meta, out, n: int) -> list:
    """The skeleton's arguments in its order (kernel_floor.SIGNATURE, FEATURE_ARGS), the keys'
    scales one and offsets zero."""
    return [q, kc, vc, meta["w"], meta["b"], out, n, table, meta["sink"], meta["index"],
            meta["delta"], meta["scale"], meta["zero"], meta["slots"], meta["freq"],
            torch.ones(q.shape[1]), torch.zeros(q.shape[1])]  # fmt: skip


def _int32(words: torch.Tensor) -> torch.Tensor:
    """32-bit patterns (int64, 0 .. 2^32 - 1) as int32."""
    return words.where(words < 2**31, words - 2**32).to(torch.int32)


def skeleton_inputs(gen, n: int, d: int, g: int, bits: int = 2):
    """The skeleton's arguments for n positions (a multiple of 64), g query heads of d
    channels: (q, key words, value words, the level tables: at 2 bits the keys' table words
    and the values' uniform 0 .. 3; at 3 and 4 bits two random codebooks' tables of level
    pairs, the keys' at word 0, the values' at word 256), the per-position metadata, and what
    the reference needs: levels [n, d] of keys and values (at 2 bits the values' codes),
    fp32. Code c of a position is at bits c bits .. of its row (3 bits: across words)."""
    key_codes = torch.randint(0, 2**bits, (n, d), generator=gen)
    value_codes = torch.randint(0, 2**bits, (n, d), generator=gen)

    def pack(codes):
        stream = ((codes[..., None] >> torch.arange(bits)) & 1).reshape(n, -1, 32)
        return _int32((stream << torch.arange(32)).sum(-1))

    levels = torch.randn(2**bits, generator=gen).to(torch.float16)
    pattern = levels.view(torch.int16).long() & 0xFFFF
    if bits == 2:
        table = _int32(torch.tensor([pattern[0] | pattern[1] << 16, pattern[2] | pattern[3] << 16,
                                     0x3C000000, 0x42004000]))  # fmt: skip
        table = torch.cat([table, torch.zeros(2 * 128, dtype=torch.int32)])  # each thread's copy
        value_levels = torch.arange(4.0)
    else:
        value_levels = torch.randn(2**bits, generator=gen).to(torch.float16)
        x = torch.arange(256) % 4**bits
        pairs = [(p[x % 2**bits] | p[x // 2**bits] << 16)
                 for p in (pattern, value_levels.view(torch.int16).long() & 0xFFFF)]  # fmt: skip
        table = _int32(torch.cat(pairs))
    q = torch.randn(g, d, generator=gen).to(torch.float16)
    meta = dict(w=torch.rand(n, generator=gen) + 0.5, b=torch.randn(n, generator=gen) * 0.1,
                sink=(torch.rand(n, generator=gen) < 0.05).to(torch.uint8),
                index=torch.randint(0, d, (n,), generator=gen).to(torch.uint8),
                delta=torch.randint(0, 256, (n,), generator=gen).to(torch.uint8),
                scale=torch.randint(80, 120, (n,), generator=gen).to(torch.uint8),
                zero=torch.randint(0, 256, (n,), generator=gen).to(torch.uint8),
                slots=torch.randn(d + 1 + d, 8, generator=gen) * 0.1,
                freq=1e4 ** -(torch.arange(d // 2) / (d // 2)))  # fmt: skip
    meta["delta"][(meta["delta"] & 0x7F) > 0x77] = 0  # finite E4M3 bytes only
    args = (q, pack(key_codes), pack(value_codes), table)
    return args, meta, levels.float()[key_codes], value_levels.float()[value_codes]


def skeleton_reference(q, keys, values, meta, features: bool, pre: bool):
    """The skeleton's attention in fp32 torch: scores in log2 units (exp2), values w v + b."""
    n, d = keys.shape
    q = q.float()
    pos = torch.arange(n, dtype=torch.float32)
    if pre:  # keys rotated by RoPE at their position, channel c with c + D/2
        angle = pos[:, None] * meta["freq"][None, :]
        lo, hi = keys[:, : d // 2], keys[:, d // 2 :]
        keys = torch.cat(
            [lo * angle.cos() - hi * angle.sin(), hi * angle.cos() + lo * angle.sin()], 1
        )
    s = keys @ q.T  # [n, G]
    w, b = meta["w"], meta["b"]
    if features:
        c = meta["index"].long()
        delta = fp8.decode(meta["delta"]).float()
        slot = meta["slots"][c, : q.shape[0]]
        if pre:
            angle = pos * meta["freq"][c % (d // 2)]
            pair = meta["slots"][d + 1 + c, : q.shape[0]]
            slot = slot * angle.cos()[:, None] + pair * angle.sin()[:, None]
        s = s + slot * delta[:, None] + meta["slots"][d, : q.shape[0]][None, :]
        s = s.masked_fill(meta["sink"][:, None].bool(), float("-inf"))
        w = metabyte.decode_scale(meta["scale"])
        b = -(meta["zero"].float() * (3.0 / metabyte.ZERO_STEPS)) * w
    p = torch.exp2(s - s.max(0).values)
    return (p.T @ (w[:, None] * values) + (p * b[:, None]).sum(0)[:, None]) / p.sum(0)[:, None]
