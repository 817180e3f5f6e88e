"""MosaicQuant's sparse 4-bit residual: block scores, selection and Hessian-aware fitting.

For one linear layer with transformed weight ``Ŵ [N, K]`` and dense 4-bit base
``base = deq(Q(Ŵ))`` (RTN or GPTQ), the residual is ``E = Ŵ - base``. It is tiled into blocks
of ``Bn × Bk``: block ``(i, j)`` covers rows ``i*Bn .. min((i+1)*Bn, N)`` and columns
``j*Bk .. min((j+1)*Bk, K)``. Edge blocks are ragged (zero-padded in storage), never skipped.
A kept block stores a 4-bit symmetric correction with one FP16 scale per block row
(:class:`mosaicquant.methods.format.ResidualBlocks`).

Conventions:

- ``H`` is the input Hessian ``mean_t x̂_tᵀ x̂_t`` (:class:`~mosaicquant.methods.gptq.HessianAccumulator`),
  ``h_k = H[k, k] = mean_t X̂[t, k]²``. The output distortion of a weight error ``Δ`` is
  ``D(Δ) = tr(Δ H Δᵀ) = mean_t ‖x̂_t Δᵀ‖² = ‖X̂ Δᵀ‖_F² / T``. A sum Hessian (``X̂ᵀX̂``) scales
  every ``D`` by ``T``; scores, selections and the fraction recovered do not change.
- Distortion separates over output rows, ``D = Σ_n e_n H e_nᵀ``, so blocks interact only
  within a block row; the greedy selectors exploit it (after a pick only that block row's
  gains are recomputed; a global maximum over block rows spends the budget on the best
  blocks of the whole layer).
- Budget ``ρ`` (fraction of the blocks of the layer, ``0 <= ρ <= 1``) keeps
  ``floor(ρ · n_blocks + 0.5)`` blocks (round half up). The greedy selectors stop early if
  no remaining block lowers the distortion (a block that adds distortion is never kept), so
  they may keep fewer.
- Coordinates come in selection order (best first); for the greedy selectors the first
  ``m`` picks at a budget are exactly the picks at the smaller budget that keeps ``m``.
- Selection math runs in float64; the residual integers and FP16-rounded scales come from
  :func:`mosaicquant.methods.quant.quantize` (``scale_dtype=torch.float16``).
- Scales ``"free"`` (these functions' default, ``base_scale=None``): each block row's own absmax scale
  (MosaicQuant itself defaults to ``"pow2"``, :class:`mosaicquant.methods.mosaicquant.MosaicQuantConfig`). ``"pow2"`` (``base_scale=``
  given): each block row's scale is its base row's scale times ``2^-j``, ``j = 0 …``
  :data:`POW2_MAX_SHIFT`, the ``j`` of least error (:func:`quantize_pow2_rows`). The format is the
  same (FP16 scales per row of a block); the kernels can then add a kept block's integers, shifted
  left by ``4 - j`` bits, into the dense product's int32 accumulator (the base unpacked as
  ``16 q``), so the residual costs no second accumulator, no conversion and no rescale
  (:func:`mosaicquant.methods.format.residual_shifts`).

Selection methods (:func:`select_residual`):

``"hessian"`` (default)
    Hessian-aware least-squares fit (SPEC §1.9): the correction of block ``(I, J)`` given
    the current error rows ``E_I`` is ``C = E_I H[:, J] (H[J, J] + λ_J I)⁻¹``, quantized to
    4 bits; its gain is the exact distortion reduction of the *quantized* correction;
    blocks are chosen greedily with the error rows updated after each pick.
``"delta"``
    The paper's diagonal Δ-score (SPEC §1.4) of the plain quantized residual ``Q4(E)``.
``"exact-greedy"``
    Plain quantized residual, blocks chosen greedily by exact distortion reduction.
``"frobenius"``
    Plain quantized residual, blocks ranked by ``‖E_b‖²``.
``"random"``
    Plain quantized residual, blocks ranked by seeded uniform random scores.

:func:`channel_residual` gives the channel-allocation ablation (whole input or output
channels at the same number of stored residual elements).
"""

from __future__ import annotations

import math

import torch

from mosaicquant.errors import unknown_name
from mosaicquant.methods.format import POW2_SHIFT_RANGE, parse_block_shape
from mosaicquant.methods.quant import all_finite, quantize

__all__ = [
    "SELECTION_METHODS",
    "DEFAULT_SELECTION",
    "block_grid",
    "tile_blocks",
    "untile_blocks",
    "quantize_residual_blocks",
    "quantize_pow2_rows",
    "POW2_MAX_SHIFT",
    "dequantize_residual_blocks",
    "selected_dense",
    "delta_scores",
    "frobenius_scores",
    "random_scores",
    "num_kept_blocks",
    "select_top_blocks",
    "output_distortion",
    "distortion_recovered",
    "exact_greedy_select",
    "hessian_fit_select",
    "channel_residual",
    "select_residual",
]

SELECTION_METHODS = ("hessian", "delta", "exact-greedy", "frobenius", "random")
DEFAULT_SELECTION = "hessian"
RESIDUAL_SCALE_DTYPE = torch.float16
# "pow2" residual scales: a block row's scale is its base row's scale times 2^-j, j = 0 .. POW2_MAX_SHIFT
# (the kernels add r * 2^(4 - j) into the accumulator of the base unpacked as 16 q: int8 for j >= 0)
POW2_MAX_SHIFT = POW2_SHIFT_RANGE[1]
CHANNEL_AXES = ("input", "output")


