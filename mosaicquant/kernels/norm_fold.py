"""The RMSNorm after a decode GEMM, run by that GEMM's own last programs ("norm fold").

In the decode step the outputs of ``o_proj`` and ``down_proj`` go to an RMSNorm that adds them
into the residual stream and quantizes the normalized row for the next GEMM
(:func:`mosaicquant.kernels.decoder.rmsnorm_quant`). As a kernel of its own that norm costs a
launch boundary: it waits for the whole GEMM grid to finish, loads the rows, and the next GEMM
waits for it in turn. Folded, the GEMM does it itself: every program that writes an output tile
(the only split, or the split-K fix-up) counts it done after its store (:func:`fold_norm`), and
the last ones to finish normalize and quantize the rows.

- ``FOLD == 2`` (the GPU): the last ``M`` tiles' writers to arrive take a row each. Each waits until
  the counter reaches the launch's tiles (every tile written), then runs the row. A waiting
  program only waits for programs that have already arrived or that can still be scheduled
  (at most ``M`` programs wait; every other slot frees as its program ends), so the grid
  cannot deadlock.
- ``FOLD == 1``: the last program runs every row in turn: launches of fewer tiles than rows,
  and Triton's interpreter, which runs programs one after another (nothing there may wait for a
  later program).

The row is :func:`norm_quant_row`, the body of the standalone kernel. With the GEMM's warps the
sums of squares and the absmax may be reduced in another order than the standalone kernel's;
the integers and scales agree with it up to that order (tests check both against the reference).
The two counters reset themselves, so the buffer is zero between launches.

Measured slower than the norm's own kernel on the H200: the fused
decoder leaves it off (``mosaicquant.harness.runtime.NORM_FOLD_MAX_M``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import check_tensor, triton_interpreting
from mosaicquant.kernels._tl import max_nan, rnd, sym_scale
from mosaicquant.kernels.act_quant import LAYOUTS, quantize_store, split8_width

__all__ = ["NormFold", "norm_fold", "fold_reason", "fold_launch_args", "fold_pdl", "FOLD_SPIN", "FOLD_LATE_SIGNAL"]

# The last M tile writers take a row each (waiting for the count), rather than the last one taking every row.
FOLD_SPIN = True
# In the decode step's PDL chain, a folding GEMM lets the kernel after it launch once each program has stored
# its tile (before the fold's tail) instead of as it starts: the next GEMM's weight prefetch then overlaps the
# tail, as it overlapped the norm's kernel, rather than the GEMM's own weight stream.
FOLD_LATE_SIGNAL = True


@triton.jit
def add_residual(x, r_ptrs, mask, DT: tl.constexpr, BITS: tl.constexpr):
    """``x + residual`` rounded to ``DT`` (as the eager add rounds it), stored back as the new residual."""
    x = rnd(x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32), DT, BITS)
    tl.store(r_ptrs, x.to(DT), mask=mask)
    return x


@triton.jit
def norm_quant_row(X, R, W, Q, S, n, kp, eps, clip_ratio, HB: tl.constexpr, HAS_RES: tl.constexpr,
                   DT: tl.constexpr, BITS: tl.constexpr, SPLIT8: tl.constexpr, X_CG: tl.constexpr):
    """One row: ``r += x`` (with ``HAS_RES``), RMSNorm, then the activation quantizer (scale to ``S``, ints to ``Q``).

    ``X_CG``: read ``x`` past L1 (rows other programs of the same launch wrote).
    """
    pairs = tl.arange(0, HB)
    k = pairs[:, None] * 2 + tl.arange(0, 2)[None, :]
    mask = k < n
    if X_CG:
        x = tl.load(X + k, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(X + k, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = add_residual(x, R + k, mask, DT, BITS)
    var = tl.sum(tl.sum(x * x, axis=1), axis=0) / n
    y = rnd(x * (1.0 / tl.sqrt(var + eps)), DT, BITS)
    w = tl.load(W + k, mask=mask, other=0.0).to(tl.float32)
    z = rnd(w * y, DT, BITS)  # the normalized row exactly as rmsnorm() stores it
    # then act_quant's quantizer on it (same operations, same integers)
    scale = sym_scale(max_nan(max_nan(tl.abs(z), 1), 0), clip_ratio, 7.0)
    tl.store(S, scale)
    quantize_store(z, scale, Q, pairs, kp, SPLIT8)


@triton.jit
def fold_norm(wrote, y_ptr, stride_y, M, N, TOTAL, done_ptr, R, stride_r, W, Q, stride_q, S, eps, clip_ratio,
              FOLD: tl.constexpr, HB: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr, SPLIT8: tl.constexpr):
    """Count this program's output tile done (``wrote``: it stored the tile); the last ones run the norm on
    the rows of ``y``.

    ``TOTAL``: the launch's output tiles. ``done_ptr``: two int32 counters, zero between launches. Only the
    programs that wrote a tile count: one atomic a tile on the shared address (every split counting cost the
    o_proj GEMM ~6 µs at 4 tokens).
    """
    if wrote:
        _fold_tile_done(y_ptr, stride_y, M, N, TOTAL, done_ptr, R, stride_r, W, Q, stride_q, S, eps, clip_ratio,
                        FOLD, HB, DT, BITS, SPLIT8)


@triton.jit
def _fold_tile_done(y_ptr, stride_y, M, N, TOTAL, done_ptr, R, stride_r, W, Q, stride_q, S, eps, clip_ratio,
                    FOLD: tl.constexpr, HB: tl.constexpr, DT: tl.constexpr, BITS: tl.constexpr, SPLIT8: tl.constexpr):
    kp = (N + 1) // 2
    arrived = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    if FOLD == 1:
        if arrived == TOTAL - 1:
            for row in range(0, M):  # decode-sized: row * stride stays in int32
                norm_quant_row(y_ptr + row * stride_y, R + row * stride_r, W, Q + row * stride_q, S + row, N, kp,
                               eps, clip_ratio, HB, True, DT, BITS, SPLIT8, True)
            tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
    else:
        row = arrived - (TOTAL - M)
        if row >= 0:
            seen = arrived + 1
            while seen < TOTAL:  # the other tiles' stores are visible once the count is whole (acquire)
                seen = tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu")
            r64 = row.to(tl.int64)
            norm_quant_row(y_ptr + r64 * stride_y, R + r64 * stride_r, W, Q + r64 * stride_q, S + r64, N, kp,
                           eps, clip_ratio, HB, True, DT, BITS, SPLIT8, True)
            finished = tl.atomic_add(done_ptr + 1, 1, sem="acq_rel", scope="gpu")
            if finished == M - 1:  # every waiting program has seen the whole count: reset both
                tl.atomic_xchg(done_ptr + 1, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class NormFold:
    """What a decode GEMM's last programs do with its ``[M, N]`` BF16 output ``y``.

    ``residual += y`` (in place), ``RMSNorm(residual) · weight``, quantized to 4 bits per token
    with ``clip_ratio`` into ``q`` (``layout``) and ``scale``: the integers and scales of
    :func:`mosaicquant.kernels.decoder.rmsnorm_quant` on ``y``. Made by :func:`norm_fold`.
    """

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor
    clip_ratio: float
    layout: str
    q: torch.Tensor
    scale: torch.Tensor


def norm_fold(weight: torch.Tensor, eps: float, residual: torch.Tensor, clip_ratio: float,
              layout: str = "packed") -> NormFold:
    """A :class:`NormFold` with its outputs allocated.

    Args:
        weight: the norm's ``[N]`` weight.
        eps: the norm's epsilon.
        residual: the BF16 residual stream ``[M, N]`` (contiguous rows), updated in place.
        clip_ratio: fraction of each token's absmax kept, in (0, 1].
        layout: ``"packed"`` or ``"split8"`` (as :func:`mosaicquant.kernels.act_quant.quantize_activations_triton`).

    Raises:
        UserInputError: a residual that is not BF16 ``[M, N]`` with unit stride, a weight of another size or
            device, a clip ratio outside (0, 1], an unknown layout.
    """
    check_tensor("residual", residual, dtypes=(torch.bfloat16,), dim=2)
    m, n = residual.shape
    if residual.stride(1) != 1:
        raise UserInputError("residual must have unit stride along its features")
    check_tensor("weight", weight, dtypes=(torch.bfloat16, torch.float16, torch.float32), shape=(n,))
    if weight.device != residual.device:
        raise UserInputError(f"weight is on {weight.device}, residual on {residual.device}")
    if layout not in LAYOUTS:
        raise UserInputError(f"layout={layout!r} is not allowed: choose one of {', '.join(LAYOUTS)}")
    if not isinstance(clip_ratio, (int, float)) or not 0.0 < float(clip_ratio) <= 1.0:
        raise UserInputError(f"clip_ratio={clip_ratio!r} is out of range: allowed (0, 1]")
    if layout == "split8":
        q = torch.empty(m, split8_width(n), dtype=torch.int8, device=residual.device)
    else:
        q = torch.empty(m, (n + 1) // 2, dtype=torch.uint8, device=residual.device)
    scale = torch.empty(m, dtype=torch.float32, device=residual.device)
    return NormFold(weight, float(eps), residual, float(clip_ratio), layout, q, scale)


def fold_reason(fold: NormFold, m: int, n: int, out_fp32: bool, gated: bool, device: torch.device) -> str | None:
    """``None`` when a GEMM launch writing ``[m, n]`` on ``device`` can run ``fold``, else why not."""
    if fold.residual.device != device:
        return f"the residual is on {fold.residual.device}, the GEMM on {device}"
    if gated or out_fp32:
        return "the norm reads the GEMM's plain BF16 output (not gated, not fp32)"
    if tuple(fold.residual.shape) != (m, n):
        return f"the residual is {list(fold.residual.shape)}, the GEMM writes [{m}, {n}]"
    if m < 1:
        return "no rows to normalize"
    return None


def fold_launch_args(fold: NormFold | None, m: int, tiles: int, out: torch.Tensor) -> tuple[tuple, dict]:
    """The GEMM kernels' trailing fold arguments (``tiles``: the launch's output tiles) and their constexprs
    (``FOLD`` 0 without a fold)."""
    from mosaicquant.kernels._tiles import persistent_zeros

    if fold is None:
        return (out, out, out, out, out, 0.0, 1.0, 0, 0, 0), {"FOLD": 0}
    done = persistent_zeros("norm fold counters", 2, torch.int32, out.device)
    n = fold.residual.shape[1]
    args = (done, fold.residual, fold.weight, fold.q.view(torch.int8), fold.scale, fold.eps, fold.clip_ratio,
            fold.residual.stride(0), fold.q.stride(0), tiles)
    return args, {"FOLD": 2 if FOLD_SPIN and not triton_interpreting() and tiles >= m else 1, "FHB": max(64, triton.next_power_of_2((n + 1) // 2)),
                  "FSPLIT8": fold.layout == "split8"}


def fold_pdl(fold: NormFold | None, pdl: int) -> tuple[int, bool]:
    """A GEMM launch's ``(PDL, LATE_SIGNAL)`` constexprs from its ``PDL`` (``_common.gemm_pdl``): with a fold in
    the step's chain (``PDL == 2``) and :data:`FOLD_LATE_SIGNAL`, wait as before but signal after the store."""
    if fold is not None and pdl == 2 and FOLD_LATE_SIGNAL:
        return 1, True
    return pdl, False
