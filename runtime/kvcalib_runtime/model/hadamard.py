"""Hadamard matrices and fast randomized Hadamard rotations for KV-cache quantization.

Orders are built, never tabulated: Sylvester doubling for powers of two, Paley I (order q + 1,
prime power q = 3 mod 4) and Paley II (order 2(q + 1), prime power q = 1 mod 4) over GF(q), and
Kronecker products. For n = m·2^a the base order is the smallest h = m·2^c (c <= a) that Paley
(or Sylvester, when m == 1) can build, and H_n = kron(H_h, H_{2^(a-c)}). Every model width in
use fits: 80 = 20·4, 96 = 12·8, 576 = 36·16, 896 = 28·32 (GF(27)), 11008 = 344·32 (GF(343)),
18944 = 148·128, ...

The rotation Q = diag(s) @ H / sqrt(n) (s random ±1 signs) is orthonormal; `hadamard_transform`
applies it in O(n log n + n h) through the Kronecker structure instead of a dense n x n matmul,
and `rotate_columns` applies Q^T to every column of a matrix by butterflies (what the converter
fuses into weights).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

__all__ = [
    "fwht",
    "hadamard_matrix",
    "hadamard_transform",
    "is_supported",
    "orthogonal_hadamard",
    "random_signs",
    "rotate_columns",
]


def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, k) with q == p**k for a prime p, or None."""
    if q < 2:
        return None
    p = next((d for d in range(2, math.isqrt(q) + 1) if q % d == 0), q)
    k = 0
    while q % p == 0:
        q //= p
        k += 1
    return (p, k) if q == 1 else None