# --------------------------------------------------------------------------- tiling


def _check_matrix(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, K], got shape {tuple(x.shape)}")
    if not all_finite(x):
        raise ValueError(f"{name} holds NaN or Inf values")


def _check_hessian(h: torch.Tensor, k: int) -> None:
    if h.dim() != 2 or tuple(h.shape) != (k, k):
        raise ValueError(f"the Hessian must be [K, K] = [{k}, {k}], got shape {tuple(h.shape)}")
    if not all_finite(h):
        raise ValueError("the Hessian holds NaN or Inf values")


def _check_bits4(bits: int) -> None:
    # The packed residual format holds signed 4-bit values only.
    if bits != 4:
        raise ValueError(f"bits={bits!r}: the residual format stores 4-bit values only (allowed: 4)")


def block_grid(shape: tuple[int, int], block_shape) -> tuple[int, int]:
    """Number of block rows and block columns ``(ceil(N / Bn), ceil(K / Bk))``.

    Raises:
        ValueError: an invalid block shape (see :func:`~mosaicquant.methods.format.parse_block_shape`).
    """
    bn, bk = parse_block_shape(block_shape)
    return -(-int(shape[0]) // bn), -(-int(shape[1]) // bk)


def tile_blocks(x: torch.Tensor, block_shape) -> torch.Tensor:
    """View a ``[N, K]`` matrix as zero-padded blocks ``[nbr, nbc, Bn, Bk]``.

    Args:
        x: ``[N, K]``.
        block_shape: ``(Bn, Bk)``, an int or ``"BnxBk"``.

    Returns:
        A new tensor ``[nbr, nbc, Bn, Bk]``; entries outside ``x`` are 0.

    Raises:
        ValueError: ``x`` not 2-D or an invalid block shape.
    """
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D [N, K] tensor, got shape {tuple(x.shape)}")
    bn, bk = parse_block_shape(block_shape)
    n, k = x.shape
    nbr, nbc = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(x, (0, nbc * bk - k, 0, nbr * bn - n))
    return padded.reshape(nbr, bn, nbc, bk).permute(0, 2, 1, 3).contiguous()


def untile_blocks(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`tile_blocks`: ``[nbr, nbc, Bn, Bk]`` → ``[N, K]`` (padding dropped).

    Raises:
        ValueError: the block grid does not cover ``shape`` exactly.
    """
    nbr, nbc, bn, bk = blocks.shape
    n, k = int(shape[0]), int(shape[1])
    if (nbr, nbc) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"a {nbr}x{nbc} grid of {bn}x{bk} blocks does not tile shape {(n, k)}")
    return blocks.permute(0, 2, 1, 3).reshape(nbr * bn, nbc * bk)[:n, :k].contiguous()


# ---------------------------------------------------------------- residual quantizer


def quantize_residual_blocks(
    residual: torch.Tensor, block_shape, bits: int = 4, base_scale: torch.Tensor | None = None,
    max_shift: int = POW2_MAX_SHIFT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize every block of a residual: 4-bit symmetric, one FP16 scale per block row.

    Args:
        residual: ``E`` (or any correction) ``[N, K]``.
        block_shape: ``(Bn, Bk)``.
        bits: must be 4 (the packed residual format).
        base_scale: ``[N]`` per-output-channel scales of the dense base for ``"pow2"`` scales
            (:func:`quantize_pow2_rows`), or ``None`` for each row's own absmax scale.
        max_shift: the largest ``j`` of ``"pow2"`` scales.

    Returns:
        ``(q, scales)``: ``q`` int8 ``[nbr, nbc, Bn, Bk]`` (0 in the padding);
        ``scales`` float32 ``[nbr, nbc, Bn]`` holding FP16-representable values (1 for an
        all-zero row, as :mod:`~mosaicquant.methods.quant` does).

    Raises:
        ValueError: not 2-D, non-finite values, ``bits != 4``, a bad block shape or base scale.

    Example:
        >>> q, s = quantize_residual_blocks(torch.randn(5, 6), (4, 4))
        >>> q.shape, s.shape
        (torch.Size([2, 2, 4, 4]), torch.Size([2, 2, 4]))
    """
    _check_matrix(residual, "residual")
    _check_bits4(bits)
    blocks = tile_blocks(residual.to(torch.float32), block_shape)
    if base_scale is not None:
        return quantize_pow2_rows(blocks, _base_rows(base_scale, residual.shape[0], block_shape).unsqueeze(1),
                                  max_shift=max_shift)
    qt = quantize(blocks, bits, symmetric=True, scale_dtype=RESIDUAL_SCALE_DTYPE)
    return qt.q, qt.scale[..., 0]


def _base_rows(base_scale: torch.Tensor, n: int, block_shape) -> torch.Tensor:
    """``[N]`` base scales as ``[nbr, Bn]`` block rows (1 in the padding rows), float32."""
    bn, _ = parse_block_shape(block_shape)
    base = base_scale.reshape(-1).to(torch.float32)
    if base.numel() != n:
        raise ValueError(f"base_scale must hold one scale per output channel ({n}), got shape "
                         f"{tuple(base_scale.shape)} (pow2 residual scales need per-channel base scales)")
    if not torch.isfinite(base).all() or (base < 0).any():
        raise ValueError("base_scale must hold finite values >= 0")
    nbr = -(-n // bn)
    return torch.nn.functional.pad(base, (0, nbr * bn - n), value=1.0).reshape(nbr, bn)


def _check_max_shift(max_shift) -> None:
    if isinstance(max_shift, bool) or not isinstance(max_shift, int) or not 0 <= max_shift <= POW2_MAX_SHIFT:
        raise ValueError(f"max_shift={max_shift!r} is out of range: allowed integers 0..{POW2_MAX_SHIFT}")


def quantize_pow2_rows(
    x: torch.Tensor, base_rows: torch.Tensor, hessian_blocks: torch.Tensor | None = None,
    max_shift: int = POW2_MAX_SHIFT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit symmetric rows whose scales are the base's row scales times ``2^-j``, ``j = 0 … max_shift``.

    Each row of ``x [..., Bn, Bk]`` takes the ``j`` of least error ``Σ (x - q·s)²`` (with
    ``hessian_blocks [..., Bk, Bk]``: ``(x - q·s) H (x - q·s)ᵀ``, the output distortion); ties go
    to the smaller ``j``. Scales that FP16 cannot hold exactly (``s_w · 2^-j`` below FP16's
    subnormal grid) are not candidates; ``j = 0`` (the base scale, FP16 already) always is. A row
    whose base scale is 0 gets ``q = 0`` and scale 0.

    Args:
        x: float ``[..., Bn, Bk]``.
        base_rows: ``[..., Bn]`` base scales, broadcastable against ``x``'s rows.
        hessian_blocks: optional ``[..., Bk, Bk]`` (broadcastable) weighting of the error.
        max_shift: the largest ``j``, 0 … :data:`POW2_MAX_SHIFT` (3 lets the prefill GEMM multiply a kept block's
            base and residual as one int8 operand, :func:`mosaicquant.kernels.w4a4_gemm.merged_residual_operand`).

    Raises:
        ValueError: ``max_shift`` out of range.

    Returns:
        ``(q, scales)``: int8 ``[..., Bn, Bk]`` in [-8, 7], float32 ``[..., Bn]`` (FP16-exact).

    Example:
        >>> q, s = quantize_pow2_rows(torch.tensor([[0.30, -0.05, 0.11]]), torch.tensor([0.5]))
        >>> q.tolist(), s.tolist()
        ([[5, -1, 2]], [0.0625])
    """
    _check_max_shift(max_shift)
    xf = x.to(torch.float64)
    base = torch.broadcast_to(base_rows.to(torch.float64), xf.shape[:-1])
    live = base > 0
    # x / (s_w 2^-j) = (x / s_w) 2^j exactly (a power-of-two factor), so one division serves every j;
    # a dead row's ratio is 0, so its integers are 0 at every j
    ratio = (xf / torch.where(live, base, 1.0).unsqueeze(-1)).mul_(live.unsqueeze(-1))
    hessian = None if hessian_blocks is None else hessian_blocks.to(torch.float64)
    best_err = torch.full(base.shape, math.inf, dtype=torch.float64, device=xf.device)
    best_j = torch.zeros(base.shape, dtype=torch.float64, device=xf.device)
    q = torch.empty_like(xf)
    d = torch.empty_like(xf)
    for j in range(max_shift + 1):
        s = base * 2.0 ** -j
        exact = s.to(RESIDUAL_SCALE_DTYPE).to(torch.float64) == s
        torch.mul(ratio, 2.0 ** j, out=q).round_().clamp_(-8, 7)
        torch.sub(xf, torch.mul(q, s.unsqueeze(-1), out=d), out=d)
        err = (d * d).sum(-1) if hessian is None else (torch.matmul(d, hessian) * d).sum(-1)
        take = exact & (err < best_err)
        best_err = torch.where(take, err, best_err)
        best_j.masked_fill_(take, float(j))
    shift = torch.exp2(best_j)
    best_q = torch.mul(ratio, shift.unsqueeze(-1), out=q).round_().clamp_(-8, 7).to(torch.int8)
    return best_q, (base / shift).to(torch.float32)


def dequantize_residual_blocks(
    q: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """Dense ``float32 [N, K]`` view of a full grid of quantized blocks (``q * scale``).

    Args:
        q: int8 ``[nbr, nbc, Bn, Bk]``.
        scales: ``[nbr, nbc, Bn]``.
        shape: ``(N, K)``.

    Raises:
        ValueError: mismatched shapes.
    """
    if q.dim() != 4 or tuple(scales.shape) != tuple(q.shape[:3]):
        raise ValueError(
            f"q must be [nbr, nbc, Bn, Bk] and scales [nbr, nbc, Bn], got {tuple(q.shape)} "
            f"and {tuple(scales.shape)}"
        )
    deq = q.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
    return untile_blocks(deq, shape)


def selected_dense(
    shape: tuple[int, int],
    block_shape,
    coords: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """Dense ``float32 [N, K]`` correction of kept blocks (0 elsewhere), unpacked.

    Args:
        shape: ``(N, K)``.
        block_shape: ``(Bn, Bk)``.
        coords: ``[nb, 2]`` block coordinates ``(i, j)``.
        q: int8 ``[nb, Bn, Bk]``.
        scales: ``[nb, Bn]``.

    Returns:
        The same values as ``ResidualBlocks.from_blocks(...).to_dense()`` (FP16 scales).

    Raises:
        ValueError: mismatched shapes.
    """
    bn, bk = parse_block_shape(block_shape)
    nbr, nbc = block_grid(shape, (bn, bk))
    nb = coords.shape[0] if coords.dim() == 2 else -1
    if coords.dim() != 2 or coords.shape[1] != 2 or tuple(q.shape) != (nb, bn, bk) or tuple(scales.shape) != (nb, bn):
        raise ValueError(
            f"expected coords [nb, 2], q [nb, {bn}, {bk}], scales [nb, {bn}]; got "
            f"{tuple(coords.shape)}, {tuple(q.shape)}, {tuple(scales.shape)}"
        )
    blocks = torch.zeros(nbr, nbc, bn, bk, dtype=torch.float32, device=q.device)
    if nb:
        vals = q.to(torch.float32) * scales.to(RESIDUAL_SCALE_DTYPE).to(torch.float32).unsqueeze(-1)
        blocks[coords[:, 0].long(), coords[:, 1].long()] = vals
    return untile_blocks(blocks, shape)


# ------------------------------------------------------------------------- scores


def delta_scores(residual: torch.Tensor, h_diag: torch.Tensor, block_shape,
                 base_scale: torch.Tensor | None = None, max_shift: int = POW2_MAX_SHIFT) -> torch.Tensor:
    """The paper's Δ-score of every block (SPEC §1.4).

    ``Δ_b = Σ_{(n,k)∈b} h_k (E[n,k]² − (E[n,k] − deq(R)[n,k])²)`` with ``R = Q4(E)`` per block
    (4-bit symmetric, per block row, FP16 scales: :func:`quantize_residual_blocks`).

    Args:
        residual: ``E [N, K]``.
        h_diag: ``[K]``, ``h_k = mean_t X̂[t, k]²`` (the Hessian diagonal).
        block_shape: ``(Bn, Bk)``.
        base_scale: ``[N]`` base scales for ``"pow2"`` residual scales (``None``: free scales).
        max_shift: the largest ``j`` of ``"pow2"`` scales.

    Returns:
        float64 ``[nbr, nbc]``.

    Raises:
        ValueError: shape mismatch, non-finite or negative ``h_diag``, bad block shape.
    """
    _check_matrix(residual, "residual")
    _check_h_diag(h_diag, residual.shape[1])
    q, s = quantize_residual_blocks(residual, block_shape, base_scale=base_scale, max_shift=max_shift)
    return _delta_scores_of(residual, h_diag, q, s, block_shape)


def _check_h_diag(h_diag: torch.Tensor, k: int) -> None:
    if h_diag.dim() != 1 or h_diag.shape[0] != k:
        raise ValueError(f"h_diag must be [K] = [{k}], got shape {tuple(h_diag.shape)}")
    if not torch.isfinite(h_diag).all() or (h_diag < 0).any():
        raise ValueError("h_diag must hold finite values >= 0 (a Hessian diagonal)")


def _delta_scores_of(residual: torch.Tensor, h_diag: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                     block_shape) -> torch.Tensor:
    """:func:`delta_scores` of the residual's blocks already quantized to ``(q, s)`` (every block)."""
    r = dequantize_residual_blocks(q, s, residual.shape).to(torch.float64)
    e = residual.to(torch.float64)
    contrib = h_diag.to(torch.float64).unsqueeze(0) * (e * e - (e - r) ** 2)
    return tile_blocks(contrib, block_shape).sum(dim=(-1, -2))


def frobenius_scores(residual: torch.Tensor, block_shape) -> torch.Tensor:
    """``‖E_b‖_F²`` of every block, float64 ``[nbr, nbc]``.

    Raises:
        ValueError: not 2-D, non-finite, or a bad block shape.
    """
    _check_matrix(residual, "residual")
    e = residual.to(torch.float64)
    return tile_blocks(e * e, block_shape).sum(dim=(-1, -2))


def random_scores(grid: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Seeded uniform random scores ``[nbr, nbc]`` (the random-selection baseline).

    Args:
        grid: ``(nbr, nbc)``, e.g. from :func:`block_grid`.
        seed: generator seed; equal seeds give equal scores.

    Raises:
        ValueError: a negative grid size.
    """
    nbr, nbc = int(grid[0]), int(grid[1])
    if nbr < 0 or nbc < 0:
        raise ValueError(f"grid={grid!r} must hold non-negative sizes")
    gen = torch.Generator().manual_seed(int(seed))
    return torch.rand(nbr, nbc, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------------- selection


def num_kept_blocks(budget: float, n_blocks: int) -> int:
    """Blocks kept at budget ``ρ``: ``floor(ρ · n_blocks + 0.5)``.

    Raises:
        ValueError: ``budget`` not a number in [0, 1].
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 <= float(budget) <= 1.0:
        raise ValueError(f"budget={budget!r} is out of range: allowed a fraction of blocks in [0, 1]")
    return int(math.floor(float(budget) * n_blocks + 0.5))


def select_top_blocks(scores: torch.Tensor, budget: float) -> torch.Tensor:
    """Coordinates of the top ``floor(ρ · n_blocks + 0.5)`` blocks by score.

    Args:
        scores: ``[nbr, nbc]``.
        budget: fraction of blocks ``ρ`` in [0, 1].

    Returns:
        int64 ``[K, 2]`` ``(i, j)`` coordinates, highest score first (ties: lower flat index first).

    Raises:
        ValueError: scores not 2-D or non-finite, budget out of range.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [nbr, nbc], got shape {tuple(scores.shape)}")
    if not torch.isfinite(scores).all():
        raise ValueError("scores hold NaN or Inf values")
    keep = num_kept_blocks(budget, scores.numel())
    order = torch.argsort(scores.reshape(-1), descending=True, stable=True)[:keep]
    nbc = scores.shape[1]
    return torch.stack([order // nbc, order % nbc], dim=1).to(torch.int64)


# ------------------------------------------------------------------- distortion


def output_distortion(delta_w: torch.Tensor, hessian: torch.Tensor) -> float:
    """Exact output distortion ``tr(ΔW H ΔWᵀ)`` (float64).

    With ``H = mean_t x_tᵀ x_t`` this is ``‖X ΔWᵀ‖_F² / T``; with ``H = XᵀX`` it is
    ``‖X ΔWᵀ‖_F²``.

    Args:
        delta_w: ``[N, K]`` weight error.
        hessian: ``[K, K]``.

    Raises:
        ValueError: mismatched shapes or non-finite values.
    """
    _check_matrix(delta_w, "delta_w")
    _check_hessian(hessian, delta_w.shape[1])
    d = delta_w.to(torch.float64)
    return float(((d @ hessian.to(torch.float64)) * d).sum())


def distortion_recovered(
    w_hat: torch.Tensor,
    base_deq: torch.Tensor,
    correction_dense: torch.Tensor,
    hessian_heldout: torch.Tensor,
) -> float:
    """Fraction of the base's output distortion that the correction removes.

    ``(D(Ŵ - base) - D(Ŵ - base - correction)) / D(Ŵ - base)`` with ``D`` from
    :func:`output_distortion` on held-out calibration statistics. At most 1; negative when
    the correction adds distortion.

    Args:
        w_hat: ``Ŵ [N, K]`` (the transformed float weight).
        base_deq: ``deq(Q(Ŵ)) [N, K]``.
        correction_dense: dense residual correction ``[N, K]``.
        hessian_heldout: ``[K, K]`` Hessian of held-out tokens.

    Raises:
        ValueError: mismatched shapes, or a base with zero distortion (nothing to recover).
    """
    for name, t in (("base_deq", base_deq), ("correction_dense", correction_dense)):
        if t.shape != w_hat.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(w_hat.shape)}")
    err = w_hat.to(torch.float64) - base_deq.to(torch.float64)
    before = output_distortion(err, hessian_heldout)
    if before <= 0.0:
        raise ValueError("the base has zero output distortion on these statistics: nothing to recover")
    after = output_distortion(err - correction_dense.to(torch.float64), hessian_heldout)
    return (before - after) / before


def _padded_hessian(hessian: torch.Tensor, kp: int) -> torch.Tensor:
    """``H`` in float64, padded to ``[kp, kp]`` with 1 on the padding diagonal (padding is inert)."""
    k = hessian.shape[0]
    h = torch.zeros(kp, kp, dtype=torch.float64, device=hessian.device)
    h[:k, :k] = hessian.to(torch.float64)
    idx = torch.arange(k, kp, device=hessian.device)
    h[idx, idx] = 1.0
    return h


def _diag_blocks(h: torch.Tensor, bk: int) -> torch.Tensor:
    """The diagonal ``[Bk, Bk]`` blocks of a padded ``[nbc*Bk, nbc*Bk]`` matrix: ``[nbc, Bk, Bk]``."""
    nbc = h.shape[0] // bk
    return torch.stack([h[j * bk:(j + 1) * bk, j * bk:(j + 1) * bk] for j in range(nbc)])


def exact_greedy_select(
    residual: torch.Tensor,
    residual_deq: torch.Tensor,
    hessian: torch.Tensor,
    block_shape,
    budget: float,
) -> torch.Tensor:
    """Greedy block selection by exact distortion reduction of the plain quantized residual.

    Step by step, keep the block whose correction ``R_b`` (``residual_deq`` on the block)
    most lowers ``D(E − Σ_kept R)``. Per block row ``I`` with ``P_I = E_I H`` the gain of
    block ``(I, J)`` is ``2 ⟨P_I[:, J], R_b⟩ − Σ_n r_n H[J, J] r_nᵀ``; after a pick only
    ``P_I`` (rank-``Bn`` update) and that row's gains change.

    Args:
        residual: ``E [N, K]``.
        residual_deq: dequantized plain residual ``[N, K]`` (e.g. from
            :func:`quantize_residual_blocks` and :func:`dequantize_residual_blocks`).
        hessian: ``H [K, K]``.
        block_shape: ``(Bn, Bk)``.
        budget: fraction of blocks ``ρ`` in [0, 1].

    Returns:
        int64 ``[≤K, 2]`` coordinates in pick order (stops early when no block helps).

    Raises:
        ValueError: mismatched shapes, non-finite values, bad budget or block shape.
    """
    _check_matrix(residual, "residual")
    _check_matrix(residual_deq, "residual_deq")
    if residual_deq.shape != residual.shape:
        raise ValueError(f"residual_deq is {tuple(residual_deq.shape)}, expected {tuple(residual.shape)}")
    _check_hessian(hessian, residual.shape[1])
    bn, bk = parse_block_shape(block_shape)
    nbr, nbc = block_grid(residual.shape, (bn, bk))
    target = num_kept_blocks(budget, nbr * nbc)
    if target == 0:
        return torch.zeros(0, 2, dtype=torch.int64)
    h = _padded_hessian(hessian, nbc * bk)
    e = tile_blocks(residual.to(torch.float64), (bn, bk))
    r = tile_blocks(residual_deq.to(torch.float64), (bn, bk))
    hjj = _diag_blocks(h, bk)
    self_term = (torch.matmul(r, hjj.unsqueeze(0)) * r).sum(dim=(-1, -2))
    p = untile_blocks(e, (nbr * bn, nbc * bk)) @ h
    p_blocks = p.reshape(nbr, bn, nbc, bk)
    gains = 2.0 * torch.einsum("iajb,iajb->ij", p_blocks, r.permute(0, 2, 1, 3)) - self_term
    taken = torch.zeros(nbr, nbc, dtype=torch.bool, device=gains.device)
    picks: list[tuple[int, int]] = []
    while len(picks) < target:
        masked = gains.masked_fill(taken, -math.inf)
        flat = int(torch.argmax(masked))
        if not float(masked.reshape(-1)[flat]) > 0.0:
            break
        i, j = divmod(flat, nbc)
        picks.append((i, j))
        taken[i, j] = True
        rows = slice(i * bn, (i + 1) * bn)
        p[rows] -= r[i, j] @ h[j * bk:(j + 1) * bk]
        row_p = p[rows].reshape(bn, nbc, bk)
        gains[i] = 2.0 * (row_p.permute(1, 0, 2) * r[i]).sum(dim=(-1, -2)) - self_term[i]
    return torch.tensor(picks, dtype=torch.int64).reshape(-1, 2)


def hessian_fit_select(
    residual: torch.Tensor,
    hessian: torch.Tensor,
    block_shape,
    budget: float,
    damp: float = 0.01,
    bits: int = 4,
    base_scale: torch.Tensor | None = None,
    max_shift: int = POW2_MAX_SHIFT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hessian-aware residual (SPEC §1.9): least-squares block corrections, chosen greedily.

    For block ``b = (I, J)`` and current error rows ``E_I``, the correction supported on the
    columns ``J`` minimising ``Σ_{n∈I} (e_n − c_n) H (e_n − c_n)ᵀ`` is
    ``C = E_I H[:, J] (H[J, J] + λ_J I)⁻¹`` with ``λ_J = damp · mean(diag H[J, J])``
    (dead columns, ``H[k, k] = 0``, get 1 on the diagonal of the solve and a zero
    correction). ``C`` is quantized like every residual block (4-bit, per block row, FP16
    scale); the gain is the exact distortion reduction of the *quantized* correction. The
    best block of the layer is kept, ``E_I[:, J]`` is updated by its quantized correction,
    and only that block row's candidates are refitted (batched over its blocks, with
    ``(H[J, J] + λ_J I)⁻¹`` precomputed once per column block).

    Args:
        residual: ``E = Ŵ − base [N, K]``.
        hessian: ``H [K, K]`` (calibration tokens).
        block_shape: ``(Bn, Bk)``.
        budget: fraction of blocks ``ρ`` in [0, 1].
        damp: relative ridge ``>= 0`` of each column block's solve.
        bits: must be 4 (the packed residual format).
        base_scale: ``[N]`` base scales for ``"pow2"`` residual scales (each row's ``j`` of least
            output distortion, :func:`quantize_pow2_rows` with ``H[J, J]``), or ``None``.
        max_shift: the largest ``j`` of ``"pow2"`` scales.

    Returns:
        ``(coords, q, scales)``: int64 ``[nb, 2]`` in pick order, int8 ``[nb, Bn, Bk]``
        (0 in the padding), float32 ``[nb, Bn]`` FP16-representable scales; ready for
        ``ResidualBlocks.from_blocks(shape, block_shape, coords, q, scales)``. Fewer than
        the budget's blocks only when no remaining block lowers the distortion.

    Raises:
        ValueError: mismatched shapes, non-finite values, bad budget/damp/block shape, or a
            singular column-block Hessian with ``damp = 0``.
    """
    _check_matrix(residual, "residual")
    _check_hessian(hessian, residual.shape[1])
    _check_bits4(bits)
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0.0 <= float(damp) < math.inf:
        raise ValueError(f"damp={damp!r} is out of range: allowed finite values >= 0")
    bn, bk = parse_block_shape(block_shape)
    n, k = residual.shape
    nbr, nbc = block_grid((n, k), (bn, bk))
    target = num_kept_blocks(budget, nbr * nbc)
    empty = (
        torch.zeros(0, 2, dtype=torch.int64),
        torch.zeros(0, bn, bk, dtype=torch.int8),
        torch.zeros(0, bn, dtype=torch.float32),
    )
    if target == 0:
        return empty
    kp = nbc * bk
    h = _padded_hessian(hessian, kp)
    hjj = _diag_blocks(h, bk)
    solve = hjj.clone()
    diag = torch.diagonal(solve, dim1=-2, dim2=-1)
    diag[diag == 0] = 1.0
    real = (torch.arange(kp, device=h.device) < k).reshape(nbc, bk)
    lam = float(damp) * (diag * real).sum(-1) / real.sum(-1)
    diag += lam.unsqueeze(-1)
    chol, info = torch.linalg.cholesky_ex(solve)
    if bool((info != 0).any()):
        raise ValueError(
            f"a column block of the Hessian is not positive definite with damp={damp} "
            "(singular, or not a Hessian); use damp > 0"
        )
    hinv = torch.cholesky_inverse(chol)
    base_rows = None if base_scale is None else _base_rows(base_scale, n, (bn, bk))

    e = tile_blocks(residual.to(torch.float64), (bn, bk))
    p = untile_blocks(e, (nbr * bn, kp)) @ h

    def fit_row(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        row_p = p[i * bn:(i + 1) * bn].reshape(bn, nbc, bk).permute(1, 0, 2)
        corr = torch.matmul(row_p, hinv)
        if base_rows is None:
            qt = quantize(corr.to(torch.float32), bits, symmetric=True, scale_dtype=RESIDUAL_SCALE_DTYPE)
            q, sc = qt.q, qt.scale[..., 0]
        else:
            q, sc = quantize_pow2_rows(corr.to(torch.float32), base_rows[i].unsqueeze(0), hjj, max_shift=max_shift)
        cq = q.to(torch.float64) * sc.to(torch.float64).unsqueeze(-1)
        gain = 2.0 * (row_p * cq).sum(dim=(-1, -2)) - (torch.matmul(cq, hjj) * cq).sum(dim=(-1, -2))
        return gain, q, sc

    dev = h.device
    gains = torch.empty(nbr, nbc, dtype=torch.float64, device=dev)
    q_all = torch.empty(nbr, nbc, bn, bk, dtype=torch.int8, device=dev)
    s_all = torch.empty(nbr, nbc, bn, dtype=torch.float32, device=dev)
    for i in range(nbr):
        gains[i], q_all[i], s_all[i] = fit_row(i)
    taken = torch.zeros(nbr, nbc, dtype=torch.bool, device=dev)
    picks: list[tuple[int, int]] = []
    q_out: list[torch.Tensor] = []
    s_out: list[torch.Tensor] = []
    while len(picks) < target:
        masked = gains.masked_fill(taken, -math.inf)
        flat = int(torch.argmax(masked))
        if not float(masked.reshape(-1)[flat]) > 0.0:
            break
        i, j = divmod(flat, nbc)
        picks.append((i, j))
        taken[i, j] = True
        q_out.append(q_all[i, j].clone())
        s_out.append(s_all[i, j].clone())
        cq = q_all[i, j].to(torch.float64) * s_all[i, j].to(torch.float64).unsqueeze(-1)
        p[i * bn:(i + 1) * bn] -= cq @ h[j * bk:(j + 1) * bk]
        gains[i], q_all[i], s_all[i] = fit_row(i)
    if not picks:
        return empty
    return (
        torch.tensor(picks, dtype=torch.int64).reshape(-1, 2),
        torch.stack(q_out),
        torch.stack(s_out),
    )


# ------------------------------------------------------------- channel ablation


def channel_residual(
    residual: torch.Tensor,
    h_diag: torch.Tensor,
    budget: float,
    *,
    axis: str = "input",
    group_size: int = 128,
    bits: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel allocation of the residual (the ablation against block allocation).

    Keeps whole channels of ``Q4(E)`` at the same number of stored residual elements as a
    block budget ``ρ`` (``ρ · N · K``, the block count ``floor(ρ · n_blocks + 0.5)`` rounds
    the same quantity in blocks):

    - ``axis="input"``: ``floor(ρ · K + 0.5)`` columns ``k``. A column's residual ``E[:, k]``
      is quantized 4-bit symmetric in groups of ``group_size`` consecutive output rows (one
      FP16 scale per ``group_size`` stored values, like a block row of ``Bk`` values);
      columns are ranked by ``h_k Σ_n (E[n,k]² − (E[n,k] − R[n,k])²)``.
    - ``axis="output"``: ``floor(ρ · N + 0.5)`` rows ``n``, each quantized in groups of
      ``group_size`` columns; rows ranked by ``Σ_k h_k (E[n,k]² − (E[n,k] − R[n,k])²)``.

    Ragged last groups are zero-padded.

    Args:
        residual: ``E [N, K]``.
        h_diag: ``[K]`` Hessian diagonal.
        budget: ``ρ`` in [0, 1].
        axis: ``"input"`` or ``"output"``.
        group_size: values per scale (pass ``Bk`` of the compared block shape).
        bits: must be 4.

    Returns:
        ``(indices, correction)``: int64 kept channel indices (best first) and the dense
        ``float32 [N, K]`` correction (0 outside kept channels).

    Raises:
        ValueError: bad axis, budget, group size, shapes or values.
    """
    _check_matrix(residual, "residual")
    _check_bits4(bits)
    if axis not in CHANNEL_AXES:
        raise ValueError(f"axis={axis!r} is not allowed: choose one of {', '.join(CHANNEL_AXES)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive integer")
    _check_h_diag(h_diag, residual.shape[1])
    lines = residual.to(torch.float32) if axis == "output" else residual.to(torch.float32).t()
    length = lines.shape[1]
    pad = -(-length // group_size) * group_size - length
    qt = quantize(
        torch.nn.functional.pad(lines, (0, pad)), bits, symmetric=True,
        group_size=group_size, scale_dtype=RESIDUAL_SCALE_DTYPE,
    )
    r_lines = qt.dequantize()[:, :length]
    r = r_lines if axis == "output" else r_lines.t()
    e64, r64 = residual.to(torch.float64), r.to(torch.float64)
    contrib = h_diag.to(torch.float64).unsqueeze(0) * (e64 * e64 - (e64 - r64) ** 2)
    scores = contrib.sum(dim=1) if axis == "output" else contrib.sum(dim=0)
    keep = num_kept_blocks(budget, scores.numel())
    indices = torch.argsort(scores, descending=True, stable=True)[:keep]
    correction = torch.zeros_like(r)
    if axis == "output":
        correction[indices] = r[indices]
    else:
        correction[:, indices] = r[:, indices]
    return indices.to(torch.int64), correction


# --------------------------------------------------------------------- dispatch


def select_residual(
    method: str,
    residual: torch.Tensor,
    block_shape,
    budget: float,
    *,
    hessian: torch.Tensor | None = None,
    h_diag: torch.Tensor | None = None,
    seed: int = 0,
    damp: float = 0.01,
    base_scale: torch.Tensor | None = None,
    max_shift: int = POW2_MAX_SHIFT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Select and quantize the residual blocks of one layer.

    Args:
        method: one of :data:`SELECTION_METHODS` (default of the method: ``"hessian"``).
        residual: ``E = Ŵ − base [N, K]``.
        block_shape: ``(Bn, Bk)``, an int or ``"BnxBk"``.
        budget: fraction of blocks ``ρ`` in [0, 1].
        hessian: ``H [K, K]``; required by ``"hessian"`` and ``"exact-greedy"``, and gives
            ``h_diag`` for ``"delta"`` when ``h_diag`` is not passed.
        h_diag: ``[K]`` Hessian diagonal for ``"delta"``.
        seed: for ``"random"``.
        damp: ridge of the ``"hessian"`` fit.
        base_scale: ``[N]`` per-channel base scales: ``"pow2"`` residual scales (base row scale
            times ``2^-j``, see the module docstring); ``None``: each block row's own scale.
        max_shift: the largest ``j`` of ``"pow2"`` scales (0 … :data:`POW2_MAX_SHIFT`).

    Returns:
        ``(coords, q, scales)``: int64 ``[nb, 2]`` (selection order), int8 ``[nb, Bn, Bk]``,
        float32 ``[nb, Bn]`` (FP16-representable); pass them to
        ``ResidualBlocks.from_blocks(tuple(residual.shape), block_shape, coords, q, scales)``.

    Raises:
        UserInputError: an unknown method (with a did-you-mean hint).
        ValueError: a statistic the method needs is missing, or as the called functions.

    Example:
        >>> e, x = torch.randn(40, 64), torch.randn(256, 64)
        >>> coords, q, s = select_residual("hessian", e, 16, 0.25, hessian=x.T @ x / 256)
        >>> coords.shape[1], q.shape[1:], s.shape[1]
        (2, torch.Size([16, 16]), 16)
    """
    if method not in SELECTION_METHODS:
        raise unknown_name("residual selection method", str(method), SELECTION_METHODS)
    bn, bk = parse_block_shape(block_shape)
    if method in ("hessian", "exact-greedy") and hessian is None:
        raise ValueError(f"residual selection '{method}' needs the input Hessian (hessian=)")
    if method == "hessian":
        return hessian_fit_select(residual, hessian, (bn, bk), budget, damp=damp, base_scale=base_scale,
                                  max_shift=max_shift)
    q_all, s_all = quantize_residual_blocks(residual, (bn, bk), base_scale=base_scale, max_shift=max_shift)
    if method == "delta":
        if h_diag is None:
            if hessian is None:
                raise ValueError("residual selection 'delta' needs h_diag= or hessian=")
            h_diag = torch.diagonal(hessian)
        _check_h_diag(h_diag, residual.shape[1])
        coords = select_top_blocks(_delta_scores_of(residual, h_diag, q_all, s_all, (bn, bk)), budget)
    elif method == "frobenius":
        coords = select_top_blocks(frobenius_scores(residual, (bn, bk)), budget)
    elif method == "random":
        coords = select_top_blocks(random_scores(tuple(q_all.shape[:2]), seed), budget)
    else:
        r_deq = dequantize_residual_blocks(q_all, s_all, residual.shape)
        coords = exact_greedy_select(residual, r_deq, hessian, (bn, bk), budget)
    i, j = coords[:, 0], coords[:, 1]
    return coords, q_all[i, j], s_all[i, j]
