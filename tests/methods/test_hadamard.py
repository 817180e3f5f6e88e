"""Hadamard matrices (Sylvester × Paley) and the fast online transform."""

from __future__ import annotations

import math

import pytest
import torch

from mosaicquant.methods import hadamard as had
from mosaicquant.methods.hadamard import (
    OnlineHadamard,
    apply_hadamard,
    factor_orders,
    hadamard_factor,
    hadamard_factorization,
    hadamard_matrix,
    is_hadamard_size,
    random_hadamard,
    random_signs,
)

# float64 transform vs dense float64 matmul: sums of n terms of size ~1
FP64_ATOL = 1e-12
# float32 transform vs float64 reference, relative to the output scale
FP32_RTOL = 1e-5
# a transformed unit vector scaled by √n must round to ±1 within this
ROUNDING_ATOL = 1e-9

# (n, smallest factor m) for every model size the suites use (SPEC §4) and head dims
REQUIRED_SIZES = [
    (576, 36),  # SmolLM2 hidden
    (1536, 12),  # SmolLM2 intermediate
    (4096, 1),  # Llama-3-8B / Qwen3-8B hidden
    (14336, 28),  # Llama-3-8B intermediate
    (12288, 12),  # Qwen3-8B intermediate
    (5120, 20),  # Qwen3-32B / 14B hidden
    (25600, 100),  # Qwen3-32B intermediate
    (2560, 20),  # Qwen3-4B hidden
    (9728, 76),  # Qwen3-4B intermediate
    (17408, 68),  # Qwen3-14B intermediate
    (3072, 12),  # Llama-3.2-3B hidden
    (8192, 1),  # Llama-3.2-3B intermediate
    (64, 1),  # head dim
    (128, 1),  # head dim
]
# small enough to form H and check H Hᵀ = n I exactly in a few seconds on 2 cores
DENSE_EXACT_SIZES = [64, 128, 576, 1536, 2560]
PALEY_I_ORDERS = [4, 8, 12, 20, 24, 28, 32, 44, 48, 60, 68, 72, 80, 84]
PALEY_II_ORDERS = [12, 20, 28, 36, 52, 60, 76, 100]


def _popcount_parity(i: int) -> int:
    return bin(i).count("1") % 2


