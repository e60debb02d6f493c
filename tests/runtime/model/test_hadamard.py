"""Tests for kvcalib_runtime.model.hadamard: exact Hadamard property, fast transform, signs and
errors."""

import pytest
import torch

from kvcalib_runtime.model.hadamard import (
    fwht,
    hadamard_matrix,
    hadamard_transform,
    is_supported,
    orthogonal_hadamard,
    random_signs,
    rotate_columns,
)

# (n, base order h of H_n = kron(H_h, Sylvester_{n/h}), model that uses n)
SIZES = [
    (64, 1, "llama-smollm2-head-dim"),  # head dim: Llama / SmolLM2
    (80, 20, "phi2-stablelm-head-dim"),  # head dim: phi-2 / StableLM
    (96, 12, "phi3-head-dim"),  # head dim: Phi-3
    (128, 1, "llama3-mistral-qwen-head-dim"),  # head dim: Llama-3 / Mistral / Qwen
    (576, 36, "smollm2-hidden"),  # SmolLM2-135M hidden (Paley II, q = 17)
    (768, 12, "bert-gpt2-hidden"),  # BERT / GPT-2 hidden
    (896, 28, "qwen2-0.5b-hidden"),  # Qwen2-0.5B hidden (Paley I over GF(27))
    (1536, 12, "smollm2-intermediate-qwen2-1.5b-hidden"),  # SmolLM2-135M inter. / Qwen2-1.5B
    (2048, 1, "llama3.2-1b-hidden"),  # Llama-3.2-1B hidden
    (2560, 20, "phi2-hidden"),  # Phi-2 hidden
    (3072, 12, "llama3.2-3b-hidden"),  # Llama-3.2-3B hidden
    (4096, 1, "llama-8b-hidden"),  # Llama-2/3-8B hidden
    (4864, 76, "qwen2-0.5b-intermediate"),  # Qwen2-0.5B intermediate (Paley II, q = 37)
    (5120, 20, "llama2-13b-hidden"),  # Llama-2-13B hidden
    (5632, 44, "tinyllama-intermediate"),  # TinyLlama intermediate
    (8192, 1, "llama3-70b-hidden"),  # Llama-3-70B hidden
    (11008, 344, "llama2-7b-intermediate"),  # Llama-2-7B intermediate (Paley I over GF(343))
    (13824, 108, "llama2-13b-intermediate"),  # Llama-2-13B intermediate
    (14336, 28, "llama3-8b-mistral-intermediate"),  # Llama-3-8B / Mistral-7B intermediate
    (18944, 148, "qwen2-7b-intermediate"),  # Qwen2-7B intermediate (Paley II, q = 73)
]
BASE = {n: h for n, h, _ in SIZES}
SIZE_PARAMS = [pytest.param(n, id=f"{n}-{label}") for n, _, label in SIZES]
# A dense float32 Gram matrix costs ~0.4 s at n = 2048 on 2 cores and grows as n^3 (~100 s at
# 18944), so above this the Hadamard property is proven through the Kronecker factors alone.
FULL_GRAM_MAX = 2048


def _sylvester(s: int) -> torch.Tensor:
    """Reference Sylvester matrix straight from H_2s = [[H_s, H_s], [H_s, -H_s]] (int8)."""
    h = torch.ones(1, 1, dtype=torch.int8)
    while h.shape[0] < s:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def _assert_gram(h: torch.Tensor) -> None:
    # Entries are ±1, so every partial sum of a float32 dot product is an integer of magnitude
    # <= n < 2^24: the float32 Gram matrix is exact and torch.equal is the right bound.
    n = h.shape[0]
    h = h.float()
    assert torch.equal(h @ h.T, n * torch.eye(n))


