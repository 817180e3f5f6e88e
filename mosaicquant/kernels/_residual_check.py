"""The argument check every kernel that takes a :class:`~mosaicquant.methods.format.ResidualBlocks` runs.

ZipperEngine (:mod:`.zipper`), the split-layout dense GEMM (:mod:`.w4a4_gemm`), the decode GEMV
(:mod:`.gemv`) and the separate residual kernel (:mod:`.residual_gemm`) all take the sparse
residual; the check lives below them so none of them imports another for it.
"""

from __future__ import annotations

import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import check_tensor
from mosaicquant.methods.format import ResidualBlocks

__all__ = ["check_residual"]


def check_residual(residual: ResidualBlocks, n: int, k: int, device: torch.device | None = None) -> None:
    """Check that a :class:`ResidualBlocks` matches an ``[n, k]`` layer and the kernels' needs.

    Shapes, dtypes, strides and devices only, nothing that reads the tensors (no device
    synchronisation): the indices' values are checked once, as the blocks are built
    (:meth:`ResidualBlocks.validate`).

    Args:
        device: the operands' device, which every residual tensor must be on; ``None``: one
            device for the residual's tensors.

    Raises:
        UserInputError: naming the mismatching shape, dtype, field or device.
    """
    if not isinstance(residual, ResidualBlocks):
        raise UserInputError(f"residual must be a ResidualBlocks, got {type(residual).__name__}")
    if tuple(residual.shape) != (n, k):
        raise UserInputError(f"residual is for a {tuple(residual.shape)} layer, the weight is ({n}, {k})")
    bn, bk = residual.block_shape
    nbr, _ = residual.grid
    nb = residual.num_blocks
    check_tensor("residual.values", residual.values, dtypes=(torch.uint8,), shape=(nb, bn, bk // 2))
    check_tensor("residual.scales", residual.scales, dtypes=(torch.float16, torch.float32), shape=(nb, bn))
    check_tensor("residual.coords", residual.coords, dtypes=(torch.int32,), shape=(nb, 2))
    check_tensor("residual.row_ptr", residual.row_ptr, dtypes=(torch.int32,), shape=(nbr + 1,))
    if not residual.values.is_contiguous() or not residual.coords.is_contiguous() or not residual.scales.is_contiguous():
        raise UserInputError("residual.values, .scales and .coords must be contiguous")
    fields = {f"residual.{f}": getattr(residual, f) for f in ("values", "scales", "coords", "row_ptr")}
    device = residual.values.device if device is None else device
    elsewhere = {name: t.device for name, t in fields.items() if t.device != device}
    if elsewhere:
        listing = ", ".join(f"{name} on {d}" for name, d in elsewhere.items())
        raise UserInputError(f"the residual must be on the operands' device {device}, got {listing}")
