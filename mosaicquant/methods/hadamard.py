"""Hadamard matrices and the fast (online) Hadamard transform.

A Hadamard matrix ``H`` of order ``n`` has entries ±1 and ``H Hᵀ = n I``; ``H / √n`` is
orthogonal. The rotations of QuaRot-style methods need one for every hidden, intermediate
and head size of the models in the suites, most of which are not powers of two
(576 = 36·16, 14336 = 28·512, 25600 = 100·256, ...). This module builds

    ``H_n = H_m ⊗ S_{2^k}``,  ``n = m · 2^k``,

where ``S_{2^k}`` is the Sylvester matrix (``S_1 = [1]``, ``S_{2j} = [[S_j, S_j], [S_j, -S_j]]``,
entry ``(i, j) = (-1)^popcount(i & j)``) and ``H_m`` is ``[1]`` (``m = 1``) or a Paley matrix:

- **Paley I** (``q ≡ 3 mod 4`` a prime power, order ``m = q + 1``):
  ``H = I + C`` with the skew conference matrix ``C = [[0, 1ᵀ], [-1, J]]``;
- **Paley II** (``q ≡ 1 mod 4`` a prime power, order ``m = 2(q + 1)``):
  ``H = C ⊗ [[1, 1], [1, -1]] + I ⊗ [[1, -1], [-1, -1]]`` with the symmetric conference
  matrix ``C = [[0, 1ᵀ], [1, J]]``;

``J[i, j] = χ(a_i - a_j)`` is the Jacobsthal matrix of the field ``GF(q)``
(``q = p^r``: polynomials over ``GF(p)`` modulo a monic irreducible polynomial of degree ``r``;
the element with base-``p`` digits ``c_0, c_1, ...`` is ``Σ c_i x^i``), and
``χ(a) = a^((q-1)/2)`` the quadratic character (``χ(0) = 0``).

For a given ``n`` the smallest factor order ``m`` that works is chosen (a power of two gets
``m = 1``); both Paley constructions are tried, Paley I first. Factor matrices are cached.

The fast transform :func:`apply_hadamard` computes ``x @ H_n / √n`` without forming ``H_n``:
Walsh–Hadamard butterflies along the ``2^k`` part (the lowest 7 bits of it as one dense
128×128 Sylvester product, which is faster than short-stride butterflies) and one dense
``m × m`` product for the Paley part. It is the "online Hadamard" applied at run time to the inputs
of ``down_proj`` / ``o_proj`` (:class:`OnlineHadamard`).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import nn

__all__ = [
    "MAX_FACTOR_ORDER",
    "factor_orders",
    "hadamard_factorization",
    "is_hadamard_size",
    "hadamard_factor",
    "hadamard_matrix",
    "random_signs",
    "random_hadamard",
    "apply_hadamard",
    "OnlineHadamard",
]

# Largest Paley factor order considered; Jacobsthal matrices up to this size build in well
# under a second, and every size in the suites needs m <= 100.
MAX_FACTOR_ORDER = 1024


# --------------------------------------------------------------------------------------
# Number theory and the finite field GF(p^r)
# --------------------------------------------------------------------------------------


def _prime_power(q: int) -> tuple[int, int] | None:
    """``(p, r)`` with ``q = p**r`` and ``p`` prime, or ``None``."""
    if q < 2:
        return None
    p = next(d for d in range(2, q + 1) if q % d == 0)  # smallest prime divisor
    r = 0
    while q % p == 0:
        q //= p
        r += 1
    return (p, r) if q == 1 else None


def _poly_mod(a: list[int], f: list[int], p: int) -> list[int]:
    """Remainder of ``a`` modulo the monic ``f`` over GF(p) (coefficients low to high)."""
    a = [c % p for c in a]
    deg_f = len(f) - 1
    for top in range(len(a) - 1, deg_f - 1, -1):
        c = a[top]
        if c:
            shift = top - deg_f
            for i, fc in enumerate(f):
                a[shift + i] = (a[shift + i] - c * fc) % p
    return a[:deg_f] + [0] * max(0, deg_f - len(a))


def _monic_polys(degree: int, p: int):
    """All monic polynomials of ``degree`` over GF(p), low-to-high coefficient lists."""
    for code in range(p**degree):
        coeffs = [(code // p**i) % p for i in range(degree)]
        yield coeffs + [1]


def _is_irreducible(f: list[int], p: int) -> bool:
    """Trial division by every monic polynomial of degree 1 .. deg(f) // 2."""
    deg = len(f) - 1
    for d in range(1, deg // 2 + 1):
        for g in _monic_polys(d, p):
            if not any(_poly_mod(f, g, p)):
                return False
    return True


@functools.cache
def _irreducible_poly(p: int, r: int) -> tuple[int, ...]:
    """The first monic irreducible polynomial of degree ``r`` over GF(p) (lexicographic)."""
    for f in _monic_polys(r, p):
        if _is_irreducible(f, p):
            return tuple(f)
    raise AssertionError(f"no irreducible polynomial of degree {r} over GF({p})")  # impossible


def _field_digits(q: int, p: int, r: int) -> np.ndarray:
    """Base-``p`` digits ``[q, r]`` of the elements ``0 .. q-1``."""
    elems = np.arange(q)
    return np.stack([(elems // p**i) % p for i in range(r)], axis=1)


def _quadratic_character(q: int) -> np.ndarray:
    """``χ(a) = a^((q-1)/2)`` in {-1, 0, 1} for every element ``a`` of GF(q) (odd ``q``)."""
    p, r = _prime_power(q)
    exponent = (q - 1) // 2
    if r == 1:
        return np.array([0] + [1 if pow(a, exponent, p) == 1 else -1 for a in range(1, q)])
    f = list(_irreducible_poly(p, r))

    def mul(a: list[int], b: list[int]) -> list[int]:
        prod = [0] * (len(a) + len(b) - 1)
        for i, ai in enumerate(a):
            if ai:
                for j, bj in enumerate(b):
                    prod[i + j] += ai * bj
        return _poly_mod(prod, f, p)

    one = [1] + [0] * (r - 1)
    minus_one = [p - 1] + [0] * (r - 1)
    chi = np.zeros(q, dtype=np.int64)
    for a, digits in enumerate(_field_digits(q, p, r).tolist()):
        if a == 0:
            continue
        result, base, e = one, digits, exponent
        while e:
            if e & 1:
                result = mul(result, base)
            base = mul(base, base)
            e >>= 1
        if result == one:
            chi[a] = 1
        elif result == minus_one:
            chi[a] = -1
        else:  # impossible in a field: a^((q-1)/2) is a square root of 1
            raise AssertionError(f"GF({q}) arithmetic broken: a={a} gives {result}")
    return chi


def _jacobsthal(q: int) -> np.ndarray:
    """``J[i, j] = χ(a_i - a_j)`` over GF(q), ``[q, q]`` int64."""
    p, r = _prime_power(q)
    chi = _quadratic_character(q)
    digits = _field_digits(q, p, r)
    diff = (digits[:, None, :] - digits[None, :, :]) % p
    index = (diff * (p ** np.arange(r))).sum(axis=-1)
    return chi[index]


# --------------------------------------------------------------------------------------
# Factor matrices
# --------------------------------------------------------------------------------------


def _paley_kind(m: int) -> str | None:
    """Which Paley construction gives order ``m`` ("I", "II") or ``None``."""
    if m < 4 or m % 4:
        return None
    pp = _prime_power(m - 1)
    if pp is not None and (m - 1) % 4 == 3:
        return "I"
    q = m // 2 - 1
    pp = _prime_power(q)
    if pp is not None and q % 4 == 1:
        return "II"
    return None


@functools.lru_cache(maxsize=1)
def factor_orders(limit: int = MAX_FACTOR_ORDER) -> tuple[int, ...]:
    """Orders ``m`` of the factor matrices available (1 and every Paley order up to ``limit``).

    Args:
        limit: largest order listed.

    Returns:
        Sorted tuple of orders, starting ``(1, 4, 8, 12, 20, 24, 28, 32, 36, ...)``.
    """
    return (1,) + tuple(m for m in range(4, limit + 1, 4) if _paley_kind(m) is not None)


def _describe_orders(shown: int = 24) -> str:
    orders = factor_orders()
    head = ", ".join(str(m) for m in orders[:shown])
    return f"{head}, ... ({len(orders)} orders up to {MAX_FACTOR_ORDER}, see factor_orders())"


def _check_size(n: object, name: str = "n") -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name}={n!r} must be a positive integer")
    return n


def _factorization_or_none(n: int) -> tuple[int, int] | None:
    odd, k = n, 0
    while odd % 2 == 0:
        odd //= 2
        k += 1
    for b in range(k + 1):  # growing m = odd * 2^b: the first hit is the smallest factor
        m = odd << b
        if m > MAX_FACTOR_ORDER:
            break
        if m == 1 or _paley_kind(m) is not None:
            return m, k - b
    return None


def hadamard_factorization(n: int) -> tuple[int, int]:
    """Split ``n = m · 2^k`` with the smallest factor order ``m`` that has a Hadamard matrix.

    Args:
        n: matrix order.

    Returns:
        ``(m, k)``; ``m == 1`` for powers of two, else a Paley order.

    Raises:
        ValueError: ``n`` is not a positive integer or has no such factorization.

    Example:
        >>> hadamard_factorization(576), hadamard_factorization(14336), hadamard_factorization(4096)
        ((36, 4), (28, 9), (1, 12))
    """
    _check_size(n)
    split = _factorization_or_none(n)
    if split is None:
        raise ValueError(
            f"no Hadamard matrix of order n={n}: n must be m·2^k with m one of the factor "
            f"orders available ({_describe_orders()})"
        )
    return split


def is_hadamard_size(n: int) -> bool:
    """Whether :func:`hadamard_matrix` supports order ``n`` (a positive integer)."""
    return (
        isinstance(n, int)
        and not isinstance(n, bool)
        and n >= 1
        and (_factorization_or_none(n) is not None)
    )


@functools.cache
def _factor_numpy(m: int) -> np.ndarray:
    if m == 1:
        return np.ones((1, 1), dtype=np.int64)
    kind = _paley_kind(m)
    if kind == "I":
        q = m - 1
        conference = np.zeros((m, m), dtype=np.int64)
        conference[0, 1:] = 1
        conference[1:, 0] = -1
        conference[1:, 1:] = _jacobsthal(q)
        h = np.eye(m, dtype=np.int64) + conference
    elif kind == "II":
        q = m // 2 - 1
        conference = np.zeros((q + 1, q + 1), dtype=np.int64)
        conference[0, 1:] = 1
        conference[1:, 0] = 1
        conference[1:, 1:] = _jacobsthal(q)
        h = np.kron(conference, np.array([[1, 1], [1, -1]])) + np.kron(
            np.eye(q + 1, dtype=np.int64), np.array([[1, -1], [-1, -1]])
        )
    else:
        raise ValueError(
            f"no Paley Hadamard matrix of order m={m}; factor orders available: "
            f"{_describe_orders()}"
        )
    h.setflags(write=False)
    return h


def hadamard_factor(m: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The ``m × m`` factor matrix (``[1]`` or Paley) with entries ±1 (a fresh tensor).

    Args:
        m: a factor order from :func:`factor_orders`.
        dtype: result dtype.

    Returns:
        ``[m, m]`` tensor with ``H Hᵀ = m I``.

    Raises:
        ValueError: ``m`` is not a factor order.
    """
    _check_size(m, "m")
    return _factor_tensor(m).to(dtype, copy=True)


@functools.cache
def _factor_tensor(m: int) -> torch.Tensor:
    """Cached float64 factor matrix; callers must not modify it."""
    return torch.from_numpy(_factor_numpy(m).astype(np.float64))


def _sylvester(size: int, dtype: torch.dtype) -> torch.Tensor:
    idx = torch.arange(size)
    bits = torch.bitwise_and(idx[:, None], idx[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The ±1 Hadamard matrix ``H_n = H_m ⊗ S_{2^k}`` (unnormalised, ``H Hᵀ = n I``).

    Args:
        n: order; see :func:`hadamard_factorization`.
        dtype: result dtype (±1 is exact in every float type).

    Returns:
        ``[n, n]`` tensor. ``apply_hadamard(x)`` equals ``x @ hadamard_matrix(n) / √n``.

    Raises:
        ValueError: no Hadamard matrix of order ``n`` is available (message names ``n`` and
            the factor orders).

    Example:
        >>> h = hadamard_matrix(12)
        >>> bool((h @ h.T == 12 * torch.eye(12, dtype=h.dtype)).all())
        True
    """
    m, k = hadamard_factorization(n)
    return torch.kron(hadamard_factor(m, dtype), _sylvester(2**k, dtype))


def random_signs(n: int, seed: int) -> torch.Tensor:
    """Deterministic random ±1 vector of length ``n`` (float64) drawn from ``seed``.

    Raises:
        ValueError: ``n`` not a positive integer or ``seed`` not an integer.
    """
    _check_size(n)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r} must be an integer")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1


def random_hadamard(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Randomised orthonormal Hadamard ``H_n · diag(random_signs(n, seed)) / √n``.

    Args:
        n: order; see :func:`hadamard_factorization`.
        seed: seed of the sign vector (same seed, same matrix).
        dtype: result dtype.

    Returns:
        ``[n, n]`` orthogonal matrix ``R`` (``R Rᵀ = I``). ``x @ R`` equals
        ``apply_hadamard(x, signs=random_signs(n, seed))``.

    Raises:
        ValueError: as :func:`hadamard_matrix` / :func:`random_signs`.
    """
    signs = random_signs(n, seed)
    h = hadamard_matrix(n, torch.float64)
    return (h * signs[None, :] / math.sqrt(n)).to(dtype)


# --------------------------------------------------------------------------------------
# Fast transform
# --------------------------------------------------------------------------------------


# Sylvester bits handled by one dense product before the butterflies: on CPUs and GPUs a
# [rows, 128] × [128, 128] matmul is faster than seven butterfly passes with short strides.
_DENSE_SYLVESTER = 128


@functools.cache
def _sylvester_cached(size: int) -> torch.Tensor:
    return _sylvester(size, torch.float64)


@functools.cache
def _sylvester_on(size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # one copy per device and dtype: no host-to-device copy per call (CUDA-graph capturable)
    return _sylvester_cached(size).to(device=device, dtype=dtype)


def _walsh_hadamard_last(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised ``x @ S_{2^k}`` along the last dim (length ``2^k``).

    ``S_{2^k} = S_{2^(k-b)} ⊗ S_{2^b}``: the low ``b`` index bits (``2^b <= 128``) by one
    dense product with ``S_{2^b}``, the remaining bits by butterflies
    ``(a, b) -> (a + b, a - b)`` at strides ``2^b, 2^(b+1), ...``.
    """
    size = x.shape[-1]
    lead = x.shape[:-1]
    block = min(size, _DENSE_SYLVESTER)
    rows = x.reshape(-1, size // block, block)
    if block > 1:
        rows = rows @ _sylvester_on(block, x.device, x.dtype)
    h = block
    while h < size:
        pairs = rows.reshape(rows.shape[0], size // (2 * h), 2, h)
        out = torch.empty_like(pairs)
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 1])
        rows = out
        h *= 2
    return rows.reshape(*lead, size)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kron_transform(
    x: torch.Tensor, factor: torch.Tensor, signs: torch.Tensor | None, transpose: bool
) -> torch.Tensor:
    """``x @ (H_m ⊗ S) D / √n`` (or ``x @ ((H_m ⊗ S) D)ᵀ / √n``) along the last dim."""
    n = x.shape[-1]
    m = factor.shape[0]
    out_dtype = x.dtype
    work = _compute_dtype(out_dtype)
    y = x.to(work)
    if transpose and signs is not None:
        # (H D)ᵀ = D Hᵀ: the signs act on the input first
        y = y * signs.to(device=y.device, dtype=work)
    y = _walsh_hadamard_last(y.reshape(*x.shape[:-1], m, n // m))
    if m > 1:
        f = factor.to(device=y.device, dtype=work)
        # index i = a·2^k + b: x @ (A ⊗ S) = Aᵀ X S with X the [m, 2^k] view
        y = torch.matmul(f if transpose else f.T, y)
    y = y.reshape(x.shape) * (1.0 / math.sqrt(n))
    if signs is not None and not transpose:
        y = y * signs.to(device=y.device, dtype=work)
    return y.to(out_dtype)


def _check_signs(signs: torch.Tensor | None, n: int) -> None:
    if signs is None:
        return
    if signs.shape != (n,):
        raise ValueError(f"signs must have shape ({n},), got {tuple(signs.shape)}")
    if not bool((signs.abs() == 1).all()):
        raise ValueError("signs must hold only +1 and -1")


def apply_hadamard(
    x: torch.Tensor,
    *,
    signs: torch.Tensor | None = None,
    transpose: bool = False,
) -> torch.Tensor:
    """Fast orthonormal Hadamard transform of the last dimension: ``x @ H_n D / √n``.

    ``n = x.shape[-1]``, ``H_n = hadamard_matrix(n)``, ``D = diag(signs)`` (identity when
    ``signs`` is ``None``). Half-precision inputs are transformed in float32 and cast back;
    float64 stays float64.

    Args:
        x: ``[..., n]`` floating tensor.
        signs: optional ±1 vector ``[n]`` (e.g. :func:`random_signs`); with it the result is
            ``x @ random_hadamard(n, seed)``.
        transpose: apply the transposed (= inverse) matrix ``(H_n D / √n)ᵀ`` instead.

    Returns:
        Tensor of the shape and dtype of ``x``.

    Raises:
        ValueError: ``x`` is not floating point, its last dimension has no Hadamard matrix,
            or ``signs`` has the wrong shape or values.

    Example:
        >>> x = torch.randn(3, 20, dtype=torch.float64)
        >>> torch.allclose(apply_hadamard(x), x @ hadamard_matrix(20) / 20**0.5)
        True
    """
    if not x.is_floating_point():
        raise ValueError(f"apply_hadamard takes a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("apply_hadamard takes a tensor with at least one dimension")
    n = x.shape[-1]
    m, _ = hadamard_factorization(n)
    _check_signs(signs, n)
    return _kron_transform(x, _factor_tensor(m), signs, transpose)


class OnlineHadamard(nn.Module):
    """Run-time Hadamard transform of the last dimension, usable as a linear's input transform.

    ``forward(x) = x @ H_n D / √n`` (see :func:`apply_hadamard`). The Paley factor and the
    signs are buffers, so the module follows ``.to(device)``; the signs (if any) are saved in
    the state dict, the factor (rebuilt from ``size``) is not.

    Args:
        size: the transformed dimension ``n``.
        signs: optional ±1 vector ``[n]``.
        transpose: apply the transposed (inverse) matrix.

    Raises:
        ValueError: ``size`` has no Hadamard matrix or ``signs`` is invalid.

    Example:
        >>> had = OnlineHadamard(28)
        >>> x = torch.randn(2, 5, 28)
        >>> torch.allclose(had(x), apply_hadamard(x))
        True
    """

    def __init__(self, size: int, signs: torch.Tensor | None = None, transpose: bool = False):
        super().__init__()
        self.size = size
        self.factor_order, self.log2_sylvester = hadamard_factorization(size)
        self.transpose = bool(transpose)
        self.register_buffer(
            "factor", hadamard_factor(self.factor_order, torch.float32), persistent=False
        )
        if signs is not None:
            signs = torch.as_tensor(signs, dtype=torch.float32)
            _check_signs(signs, size)
        self.register_buffer("signs", signs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(
                f"OnlineHadamard of size {self.size} got an input with last dimension {x.shape[-1]}"
            )
        return _kron_transform(x, self.factor, self.signs, self.transpose)

    def extra_repr(self) -> str:
        return (
            f"size={self.size} ({self.factor_order}·2^{self.log2_sylvester}), "
            f"signs={self.signs is not None}, transpose={self.transpose}"
        )
