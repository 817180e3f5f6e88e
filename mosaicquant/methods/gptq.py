"""GPTQ: Hessian-guided weight quantization with error compensation (the one GPTQ).

Every method that asks for GPTQ (MosaicQuant's dense base, QuaRot, SpinQuant, Atom, ...)
calls :func:`gptq_quantize`; the quantizer itself is :mod:`mosaicquant.methods.quant`, so
GPTQ and RTN share grids, rounding, FP16 scale rounding and the clipping search.

Algorithm, for a weight ``W [N, K]`` and the input Hessian ``H [K, K]``:

1. Dead columns (``H[k, k] == 0``: the input channel never fires) get ``H[k, k] = 1`` and
   ``W[:, k] = 0`` (they quantize to exactly 0).
2. Damping: ``H += percdamp * mean(diag H) * I``.
3. ``U = chol(H⁻¹)`` (upper Cholesky factor of the inverse, ``H⁻¹ = Uᵀ U``).
4. Columns are quantized one at a time, in blocks of ``block_size`` columns: column ``i`` is
   rounded, its scaled error ``e_i = (w_i - q_i) / U[i, i]`` is propagated to the columns
   after it inside the block (``W[:, i:] -= e_i U[i, i:]``), and the accumulated block error
   is applied lazily to the columns after the block (``W[:, end:] -= E_block U[block, end:]``).

With this update the total error is ``W - Ŵ = E U`` exactly, so the damped output
distortion ``tr((W - Ŵ) H (W - Ŵ)ᵀ)`` equals ``Σ_i ‖e_i‖²``; :func:`gptq_quantize_with_error`
returns it per output row as :attr:`GPTQResult.loss`.

Quantizer parameters (scale, zero; clipping search as in RTN when ``clip_search``):

- ``group_size=None``: one scale per output row, computed once on the (dead-column-zeroed)
  weight before any update, as the reference implementation does.
- ``group_size=g``, natural order: the parameters of group ``[c, c + g)`` are computed when
  column ``c`` is reached, on the **current** error-updated weights of the group (including
  the pending lazy update of columns past the current block, so the result does not depend
  on ``block_size``).
- ``group_size=g`` with ``act_order``: "static groups". All group parameters are computed
  up front on the original weight in natural column order, then columns are quantized in
  order of decreasing ``H[k, k]``, each with the scale of its natural group. The stored
  ``q``/``scale`` therefore follow the natural column order and group mapping (no ``g_idx``
  permutation in the packed format), at the price of scales that do not see the error
  updates.

Hessian convention: ``H = mean_t x_tᵀ x_t`` (:class:`HessianAccumulator`); the reference
code's ``2/n Σ x_tᵀ x_t`` differs by a factor 2, to which GPTQ is invariant (the damping is
relative), and ``diag H`` is then exactly MosaicQuant's ``h_k = mean_t X̂[t, k]²``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mosaicquant.methods.quant import (
    Quantized,
    all_finite,
    check_bits,
    qrange,
    quantize,
    quantize_with_clip_search,
)

__all__ = [
    "GPTQResult",
    "gptq_quantize",
    "gptq_quantize_with_error",
    "HessianAccumulator",
    "accumulate_hessian",
    "damp",
]


def damp(hessian: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Return ``H + percdamp * mean(diag H) * I`` (a new tensor; ``H`` is left as is).

    Args:
        hessian: ``[K, K]`` symmetric positive semi-definite matrix.
        percdamp: relative damping, ``>= 0``.

    Returns:
        The damped ``[K, K]`` matrix, same dtype as ``hessian``.

    Raises:
        ValueError: ``percdamp`` negative or not finite, or ``hessian`` not square.
    """
    _check_square(hessian, "hessian")
    if not (isinstance(percdamp, (int, float)) and 0.0 <= float(percdamp) < float("inf")):
        raise ValueError(f"percdamp={percdamp!r} is out of range: allowed finite values >= 0")
    out = hessian.clone()
    diag = torch.diagonal(out)
    diag += float(percdamp) * diag.mean()
    return out


