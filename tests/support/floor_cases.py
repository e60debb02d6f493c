"""The Gluon skeleton of benchmarks/kernel_floor.py: its inputs (random codes, a random level
table and kvcalib-2's per-position metadata) and the attention it computes, in fp32 torch."""

import torch

from kvcalib_runtime.layouts import fp8, metabyte


def skeleton_args(q, kc, vc, table, meta, out, n: int) -> list:
    """The skeleton's arguments in its order (kernel_floor.SIGNATURE, FEATURE_ARGS), the keys'
    scales one and offsets zero."""
    return [q, kc, vc, meta["w"], meta["b"], out, n, table, meta["sink"], meta["index"],
            meta["delta"], meta["scale"], meta["zero"], meta["slots"], meta["freq"],
            torch.ones(q.shape[1]), torch.zeros(q.shape[1])]  # fmt: skip


def skeleton_inputs(gen, n: int, d: int, g: int):
    """The skeleton's arguments for n positions (a multiple of 64), g query heads of d
    channels: (q, key words, value words, the level tables: the keys' and the values' uniform
    0 .. 3), the per-position metadata, and what the reference needs: levels [n, d] of keys
    and values (the codes), fp32."""
    key_codes = torch.randint(0, 4, (n, d), generator=gen)
    value_codes = torch.randint(0, 4, (n, d), generator=gen)

    def pack(codes):
        words = (codes.view(n, d // 16, 16) << 2 * torch.arange(16)).sum(-1)
        return words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32)

    levels = torch.randn(4, generator=gen).to(torch.float16)
    bits = levels.view(torch.int16).long() & 0xFFFF
    table = torch.tensor([bits[0] | bits[1] << 16, bits[2] | bits[3] << 16, 0x3C000000, 0x42004000])
    table = table.where(table < 2**31, table - 2**32).to(torch.int32)
    table = torch.cat([table, torch.zeros(2 * 128, dtype=torch.int32)])  # each thread's copy
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
    return args, meta, levels.float()[key_codes], value_codes.float()


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
