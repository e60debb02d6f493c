"""Fixed Lloyd-Max tables: the MSE-optimal scalar quantizer of one coordinate of a uniformly
random unit vector, TurboQuant's codebook (Zandieh et al., ICLR 2026, arXiv:2504.19874, Lemma 1
and §3.1).

A coordinate y of a point drawn uniformly from the unit sphere S^(n-1) has the density

    f_n(y) = Γ(n/2) / (√π Γ((n-1)/2)) · (1 - y²)^((n-3)/2),   y in [-1, 1]

(→ N(0, 1/n) as n grows). `lloyd_max(n, bits)` solves the continuous 1-D k-means problem for
f_n — levels c_1 < ... < c_L (L = 2**bits) minimizing E[min_k (y - c_k)²] — by Lloyd's
iteration on a fine midpoint grid of [-1, 1] in float64, started from the quantiles of f_n.
The tables are computed, not tabulated (like the Hadamard orders), and cached per (n, bits).
`distortion(n, bits)` = n · that minimum: the MSE D_mse of quantizing a unit vector of n
coordinates this way (the paper's Theorem 1 quotes 0.36, 0.117, 0.03, 0.009 at 1-4 bits).
"""

import functools

import torch

GRID = 1 << 15  # midpoint cells on [-1, 1]: spacing 6e-5, far below a level gap at 5 bits
MAX_ITERATIONS = 5000
TOLERANCE = 1e-12  # stop once no level moves more than this


def _density(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, w): float64 [GRID] grid midpoints and their probability masses under f_n."""
    if n < 2:
        raise ValueError(f"a unit vector of n = {n} coordinates: use n >= 2")
    y = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID * 2 - 1
    logw = (n - 3) / 2 * torch.log1p(-y * y)
    w = torch.exp(logw - logw.max())
    return y, w / w.sum()


@functools.lru_cache(maxsize=64)
def _solve(n: int, bits: int) -> tuple[torch.Tensor, float]:
    """(levels float64 [2**bits], minimal per-coordinate MSE) of f_n."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits = {bits}: Lloyd-Max tables are for 1 to 8 bits")
    y, w = _density(n)
    count = 2**bits
    cdf = w.cumsum(0)
    targets = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    levels = y[torch.searchsorted(cdf, targets).clamp(max=GRID - 1)]
    for _ in range(MAX_ITERATIONS):
        cell = torch.searchsorted((levels[1:] + levels[:-1]) / 2, y)
        mass = torch.zeros(count, dtype=torch.float64).scatter_add_(0, cell, w)
        moment = torch.zeros(count, dtype=torch.float64).scatter_add_(0, cell, w * y)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), levels)
        moved = (new - levels).abs().max().item()
        levels = new
        if moved < TOLERANCE:
            break
    cell = torch.searchsorted((levels[1:] + levels[:-1]) / 2, y)
    cost = float((w * (y - levels[cell]) ** 2).sum())
    return levels, cost


def lloyd_max(n: int, bits: int) -> torch.Tensor:
    """The sorted levels float32 [2**bits] in [-1, 1] for one coordinate of a unit vector of n
    coordinates (a fresh tensor)."""
    return _solve(n, bits)[0].float()


def distortion(n: int, bits: int) -> float:
    """D_mse = E ||x - x_hat||² of a uniformly random unit vector of n coordinates quantized
    coordinate-wise with `lloyd_max(n, bits)` (n times the per-coordinate minimum)."""
    return n * _solve(n, bits)[1]


@functools.lru_cache(maxsize=64)
def _haar(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))  # the sign fix makes Q Haar-distributed


def random_rotation(n: int, seed: int = 0) -> torch.Tensor:
    """A random orthogonal float64 [n, n] matrix R, Haar-distributed: the Q of a QR
    decomposition of a Gaussian matrix drawn from torch.Generator().manual_seed(seed) on the CPU
    (TurboQuant's Π, §3.1), with R's diagonal signs moved into Q. Rows of x are rotated as
    x @ R and back as y @ R.T. Cached; do not modify the returned tensor."""
    return _haar(n, seed)