def accumulate_hessian(
    hessian: torch.Tensor | None, x: torch.Tensor, n_seen: int
) -> tuple[torch.Tensor, int]:
    """Fold a batch of inputs into a running mean Hessian ``H = mean_t x_tᵀ x_t``.

    Args:
        hessian: current mean ``[K, K]`` over ``n_seen`` tokens, or ``None`` to start
            (then a float32 matrix on ``x``'s device is created).
        x: inputs ``[..., K]``; every leading index is one token.
        n_seen: number of tokens already in ``hessian``.

    Returns:
        ``(hessian, n_seen + T)`` with ``T`` the number of tokens in ``x``; ``hessian`` is
        updated in place when given.

    Raises:
        ValueError: the last dim of ``x`` does not match ``hessian``, ``n_seen < 0``, or
            ``x`` holds NaN/Inf.

    Example:
        >>> h, n = accumulate_hessian(None, torch.ones(3, 2), 0)
        >>> n, h.tolist()
        (3, [[1.0, 1.0], [1.0, 1.0]])
    """
    if n_seen < 0:
        raise ValueError(f"n_seen={n_seen!r} must be >= 0")
    k = x.shape[-1]
    if hessian is None:
        if n_seen:
            raise ValueError(f"n_seen={n_seen} given without a hessian to continue")
        hessian = torch.zeros(k, k, dtype=torch.float32, device=x.device)
    _check_square(hessian, "hessian")
    if hessian.shape[0] != k:
        raise ValueError(f"inputs have {k} channels but the hessian is {tuple(hessian.shape)}")
    flat = x.reshape(-1, k).to(hessian.dtype)
    t = flat.shape[0]
    if t == 0:
        return hessian, n_seen
    if not all_finite(flat):
        raise ValueError("calibration inputs hold NaN or Inf values")
    total = n_seen + t
    hessian.mul_(n_seen / total)
    hessian.addmm_(flat.t(), flat, alpha=1.0 / total)
    return hessian, total


