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

A second output layout, ``"split8"`` (for :func:`mosaicquant.kernels.w4a4_gemm.w4a4_gemm_swapped_triton`):
the same integers as ``int8``, one per byte, in blocks of ``SPLIT_BLOCK`` = 128 K: the block's
64 even-K values first, then its 64 odd-K values; rows padded with zeros to a whole block.
A GEMM then reads each block's even and odd halves as two contiguous int8 tiles, with no
unpacking.

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
from mosaicquant.kernels._tl import release_dependents, round_half_even, silu_mul_rounded
from mosaicquant.methods.format import pack_int4
from mosaicquant.methods.quant import quantize

__all__ = ["quantize_activations", "quantize_activations_triton", "quantize_activations_reference", "split8_from_int",
           "split8_width", "SPLIT_BLOCK"]

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_KP = 8192
LAYOUTS = ("packed", "split8")
SPLIT_BLOCK = 128  # K values per block of the "split8" layout (64 even, then 64 odd)


@triton.jit
def quantize_store(x, scale, q_row, kp, KP, SPLIT8: tl.constexpr):
    """Quantize pairs ``x [len(kp), 2]`` (fp32) of one row with ``scale``; store them packed or split8."""
    # Clamping to [-9, 9] before rounding does not change clamp(round(v), -8, 7) and keeps
    # the magic-number rounding in its exact range for any clip ratio.
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -9.0), 9.0)
    q = tl.minimum(tl.maximum(round_half_even(v), -8.0), 7.0).to(tl.int8)
    q_even, q_odd = tl.split(q)
    if SPLIT8:
        # pair kp → block kp // 64: even value at byte kp % 64 of the block, odd value 64 bytes on;
        # pairs past K (up to the padded block) hold zeros (x was loaded as 0 there)
        at = (kp // 64) * 128 + kp % 64
        inside = kp < tl.cdiv(KP, 64) * 64
        tl.store(q_row + at, q_even, mask=inside)
        tl.store(q_row + at + 64, q_odd, mask=inside)
    else:
        packed = (q_even & 0xF) | (q_odd << 4)
        tl.store(q_row + kp, packed, mask=kp < KP)


@triton.jit
def _load_row(x_row, k, K, GATED: tl.constexpr):
    """Activations ``k`` of one row in fp32; with ``GATED`` the row is ``[gate | up]`` (``K`` each)
    and the activations are ``silu(gate) · up``, rounded as :func:`mosaicquant.kernels.decoder.silu_mul` rounds."""
    x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(x_row + K + k, mask=k < K, other=0.0).to(tl.float32)
        x = silu_mul_rounded(x, up, x_row.dtype.element_ty == tl.bfloat16)
    return x


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, scale_ptr, K, KP, stride_xm, stride_qm, clip_ratio,
    BLOCK_KP: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr, SPLIT8: tl.constexpr = False,
    GATED: tl.constexpr = False,
):
    release_dependents(PDL)  # the GEMM that reads our output may start (it waits for us before reading)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    pairs = tl.arange(0, BLOCK_KP)
    lanes = tl.arange(0, 2)

    if ONE_PASS:
        k = pairs[:, None] * 2 + lanes[None, :]
        x_all = _load_row(x_row, k, K, GATED)
        absmax = tl.max(tl.abs(x_all), axis=1)
    else:
        absmax = tl.zeros([BLOCK_KP], dtype=tl.float32)
        for kp0 in range(0, KP, BLOCK_KP):
            k = (kp0 + pairs)[:, None] * 2 + lanes[None, :]
            x = _load_row(x_row, k, K, GATED)
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
            x = _load_row(x_row, k, K, GATED)
        quantize_store(x, scale, q_row, kp, KP, SPLIT8)


