"""method "ggml": llama.cpp's KV cache types (ggml-quants.c, quantize_row_q4_0_ref /
quantize_row_q8_0_ref) — "token" groups of 32 channels, symmetric, one scale d per group
computed in fp32 from m, the group's element of largest |x| (the first on ties), and stored in
fp16 whatever the cache dtype:

    bits 4 (q4_0)  d = m / -8, code = min(15, trunc(x * (1/d) + 8.5)), level[c] = c - 8
    bits 8 (q8_0)  d = |m| / 127, code = roundf(x * (1/d)) + 127 (ties away from zero),
                   level[c] = c - 127

1/d is taken in fp32 before d is rounded (d = 0 gives the zero level). No offset, no outliers;
a body is a PackedBody of "token" groups, which the kernels do not read (their levels differ)."""

import torch

from kvcalib_runtime.layouts.base import QTensor, register
from kvcalib_runtime.layouts.token import TokenGroups

GGML_GROUP = 32  # llama.cpp's QK4_0 = QK8_0


@register
class GgmlBlocks(TokenGroups):
    name = method = "ggml"
    calibrates = ()  # llama.cpp's levels: no codebook
    affine = False

    def check(self) -> None:
        super().check()
        spec = self.spec
        if spec.bits not in (4, 8) or spec.granularity != "token" or spec.group_size != GGML_GROUP:
            raise ValueError(
                f"method 'ggml' is llama.cpp's q4_0 / q8_0: bits 4 or 8, granularity 'token', "
                f"group_size {GGML_GROUP}"
            )

    def levels(self, codes: torch.Tensor, codebook) -> torch.Tensor:
        if self.spec.bits == 4:
            return codes.float() - 8
        return super().levels(codes, codebook)

    def quantize(self, x, *, static_range=None, codebook=None, exclude=None, split=None):
        g = self.group(x.float())  # [..., T, D/32, 32]
        m = g.gather(-1, g.abs().argmax(-1, keepdim=True))  # argmax: the first on ties, as ggml
        d = m / -8 if self.spec.bits == 4 else m.abs() / 127
        t = g * torch.where(d != 0, 1 / d, 0.0)
        if self.spec.bits == 4:
            codes = (t + 8.5).trunc().clamp(max=15)
        else:
            whole = t.trunc()
            codes = whole + torch.sign(t) * ((t - whole).abs() >= 0.5) + 127  # roundf
        codes = self.ungroup(codes, x.shape).to(torch.uint8)
        return QTensor(codes, d.to(torch.float16).to(x.dtype), None)
