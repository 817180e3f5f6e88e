"""Atom: salient channels in INT8, the rest W4A4 in groups, GPTQ weights (SPEC §3).

Per linear layer with input Hessian ``H = mean_t x_t x_tᵀ`` (from
:func:`mosaicquant.methods.calibration.calibrate_layerwise`, i.e. on the inputs the layer
will see with the earlier layers already quantized):

1. **Reorder** the input channels by the diagonal ``diag(H) = mean_t x_t²`` in ascending
   order; the last ``n_outliers`` (128) are the most salient ("outlier") channels. The
   reordering is a permutation of the linear's input (in a deployment it is fused into the
   op that produces the input); the simulation gathers the channels.
2. **Activations** (:class:`MixedActQuant`): the outlier channels 8-bit per token
   (symmetric, unclipped: clipping the channels kept for their outliers would defeat the
   purpose), the other channels 4-bit symmetric in groups of ``group_size`` (128) of the
   reordered layout, clip ``a_clip`` = 0.9.
3. **Weights** (:func:`gptq_quantize_segments`): GPTQ over the reordered columns, the normal
   channels first, group by group (4-bit symmetric, one scale per output row and group,
   fixed clip ``w_clip`` = 0.85, no search), the outlier columns last (8-bit symmetric,
   one scale per output row over the outlier columns, unclipped). Quantizing the outliers
   last lets them absorb the error of the 4-bit groups, the order of the authors' code,
   which moves the outlier channels to the end.
4. **KV cache**: 4-bit asymmetric, one group per head and token
   (:mod:`mosaicquant.methods.kvcache`), no Q/K rotation.

Ragged groups: SmolLM2's hidden size 576 leaves 576 − 128 = 448 normal channels, 3.5
groups of 128. The layout used is groups of ``group_size`` from the start of the reordered
normal channels and one smaller last group (here 128, 128, 128, 64), for weights and
activations alike; a ragged activation group is quantized as if zero-padded to the full
group, which leaves its scale unchanged (zeros never raise an absolute maximum).

Both mixed-precision pieces, :class:`MixedActQuant` and :func:`gptq_quantize_segments`,
are shared with ResQ (:mod:`mosaicquant.baselines.resq`).

Layers are simulated (fake-quant): :class:`~mosaicquant.methods.qlinear.FakeQuantLinear`
with the dequantized weight and :class:`MixedActQuant` as its activation quantizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from mosaicquant.harness.config import Config, check_range
from mosaicquant.harness.registry import register_method
from mosaicquant.methods.calibration import calibrate_layerwise
from mosaicquant.methods.gptq import damp, gptq_quantize
from mosaicquant.methods.kvcache import KVQuantSpec, enable_kv_quant
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear, input_transform_of, set_module
from mosaicquant.methods.quant import Quantized, check_bits, fake_quantize

__all__ = [
    "MixedActQuant",
    "WeightSegment",
    "SegmentedWeight",
    "gptq_quantize_segments",
    "ragged_groups",
    "salient_order",
    "mixed_weight_memory",
    "AtomConfig",
    "atom_quantize_linear",
    "atom",
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


@dataclass(frozen=True)
class AtomConfig(Config):
    """Atom options (command line: ``atom:n_outliers=64:kvbits=16``).

    Attributes:
        wbits / abits: bits of the normal channels' weights / activations, 2..8.
        outlier_bits: bits of the salient channels (weights and activations), 2..8.
        n_outliers: salient input channels per linear kept at ``outlier_bits`` (capped at
            the layer's input size).
        group_size: group of the normal channels along the reordered input (weights and
            activations); the last group may be shorter.
        a_clip: clip ratio of the normal channels' activations, (0, 1].
        w_clip: fixed clip ratio of the normal channels' weights, (0, 1].
        kvbits: KV-cache bits, 2..8, or 16 (float cache).
        kv_symmetric: symmetric K/V grid (default asymmetric, per head).
        percdamp: GPTQ damping relative to the mean Hessian diagonal.
        act_order: GPTQ visits each group's columns by decreasing Hessian diagonal.
        calib_batch: calibration sequences per forward pass.
    """

    description = "Atom: 128 salient channels INT8, the rest W4A4 group 128 (GPTQ), KV4 asymmetric"

    wbits: int = 4
    abits: int = 4
    outlier_bits: int = 8
    n_outliers: int = 128
    group_size: int = 128
    a_clip: float = 0.9
    w_clip: float = 0.85
    kvbits: int = 4
    kv_symmetric: bool = False
    percdamp: float = 0.01
    act_order: bool = True
    calib_batch: int = 4

    def validate(self):
        for name in ("wbits", "abits", "outlier_bits"):
            check_range(name, getattr(self, name), 2, 8, integer=True)
        check_range("kvbits", self.kvbits, 2, 8, integer=True, extra=(16,))
        check_range("n_outliers", self.n_outliers, 0, None, integer=True)
        check_range("group_size", self.group_size, 1, None, integer=True)
        check_range("a_clip", self.a_clip, 0.01, 1.0)
        check_range("w_clip", self.w_clip, 0.01, 1.0)
        check_range("percdamp", self.percdamp, 0.0, 1.0)
        check_range("calib_batch", self.calib_batch, 1, None, integer=True)

    def kv_spec(self) -> KVQuantSpec:
        """K/V per head and token, asymmetric by default; no Q/K rotation."""
        return KVQuantSpec(bits=self.kvbits, group_size=None, symmetric=self.kv_symmetric, clip_ratio=1.0)


def atom_quantize_linear(linear: nn.Linear, hessian: torch.Tensor, config: AtomConfig) -> FakeQuantLinear:
    """Quantize one linear the Atom way (reorder, INT8 salient channels, W4A4 groups, GPTQ).

    Args:
        linear: the float layer (its online input transform, if any, is kept).
        hessian: ``[K, K]`` Hessian of the layer's input.
        config: :class:`AtomConfig`.

    Returns:
        :class:`FakeQuantLinear` whose ``act`` is a :class:`MixedActQuant`; attributes
        ``outlier_channels`` (the salient input channels), ``wbits`` (mean bits per
        weight) and ``weight_groups`` (scales per output row).

    Raises:
        ValueError: as :func:`gptq_quantize_segments`.
    """
    k = linear.in_features
    normal, outliers = salient_order(torch.diagonal(hessian).to(torch.float32).cpu(), min(config.n_outliers, k))
    groups = ragged_groups(normal, config.group_size)
    segments = [WeightSegment(g, config.wbits, clip_ratio=config.w_clip) for g in groups]
    if outliers.numel():
        segments.append(WeightSegment(outliers, config.outlier_bits))
    result = gptq_quantize_segments(linear.weight.data.to(torch.float32), hessian, segments,
                                    percdamp=config.percdamp, act_order=config.act_order)
    act = MixedActQuant(
        outliers, normal, k,
        high=ActQuantSpec(bits=config.outlier_bits, symmetric=True),
        low=ActQuantSpec(bits=config.abits, symmetric=True, group_size=config.group_size, clip_ratio=config.a_clip),
    )
    wbits = result.storage_bits() / linear.weight.numel()
    layer = FakeQuantLinear(result.dequantized.to(linear.weight.dtype), linear.bias, act,
                            input_transform_of(linear), None, wbits)
    layer.weight_groups = result.scale_groups
    layer.register_buffer("outlier_channels", outliers.clone())
    # the integers and scales per segment, for the kernel path (mosaicquant.kernels.mixed_gemm)
    layer.weight_segments = [(seg.columns, q) for seg, q in zip(segments, result.segments)]
    return layer.to(linear.weight.device)


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


@register_method("atom", config=AtomConfig, description=AtomConfig.description)
def atom(model, config: AtomConfig, ctx):
    """Quantize ``model`` in place with Atom; fills ``ctx.info``."""
    t0 = time.perf_counter()
    calib = ctx.calib_tokens()
    kv = enable_kv_quant(model, config.kv_spec())
    outliers: dict[str, int] = {}
    replaced = 0

    def quantize_layer(index, layer, stats):
        nonlocal replaced
        for name, st in stats.items():
            new = atom_quantize_linear(layer.get_submodule(name), st.hessian, config)
            set_module(layer, name, new)
            outliers[name] = int(new.outlier_channels.numel())
            replaced += 1

    calibrate_layerwise(model, calib, quantize_layer, batch_size=config.calib_batch, log=ctx.log)
    ctx.info.update(
        wbits=f"{config.wbits}/{config.outlier_bits}", abits=f"{config.abits}/{config.outlier_bits}",
        kv_bits=config.kvbits, kv_cache=kv,
        exec_path="simulated (fake-quant; channel reorder by gather)",
        weight_quantizer="gptq (segments: 4-bit groups, then 8-bit outlier columns)",
        outlier_channels=config.n_outliers, outlier_channels_per_linear=outliers,
        group_size=config.group_size, a_clip=config.a_clip, w_clip=config.w_clip,
        quantized_linears=replaced, memory_bytes=mixed_weight_memory(model),
        timing={"total_s": round(time.perf_counter() - t0, 2)},
    )
    return model
