"""Codebooks are fitted on the domain the quantizer codes in: each group's range is the one
kvcalib_runtime.layouts.quant computes (after leaving out its outliers, which the cache keeps
exactly), and a static codebook's range leaves out the fraction its recipe does. Before, token
groups were normalized by ranges that included the outliers, so the levels sat in a squeezed domain
the quantizer never uses; a planted outlier makes that visible (the coded values filled under a
fifth of [0, 1]).
"""

import pytest
import torch

from kvcalib.calibration.codebooks import Codebooks, _normalized
from kvcalib.core.profile import OUTLIER_FRACTIONS, QUANTILE_LEVELS
from kvcalib_runtime.layouts.quant import QuantSpec
from kvcalib_runtime.layouts.vector import to_vector

L, HKV, T, D = 2, 3, 5, 64


def _window(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, HKV, T, D, generator=g)
    x[:, 0, :, 7] = 50.0  # one outlier above and one below in every token vector
    x[:, 2, :, 3] = -50.0
    acts = {name: x.clone() for name in ("pre", "key", "value")}
    grads = {name: torch.ones_like(x) for name in acts}
    return acts, grads


@pytest.mark.parametrize(
    "variant, spec",
    [
        ("value:vector:outliers0.01", QuantSpec(2, "vector", outliers=0.01)),
        ("value:token32:outliers0.1", QuantSpec(2, "token", 32, outliers=0.1)),
    ],
)
def test_group_variants_normalize_with_the_quantizers_ranges(variant, spec):
    acts, grads = _window()
    keep = torch.ones(T, dtype=torch.bool)
    u, weight = _normalized(variant, acts, grads, keep, quantiles={})
    layout = spec.layout
    v = to_vector(acts["value"]) if layout.joins_heads else acts["value"]
    lo, hi = (layout.expand(r, v.shape) for r in layout.group_range(v, None))
    inside = weight > 0
    torch.testing.assert_close(u[inside], ((v - lo) / (hi - lo))[inside], atol=1e-6, rtol=0)
    # left out of the fit: the planted outliers, and in all k at each end of every group
    assert not inside[v.abs() == 50.0].any()
    g = layout.row_group(v.shape[-1])
    assert (~inside).sum() == v.numel() // g * 2 * layout.outliers_per_side(g)
    assert u[inside].max() == pytest.approx(1.0) and u[inside].min() == pytest.approx(0.0)
    # the old domain (each group's min-max, outliers in): in a group holding a planted outlier
    # the values the quantizer codes filled less than a fifth of [0, 1]
    plain = QuantSpec(2, spec.granularity, spec.group_size).layout
    old_lo, old_hi = (plain.expand(r, v.shape) for r in plain.group_range(v, None))
    planted = plain.expand(plain.group(v.abs() == 50.0).any(-1, keepdim=True), v.shape)
    assert planted.any() and ((hi - lo) / (old_hi - old_lo))[planted].max() < 0.2


@pytest.mark.parametrize("fraction", [0.01, 0.02])
def test_static_variants_use_the_recipes_range_fraction(fraction):
    acts, grads = _window()
    levels = torch.arange(len(QUANTILE_LEVELS), dtype=torch.float32) - 6.5  # distinct per level
    quantiles = {"pre_rope": levels.expand(L, HKV, D, -1).contiguous()}
    keep = torch.ones(T, dtype=torch.bool)
    u, _ = _normalized(f"key:static:pre_rope:outliers{fraction:g}", acts, grads, keep, quantiles)
    i = OUTLIER_FRACTIONS.index(fraction)
    lo, hi = levels[i], levels[len(QUANTILE_LEVELS) - 1 - i]
    torch.testing.assert_close(u, (acts["pre"] - lo) / (hi - lo))


def test_answer_weighted_levels_move_to_what_the_answer_reads():
    # Per-token ranges ("value:token"): the text's elements spread evenly over [0, 1], so its
    # 2-bit Fisher levels sit near 1/8, 3/8, 5/8, 7/8 and none within 0.1 of 1/2. A retrieval
    # prompt's answer reads elements at exactly 1/2 (its gradient sits there, 1e-3 elsewhere):
    # weighing its histogram as much as the text's puts a level within 0.01 of 1/2, while the
    # text variant beside it keeps its levels.
    gen = torch.Generator().manual_seed(0)
    text = torch.rand(1, 256, 16, generator=gen)
    text[..., 0], text[..., 1] = 0.0, 1.0  # every token's range is [0, 1]
    prompt = text.clone()
    prompt[:, 100:120, 2:] = 0.5
    grad = torch.full_like(prompt, 1e-3)
    grad[:, 100:120, 2:] = 1.0
    books = Codebooks(
        ("value:token", "value:token:answer"), 1, 1024, torch.zeros(1, 256, dtype=torch.bool), {}, 1
    )
    wrap = lambda t: {"value": t, "pre": t, "key": t}  # noqa: E731
    books.add(0, 0, wrap(text), wrap(torch.ones_like(text)))
    with pytest.raises(RuntimeError, match="no retrieval prompt"):
        books.result()
    books.answer_consumer(torch.ones(1, 256, dtype=torch.bool)).add(0, 0, wrap(prompt), wrap(grad))
    out = books.result()
    near = {v: (out[f"codebook.{v}.2"][0] - 0.5).abs().min() for v in books.names}
    assert near["value:token:answer"] < 0.01 < 0.1 < near["value:token"]
