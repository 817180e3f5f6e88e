"""Mixed-precision blocks Atom and ResQ share: per-channel-set activation quantizer, segmented GPTQ.

A layer's input channels are split into sets (e.g. Atom's 128 salient channels kept at 8 bits and
the rest at 4 bits in groups; ResQ's high-variance subspace at 8 bits). Two pieces implement that:

- :class:`MixedActQuant`: the activation quantizer of such a layer, each channel set at its own
  bits (symmetric per token; the low-bit set optionally in groups, with a clip ratio);
- :func:`gptq_quantize_segments`: GPTQ over the weight's columns in the order of their segments
  (:class:`WeightSegment`), each segment at its own bits and grouping, so a later segment absorbs
  the error of the earlier ones.

:func:`ragged_groups` and :func:`salient_order` build the channel sets; :func:`mixed_weight_memory`
counts the bytes of the result. The kernel path of such a layer is
:mod:`mosaicquant.kernels.mixed_gemm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mosaicquant.methods.gptq import damp, gptq_quantize
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear
from mosaicquant.methods.quant import Quantized, check_bits, fake_quantize

__all__ = [
    "MixedActQuant",
    "MultiPassActQuant",
    "WeightSegment",
    "SegmentedWeight",
    "gptq_quantize_segments",
    "ragged_groups",
    "salient_order",
    "mixed_weight_memory",
]


def _check_index(name: str, index: torch.Tensor, size: int) -> torch.Tensor:
    index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
    if index.numel() and (index.min() < 0 or index.max() >= size):
        raise ValueError(f"{name} holds channel indices outside 0..{size - 1}")
    if index.unique().numel() != index.numel():
        raise ValueError(f"{name} holds repeated channel indices")
    return index


class MixedActQuant(nn.Module):
    """Mixed-precision activation quantizer: chosen channels at ``high``, the rest at ``low``.

    ``forward(x)`` fake-quantizes ``x [..., K]``: the ``high_channels`` together, per token
    (one range over those channels of a token) with the ``high`` spec; the other channels,
    taken in the order of ``low_channels``, with the ``low`` spec, per token or in groups of
    ``low.group_size`` consecutive channels of that order. A last group shorter than
    ``low.group_size`` is quantized as if zero-padded, so it keeps its own range.

    Args:
        high_channels: indices of the high-precision channels.
        low_channels: the remaining channels in group order; ``None`` = the complement of
            ``high_channels`` in ascending order.
        in_features: ``K``.
        high: spec of the high-precision channels (``group_size`` must be ``None``).
        low: spec of the other channels.

    Raises:
        ValueError: indices out of range, repeated, or not covering ``0..K-1`` exactly once
            together, or a grouped ``high`` spec.

    Example:
        >>> q = MixedActQuant(torch.tensor([0]), None, 4, ActQuantSpec(8), ActQuantSpec(4))
        >>> [round(v, 3) for v in q(torch.tensor([[100.0, 1.0, -2.0, 0.5]]))[0].tolist()]
        [100.0, 0.857, -2.0, 0.571]
    """

    def __init__(
        self,
        high_channels: torch.Tensor,
        low_channels: torch.Tensor | None,
        in_features: int,
        high: ActQuantSpec,
        low: ActQuantSpec,
    ):
        super().__init__()
        if not isinstance(in_features, int) or isinstance(in_features, bool) or in_features < 1:
            raise ValueError(f"in_features={in_features!r} must be a positive integer")
        if high.group_size is not None:
            raise ValueError(f"high.group_size={high.group_size!r} is not allowed: the high channels are quantized per token (None)")
        high_idx = _check_index("high_channels", high_channels, in_features)
        if low_channels is None:
            mask = torch.ones(in_features, dtype=torch.bool)
            mask[high_idx] = False
            low_idx = torch.nonzero(mask).reshape(-1)
        else:
            low_idx = _check_index("low_channels", low_channels, in_features)
        if high_idx.numel() + low_idx.numel() != in_features or torch.cat([high_idx, low_idx]).unique().numel() != in_features:
            raise ValueError(
                f"high_channels ({high_idx.numel()}) and low_channels ({low_idx.numel()}) must together "
                f"cover the {in_features} channels exactly once"
            )
        if low.group_size is not None and low.group_size < 1:
            raise ValueError(f"low.group_size={low.group_size!r} must be None or a positive integer")
        self.in_features = in_features
        self.high = high
        self.low = low
        self.register_buffer("high_channels", high_idx)
        self.register_buffer("low_channels", low_idx)

    @property
    def bits(self) -> str:
        """``"low/high"`` bit widths, for reports."""
        return f"{self.low.bits}/{self.high.bits}"

    @property
    def n_high(self) -> int:
        return int(self.high_channels.numel())

    def effective_bits(self, k: int) -> tuple[float, float]:
        """Bits per input element: ``(values, scales)`` (see :mod:`mosaicquant.methods.bits`).

        Values: the high channels at ``high.bits``, the others at ``low.bits`` (16 where a spec is off).
        Scales: per token, one 16-bit scale (and zero point, if asymmetric) over the high channels and
        one per group of the others (a ragged last group has its own).

        Raises:
            ValueError: ``k`` is not this quantizer's ``in_features``.
        """
        from mosaicquant.methods.bits import activation_bits

        if k != self.in_features:
            raise ValueError(f"MixedActQuant over {self.in_features} channels asked for the bits of {k}")
        n_high, n_low = self.n_high, int(self.low_channels.numel())
        values = scales = 0.0
        for spec, width in ((self.high, n_high), (self.low, n_low)):
            if width:
                v, s = activation_bits(spec, width)
                values += v * width
                scales += s * width
        return values / k, scales / k

    def _low(self, x: torch.Tensor) -> torch.Tensor:
        if not self.low.enabled or x.shape[-1] == 0:
            return x
        g = self.low.group_size
        k = x.shape[-1]
        pad = 0 if g is None else (-k) % g
        if pad:
            x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)
        out = fake_quantize(x, self.low.bits, symmetric=self.low.symmetric, group_size=g,
                            clip_ratio=self.low.clip_ratio)
        return out[..., :k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MixedActQuant over {self.in_features} channels got an input with last dimension {x.shape[-1]}")
        out = torch.empty_like(x)
        if self.n_high:
            out[..., self.high_channels] = self.high(x[..., self.high_channels])
        if self.low_channels.numel():
            out[..., self.low_channels] = self._low(x[..., self.low_channels])
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, high={self.n_high} ch @ {self.high.bits} bits, "
                f"low={self.low_channels.numel()} ch @ {self.low.bits} bits (group {self.low.group_size}, "
                f"clip {self.low.clip_ratio})")


class MultiPassActQuant(nn.Module):
    """An activation grid applied ``passes`` times, each pass to the error the earlier ones left.

    ``forward(x) = Σ_p deq(Q(r_p))`` with ``r_1 = x`` and ``r_{p+1} = x − Σ_{q≤p} deq(Q(r_q))``: each pass
    is one more ``spec.bits``-bit operand with its own per-token scales, multiplied by the same weights,
    so two 4-bit passes give a finer step (about ``2^-(2·bits−1)`` of the range) with every operand
    still 4-bit.

    Args:
        spec: the grid of every pass (``group_size`` None: per token).
        passes: 1..4.

    Raises:
        ValueError: a grouped or disabled spec, or ``passes`` out of range.

    Example:
        >>> q = MultiPassActQuant(ActQuantSpec(4), passes=2)  # one pass gives [7.0, 1.0, -2.0]
        >>> [round(v, 3) for v in q(torch.tensor([[7.0, 1.3, -2.2]]))[0].tolist()]
        [7.0, 1.3, -2.214]
    """

    def __init__(self, spec: ActQuantSpec, passes: int):
        super().__init__()
        if spec.group_size is not None or not spec.enabled:
            raise ValueError(f"MultiPassActQuant needs a per-token quantized spec, got {spec!r}")
        if isinstance(passes, bool) or not isinstance(passes, int) or not 1 <= passes <= 4:
            raise ValueError(f"passes={passes!r} is out of range: allowed integers 1..4")
        self.spec = spec
        self.passes = passes
        self.group_size = None
        self.symmetric = spec.symmetric

    @property
    def bits(self) -> str:
        """``"bits x passes"``, for reports."""
        return f"{self.spec.bits}x{self.passes}"

    @property
    def enabled(self) -> bool:
        return True

    def effective_bits(self, k: int) -> tuple[float, float]:
        """``(values, scales)`` per element: each pass's bits and per-token scales, summed."""
        from mosaicquant.methods.bits import activation_bits

        values, scales = activation_bits(self.spec, k)
        return values * self.passes, scales * self.passes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.spec(x)
        for _ in range(self.passes - 1):
            out = out + self.spec(x - out)
        return out


