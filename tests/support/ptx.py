"""A CPU executor of the kernels' inline PTX (which only a GPU runs), instruction by instruction:
the tests hold the bit tricks of kernels.packed and of benchmarks/kernel_floor.py's Gluon
skeleton to the plain decode with it."""

import torch


def run_ptx(asm: str, regs: dict[str, torch.Tensor],
            shared: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Execute inline PTX of one thread on int64 tensors of 32-bit values, `regs` its operands
    by name ($n, or the block's own registers): prmt.b32 in its default mode, and.b32, or.b32,
    shl.b32, shr.u32, mad.lo.u32, shf.r.clamp.b32 (the funnel shift of {b, a} right by
    min(c, 32)), sub.rn.f16x2 (each half rounded once), mov.b32 d, src and mov.b32 {lo, hi},
    src (the PTX ISA's definitions), and ld.shared.b32 d, [a] (ld.shared.v2.b32 {d0, d1}, [a])
    of the words `shared` (int64, word-aligned addresses: word a / 4)."""
    mask = 0xFFFFFFFF

    def value(token):
        return regs[token] if token in regs else torch.tensor(int(token, 0))

    def halves(x):  # a register's two fp16, as float64 [..., 2]
        pairs = torch.stack([x & 0xFFFF, x >> 16], -1).to(torch.int32)
        return pairs.to(torch.int16).view(torch.float16).double()

    def packed(h):  # float64 [..., 2] rounded to fp16, as one register
        bits = h.to(torch.float16).view(torch.int16).long() & 0xFFFF
        return bits[..., 0] | bits[..., 1] << 16

    for line in asm.strip("{} \n").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):  # {lo, hi}, src: the two 16-bit halves
            pair, src = args.rsplit(",", 1)
            lo, hi = (h.strip(" {}") for h in pair.split(","))
            regs[lo], regs[hi] = value(src.strip()) & 0xFFFF, value(src.strip()) >> 16
            continue
        if op == "ld.shared.v2.b32":  # {d0, d1}, [a]: the words at a and a + 4
            pair, src = args.rsplit(",", 1)
            at = value(src.strip(" []"))
            assert shared is not None and not (at % 8).any(), "an 8-byte-aligned shared load"
            for k, name in enumerate(h.strip(" {}") for h in pair.split(",")):
                regs[name] = shared[at // 4 + k]
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "ld.shared.b32":
            at = value(src[0].strip("[]"))
            assert shared is not None and not (at % 4).any(), "a word-aligned shared load"
            regs[dst] = shared[at // 4]
            continue
        if op == "mov.b32":
            regs[dst] = value(src[0]) & mask
            continue
        a, b = value(src[0]), value(src[1])
        if op == "and.b32":
            out = a & b
        elif op == "or.b32":
            out = a | b
        elif op == "shl.b32":
            out = a << b
        elif op == "shr.u32":
            out = a >> b
        elif op == "sub.rn.f16x2":  # the exact difference, rounded once to fp16
            out = packed(halves(a) - halves(b))
        elif op == "shf.r.clamp.b32":
            out = ((b << 32) | a) >> value(src[2]).clamp(max=32)
        elif op == "mad.lo.u32":
            out = a * b + value(src[2])
        elif op == "prmt.b32":  # byte i of d: byte (selector nibble i) of {b, a}
            pool = [(a >> 8 * k) & 0xFF for k in range(4)] + [(b >> 8 * k) & 0xFF for k in range(4)]
            sel, out = value(src[2]), 0
            for i in range(4):
                nibble = (sel >> 4 * i) & 0xF
                assert not (nibble & 8).any()  # the sign-replicate mode: never selected here
                out = out | sum(torch.where(nibble == k, pool[k], 0) for k in range(8)) << 8 * i
        else:
            raise AssertionError(f"unexpected PTX {op}")
        regs[dst] = out & mask
    return regs