def _kronecker_row(n: int, row: int) -> torch.Tensor:
    """Row ``row`` of H_m ⊗ S_{2^k} from its entry formula (independent of hadamard_matrix)."""
    m, k = hadamard_factorization(n)
    size = 2**k
    factor = hadamard_factor(m)
    a, b = divmod(row, size)
    cols = torch.arange(n)
    sylvester = torch.tensor(
        [1.0 - 2.0 * _popcount_parity(b & j) for j in range(size)], dtype=torch.float64
    )
    return factor[a, cols // size] * sylvester[cols % size]


@pytest.mark.parametrize(("n", "m"), REQUIRED_SIZES)
def test_required_sizes_factorize_with_smallest_factor(n, m):
    assert hadamard_factorization(n) == (m, int(math.log2(n // m)))
    assert is_hadamard_size(n)


def test_factor_orders_contain_both_paley_constructions():
    orders = set(factor_orders())
    assert set(PALEY_I_ORDERS) <= orders
    assert set(PALEY_II_ORDERS) <= orders
    assert 1 in orders
    # orders that neither construction reaches
    for m in (40, 88, 92, 112, 116):
        assert m not in orders, m


@pytest.mark.parametrize("m", sorted(set(PALEY_I_ORDERS + PALEY_II_ORDERS + [1])))
def test_factor_is_hadamard_exactly(m):
    h = hadamard_factor(m)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    gram = h @ h.T
    assert torch.equal(gram, m * torch.eye(m, dtype=torch.float64)), f"m={m}"


def test_every_listed_factor_up_to_256_is_hadamard_exactly():
    for m in factor_orders():
        if m > 256:
            break
        h = hadamard_factor(m, torch.int64)
        assert torch.equal(h @ h.T, m * torch.eye(m, dtype=torch.int64)), f"m={m}"


@pytest.mark.parametrize("q", [3, 5, 7, 11, 13, 17, 37, 43])
def test_quadratic_character_of_prime_field_matches_squares(q):
    squares = {(x * x) % q for x in range(1, q)}
    expected = [0] + [1 if a in squares else -1 for a in range(1, q)]
    assert had._quadratic_character(q).tolist() == expected


@pytest.mark.parametrize("q", [9, 25, 27, 49])
def test_quadratic_character_of_prime_power_field_has_half_squares(q):
    chi = had._quadratic_character(q)
    assert chi[0] == 0
    assert int((chi == 1).sum()) == (q - 1) // 2
    assert int((chi == -1).sum()) == (q - 1) // 2
    # χ(-1) = (-1)^((q-1)/2): the Paley I / II symmetry the constructions rely on
    p, r = had._prime_power(q)
    minus_one = p - 1  # constant polynomial p-1
    assert chi[minus_one] == (1 if (q - 1) // 2 % 2 == 0 else -1)


@pytest.mark.parametrize("n", DENSE_EXACT_SIZES)
def test_full_matrix_is_hadamard_exactly(n):
    h = hadamard_matrix(n)
    assert h.shape == (n, n)
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)), f"n={n}"


@pytest.mark.parametrize("n", [n for n, _ in REQUIRED_SIZES if n not in DENSE_EXACT_SIZES])
def test_large_sizes_rows_are_orthogonal_exactly(n):
    # Forming a 25600² matrix and its Gram is out of reach on CI: take a random subset of
    # rows through the fast transform (e_i @ H / √n), check they are exactly ±1 after
    # scaling, equal the Kronecker formula, and have an exact Gram n·I.
    gen = torch.Generator().manual_seed(n)
    rows = torch.randperm(n, generator=gen)[:24]
    unit = torch.zeros(len(rows), n, dtype=torch.float64)
    unit[torch.arange(len(rows)), rows] = 1.0
    scaled = apply_hadamard(unit) * math.sqrt(n)
    signs = scaled.round()
    assert (scaled - signs).abs().max() < ROUNDING_ATOL
    assert set(signs.unique().tolist()) <= {-1.0, 1.0}
    for i, row in enumerate(rows.tolist()):
        assert torch.equal(signs[i], _kronecker_row(n, row)), f"n={n} row={row}"
    gram = signs @ signs.T
    assert torch.equal(gram, n * torch.eye(len(rows), dtype=torch.float64))


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_sylvester_entries(k):
    n = 2**k
    h = hadamard_matrix(n)
    expected = torch.tensor(
        [[1.0 - 2.0 * _popcount_parity(i & j) for j in range(n)] for i in range(n)],
        dtype=torch.float64,
    )
    assert torch.equal(h, expected)


@pytest.mark.parametrize("n", [6, 10, 46, 92, 3 * 5 * 7 * 11 * 13])
def test_unsupported_size_raises_naming_n_and_orders(n):
    assert not is_hadamard_size(n)
    with pytest.raises(ValueError, match=rf"n={n}\b.*factor orders available \(1, 4, 8, 12"):
        hadamard_matrix(n)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, "8"])
def test_bad_size_raises(bad):
    with pytest.raises(ValueError, match="positive integer"):
        hadamard_factorization(bad)
    assert not is_hadamard_size(bad)


def test_non_paley_factor_raises():
    with pytest.raises(ValueError, match="m=16"):
        hadamard_factor(16)


@pytest.mark.parametrize("n", [12, 20, 28, 36, 52, 64, 80, 96, 100, 200, 576])
@pytest.mark.parametrize("lead", [(1,), (13,), (3, 67)])
def test_apply_matches_dense_matmul(n, lead):
    gen = torch.Generator().manual_seed(n + len(lead))
    x = torch.randn(*lead, n, generator=gen, dtype=torch.float64)
    h = hadamard_matrix(n) / math.sqrt(n)
    torch.testing.assert_close(apply_hadamard(x), x @ h, atol=FP64_ATOL, rtol=0)
    torch.testing.assert_close(apply_hadamard(x, transpose=True), x @ h.T, atol=FP64_ATOL, rtol=0)


@pytest.mark.parametrize("n", [28, 96, 1536])
def test_apply_with_signs_matches_random_hadamard(n):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(13, n, generator=gen, dtype=torch.float64)
    signs = random_signs(n, seed=5)
    r = random_hadamard(n, seed=5)
    torch.testing.assert_close(apply_hadamard(x, signs=signs), x @ r, atol=FP64_ATOL, rtol=0)
    torch.testing.assert_close(
        apply_hadamard(x, signs=signs, transpose=True), x @ r.T, atol=FP64_ATOL, rtol=0
    )


@pytest.mark.parametrize("n", [n for n, _ in REQUIRED_SIZES])
def test_apply_is_orthogonal_on_required_sizes(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=gen, dtype=torch.float64)
    signs = random_signs(n, seed=1)
    y = apply_hadamard(x, signs=signs)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-10, rtol=0)
    torch.testing.assert_close(
        apply_hadamard(y, signs=signs, transpose=True), x, atol=1e-10, rtol=0
    )