@dataclass(frozen=True)
class WeightSegment:
    """A set of weight columns quantized together: one scale per output row.

    Attributes:
        columns: input-column indices, in the order GPTQ visits them (within a segment
            ``act_order`` may reorder them).
        bits: 2..8.
        clip_ratio: fixed fraction of each row's range kept (used when ``clip_search`` is off).
        clip_search: search the clip ratio per row (RTN/GPTQ convention) instead.
    """

    columns: torch.Tensor
    bits: int
    clip_ratio: float = 1.0
    clip_search: bool = False

    def __post_init__(self):
        check_bits(self.bits, "segment bits")
        if not 0.0 < self.clip_ratio <= 1.0:
            raise ValueError(f"segment clip_ratio={self.clip_ratio!r} is out of range: allowed (0, 1]")


@dataclass
class SegmentedWeight:
    """What :func:`gptq_quantize_segments` returns.

    Attributes:
        dequantized: ``float32 [N, K]`` weight in the original column order.
        segments: the :class:`Quantized` of each segment (columns in segment order).
        loss: ``float32 [N]`` damped output distortion per row,
            ``(W - Ŵ) H_d (W - Ŵ)ᵀ`` on the diagonal.
    """

    dequantized: torch.Tensor
    segments: list[Quantized]
    loss: torch.Tensor

    @property
    def scale_groups(self) -> int:
        """Scales per output row (one per segment)."""
        return len(self.segments)

    def storage_bits(self) -> int:
        """Bits of all integer values (scales not included)."""
        return sum(int(q.q.numel()) * q.bits for q in self.segments)