def _paley(h: int) -> tuple[int, bool] | None:
    """(q, is_type_one) when Paley I (h = q + 1) or Paley II (h = 2(q + 1)) builds order h."""
    if h % 4 == 0 and _prime_power(h - 1):
        return h - 1, True  # q = h - 1 = 3 mod 4
    if h % 8 == 4 and _prime_power(h // 2 - 1):
        return h // 2 - 1, False  # q = h/2 - 1 = 1 mod 4
    return None


def _decompose(n: int) -> tuple[int, int]:
    """Split n = h * s into the smallest constructible base order h and a power of two s."""
    if n >= 1:
        m = n // (n & -n)  # odd part of n
        h = m
        while h <= n:
            if m == 1 or _paley(h):
                return h, n // h
            h *= 2
    raise ValueError(
        f"no Hadamard matrix of order n = {n}: supported orders are n = m·2^a where m·2^c "
        f"(c <= a) is a Paley order (q + 1 for a prime power q = 3 mod 4, or 2(q + 1) for a "
        f"prime power q = 1 mod 4), or m = 1 (Sylvester)"
    )


def is_supported(n: int) -> bool:
    """True when `hadamard_matrix(n)` can be built (see the module docstring for which n)."""
    try:
        _decompose(n)
    except ValueError:
        return False
    return True


def _polymod(a: list[int], f: list[int], p: int) -> list[int]:
    """Remainder of polynomial a modulo monic f over GF(p); coefficients low -> high."""
    a = [c % p for c in a]
    k = len(f) - 1
    for d in range(len(a) - 1, k - 1, -1):
        if c := a[d]:
            for i, fi in enumerate(f):
                a[d - k + i] = (a[d - k + i] - c * fi) % p
    return a[:k]


def _irreducible(p: int, k: int) -> list[int]:
    """First monic degree-k polynomial over GF(p) with no monic factor of degree 1..k//2."""

    def monic(d: int) -> list[list[int]]:
        return [[*tail, 1] for tail in itertools.product(range(p), repeat=d)]

    factors = [g for d in range(1, k // 2 + 1) for g in monic(d)]
    return next(f for f in monic(k) if all(any(_polymod(f, g, p)) for g in factors))


def _jacobsthal(q: int) -> torch.Tensor:
    """(q, q) int64 matrix J[i, j] = chi(a_i - a_j), chi the quadratic character of GF(q).

    Element e of GF(p^k) is the polynomial whose coefficients are the base-p digits of e.
    """
    p, k = _prime_power(q)
    f = _irreducible(p, k)
    chi = torch.full((q,), -1, dtype=torch.int64)
    chi[0] = 0
    for e in range(1, q):  # mark the nonzero squares by brute force
        a = [(e // p**i) % p for i in range(k)]
        product = [0] * (2 * k - 1)
        for i, j in itertools.product(range(k), repeat=2):
            product[i + j] += a[i] * a[j]
        chi[sum(c * p**i for i, c in enumerate(_polymod(product, f, p)))] = 1
    elements = torch.arange(q)
    diff = torch.zeros(q, q, dtype=torch.int64)
    for i in range(k):  # digit-wise subtraction mod p, re-encoded as an element index
        digit = (elements // p**i) % p
        diff += (digit[:, None] - digit[None, :]) % p * p**i
    return chi[diff]


@functools.lru_cache(maxsize=32)
def _base_matrix(h: int) -> torch.Tensor:
    """Cached (h, h) int8 base factor; shared between callers, so never hand it out uncopied."""
    if h == 1:
        return torch.ones(1, 1, dtype=torch.int8)
    q, type_one = _paley(h)
    core = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    core[0, 1:] = 1
    core[1:, 0] = -1 if type_one else 1
    core[1:, 1:] = _jacobsthal(q)
    eye = torch.eye(q + 1, dtype=torch.int64)
    if type_one:  # skew core C with C C^T = q I: (I + C)(I + C)^T = (q + 1) I
        return (eye + core).to(torch.int8)
    # Paley II: zeros (the diagonal) -> [[1, -1], [-1, -1]], entries ±1 -> ±[[1, 1], [1, -1]]
    plus = torch.tensor([[1, 1], [1, -1]])
    zero = torch.tensor([[1, -1], [-1, -1]])
    return (torch.kron(core, plus) + torch.kron(eye, zero)).to(torch.int8)


def _sylvester(s: int, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """(s, s) Sylvester matrix for a power of two s: H_2s = [[H_s, H_s], [H_s, -H_s]]."""
    h2 = torch.tensor([[1, 1], [1, -1]], dtype=dtype, device=device)
    out = torch.ones(1, 1, dtype=dtype, device=device)
    for _ in range(s.bit_length() - 1):
        out = torch.kron(out, h2)
    return out


def hadamard_matrix(
    n: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Fresh (n, n) ±1 Hadamard matrix in a signed `dtype`: H @ H.T = n I, H = kron(H_h, H_2^b).

    Raises ValueError when n is not supported (see `is_supported`).
    """
    h, s = _decompose(n)
    base = _base_matrix(h).to(dtype=dtype, device=device)
    return torch.kron(base, _sylvester(s, dtype, device))  # kron allocates: cache stays private


def random_signs(n: int, seed: int) -> torch.Tensor:
    """(n,) float32 CPU vector of ±1 drawn from torch.Generator().manual_seed(seed).

    Drawn on CPU so a stored seed reproduces the same signs on every platform and device.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1


def orthogonal_hadamard(
    n: int,
    *,
    seed: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(n, n) orthonormal Q = diag(s) @ H / sqrt(n), s = random_signs(n, seed) (ones if None).

    Q @ Q.T = I; x @ Q is what `hadamard_transform(x, seed=seed)` computes.
    """
    q = hadamard_matrix(n, dtype=dtype, device=device)
    scale = torch.full((n,), n**-0.5, dtype=torch.float64)
    if seed is not None:
        scale *= random_signs(n, seed).double()
    return q.mul_(scale.to(dtype=dtype, device=device)[:, None])


_RADIX = 128  # largest dense Sylvester block of the blocked fast transform


def _kron_factors(n: int, h: int) -> list[int]:
    """Orders of the dense factors whose Kronecker product is H_n: h, then blocks of <= _RADIX."""
    sizes, s = ([h] if h > 1 else []), n // h
    while s > 1:
        r = min(s, _RADIX)
        sizes.append(r)
        s //= r
    return sizes or [1]


def _apply(x: torch.Tensor, mats: list[torch.Tensor]) -> torch.Tensor:
    """x @ kron(*mats) along the last dim, one dense matmul per factor axis."""
    lead = x.shape[:-1]
    y = x.reshape(*lead, *(m.shape[0] for m in mats))
    k = len(mats)
    for i, m in enumerate(mats):
        axis = len(lead) + i
        y = (y.movedim(axis, -1) @ m).movedim(-1, axis) if i < k - 1 else y @ m
    return y.reshape(x.shape)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform x @ H_n along the last dim (n a power of two).

    Same shape and dtype as x. Blocked: H_n = kron of dense Sylvester blocks of at most 128, each
    applied as one matmul over its axis — O(n log n)-like work (n * sum of block orders) with
    large, vectorized steps instead of log2(n) tiny butterfly stages.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two last dimension, got n = {n}")
    mats = [_sylvester(r, x.dtype, x.device) for r in _kron_factors(n, 1)]
    return _apply(x, mats)


@functools.lru_cache(maxsize=64)
def _transform_factors(
    n: int, seed: int | None, dtype: torch.dtype, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """Internal cache: the dense factors of H_n, each scaled by 1/sqrt(order), and the signs."""
    h, _ = _decompose(n)
    mats = []
    for i, r in enumerate(_kron_factors(n, h)):
        m = _base_matrix(h) if i == 0 and h > 1 else _sylvester(r, torch.int8, None)
        mats.append((m.double() * r**-0.5).to(dtype=dtype, device=device))
    signs = None if seed is None else random_signs(n, seed).to(dtype=dtype, device=device)
    return tuple(mats), signs


def hadamard_transform(
    x: torch.Tensor, *, seed: int | None = None, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last dim by Q = orthogonal_hadamard(n, seed): y = x @ Q, or x = y @ Q.T.

    Any leading shape, same shape out; floating x keeps its dtype (others compute in float32).
    H = kron(H_h, S_1, ..., S_k) with dense factors (the Paley/Sylvester base and Sylvester
    blocks of <= 128), so x @ H is one small matmul per factor over its axis of x.
    """
    if not x.is_floating_point():
        x = x.float()
    mats, signs = _transform_factors(x.shape[-1], seed, x.dtype, x.device)
    if signs is not None and not inverse:
        x = x * signs
    y = _apply(x, [m.T for m in mats] if inverse else list(mats))
    if signs is not None and inverse:
        y = y * signs
    return y


@functools.lru_cache(maxsize=64)
def _column_factors(
    n: int, seed: int | None, device: torch.device
) -> tuple[int, int, torch.Tensor, torch.Tensor | None]:
    """Internal cache: (h, t) with H_n = kron(B_h, S_t), the float32 (n, 1) row scale s / sqrt(n)
    and the float32 (h, h) B_h^T (None when h == 1)."""
    h, t = _decompose(n)
    scale = torch.full((n, 1), n**-0.5, dtype=torch.float64)
    if seed is not None:
        scale *= random_signs(n, seed).double()[:, None]
    base = _base_matrix(h).T.float().to(device) if h > 1 else None
    return h, t, scale.float().to(device), base


def rotate_columns(x: torch.Tensor, *, seed: int | None = None) -> torch.Tensor:
    """Q^T x for x (..., n, m), Q = orthogonal_hadamard(n, seed): every column of x rotated.

    Fresh float32 (..., n, m), whatever x's floating dtype or strides (x is not modified).
        Q^T x = H_n^T diag(s) x / sqrt(n),   H_n = kron(B_h, S_t)   (S_t Sylvester, t = 2^a)
    S_t (symmetric) by log2(t) butterfly passes (Walsh-Hadamard: each pass adds and subtracts
    the two halves of every block of rows, runs of whole rows), then B_h^T by one (h, h) matmul:
    O(n m (log2 t + h)) adds instead of the dense O(n^2 m). x @ Q is rotate_columns(x.mT).mT.
    """
    n, m = x.shape[-2:]
    h, t, scale, base = _column_factors(n, seed, x.device)
    a = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    torch.mul(x, scale, out=a)
    if a.numel() == 0:
        return a
    b = torch.empty_like(a)
    k = 1
    while k < t:  # rows i and i + k of every block of 2k rows -> their sum and difference
        src = a.view(-1, h, t // (2 * k), 2, k * m)
        dst = b.view(-1, h, t // (2 * k), 2, k * m)
        torch.add(src[..., 0, :], src[..., 1, :], out=dst[..., 0, :])
        torch.sub(src[..., 0, :], src[..., 1, :], out=dst[..., 1, :])
        a, b = b, a
        k *= 2
    if base is not None:
        a = base @ a.view(-1, h, t * m)
    return a.view(x.shape)
