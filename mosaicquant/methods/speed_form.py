"""Pieces the methods' data-free speed forms share.

A speed form builds a method's format on a random-weight model without calibration data: the
method's transforms and its weight and activation formats, with round-to-nearest integers in place
of a calibrated search (which changes the integers, not the format). The speed suites time the
result (:mod:`mosaicquant.harness.speedforms`); a method registers its form with
``@register_method(..., speed_form=fn)``, ``fn(model, config, ctx) -> (quantized linears, notes)``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mosaicquant.errors import Unavailable
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear, fake_quant_linear_from, quantize_weight, \
    replace_linears
from mosaicquant.methods.quant import quantize
from mosaicquant.methods.rotation import rotate_model

__all__ = ["check_w4a4", "dense_w4", "rotated_speed_form", "segmented_rtn_linear"]


def check_w4a4(method: str, wbits: int, abits: int) -> None:
    """Raise :class:`~mosaicquant.errors.Unavailable` unless ``wbits`` and ``abits`` are both 4.

    Example:
        >>> check_w4a4("rtn", 4, 4)
    """
    if wbits != 4 or abits != 4:
        raise Unavailable(f"no fast path: {method} W{wbits}A{abits}; the kernels run W4A4 (4-bit weights and "
                          "activations) and BF16")


def dense_w4(model: nn.Module, act: ActQuantSpec, wbits: int, group_size: int | None = None) -> int:
    """Replace every quantizable linear by a round-to-nearest symmetric ``wbits`` one; returns the count."""
    def make(name, linear):
        qweight = quantize_weight(linear.weight.data, wbits, symmetric=True, group_size=group_size,
                                  clip_search=False)
        return fake_quant_linear_from(linear, qweight, act, wbits)

    return len(replace_linears(model, make))


def rotated_speed_form(online_o: Callable[[object], bool]) -> Callable:
    """The speed form of a rotation method (QuaRot, SpinQuant): its rotations with online Hadamards,
    then dense round-to-nearest W4 layers; ``online_o(config)``: whether o_proj's input gets one."""
    def form(model, config, ctx):
        name = type(config).__name__.replace("Config", "").lower()
        check_w4a4(name, config.wbits, config.abits)
        rotation = getattr(config, "rotation", "hadamard")
        desc = rotate_model(model, seed=ctx.seed, rotation=rotation, online_down=True, online_o=online_o(config))
        act = config.act_spec() if hasattr(config, "act_spec") else ActQuantSpec(
            bits=config.abits, symmetric=True, clip_ratio=config.a_clip)
        return dense_w4(model, act, config.wbits, config.w_group_size), {"online": sorted(desc["online"])[:4]}
    return form


def segmented_rtn_linear(linear: nn.Linear, columns, act: nn.Module, transform=None) -> FakeQuantLinear:
    """A mixed-precision simulated linear with round-to-nearest symmetric integers per column segment.

    Args:
        linear: the float layer.
        columns: ``[(column indices, bits, clip ratio), ...]`` covering the input channels; each
            segment gets one scale per output row.
        act: the activation quantizer (a :class:`~mosaicquant.methods.mixed.MixedActQuant` or an
            :class:`ActQuantSpec`).
        transform: the layer's online input transform, or None.

    Returns:
        :class:`FakeQuantLinear` with ``weight_segments`` (what the mixed kernels read) and ``weight_groups``.
    """
    import torch

    w = linear.weight.data.to(torch.float32)
    deq = torch.empty_like(w)
    segments = []
    for cols, bits, clip in columns:
        dev_cols = cols.to(w.device)
        qt = quantize(w[:, dev_cols], bits, symmetric=True, clip_ratio=clip, scale_dtype=torch.float16)
        deq[:, dev_cols] = qt.dequantize(torch.float32)
        segments.append((cols, qt))
    wbits = sum(qt.q.numel() * qt.bits for _, qt in segments) / w.numel()
    layer = FakeQuantLinear(deq.to(linear.weight.dtype), linear.bias, act, transform, None, wbits)
    layer.weight_groups = len(segments)
    layer.weight_segments = segments
    return layer.to(linear.weight.device)
