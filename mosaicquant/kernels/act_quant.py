"""Activation quantization: BF16 ``[M, K]`` → packed signed 4-bit ``[M, ceil(K/2)]`` + per-token scale.

Algorithm (exactly :func:`mosaicquant.methods.quant.quantize` with ``bits=4``, symmetric,
per token, ``scale_dtype=None``):

    absmax = max_k |float32(x[m, k])|
    scale  = (absmax * clip_ratio) / 7          (fp32; an all-zero row gets scale 1)
    q      = clamp(round_half_even(x / scale), -8, 7)

``x / scale`` is an IEEE division (``div_rn``) and the rounding is ties-to-even, so the
integers and scales are bit-identical to the shared quantizer's.

Packed layout (the one of :func:`mosaicquant.methods.format.pack_int4`): byte ``j`` of a row
holds ``q[2j]`` in its low nibble and ``q[2j+1]`` in its high nibble; an odd K pads the last
high nibble with 0. Scales are ``float32 [M]``.

One program per token. Rows of up to ``2 * MAX_BLOCK_KP`` elements are loaded once and kept
in registers; longer rows take a first pass for the absmax and a second (reading the row
again, from L1/L2) to quantize and pack. Each pass loads ``[BLOCK_KP, 2]`` tiles
(contiguous, then split into the even and odd elements), so loads are wide and coalesced.
Inputs holding NaN/Inf give unspecified integers (the reference raises, the kernel cannot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mosaicquant.harness.errors import UserInputError
from mosaicquant.kernels._common import check_same_device, check_tensor, check_triton_device, pdl_supported, resolve_kernel
from mosaicquant.kernels._tl import release_dependents, round_half_even
from mosaicquant.methods.format import pack_int4
from mosaicquant.methods.quant import quantize

__all__ = ["quantize_activations", "quantize_activations_triton", "quantize_activations_reference"]

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_KP = 8192


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, scale_ptr, K, KP, stride_xm, stride_qm, clip_ratio,
    BLOCK_KP: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr,
):
    release_dependents(PDL)  # the GEMM that reads our output may start (it waits for us before reading)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    pairs = tl.arange(0, BLOCK_KP)
    lanes = tl.arange(0, 2)

    if ONE_PASS:
        k = pairs[:, None] * 2 + lanes[None, :]
        x_all = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        absmax = tl.max(tl.abs(x_all), axis=1)
    else:
        absmax = tl.zeros([BLOCK_KP], dtype=tl.float32)
        for kp0 in range(0, KP, BLOCK_KP):
            k = (kp0 + pairs)[:, None] * 2 + lanes[None, :]
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.max(tl.abs(x), axis=1))
    scale = tl.math.div_rn(tl.max(absmax, axis=0) * clip_ratio, 7.0)
    scale = tl.where(scale > 0.0, scale, 1.0)
    tl.store(scale_ptr + row, scale)

    for kp0 in range(0, KP, BLOCK_KP):
        kp = kp0 + pairs
        k = kp[:, None] * 2 + lanes[None, :]
        if ONE_PASS:
            x = x_all
        else:
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        # Clamping to [-9, 9] before rounding does not change clamp(round(v), -8, 7) and keeps
        # the magic-number rounding in its exact range for any clip ratio.
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -9.0), 9.0)
        q = tl.minimum(tl.maximum(round_half_even(v), -8.0), 7.0).to(tl.int8)
        q_even, q_odd = tl.split(q)
        packed = (q_even & 0xF) | (q_odd << 4)
        tl.store(q_row + kp, packed, mask=kp < KP)


def _check_inputs(x: torch.Tensor, clip_ratio: float) -> None:
    check_tensor("x", x, dtypes=ACT_DTYPES, dim=2)
    if not isinstance(clip_ratio, (int, float)) or not 0.0 < float(clip_ratio) <= 1.0:
        raise UserInputError(f"clip_ratio={clip_ratio!r} is out of range: allowed (0, 1]")
    if x.shape[1] < 1:
        raise UserInputError(f"x must have at least one column, got shape {tuple(x.shape)}")


def quantize_activations_triton(
    x: torch.Tensor,
    clip_ratio: float = 1.0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton activation quantizer.

    Args:
        x: ``[M, K]`` BF16 (or FP16/FP32) activations, unit stride along K.
        clip_ratio: fraction of each token's absmax kept, in (0, 1].
        out: optional preallocated contiguous ``(packed, scale)``.

    Returns:
        ``(packed, scale)``: ``uint8 [M, ceil(K/2)]`` and ``float32 [M]``.

    Raises:
        UserInputError: wrong dtype/rank/stride, clip ratio out of range, or a device the
            Triton path cannot run on.
    """
    _check_inputs(x, clip_ratio)
    check_triton_device(check_same_device(x=x))
    m, k = x.shape
    kp = (k + 1) // 2
    if out is not None:
        packed, scale = out
        check_tensor("out[0]", packed, dtypes=(torch.uint8,), shape=(m, kp))
        check_tensor("out[1]", scale, dtypes=(torch.float32,), shape=(m,))
        if not packed.is_contiguous() or packed.device != x.device or scale.device != x.device:
            raise UserInputError("out tensors must be contiguous and on x's device")
    else:
        packed = torch.empty(m, kp, dtype=torch.uint8, device=x.device)
        scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return packed, scale
    block_kp = min(MAX_BLOCK_KP, triton.next_power_of_2(kp))
    num_warps = 4 if block_kp <= 1024 else (8 if block_kp <= 4096 else 16)
    _act_quant_kernel[(m,)](
        x, packed.view(torch.int8), scale, k, kp, x.stride(0), packed.stride(0), float(clip_ratio),
        BLOCK_KP=block_kp, ONE_PASS=kp <= block_kp, PDL=pdl_supported(x.device), num_warps=num_warps,
    )
    return packed, scale


def quantize_activations_reference(x: torch.Tensor, clip_ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of the activation quantizer (the shared quantizer plus ``pack_int4``).

    Args:
        x: ``[M, K]`` float activations.
        clip_ratio: in (0, 1].

    Returns:
        ``(packed, scale)``: ``uint8 [M, ceil(K/2)]`` and ``float32 [M]``.

    Raises:
        UserInputError: bad shape/dtype/clip ratio. ValueError: NaN/Inf in ``x``.
    """
    _check_inputs(x, clip_ratio)
    qt = quantize(x, 4, symmetric=True, clip_ratio=float(clip_ratio))
    return pack_int4(qt.q), qt.scale.reshape(-1)


def quantize_activations(
    x: torch.Tensor, clip_ratio: float = 1.0, kernel: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric 4-bit activation quantization, packed two values a byte.

    Args:
        x: ``[M, K]`` activations (BF16, FP16 or FP32).
        clip_ratio: in (0, 1].
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"`` / ``None`` (see
            :func:`mosaicquant.kernels.resolve_kernel`).

    Returns:
        ``(packed, scale)``: ``uint8 [M, ceil(K/2)]`` and ``float32 [M]``.

    Raises:
        UserInputError: bad input or kernel preference.

    Example:
        >>> packed, scale = quantize_activations(torch.randn(3, 10), kernel="torch")
        >>> packed.shape, scale.shape
        (torch.Size([3, 5]), torch.Size([3]))
    """
    if resolve_kernel(kernel) == "triton":
        return quantize_activations_triton(x, clip_ratio)
    return quantize_activations_reference(x, clip_ratio)
