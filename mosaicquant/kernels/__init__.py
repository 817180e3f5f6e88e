"""Triton kernels of the W4A4 engine (ZipperEngine) and their PyTorch references.

- :mod:`.act_quant`: BF16 activations → packed 4-bit + per-token scale;
- :mod:`.hadamard_quant`: the online Hadamard fused with the activation quantizer;
- :mod:`.w4a4_gemm`: dense W4A4 GEMM;
- :mod:`.zipper`: ZipperEngine, the dense GEMM with the sparse residual fused in;
- :mod:`.gemv`: the decode GEMV on CUDA-core ``dp4a`` (dense and with the residual), and the
  residual walk ZipperEngine uses for a handful of tokens;
- :mod:`.residual_gemm`: the residual as a separate kernel (unfused pipeline);
- :mod:`.quant_linear`: ``QuantLinear``, the module that runs the packed format;
- :mod:`.convert`: a simulated model → its kernel-backed form (stacked q/k/v and gate/up).

Every kernel has a launcher that checks its arguments and a PyTorch reference; the kernel
preference (``"auto"`` / ``"triton"`` / ``"torch"``, argument or the ``kernel`` of
:class:`mosaicquant.settings.KernelSettings`) picks between them (:func:`resolve_kernel`).
"""

from mosaicquant.kernels._common import KERNEL_PREFERENCES, resolve_kernel
from mosaicquant.kernels._tiles import TileConfig, pick_config
from mosaicquant.kernels.act_quant import quantize_activations
from mosaicquant.kernels.quant_linear import QuantLinear
from mosaicquant.kernels.residual_gemm import residual_add
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm

__all__ = [
    "KERNEL_PREFERENCES",
    "resolve_kernel",
    "TileConfig",
    "pick_config",
    "quantize_activations",
    "w4a4_gemm",
    "zipper_gemm",
    "residual_add",
    "residual_block_map",
    "QuantLinear",
]
