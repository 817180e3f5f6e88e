"""Input bases from activation statistics: PCA of a linear's input covariance, random rotations
inside its high- and low-variance subspaces (ResQ's basis), applied online as a linear's input
transform.

Used by the ``resq`` baseline and by MosaicQuant's ``transform="pca"``. For an input of ``K``
channels with covariance ``H = mean_t x_t x_tᵀ = V Λ Vᵀ`` (eigenvalues descending), the basis
``U = [V_l R_l, V_h R_h]`` puts the ``K − r`` low-variance directions first and the top-``r``
high-variance directions last, each rotated by a seeded Haar-random orthogonal matrix so no
channel inside a subspace carries an outlier. ``U`` is orthogonal, so ``x Wᵀ = (x U)(W U)ᵀ``.
"""

from __future__ import annotations

import torch
from torch import nn

from mosaicquant.methods.hadamard import OnlineHadamard, apply_hadamard, is_hadamard_size
from mosaicquant.methods.rotation import random_orthogonal

__all__ = ["BasisTransform", "pca_basis", "resq_basis", "input_rotation", "input_groups", "SHARED_INPUTS", "HADAMARD_INPUTS"]


class BasisTransform(nn.Module):
    """Online change of basis ``x ↦ x U`` of a linear's input (``U [K, K]`` orthogonal).

    Args:
        basis: ``[K, K]`` matrix; stored as a float32 buffer.

    Raises:
        ValueError: ``basis`` is not square.
    """

    def __init__(self, basis: torch.Tensor):
        super().__init__()
        if basis.dim() != 2 or basis.shape[0] != basis.shape[1]:
            raise ValueError(f"basis must be a square [K, K] matrix, got shape {tuple(basis.shape)}")
        self.register_buffer("basis", basis.detach().to(torch.float32).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32) @ self.basis).to(x.dtype)

    def extra_repr(self) -> str:
        return f"size={self.basis.shape[0]}"


def pca_basis(hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a covariance, eigenvalues in descending order.

    Args:
        hessian: ``[K, K]`` symmetric positive semi-definite matrix (``mean_t x_t x_tᵀ``).

    Returns:
        ``(eigenvalues [K], eigenvectors [K, K])`` float64, column ``i`` the ``i``-th
        principal direction.

    Raises:
        ValueError: not square or not finite.
    """
    if hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise ValueError(f"hessian must be a square [K, K] matrix, got shape {tuple(hessian.shape)}")
    h = hessian.detach().to(torch.float64)
    if not torch.isfinite(h).all():
        raise ValueError("hessian holds NaN or Inf values")
    values, vectors = torch.linalg.eigh(0.5 * (h + h.T))
    return values.flip(0), vectors.flip(1)


def resq_basis(hessian: torch.Tensor, n_high: int, seed: int, *, low_group: int | None = None) -> torch.Tensor:
    """ResQ's basis ``U = [V_l R_l, V_h R_h]`` (low-variance subspace first, high last).

    Args:
        hessian: ``[K, K]`` input covariance.
        n_high: dimension ``r`` of the high-variance subspace, ``0 <= r <= K``.
        seed: seed of the two Haar-random rotations (``seed`` for ``R_l``, ``seed + 1`` for ``R_h``).
        low_group: ``None`` (ResQ), or cut the low-variance subspace into consecutive subspaces of
            ``low_group`` principal directions (descending variance; the last one shorter where
            ``K − r`` is not a multiple), each with its own rotation (seeds ``seed + 2``, ``seed + 3``, …),
            so that a per-token grid per group of ``low_group`` channels gives each its own scale.

    Returns:
        ``float64 [K, K]`` orthogonal matrix; its last ``r`` columns span the top-``r``
        principal subspace of ``hessian``.

    Raises:
        ValueError: as :func:`pca_basis`, or ``n_high`` out of range.
    """
    k = hessian.shape[-1]
    if isinstance(n_high, bool) or not isinstance(n_high, int) or not 0 <= n_high <= k:
        raise ValueError(f"n_high={n_high!r} is out of range: allowed integers 0..{k}")
    if low_group is not None and (isinstance(low_group, bool) or not isinstance(low_group, int) or low_group < 1):
        raise ValueError(f"low_group={low_group!r} must be None or a positive integer")
    _, vectors = pca_basis(hessian)
    high, low = vectors[:, :n_high], vectors[:, n_high:]
    parts = []
    if k - n_high and low_group is None:
        # the rotations are drawn on the CPU (the same basis on every device), then moved
        parts.append(low @ random_orthogonal(k - n_high, seed).to(low.device))
    elif k - n_high:
        for i, start in enumerate(range(0, k - n_high, low_group)):
            chunk = low[:, start:start + low_group]
            parts.append(chunk @ random_orthogonal(chunk.shape[1], seed + 2 + i).to(low.device))
    if n_high:
        parts.append(high @ random_orthogonal(n_high, seed + 1).to(high.device))
    return torch.cat(parts, dim=1)


def input_rotation(k: int, basis: torch.Tensor | None, device) -> tuple[nn.Module, torch.Tensor]:
    """The online input transform of a linear of ``k`` inputs and its matrix ``U`` (``x ↦ x U``).

    Args:
        basis: ``[k, k]`` orthogonal basis (:func:`resq_basis`), or ``None`` for the Hadamard transform.

    Returns:
        ``(BasisTransform or OnlineHadamard, float64 [k, k] U on device)``.

    Raises:
        ValueError: ``basis`` is ``None`` and ``k`` has no Hadamard matrix.
    """
    if basis is None:
        if not is_hadamard_size(k):
            raise ValueError(f"down_proj input size {k} has no Hadamard matrix for the online transform")
        return OnlineHadamard(k), apply_hadamard(torch.eye(k, dtype=torch.float64, device=device))
    return BasisTransform(basis), basis.to(device=device, dtype=torch.float64)


# Linears of a decoder layer that read the same input share one basis (the first one's stats).
SHARED_INPUTS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  ("mlp.gate_proj", "mlp.up_proj"),
                  ("self_attn.o_proj",),
                  # Phi-3's fused projections: one linear per shared input
                  ("self_attn.qkv_proj",), ("mlp.gate_up_proj",))
HADAMARD_INPUTS = ("mlp.down_proj",)


def input_groups(stats_names, method: str = "ResQ") -> tuple[list[tuple[str, ...]], list[str]]:
    """Split a decoder layer's linear names into groups that read one input (one basis each) and the
    linears behind an online Hadamard (down_proj).

    Raises:
        ValueError: a linear whose input is not one of the known ones.
    """
    names = set(stats_names)
    groups = [g for g in SHARED_INPUTS if all(n in names for n in g)]
    covered = {n for g in groups for n in g} | {n for n in HADAMARD_INPUTS if n in names}
    missing = sorted(names - covered)
    if missing:
        raise ValueError(f"{method} does not know the input of linears {missing}: supports Llama/Qwen-style "
                         f"decoder layers ({', '.join(n for g in SHARED_INPUTS for n in g)}, down_proj)")
    return groups, [n for n in HADAMARD_INPUTS if n in names]
