"""Activation quantization: BF16 ``[M, K]`` → packed signed 4-bit ``[M, ceil(K/2)]`` + per-token scale.

Algorithm (exactly :func:`mosaicquant.methods.quant.quantize` with ``bits=4``, symmetric,
per token, ``scale_dtype=None``):

    absmax = max_k |float32(x[m, k])|
    scale  = (absmax * clip_ratio) / 7          (fp32; an all-zero row gets scale 1)
    q      = clamp(round_half_even(x / scale), -8, 7)

``x / scale`` is rounded as the IEEE division rounds it (:func:`mosaicquant.kernels._tl.quant_div`: one
reciprocal a row, an exact two-FMA correction a value) and the rounding to integers is ties-to-even, so
the integers and scales are bit-identical to the shared quantizer's.

Packed layout (the one of :func:`mosaicquant.methods.format.pack_int4`): byte ``j`` of a row
holds ``q[2j]`` in its low nibble and ``q[2j+1]`` in its high nibble; an odd K pads the last
high nibble with 0. Scales are ``float32 [M]``.

A second output layout, ``"split8"`` (for :func:`mosaicquant.kernels.w4a4_gemm.w4a4_gemm_swapped_triton`):
the same integers as ``int8``, one per byte, in blocks of ``SPLIT_BLOCK`` = 128 K: the block's
64 even-K values first, then its 64 odd-K values; rows padded with zeros to a whole block.
A GEMM then reads each block's even and odd halves as two contiguous int8 tiles, with no
unpacking.

One program per token, or ``P`` ("programs per token", decode sizes on a GPU) each taking a
contiguous slice of the row's pairs and meeting once for the row's absmax
(:mod:`mosaicquant.kernels._token_split`); the integers and scales are the same for every ``P``.
Slices of up to ``MAX_BLOCK_KP`` pairs are loaded once and kept in registers; longer ones take
a first pass for the absmax and a second (reading the slice again, from L1/L2) to quantize and
pack. Each pass loads ``[BLOCK_KP, 2]`` tiles (contiguous, then split into the even and odd
elements), so loads are wide and coalesced.
A token whose row holds NaN or Inf gets the scale NaN (its integers are unspecified), so its GEMM output
row is NaN; the other tokens are unaffected. The reference raises instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import (
    chain_launch,
    chain_mode,
    check_same_device,
    check_tensor,
    check_triton_device,
    resolve_kernel,
)
from mosaicquant.kernels._tl import chain_start, max_nan, maximum_nan, quant_div, quantize_int4, silu_mul_rounded
from mosaicquant.kernels._token_split import (
    barrier_buffer,
    check_num_warps,
    resolve_programs_per_token,
    token_scale,
    token_slice,
)
from mosaicquant.methods.format import pack_int4
from mosaicquant.methods.quant import quantize

__all__ = ["quantize_activations", "quantize_activations_triton", "quantize_activations_reference", "split8_from_int",
           "split8_width", "SPLIT_BLOCK"]

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_KP = 8192
LAYOUTS = ("packed", "split8")
SPLIT_BLOCK = 128  # K values per block of the "split8" layout (64 even, then 64 odd)
# The default rule for several programs per token: rows of SPLIT_MIN_ROW values or more, slices
# of SPLIT_MIN_WIDTH or more (benchmarks/kernels/quant_split.py on the H200, M = 1 ... 32, 8 warps: a
# 4096-wide row took 2.2-2.6 µs with one program and no less split; a 14336-wide one 7.5-7.9 µs
# with one, 3.5-4.2 with 8 (slices of 1792 values), 3.4-4.0 with 16 and 4.6-5.4 with 4).
SPLIT_MIN_ROW = 8192
SPLIT_MIN_WIDTH = 1024


@triton.jit
def quantize_store(x, scale, q_row, kp, KP, SPLIT8: tl.constexpr):
    """Quantize pairs ``x [len(kp), 2]`` (fp32) of one row with ``scale``; store them packed or split8."""
    q = quantize_int4(quant_div(x, scale)).to(tl.int8)
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
def _load_row(x_row, k, K, end, GATED: tl.constexpr):
    """Activations ``k < end`` of one row in fp32 (0 past ``end``); with ``GATED`` the row is ``[gate | up]``
    (``K`` each) and the activations are ``silu(gate) · up``, rounded as :func:`mosaicquant.kernels.decoder.silu_mul`
    rounds them."""
    x = tl.load(x_row + k, mask=k < end, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(x_row + K + k, mask=k < end, other=0.0).to(tl.float32)
        x = silu_mul_rounded(x, up, x_row.dtype.element_ty == tl.bfloat16)
    return x


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, scale_ptr, sync_ptr, K, KP, SLICE_KP, stride_xm, stride_qm, clip_ratio,
    BLOCK_KP: tl.constexpr, ONE_PASS: tl.constexpr, CHAIN: tl.constexpr, SPLIT8: tl.constexpr = False,
    GATED: tl.constexpr = False, P: tl.constexpr = 1, SYNC: tl.constexpr = True,
):
    chain_start(CHAIN)  # the GEMM that reads our output may start (it waits for us before reading)
    row, slice_id, tag = token_slice(sync_ptr, P, SYNC)
    if P == 1:
        lo = 0
        hi = KP
        end = K
    else:
        # program token · P + s quantizes pairs [lo, hi) of the token's row (SLICE_KP: a multiple of 64)
        lo = slice_id * SLICE_KP
        hi = tl.minimum(lo + SLICE_KP, KP)
        end = tl.minimum(2 * hi, K)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    pairs = tl.arange(0, BLOCK_KP)
    lanes = tl.arange(0, 2)

    if ONE_PASS:
        k = (lo + pairs)[:, None] * 2 + lanes[None, :]
        x_all = _load_row(x_row, k, K, end, GATED)
        absmax = max_nan(tl.abs(x_all), 1)
    else:
        absmax = tl.zeros([BLOCK_KP], dtype=tl.float32)
        for kp0 in range(lo, hi, BLOCK_KP):
            k = (kp0 + pairs)[:, None] * 2 + lanes[None, :]
            x = _load_row(x_row, k, K, end, GATED)
            absmax = maximum_nan(absmax, max_nan(tl.abs(x), 1))
    scale = token_scale(max_nan(absmax, 0), clip_ratio, sync_ptr, row, slice_id, tag, P, SYNC)
    if lo == 0:
        tl.store(scale_ptr + row, scale)

    # quantize_store writes pairs below hi (split8: up to the end of hi's 64-pair block, zeros past KP)
    for kp0 in range(lo, hi, BLOCK_KP):
        kp = kp0 + pairs
        k = kp[:, None] * 2 + lanes[None, :]
        if ONE_PASS:
            x = x_all
        else:
            x = _load_row(x_row, k, K, end, GATED)
        quantize_store(x, scale, q_row, kp, hi, SPLIT8)


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
    programs_per_token: int | None = None,
    num_warps: int | None = None,
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
        programs_per_token: programs that share each token's row (a power of two, at most 16;
            the same results for any). ``None``: :func:`mosaicquant.kernels._token_split.default_programs_per_token`
            for rows of at least ``SPLIT_MIN_ROW`` values, slices of at least ``SPLIT_MIN_WIDTH``.
            More than 1 only on a GPU with ``M · P`` at most its SM count; under Triton's
            interpreter (programs run one after another, and a token's programs wait for each
            other) it must be 1.
        num_warps: warps per program (default :func:`_warps`, by the size of a program's slice).

    Returns:
        ``(packed, scale)``: ``uint8 [M, ceil(K/2)]`` (or ``int8 [M, split8_width(K)]``) and
        ``float32 [M]``.

    Raises:
        UserInputError: wrong dtype/rank/stride, clip ratio out of range, an unknown layout, a
            programs-per-token or warp count not allowed, or a device the Triton path cannot run on.
    """
    _check_inputs(x, clip_ratio)
    device = check_same_device(x=x)
    check_triton_device(device)
    if layout not in LAYOUTS:
        raise UserInputError(f"layout={layout!r} is not allowed: choose one of {', '.join(LAYOUTS)}")
    check_num_warps(num_warps)
    m, k = x.shape
    if gated:
        _check_gated(x)
        k //= 2
    kp = (k + 1) // 2
    p = resolve_programs_per_token(programs_per_token, m, device, k, SPLIT_MIN_WIDTH, min_row=SPLIT_MIN_ROW)
    if layout == "split8":
        if out is not None:
            raise UserInputError("out= takes the packed layout only")
        q = torch.empty(m, split8_width(k), dtype=torch.int8, device=device)
        scale = torch.empty(m, dtype=torch.float32, device=device)
    elif out is not None:
        q, scale = out
        check_tensor("out[0]", q, dtypes=(torch.uint8,), shape=(m, kp))
        check_tensor("out[1]", scale, dtypes=(torch.float32,), shape=(m,))
        if not q.is_contiguous() or q.device != device or scale.device != device:
            raise UserInputError("out tensors must be contiguous and on x's device")
    else:
        q = torch.empty(m, kp, dtype=torch.uint8, device=device)
        scale = torch.empty(m, dtype=torch.float32, device=device)
    if m:
        _launch(x, q.view(torch.int8), scale, k, clip_ratio, layout == "split8", gated, p, num_warps)
    return q, scale


