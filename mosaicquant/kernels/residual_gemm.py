"""Separate residual kernel of the unfused pipeline: ``y = bf16(dense + Σ_b s_a ⊙ (A_b·R_bᵀ) ⊙ s_r)``.

The unfused ZipperEngine baseline runs three launches: activation quantization, the dense
W4A4 GEMM writing fp32 (:func:`mosaicquant.kernels.w4a4_gemm.w4a4_gemm_triton` with
``out_fp32=True``), and this kernel, which re-reads the packed activations, multiplies the
kept blocks, adds the fp32 dense result and writes BF16. The difference to the fused
kernel (one launch, activation tiles shared, no fp32 round trip of the output through
memory) is what fusion buys.

Layout: the shared residual format (:mod:`mosaicquant.methods.format`): CSR ``row_ptr`` over
block rows, ``coords int32 [nb, 2]``, ``values uint8 [nb, Bn, Bk/2]`` packed like the base
(low nibble = even K), ``scales float16 [nb, Bn]``. One program per ``[BM, BN]`` output tile
(``BN`` divides ``Bn``): it walks the kept blocks of its block row, each in packed K steps
of ``BKP`` bytes (two int8 dots per step, even and odd K), scales each block's int32 sum by
its row scales, and adds the fp32 dense tile. Tiles without blocks only add and convert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import (
    check_same_device,
    check_tensor,
    check_triton_device,
    output_buffer,
    resolve_kernel,
    triton_interpreting,
)
from mosaicquant.kernels._residual_check import check_residual
from mosaicquant.kernels._tiles import TileConfig, fit_to_blocks
from mosaicquant.kernels._tl import in_range, mac_int4
from mosaicquant.kernels.zipper import residual_product_reference
from mosaicquant.methods.format import ResidualBlocks, unpack_int4

__all__ = ["residual_add", "residual_add_triton", "residual_add_reference"]


@triton.jit
def _residual_add_kernel(
    a_ptr, a_scale_ptr, dense_ptr, out_ptr, row_ptr_ptr, coords_ptr, res_val_ptr, res_scale_ptr,
    M, N, KP, stride_am, stride_dm, stride_om,
    BN_RES: tl.constexpr, BKP_RES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr,
    USE_DOT: tl.constexpr, USE_ASM: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    safe_m = in_range(offs_m, M)
    block_row = (pid_n * BN) // BN_RES
    res_rows = (offs_n - block_row * BN_RES).to(tl.int64)

    res_acc = tl.zeros([BM, BN], dtype=tl.float32)
    first = tl.load(row_ptr_ptr + block_row).to(tl.int64)
    last = tl.load(row_ptr_ptr + block_row + 1).to(tl.int64)
    for p in range(first, last):
        block_col = tl.load(coords_ptr + 2 * p + 1)
        r_acc = tl.zeros([BM, BN], dtype=tl.int32)
        for chunk in range(0, BKP_RES, BKP):
            kp = block_col * BKP_RES + chunk + tl.arange(0, BKP)
            a = tl.load(a_ptr + safe_m[:, None] * stride_am + kp[None, :], mask=kp[None, :] < KP, other=0)
            r = tl.load(res_val_ptr + p * (BN_RES * BKP_RES) + res_rows[None, :] * BKP_RES
                        + (chunk + tl.arange(0, BKP))[:, None])
            r_acc = mac_int4(r_acc, a, r, USE_DOT, USE_ASM)
        r_scale = tl.load(res_scale_ptr + p * BN_RES + res_rows).to(tl.float32)
        res_acc += r_acc.to(tl.float32) * r_scale[None, :]

    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    dense = tl.load(dense_ptr + offs_m[:, None].to(tl.int64) * stride_dm + offs_n[None, :], mask=mask, other=0.0)
    y = dense + res_acc * a_scale[:, None]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], y.to(tl.bfloat16), mask=mask)


def _check(a_packed, a_scale, dense, residual, k):
    check_tensor("a_packed", a_packed, dtypes=(torch.uint8,), dim=2)
    if not isinstance(k, int) or k < 1 or a_packed.shape[1] != (k + 1) // 2:
        raise UserInputError(f"k={k!r} does not match a_packed with {a_packed.shape[1]} packed columns")
    m = a_packed.shape[0]
    n = residual.shape[0] if isinstance(residual, ResidualBlocks) else -1
    check_residual(residual, n, k, a_packed.device)
    check_tensor("a_scale", a_scale, dtypes=(torch.float32,), shape=(m,))
    check_tensor("dense", dense, dtypes=(torch.float32,), shape=(m, n))
    check_same_device(a_packed=a_packed, a_scale=a_scale, dense=dense)
    return m, n


def residual_add_triton(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    dense: torch.Tensor,
    residual: ResidualBlocks,
    k: int,
    *,
    config: TileConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the residual kernel: BF16 ``dense + residual product``.

    Args:
        a_packed: ``uint8 [M, ceil(K/2)]`` packed activations.
        a_scale: ``float32 [M]``.
        dense: ``float32 [M, N]`` dense W4A4 result (bias already added).
        residual: kept blocks of the ``[N, K]`` layer.
        k: the unpacked K.
        config: tiles (``block_m``, ``block_n``, ``block_kp`` used; shrunk to nest in blocks).
        out: optional preallocated contiguous BF16 ``[M, N]`` output.

    Returns:
        ``bfloat16 [M, N]``.

    Raises:
        UserInputError: mismatching shapes, dtypes or devices.
    """
    m, n = _check(a_packed, a_scale, dense, residual, k)
    check_triton_device(a_packed.device)
    out = output_buffer(out, (m, n), torch.bfloat16, dense.device)
    if m == 0 or n == 0:
        return out
    bn_res, bk_res = residual.block_shape
    if config is None:
        stages = 2 if a_packed.device.type == "cuda" else 1
        config = TileConfig(block_m=16 if m <= 16 else 64, block_n=128, block_kp=64, num_warps=4, num_stages=stages)
    cfg = fit_to_blocks(config, residual.block_shape)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _residual_add_kernel[grid](
        a_packed.view(torch.int8), a_scale, dense, out, residual.row_ptr, residual.coords,
        residual.values.view(torch.int8), residual.scales,
        m, n, a_packed.shape[1], a_packed.stride(0), dense.stride(0), out.stride(0),
        BN_RES=bn_res, BKP_RES=bk_res // 2, BM=cfg.block_m, BN=cfg.block_n, BKP=cfg.block_kp, USE_DOT=cfg.use_dot, USE_ASM=not triton_interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def residual_add_reference(
    a_packed: torch.Tensor, a_scale: torch.Tensor, dense: torch.Tensor, residual: ResidualBlocks, k: int
) -> torch.Tensor:
    """PyTorch reference of :func:`residual_add_triton`."""
    _check(a_packed, a_scale, dense, residual, k)
    return (dense + residual_product_reference(unpack_int4(a_packed, k), a_scale, residual)).to(torch.bfloat16)


def residual_add(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    dense: torch.Tensor,
    residual: ResidualBlocks,
    k: int,
    *,
    kernel: str | None = None,
) -> torch.Tensor:
    """``bf16(dense + Σ_b s_a ⊙ (A_b·R_bᵀ) ⊙ s_r)`` on the chosen kernel (see :func:`residual_add_triton`).

    Raises:
        UserInputError: bad operands or kernel preference.
    """
    if resolve_kernel(kernel) == "triton":
        return residual_add_triton(a_packed, a_scale, dense, residual, k)
    return residual_add_reference(a_packed, a_scale, dense, residual, k)