@pytest.mark.parametrize("n", SIZE_PARAMS)
def test_gram_is_n_identity(n: int) -> None:
    assert is_supported(n)
    h = BASE[n]
    _assert_gram(hadamard_matrix(h))  # the Paley (or trivial) base factor, exactly
    full = hadamard_matrix(n, dtype=torch.int8)
    # H_n == kron(H_h, S) with H_h H_h^T = h I and S S^T = (n/h) I (Sylvester) gives
    # H_n H_n^T = kron(h I, (n/h) I) = n I exactly; it also pins the smallest base order h.
    assert torch.equal(full, torch.kron(hadamard_matrix(h, dtype=torch.int8), _sylvester(n // h)))
    if n <= FULL_GRAM_MAX:  # and directly, independent of the structure argument
        _assert_gram(full)


@pytest.mark.parametrize("n", SIZE_PARAMS)
def test_entries_are_plus_minus_one(n: int) -> None:
    full = hadamard_matrix(n, dtype=torch.int8)
    low, high = torch.aminmax(full)
    # Integers in [-1, 1] with no zero are exactly ±1 (cheaper than abs().eq(1) on 359M entries).
    assert (low.item(), high.item()) == (-1, 1)
    assert bool(full.ne(0).all())


def test_hadamard_matrix_dtype_device_and_fresh() -> None:
    h = hadamard_matrix(12, dtype=torch.float64, device="cpu")
    assert (h.dtype, h.shape, h.device.type) == (torch.float64, (12, 12), "cpu")
    # The int8 base factor is cached and int8 on CPU is its own dtype and device (the aliasing
    # risk): zeroing a returned matrix must leave every later one at ±1.
    hadamard_matrix(12, dtype=torch.int8).zero_()
    assert bool(hadamard_matrix(12, dtype=torch.int8).abs().eq(1).all())


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("n", [64, 80, 96, 576, 896, 1536])
def test_fast_transform_matches_dense(n: int, seed: int | None) -> None:
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    q = orthogonal_hadamard(n, seed=seed, dtype=torch.float64)
    # float64 round-off over ~log2(n) + h-term sums of O(1) values is ~1e-14; a wrong sign,
    # permutation or scale gives O(1) errors, so 1e-10 separates the two with a wide margin.
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-10)
    y = hadamard_transform(x, seed=seed)
    assert (y.shape, y.dtype) == (x.shape, torch.float64)
    assert torch.allclose(y, x @ q, rtol=0, atol=1e-10)
    assert torch.allclose(
        hadamard_transform(y, seed=seed, inverse=True), y @ q.T, rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("seed", [None, 3])
@pytest.mark.parametrize("n", SIZE_PARAMS)
def test_inverse_roundtrip_and_norm(n: int, seed: int | None) -> None:
    x = torch.randn(4, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = hadamard_transform(x, seed=seed)
    # Q is orthonormal, so only float64 round-off (~1e-15 relative) may separate these.
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    assert torch.allclose(hadamard_transform(y, seed=seed, inverse=True), x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("m", [1, 97])
@pytest.mark.parametrize("n", [64, 80, 96, 128, 576, 896, 2048])
def test_rotate_columns_is_the_dense_rotation(n: int, m: int, seed: int | None) -> None:
    """The converter's butterflies against Q^T x in float64. Bound (flash-attention's rule): the
    float32 error is at most twice that of the dense float32 matmul with the same Q, which is
    ~1e-7 relative; a wrong sign, order or scale is O(1)."""
    x = torch.randn(3, n, m, dtype=torch.float64, generator=torch.Generator().manual_seed(n + m))
    q = orthogonal_hadamard(n, seed=seed, dtype=torch.float64)
    reference = q.T @ x
    y = rotate_columns(x.float(), seed=seed)
    assert (y.shape, y.dtype) == (x.shape, torch.float32)
    dense = orthogonal_hadamard(n, seed=seed).T @ x.float()
    error, dense_error = ((t.double() - reference).abs().max() for t in (y, dense))
    assert error <= 2 * dense_error, (error, dense_error)
    assert (x - reference).abs().max() > 0.1  # a no-op could not pass
    # Strided and low-precision inputs: read as they are, computed in float32.
    assert torch.equal(rotate_columns(x.float().mT.contiguous().mT, seed=seed), y)
    x16 = x.bfloat16()
    assert torch.equal(rotate_columns(x16, seed=seed), rotate_columns(x16.float(), seed=seed))
    assert torch.equal(x16, x.bfloat16())  # the input is not modified


def test_rotate_columns_of_an_empty_matrix() -> None:
    assert rotate_columns(torch.zeros(128, 0)).shape == (128, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_transform_keeps_shape_and_dtype(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 4, 80, generator=torch.Generator().manual_seed(1))
    y = hadamard_transform(x.to(dtype), seed=5)
    assert (y.shape, y.dtype) == (x.shape, dtype)
    ref = x.double() @ orthogonal_hadamard(80, seed=5, dtype=torch.float64)
    # Error budget: a few roundings at the dtype's eps (bf16 ~8e-3) on O(1) outputs.
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    assert torch.allclose(y.double(), ref, rtol=0, atol=tol)


def test_integer_input_computes_in_float32() -> None:
    x = torch.arange(64).reshape(1, 64)
    y = hadamard_transform(x)
    assert y.dtype == torch.float32
    # x @ H / 8 for x = 0..63: column 0 is sum(x) / 8 = 2016 / 8 = 252, exactly representable.
    assert y[0, 0].item() == 252.0


def test_fwht_is_unnormalized_sylvester() -> None:
    x = torch.randn(7, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    # Same round-off argument as the dense comparison above, unnormalized so values are ~16x.
    assert torch.allclose(fwht(x), x @ _sylvester(256).double(), rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="n = 96"):  # 96 is not a power of two
        fwht(torch.zeros(96))


def test_random_signs() -> None:
    a = random_signs(128, seed=0)
    assert (a.dtype, a.shape) == (torch.float32, (128,))
    assert set(a.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(a, random_signs(128, seed=0))  # same seed -> same rotation
    # Two independent seeds agree on all 128 signs with probability 2^-128.
    assert not torch.equal(a, random_signs(128, seed=1))
    # Stored calibrations keep only the seed: pin the CPU generator's stream so a change in how
    # signs are drawn (which would silently change every saved rotation) fails here.
    assert random_signs(8, seed=0).tolist() == [-1, 1, 1, -1, 1, 1, 1, 1]


# 92 = 23·4: Paley needs q = 91 = 7·13 or q = 45 = 3^2·5, neither a prime power, and 23, 46
# are no Hadamard orders (an order above 2 is a multiple of 4). 15015 = 3·5·7·11·13 and 6 admit
# no Hadamard matrix at all; 0 and -4 are not orders.
@pytest.mark.parametrize("n", [92, 15015, 6, 0, -4])
def test_unsupported_size_raises(n: int) -> None:
    assert not is_supported(n)
    with pytest.raises(ValueError, match=rf"n = {n}\b"):
        hadamard_matrix(n)
    if n > 0:
        with pytest.raises(ValueError, match=rf"n = {n}\b"):
            hadamard_transform(torch.zeros(2, n))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    x = torch.randn(16, 896, generator=torch.Generator().manual_seed(3))
    y = hadamard_transform(x.cuda(), seed=11)
    assert y.device.type == "cuda"
    # Same float32 math on both devices; different kernels reorder sums (~1e-6 on O(1) values).
    assert torch.allclose(y.cpu(), hadamard_transform(x, seed=11), rtol=0, atol=1e-4)
    assert torch.equal(hadamard_matrix(96, device="cuda").cpu(), hadamard_matrix(96))