# Calls of at least this many tokens (one program a token) take fewer warps a program: more programs share an SM.
PREFILL_WARPS_MIN_M = 1024


def _warps(block_kp: int, p: int, m: int = 1) -> int:
    """Warps per program for tiles of ``block_kp`` pairs, ``p`` programs per token, ``m`` tokens.

    At decode sizes a token's row is all a program has, so long rows want many warps. Split programs
    take at least 8: on the H200 a 14336-wide row split 8 ways (896 pairs a program) took 3.5-4.2 µs
    with 8 warps against 4.7-5.4 with 4 (``benchmarks/kernels/quant_split.py``). From
    :data:`PREFILL_WARPS_MIN_M` tokens, 4 warps up to 2048 pairs and 8 above: at 1024 / 2048 / 8192
    tokens (``benchmarks/kernels/hadamard_warps.py``, inputs rotated through more than L2)
    a 4096-wide row took 6.63 / 10.21 / 31.09 µs (packed) and 6.87 / 10.66 / 34.52 (split8) on 4
    warps against 6.70 / 10.64 / 34.76 and 7.51 / 11.92 / 40.51 on 8; a 14336-wide row 17.79 / 32.18 /
    114.08 and 20.31 / 37.32 / 132.23 on 8 against 18.17 / 33.41 / 121.41 and 21.41 / 39.10 / 147.55 on 16.
    """
    if p > 1 and block_kp <= 4096:
        return 8
    if m >= PREFILL_WARPS_MIN_M:
        return 4 if block_kp <= 2048 else 8
    return 4 if block_kp <= 1024 else (8 if block_kp <= 4096 else 16)


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, k: int, clip_ratio: float, split8: bool,
            gated: bool, p: int, num_warps: int | None, given_absmax: torch.Tensor | None = None) -> None:
    """Run the kernel on checked arguments: ``M · p`` programs, ``p`` per token (token-major).

    ``q`` is the output's ``int8`` view and ``k`` the activations per token. ``given_absmax`` (tests on
    the interpreter, ``p > 1``): each row's absmax, given, so that a token's programs need not wait
    for each other (the kernel's ``SYNC=False``); ``None`` uses the barrier.
    """
    m, kp = x.shape[0], (k + 1) // 2
    chain = chain_mode(x.device, m)
    if p == 1:
        slice_kp = kp
        block_kp = min(MAX_BLOCK_KP, triton.next_power_of_2(kp))
        if split8:
            block_kp = max(64, block_kp)
        sync, wait = scale, True  # the kernel does not read it
    else:
        # slices of whole 64-pair blocks: the split8 padding then lies in the last non-empty slice
        slice_kp = -(-kp // (64 * p)) * 64
        block_kp = min(MAX_BLOCK_KP, triton.next_power_of_2(slice_kp))
        if given_absmax is None:
            sync, wait = barrier_buffer(x.device), True
        else:
            sync, wait = given_absmax.to(device=x.device, dtype=torch.float32).contiguous(), False
    if num_warps is None:
        num_warps = _warps(block_kp, p, m)
    _act_quant_kernel[(m * p,)](
        x, q, scale, sync, k, kp, slice_kp, x.stride(0), q.stride(0), float(clip_ratio),
        BLOCK_KP=block_kp, ONE_PASS=slice_kp <= block_kp, CHAIN=chain, SPLIT8=split8,
        GATED=gated, P=p, SYNC=wait, num_warps=num_warps, **chain_launch(chain),
    )


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
