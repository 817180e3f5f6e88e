"""Atom: salient channels in INT8, the rest W4A4 in groups, GPTQ weights (SPEC §3).

Per linear layer with input Hessian ``H = mean_t x_t x_tᵀ`` (from
:func:`mosaicquant.methods.calibration.calibrate_layerwise`, i.e. on the inputs the layer
will see with the earlier layers already quantized):

1. **Reorder** the input channels by the diagonal ``diag(H) = mean_t x_t²`` in ascending
   order; the last ``n_outliers`` (128) are the most salient ("outlier") channels. The
   reordering is a permutation of the linear's input (in a deployment it is fused into the
   op that produces the input); the simulation gathers the channels.
2. **Activations** (:class:`~mosaicquant.methods.mixed.MixedActQuant`): the outlier channels 8-bit per token
   (symmetric, unclipped: clipping the channels kept for their outliers would defeat the
   purpose), the other channels 4-bit symmetric in groups of ``group_size`` (128) of the
   reordered layout, clip ``a_clip`` = 0.9.
3. **Weights** (:func:`~mosaicquant.methods.mixed.gptq_quantize_segments`): GPTQ over the reordered columns, the normal
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

Both mixed-precision pieces, :class:`~mosaicquant.methods.mixed.MixedActQuant` and
:func:`~mosaicquant.methods.mixed.gptq_quantize_segments`, live in :mod:`mosaicquant.methods.mixed`,
shared with ResQ.

Layers are simulated (fake-quant): :class:`~mosaicquant.methods.qlinear.FakeQuantLinear`
with the dequantized weight and :class:`~mosaicquant.methods.mixed.MixedActQuant` as its activation quantizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from mosaicquant.config import Config, check_range
from mosaicquant.kernels.convert import SHARED_INPUT_GROUPS
from mosaicquant.methods.calibration import calibrate_layerwise
from mosaicquant.methods.kvcache import KVQuantSpec, enable_kv_quant
from mosaicquant.methods.mixed import (
    MixedActQuant, WeightSegment, gptq_quantize_segments, mixed_weight_memory, ragged_groups, salient_order,
)
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear, input_transform_of, replace_linears, set_module
from mosaicquant.methods.speed_form import segmented_rtn_linear
from mosaicquant.registry import register_method

__all__ = [
    "AtomConfig",
    "atom_quantize_linear",
    "atom",
]


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


def _speed_form(model, config: AtomConfig, ctx):
    """Atom's format with seeded random salient channels (in place of ``diag(XᵀX)``) and RTN integers.

    Siblings reading one input (q/k/v, gate/up) share its salient channels, as ``diag(XᵀX)`` of
    that input gives them in the quantized method: the kernels then run each group as one GEMM."""
    gen = torch.Generator().manual_seed(ctx.seed)
    high = ActQuantSpec(bits=config.outlier_bits, symmetric=True)
    low = ActQuantSpec(bits=config.abits, symmetric=True, group_size=config.group_size, clip_ratio=config.a_clip)
    drawn: dict[str, torch.Tensor] = {}

    def salience(name, k):
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in SHARED_INPUT_GROUPS if leaf in g), (leaf,))
        key = f"{parent}.{group[0]}"
        if key not in drawn:
            drawn[key] = torch.rand(k, generator=gen)
        return drawn[key]

    def make(name, linear):
        k = linear.weight.shape[1]
        normal, outliers = salient_order(salience(name, k), min(config.n_outliers, k))
        columns = [(g, config.wbits, config.w_clip) for g in ragged_groups(normal, config.group_size)]
        if outliers.numel():
            columns.append((outliers, config.outlier_bits, 1.0))
        act = MixedActQuant(outliers, normal, k, high=high, low=low).to(linear.weight.device)
        return segmented_rtn_linear(linear, columns, act, getattr(linear, "input_transform", None))

    n = len(replace_linears(model, make))
    return n, {"salient_channels": "random (data-free speed form)", "n_outliers": config.n_outliers,
               "group_size": config.group_size}


@register_method("atom", config=AtomConfig, description=AtomConfig.description, speed_form=_speed_form)
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