class HessianAccumulator:
    """Running mean input Hessian ``H = mean_t x_tᵀ x_t`` of one linear layer.

    Use it from a forward hook: ``acc.add(inputs)`` per batch, then ``acc.hessian``.

    Args:
        in_features: ``K``.
        device: where ``H`` lives.
        dtype: accumulation dtype (float32 default; float64 for very long calibration).

    Example:
        >>> acc = HessianAccumulator(4)
        >>> acc.add(torch.randn(2, 5, 4)); acc.n_tokens
        10
    """

    def __init__(self, in_features: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features={in_features!r} must be a positive integer")
        self._h = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self.n_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Fold inputs ``[..., K]`` (every leading index a token) into the mean.

        Raises:
            ValueError: as :func:`accumulate_hessian`.
        """
        self._h, self.n_tokens = accumulate_hessian(self._h, x.to(self._h.device), self.n_tokens)

    @property
    def hessian(self) -> torch.Tensor:
        """The mean Hessian ``[K, K]`` (float32).

        Raises:
            ValueError: no token was added yet.
        """
        if self.n_tokens == 0:
            raise ValueError("no calibration tokens were added to this Hessian accumulator")
        return self._h.to(torch.float32)


@dataclass
class GPTQResult:
    """What :func:`gptq_quantize_with_error` returns.

    Attributes:
        quantized: the :class:`Quantized` weight (natural column order).
        dequantized: ``float32 [N, K]``: the weights the error compensation assumed;
            equal to ``quantized.dequantize()`` bit for bit.
        loss: ``float32 [N]``: per output row, ``Σ_i ((w_i - q_i) / U[i, i])²``, which
            equals ``(W - Ŵ) H_d (W - Ŵ)ᵀ`` on the diagonal, ``H_d`` the damped Hessian
            (with the dead-column fix) and ``W`` the weight with dead columns zeroed.
        perm: the column order GPTQ used (``arange(K)`` without ``act_order``).
        dead: ``bool [K]``: the dead input columns.
    """

    quantized: Quantized
    dequantized: torch.Tensor
    loss: torch.Tensor
    perm: torch.Tensor
    dead: torch.Tensor


def _check_square(h: torch.Tensor, name: str) -> None:
    if h.dim() != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"{name} must be a square [K, K] matrix, got shape {tuple(h.shape)}")


def gptq_quantize_with_error(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    *,
    symmetric: bool = True,
    group_size: int | None = None,
    percdamp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    clip_search: bool = True,
    grid: int = 100,
    max_shrink: float = 0.8,
    norm: float = 2.4,
    scale_dtype: torch.dtype | None = None,
    clip_ratio: float = 1.0,
) -> GPTQResult:
    """Quantize ``weight`` with GPTQ and return the integers with diagnostics.

    Args:
        weight: ``[N, K]`` (out, in) float weight.
        hessian: ``[K, K]`` input Hessian (``mean_t x_tᵀ x_t``, any positive multiple works).
        bits: 2..8.
        symmetric: symmetric grid (True) or asymmetric with zero points.
        group_size: ``None`` (per output row) or a divisor of ``K``.
        percdamp: relative damping of the Hessian diagonal, ``>= 0``.
        act_order: quantize columns in order of decreasing ``H[k, k]`` (static groups).
        block_size: columns per lazy-update block, ``>= 1``.
        clip_search: choose each scale by the RTN clipping search (``grid``, ``max_shrink``,
            ``norm``, see :func:`~mosaicquant.methods.quant.quantize_with_clip_search`).
        scale_dtype: e.g. ``torch.float16``: scales rounded to their storage type before
            the integers are computed.
        clip_ratio: fixed fraction of each range kept, in (0, 1], used when
            ``clip_search`` is False (e.g. Atom's fixed weight clip 0.85).

    Returns:
        :class:`GPTQResult`.

    Raises:
        ValueError: bad shapes, a non-finite input, bits/group/block/damping out of range,
            or a Hessian that is not positive definite after damping (raise ``percdamp``).
    """
    check_bits(bits)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_square(hessian, "hessian")
    if hessian.shape[0] != k:
        raise ValueError(f"hessian is {tuple(hessian.shape)} but the weight has K={k} input columns")
    if group_size is not None and (
        not isinstance(group_size, int) or group_size <= 0 or k % group_size
    ):
        raise ValueError(f"group_size={group_size!r} must be None or a positive divisor of K={k}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive integer")
    if isinstance(clip_ratio, bool) or not isinstance(clip_ratio, (int, float)) or not 0.0 < clip_ratio <= 1.0:
        raise ValueError(f"clip_ratio={clip_ratio!r} is out of range: allowed (0, 1]")
    w = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(device=w.device, dtype=torch.float32).clone()
    if not all_finite(w):
        raise ValueError("cannot quantize a weight holding NaN or Inf values")
    if not all_finite(h):
        raise ValueError("the hessian holds NaN or Inf values")

    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    def find_params(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if clip_search:
            qt = quantize_with_clip_search(
                cols, bits, symmetric=symmetric, grid=grid, max_shrink=max_shrink,
                norm=norm, scale_dtype=scale_dtype,
            )
        else:
            qt = quantize(cols, bits, symmetric=symmetric, clip_ratio=clip_ratio, scale_dtype=scale_dtype)
        return qt.scale[:, 0], None if qt.zero is None else qt.zero[:, 0]

    n_groups = 1 if group_size is None else k // group_size
    scale = torch.ones(n, n_groups, dtype=torch.float32, device=w.device)
    zero = None if symmetric else torch.zeros(n, n_groups, dtype=torch.float32, device=w.device)
    dynamic_groups = group_size is not None and not act_order
    if not dynamic_groups:
        for g in range(n_groups):
            lo = 0 if group_size is None else g * group_size
            hi = k if group_size is None else lo + group_size
            s, z = find_params(w[:, lo:hi])
            scale[:, g] = s
            if zero is not None:
                zero[:, g] = z

    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w = w[:, perm]
        h = h[perm][:, perm]
    else:
        perm = torch.arange(k, device=w.device)
    group_of = (perm // group_size) if group_size is not None else torch.zeros_like(perm)
    group_of = group_of.tolist()

    h = damp(h, percdamp)
    chol, info = torch.linalg.cholesky_ex(h)
    if int(info):
        raise ValueError(
            f"the damped hessian is not positive definite (percdamp={percdamp}); "
            "use more calibration tokens or a larger percdamp"
        )
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)

    qmin, qmax = qrange(bits, symmetric)
    q_out = torch.zeros(n, k, dtype=torch.int8, device=w.device)
    deq_out = torch.zeros(n, k, dtype=torch.float32, device=w.device)
    loss = torch.zeros(n, dtype=torch.float32, device=w.device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        count = i2 - i1
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros(n, count, dtype=torch.float32, device=w.device)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(count):
            col = i1 + i
            if dynamic_groups and col % group_size == 0:
                end = col + group_size
                cur = w1[:, i:min(end - i1, count)]
                if end > i2:
                    # Columns past this block still miss the lazy update of columns i1..col-1.
                    rest = w[:, i2:end] - err1[:, :i] @ hinv[i1:col, i2:end]
                    cur = torch.cat([cur, rest], dim=1)
                s, z = find_params(cur)
                scale[:, col // group_size] = s
                if zero is not None:
                    zero[:, col // group_size] = z
            g = group_of[col]
            s = scale[:, g]
            wc = w1[:, i]
            qc = torch.round(wc / s)
            if zero is not None:
                qc = qc + zero[:, g]
            qc = qc.clamp_(qmin, qmax)
            dq = (qc - zero[:, g]) * s if zero is not None else qc * s
            q_out[:, col] = qc.to(torch.int8)
            deq_out[:, col] = dq
            d = hinv1[i, i]
            e = (wc - dq) / d
            loss += e * e
            w1[:, i:] -= e.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        if i2 < k:
            w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    if act_order:
        q_nat = torch.empty_like(q_out)
        q_nat[:, perm] = q_out
        deq_nat = torch.empty_like(deq_out)
        deq_nat[:, perm] = deq_out
        q_out, deq_out = q_nat, deq_nat
    qt = Quantized(q=q_out, scale=scale, zero=zero, bits=bits, group_size=group_size)
    return GPTQResult(quantized=qt, dequantized=deq_out, loss=loss, perm=perm, dead=dead)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    *,
    symmetric: bool = True,
    group_size: int | None = None,
    percdamp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    clip_search: bool = True,
    grid: int = 100,
    max_shrink: float = 0.8,
    norm: float = 2.4,
    scale_dtype: torch.dtype | None = None,
    clip_ratio: float = 1.0,
) -> Quantized:
    """Quantize ``weight [N, K]`` with GPTQ against the input Hessian ``hessian [K, K]``.

    Same arguments and errors as :func:`gptq_quantize_with_error` (see the module docstring
    for the algorithm and the group/act-order conventions).

    Returns:
        :class:`~mosaicquant.methods.quant.Quantized`: ``q`` int8 ``[N, K]`` in natural
        column order, ``scale`` ``[N, G]``, ``zero`` ``[N, G]`` or ``None``; its
        ``dequantize()`` is exactly the weight GPTQ's error compensation assumed.

    Example:
        >>> w, x = torch.randn(8, 32), torch.randn(256, 32)
        >>> qt = gptq_quantize(w, x.T @ x / 256, 4, scale_dtype=torch.float16)
        >>> qt.q.shape, qt.scale.shape
        (torch.Size([8, 32]), torch.Size([8, 1]))
    """
    return gptq_quantize_with_error(
        weight, hessian, bits, symmetric=symmetric, group_size=group_size, percdamp=percdamp,
        act_order=act_order, block_size=block_size, clip_search=clip_search, grid=grid,
        max_shrink=max_shrink, norm=norm, scale_dtype=scale_dtype, clip_ratio=clip_ratio,
    ).quantized