def test_apply_low_precision_keeps_dtype_and_accuracy():
    gen = torch.Generator().manual_seed(3)
    x64 = torch.randn(67, 320, generator=gen, dtype=torch.float64)
    ref = apply_hadamard(x64)
    y32 = apply_hadamard(x64.float())
    assert y32.dtype == torch.float32
    err = (y32.double() - ref).abs().max() / ref.abs().max()
    assert err < FP32_RTOL, f"relative error {err:.2e}"
    assert apply_hadamard(x64.to(torch.bfloat16)).dtype == torch.bfloat16


def test_apply_rejects_bad_input():
    with pytest.raises(ValueError, match="floating-point"):
        apply_hadamard(torch.arange(12))
    with pytest.raises(ValueError, match="n=6"):
        apply_hadamard(torch.randn(2, 6))
    with pytest.raises(ValueError, match=r"shape \(12,\)"):
        apply_hadamard(torch.randn(2, 12), signs=torch.ones(11))
    with pytest.raises(ValueError, match=r"\+1 and -1"):
        apply_hadamard(torch.randn(2, 12), signs=torch.full((12,), 0.5))


@pytest.mark.parametrize("n", [20, 96, 576])
def test_random_hadamard_orthonormal_and_deterministic(n):
    r = random_hadamard(n, seed=11)
    torch.testing.assert_close(r @ r.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(r, random_hadamard(n, seed=11))
    assert not torch.equal(r, random_hadamard(n, seed=12))
    signs = random_signs(n, 11)
    assert torch.equal(r * math.sqrt(n), hadamard_matrix(n) * signs[None, :])


def test_random_signs_validation():
    assert set(random_signs(64, 0).tolist()) == {-1.0, 1.0}
    with pytest.raises(ValueError, match="seed"):
        random_signs(8, seed=1.5)


def test_online_hadamard_module():
    n = 80
    signs = random_signs(n, seed=2)
    module = OnlineHadamard(n, signs=signs)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 13, n, generator=gen)
    torch.testing.assert_close(module(x), apply_hadamard(x, signs=signs), atol=1e-6, rtol=1e-6)
    assert "signs" in module.state_dict() and "factor" not in module.state_dict()
    module64 = module.to(torch.float64)
    x64 = x.double()
    torch.testing.assert_close(module64(x64), x64 @ random_hadamard(n, 2), atol=FP64_ATOL, rtol=0)
    inverse = OnlineHadamard(n, signs=signs, transpose=True).to(torch.float64)
    torch.testing.assert_close(inverse(module64(x64)), x64, atol=FP64_ATOL, rtol=0)
    assert "20·2^2" in repr(module)
    with pytest.raises(ValueError, match="last dimension 96"):
        module(torch.randn(3, 96))
    with pytest.raises(ValueError, match="n=6"):
        OnlineHadamard(6)