def _check_inputs(x: torch.Tensor, clip_ratio: float) -> None:
    check_tensor("x", x, dtypes=ACT_DTYPES, dim=2)
    if not isinstance(clip_ratio, (int, float)) or not 0.0 < float(clip_ratio) <= 1.0:
        raise UserInputError(f"clip_ratio={clip_ratio!r} is out of range: allowed (0, 1]")
    if x.shape[1] < 1:
        raise UserInputError(f"x must have at least one column, got shape {tuple(x.shape)}")


def _check_gated(x: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[1] % 2:
        dtype = str(x.dtype).replace("torch.", "")
        raise UserInputError(f"gated input must be BF16/FP16 [M, 2K] ([gate | up]), got {dtype} {list(x.shape)}")


def split8_width(k: int) -> int:
    """Bytes per row of the ``"split8"`` layout of ``k`` values (whole 128-value blocks)."""
    return -(-k // SPLIT_BLOCK) * SPLIT_BLOCK


def split8_from_int(q: torch.Tensor) -> torch.Tensor:
    """``int8 [M, K]`` integers → their ``"split8"`` layout ``int8 [M, split8_width(K)]`` (reference)."""
    m, k = q.shape
    full = torch.zeros(m, split8_width(k), dtype=torch.int8, device=q.device)
    full[:, :k] = q.to(torch.int8)
    blocks = full.view(m, -1, SPLIT_BLOCK // 2, 2)  # [M, blocks, pairs, (even, odd)]
    return blocks.permute(0, 1, 3, 2).reshape(m, -1).contiguous()


def quantize_activations_triton(
    x: torch.Tensor,
    clip_ratio: float = 1.0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    layout: str = "packed",
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton activation quantizer.

    Args:
        x: ``[M, K]`` BF16 (or FP16/FP32) activations, unit stride along K.
        clip_ratio: fraction of each token's absmax kept, in (0, 1].
        out: optional preallocated contiguous ``(packed, scale)`` (``"packed"`` layout only).
        layout: ``"packed"`` (two values a byte) or ``"split8"`` (one ``int8`` a byte, even/odd
            halves of 128-value blocks; see the module docstring).
        gated: ``x`` is ``[M, 2K]`` BF16/FP16 ``[gate | up]`` and the activations quantized are
            ``silu(gate) · up`` (:func:`mosaicquant.kernels.decoder.silu_mul`, the same roundings),
            computed as they are loaded: a gated MLP's down-projection input without its own kernel.

    Returns:
        ``(packed, scale)``: ``uint8 [M, ceil(K/2)]`` (or ``int8 [M, split8_width(K)]``) and
        ``float32 [M]``.

    Raises:
        UserInputError: wrong dtype/rank/stride, clip ratio out of range, an unknown layout, or
            a device the Triton path cannot run on.
    """
    _check_inputs(x, clip_ratio)
    check_triton_device(check_same_device(x=x))
    if layout not in LAYOUTS:
        raise UserInputError(f"layout={layout!r} is not allowed: choose one of {', '.join(LAYOUTS)}")
    m, k = x.shape
    if gated:
        _check_gated(x)
        k //= 2
    kp = (k + 1) // 2
    if layout == "split8":
        if out is not None:
            raise UserInputError("out= takes the packed layout only")
        q = torch.empty(m, split8_width(k), dtype=torch.int8, device=x.device)
        scale = torch.empty(m, dtype=torch.float32, device=x.device)
        if m:
            block_kp = max(64, min(MAX_BLOCK_KP, triton.next_power_of_2(kp)))
            _act_quant_kernel[(m,)](
                x, q, scale, k, kp, x.stride(0), q.stride(0), float(clip_ratio),
                BLOCK_KP=block_kp, ONE_PASS=kp <= block_kp, PDL=pdl_supported(x.device), SPLIT8=True,
                GATED=gated, num_warps=4 if block_kp <= 1024 else (8 if block_kp <= 4096 else 16),
            )
        return q, scale
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
        BLOCK_KP=block_kp, ONE_PASS=kp <= block_kp, PDL=pdl_supported(x.device), GATED=gated,
        num_warps=num_warps,
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
