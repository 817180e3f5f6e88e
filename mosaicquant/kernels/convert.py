"""Turn a simulated (fake-quant) model into its kernel-backed form.

Every :class:`~mosaicquant.methods.qlinear.FakeQuantLinear` that holds a packed 4-bit
weight (:class:`~mosaicquant.methods.format.PackedW4`, per-output-channel scales) and
quantizes its activations 4-bit, symmetric, per token, is replaced by a
:class:`KernelLinear`: the layer's online input transform (if any), then
:class:`~mosaicquant.kernels.quant_linear.QuantLinear` on the same integers and scales,
then a cast back to the model's dtype. Any other layer is left as it is and listed in the
returned report, so a caller can say plainly which layers have no fast path — nothing is
silently timed on a stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mosaicquant.kernels.quant_linear import QuantLinear
from mosaicquant.methods.qlinear import FakeQuantLinear, set_module

__all__ = ["KernelLinear", "KernelizeReport", "kernelize", "kernel_path_reason"]


class KernelLinear(nn.Module):
    """Online input transform + :class:`QuantLinear`, output in the input's dtype."""

    def __init__(self, quant: QuantLinear, input_transform: nn.Module | None):
        super().__init__()
        self.quant = quant
        self.input_transform = input_transform

    @property
    def in_features(self) -> int:
        return self.quant.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_transform is not None:
            x = self.input_transform(x)
        return self.quant(x).to(x.dtype)


@dataclass
class KernelizeReport:
    """Which layers run on the kernels and why the others do not."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def kernel_path_reason(layer: FakeQuantLinear) -> str | None:
    """``None`` when ``layer`` can run on the W4A4 kernels, else the reason it cannot."""
    act = layer.act
    if layer.packed is None:
        return f"weights are not in the packed 4-bit format (wbits={layer.wbits})"
    if layer.packed.group_size not in (None, layer.packed.shape[1]):
        return f"group-wise base scales (group_size={layer.packed.group_size})"
    if getattr(act, "bits", None) != 4 or not getattr(act, "symmetric", False) or getattr(act, "group_size", 1) is not None:
        return f"activations are not 4-bit symmetric per token ({act!r})"
    return None


def kernelize(model: nn.Module, *, kernel: str | None = None, fused: bool = True) -> KernelizeReport:
    """Replace every kernel-capable simulated linear of ``model`` in place.

    Args:
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"`` (see :func:`mosaicquant.kernels.resolve_kernel`).
        fused: residual fused into the GEMM (ZipperEngine) or the unfused pipeline.

    Returns:
        :class:`KernelizeReport` with the converted names and, for the rest, the reason.
    """
    report = KernelizeReport()
    for name, module in list(model.named_modules()):
        if not isinstance(module, FakeQuantLinear):
            continue
        reason = kernel_path_reason(module)
        if reason is not None:
            report.skipped[name] = reason
            continue
        device = module.weight.device
        quant = QuantLinear(module.packed.to(device), act_clip_ratio=module.act.clip_ratio, kernel=kernel,
                            fused=fused).to(device)
        set_module(model, name, KernelLinear(quant, module.input_transform))
        report.converted.append(name)
    return report