def gptq_quantize_segments(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    segments: list[WeightSegment],
    *,
    percdamp: float = 0.01,
    act_order: bool = True,
) -> SegmentedWeight:
    """GPTQ with a different quantizer per column segment (mixed precision, ragged groups).

    The segments are visited in order. For segment ``S`` with the later columns ``L``,
    :func:`~mosaicquant.methods.gptq.gptq_quantize` runs on ``W[:, S]`` against the Schur
    complement ``H_SS − H_SL H_LL⁻¹ H_LS`` of the (damped) Hessian: it is the Hessian of
    ``S``'s columns when the later columns compensate optimally, so the updates inside the
    segment are those a single GPTQ pass over all columns would make. The segment's error
    ``E`` is then compensated in the later columns, ``W_L ← W_L + E H_SL H_LL⁻¹`` (the
    optimal correction, which is also what GPTQ's column-by-column updates add up to).
    Each segment has one scale per output row (a "group" is a segment), FP16-rounded for
    4-bit symmetric segments (the packed format's storage type).

    Args:
        weight: ``[N, K]`` float weight.
        hessian: ``[K, K]`` input Hessian (``mean_t x_t x_tᵀ``).
        segments: partition of ``0..K-1`` into :class:`WeightSegment` s.
        percdamp: relative damping of the Hessian diagonal (applied once, to the full ``H``).
        act_order: within each segment, columns by decreasing Hessian diagonal.

    Returns:
        :class:`SegmentedWeight`.

    Raises:
        ValueError: shapes, segments that do not partition the columns, non-finite values,
            or a Hessian that is not positive definite after damping.

    Example:
        >>> w, x = torch.randn(6, 12), torch.randn(200, 12)
        >>> segs = [WeightSegment(torch.arange(8), 4), WeightSegment(torch.arange(8, 12), 8)]
        >>> gptq_quantize_segments(w, x.T @ x / 200, segs).dequantized.shape
        torch.Size([6, 12])
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian is {tuple(hessian.shape)} but the weight has K={k} input columns")
    if not segments:
        raise ValueError("segments is empty: give at least one WeightSegment")
    order = torch.cat([torch.as_tensor(s.columns, dtype=torch.long).reshape(-1) for s in segments])
    if order.numel() != k or not torch.equal(order.sort().values, torch.arange(k)):
        raise ValueError(f"segments must partition the {k} weight columns exactly once (got {order.numel()} indices)")
    w = weight.detach().to(torch.float64).clone()
    h = hessian.detach().to(device=w.device, dtype=torch.float64).clone()
    if not torch.isfinite(w).all() or not torch.isfinite(h).all():
        raise ValueError("weight or hessian holds NaN or Inf values")
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h_natural = damp(h, percdamp)
    original = w.clone()
    order = order.to(w.device)
    w = w[:, order]
    h = h_natural[order][:, order]
    deq = torch.empty_like(w)
    quantized = []
    start = 0
    for seg in segments:
        end = start + int(torch.as_tensor(seg.columns).numel())
        h_ss = h[start:end, start:end]
        if end < k:
            chol, info = torch.linalg.cholesky_ex(h[end:, end:])
            if int(info):
                raise ValueError(f"the damped hessian is not positive definite (percdamp={percdamp})")
            # H_LL⁻¹ H_LS: how the later columns optimally follow this segment's error
            follow = torch.cholesky_solve(h[end:, start:end], chol)
            h_ss = h_ss - h[start:end, end:] @ follow
        h_ss = 0.5 * (h_ss + h_ss.T)
        qt = gptq_quantize(
            w[:, start:end].to(torch.float32), h_ss.to(torch.float32), seg.bits, symmetric=True,
            percdamp=0.0, act_order=act_order, clip_search=seg.clip_search, clip_ratio=seg.clip_ratio,
            scale_dtype=torch.float16 if seg.bits == 4 else None,
        )
        dq = qt.dequantize(torch.float64)
        deq[:, start:end] = dq
        if end < k:
            w[:, end:] += (w[:, start:end] - dq) @ follow.T
        quantized.append(qt)
        start = end
    out = torch.empty_like(deq)
    out[:, order] = deq
    err = original - out
    loss = ((err @ h_natural) * err).sum(dim=1)
    return SegmentedWeight(dequantized=out.to(torch.float32), segments=quantized, loss=loss.to(torch.float32))


def ragged_groups(channels: torch.Tensor, group_size: int | None) -> list[torch.Tensor]:
    """Split ``channels`` into consecutive groups of ``group_size`` (the last may be shorter).

    Args:
        channels: 1-D index tensor, in group order.
        group_size: positive group length, or ``None`` for a single group.

    Returns:
        List of index tensors (empty list for no channels).

    Raises:
        ValueError: ``group_size`` not ``None`` or a positive integer.
    """
    if group_size is not None and (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1):
        raise ValueError(f"group_size={group_size!r} must be None or a positive integer")
    channels = torch.as_tensor(channels, dtype=torch.long).reshape(-1)
    if channels.numel() == 0:
        return []
    if group_size is None:
        return [channels]
    return list(torch.split(channels, group_size))


def salient_order(h_diag: torch.Tensor, n_outliers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Atom's reordering: channels by ascending ``diag(H)``; the last ``n_outliers`` are salient.

    Args:
        h_diag: ``[K]`` per-channel ``mean_t x_t²``.
        n_outliers: number of salient channels, ``0 <= n_outliers <= K``.

    Returns:
        ``(normal, outliers)``: index tensors, each in ascending saliency (ties by index).

    Raises:
        ValueError: ``h_diag`` not 1-D finite, or ``n_outliers`` out of range.
    """
    if h_diag.dim() != 1 or not torch.isfinite(h_diag).all():
        raise ValueError(f"h_diag must be a finite 1-D tensor, got shape {tuple(h_diag.shape)}")
    k = h_diag.numel()
    if isinstance(n_outliers, bool) or not isinstance(n_outliers, int) or not 0 <= n_outliers <= k:
        raise ValueError(f"n_outliers={n_outliers!r} is out of range: allowed integers 0..{k}")
    order = torch.argsort(h_diag, stable=True)
    return order[: k - n_outliers], order[k - n_outliers:]


def mixed_weight_memory(model: nn.Module) -> dict:
    """Bytes of the simulated linears' integer values (``wbits`` mean bits each) and FP16 scales.

    Returns:
        ``weight_values``, ``weight_scales``, ``linear_bf16_equivalent`` and their ratio
        ``bytes_vs_bf16``.
    """
    values = scales = dense = 0
    for module in model.modules():
        if isinstance(module, FakeQuantLinear):
            n, k = module.weight.shape
            values += int(round(n * k * module.wbits / 8))
            scales += 2 * n * getattr(module, "weight_groups", 1)
            dense += 2 * n * k
    return {"weight_values": values, "weight_scales": scales, "linear_bf16_equivalent": dense,
            "bytes_vs_bf16": (values + scales) / dense if dense else None}
