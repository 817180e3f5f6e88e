"""The simulated (fake-quant) linear layer and the model surgery that installs it.

:class:`FakeQuantLinear` computes ``y = Qa(T(x)) · Ŵᵀ + b`` where ``T`` is an optional
online input transform (e.g. the Hadamard on the down_proj input, see
:func:`mosaicquant.methods.rotation.attach_input_transform`), ``Qa`` quantizes the
activations (per token or per group, symmetric or asymmetric, with a clip ratio) and
``Ŵ`` is the already-dequantized weight. When the weight came from the packed 4-bit
format, the layer keeps the :class:`~mosaicquant.methods.format.PackedW4` so that memory
accounting and the kernel-backed layer read the very same integers and scales.

Layers are chosen by module type (``nn.Linear``) and fully-qualified name; the model's
output head (``get_output_embeddings()``) is left in 16 bits, as every baseline does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mosaicquant import progress
from mosaicquant.methods.format import PackedW4
from mosaicquant.methods.quant import check_bits, fake_quantize, quantize, quantize_with_clip_search

__all__ = [
    "ActQuantSpec",
    "FakeQuantLinear",
    "quantizable_linears",
    "output_head_name",
    "set_module",
    "replace_linears",
    "weight_memory",
]


@dataclass(frozen=True)
class ActQuantSpec:
    """How a layer quantizes its input activations.

    Attributes:
        bits: 2..8, or 16 for no activation quantization.
        symmetric: symmetric grid (True) or asymmetric with a zero point.
        group_size: ``None`` = per token; ``g`` = per group of ``g`` channels of a token.
        clip_ratio: fraction of each token's range kept, in (0, 1].
    """

    bits: int = 16
    symmetric: bool = True
    group_size: int | None = None
    clip_ratio: float = 1.0

    def __post_init__(self):
        if self.bits != 16:
            check_bits(self.bits, "abits")
        if not 0.0 < self.clip_ratio <= 1.0:
            raise ValueError(f"clip_ratio={self.clip_ratio!r} is out of range: allowed (0, 1]")

    @property
    def enabled(self) -> bool:
        return self.bits < 16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        return fake_quantize(
            x, self.bits, symmetric=self.symmetric, group_size=self.group_size, clip_ratio=self.clip_ratio
        )


class FakeQuantLinear(nn.Module):
    """Simulated quantized linear: ``Qa(T(x)) @ Ŵᵀ + b``.

    Args:
        weight: the dequantized weight ``[N, K]`` (or the float weight for W16).
        bias: optional ``[N]``.
        act: activation quantizer.
        input_transform: optional module applied to the input before ``act``.
        packed: the packed 4-bit weight this layer simulates, if any.
        wbits: weight bits recorded for reports (16 = unquantized).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        act: ActQuantSpec,
        input_transform: nn.Module | None = None,
        packed: PackedW4 | None = None,
        wbits: int = 16,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.act = act
        self.input_transform = input_transform
        self.packed = packed
        self.wbits = wbits
        #: round the output through this dtype (e.g. ``torch.bfloat16``) to emulate a kernel
        #: that writes BF16; ``None`` (default) keeps the float output
        self.output_rounding: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_transform is not None:
            x = self.input_transform(x)
        x = self.act(x)
        y = F.linear(x, self.weight, self.bias)
        if self.output_rounding is not None:
            y = y.to(self.output_rounding).to(x.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, wbits={self.wbits}, "
                f"abits={self.act.bits}, transform={type(self.input_transform).__name__ if self.input_transform is not None else None}")


def quantizable_linears(model: nn.Module, skip_output_head: bool = True) -> Iterator[tuple[str, nn.Linear]]:
    """Yield ``(qualified_name, module)`` for every ``nn.Linear`` except the output head."""
    head = model.get_output_embeddings() if skip_output_head and hasattr(model, "get_output_embeddings") else None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            yield name, module


def output_head_name(model: nn.Module) -> str | None:
    """Fully-qualified name of the module ``model.get_output_embeddings()`` returns, if any."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        return None
    return next((name for name, module in model.named_modules() if module is head), None)


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at the dotted path ``name``."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def replace_linears(
    model: nn.Module,
    make: Callable[[str, nn.Linear], nn.Module],
    names: list[str] | None = None,
) -> list[str]:
    """Replace the chosen linears by ``make(name, linear)``; returns the names replaced.

    The online input transform a linear carries (attribute ``input_transform``) must be
    taken over by the new module; ``make`` receives the original to read it from. Each
    original is let go once replaced, so a model whose new modules hold a 16-bit weight of
    their own (a fake-quant weight) never holds both copies of every layer: kept to the end,
    Qwen3-32B-shapes' originals (62 GB in BF16) ran the H200 out of memory.
    """
    chosen = dict(quantizable_linears(model))
    if names is not None:
        missing = [n for n in names if n not in chosen]
        if missing:
            raise ValueError(f"not quantizable linears of this model: {missing}")
        chosen = {n: chosen[n] for n in names}
    replaced = list(chosen)
    for name in progress.bar(replaced, desc="quantize", unit="linear"):
        set_module(model, name, make(name, chosen.pop(name)))
    return replaced


def weight_memory(model: nn.Module) -> dict[str, int]:
    """Bytes of the quantized linears' weights by part, and of the 16-bit layers left.

    Packed layers (simulated or kernel-backed) count their base values, base scales, residual values, residual
    scales and indices; kernel-backed ones also the operands their kernels keep beside the format
    (``exec_operands``: the merged walk's int8 blocks and step tables); unpacked quantized layers count ``wbits`` per weight plus one
    FP16 scale per row and group; unquantized linears count 2 bytes per weight (BF16).
    """
    out = {"base_values": 0, "base_scales": 0, "residual_values": 0, "residual_scales": 0,
           "residual_indices": 0, "exec_operands": 0, "linear_bf16_equivalent": 0}
    for module in model.modules():
        if hasattr(module, "weight_nbytes"):  # a kernel-backed layer (mosaicquant.kernels.convert)
            n, k = module.shape
            out["linear_bf16_equivalent"] += 2 * n * k
            for key, value in module.weight_nbytes().items():
                out[key] += value
        elif isinstance(module, FakeQuantLinear):
            n, k = module.weight.shape
            out["linear_bf16_equivalent"] += 2 * n * k
            if module.packed is not None:
                for key, value in module.packed.nbytes().items():
                    out[key] += value
            elif module.wbits < 16:
                out["base_values"] += (n * k * module.wbits + 7) // 8
                out["base_scales"] += 2 * n * getattr(module, "weight_groups", 1)
            else:
                out["base_values"] += 2 * n * k
    out["total_quantized_linears"] = sum(v for k, v in out.items() if k != "linear_bf16_equivalent")
    return out


def input_transform_of(linear: nn.Module) -> nn.Module | None:
    """The online input transform a linear carries, if any."""
    return getattr(linear, "input_transform", None)


def quantize_weight(
    weight: torch.Tensor,
    bits: int,
    *,
    symmetric: bool = True,
    group_size: int | None = None,
    clip_search: bool = True,
):
    """Round-to-nearest weight quantization; returns the :class:`Quantized` weight.

    4-bit symmetric weights get FP16-rounded scales (the packed format's storage type).
    """

    scale_dtype = torch.float16 if bits == 4 and symmetric else None
    if clip_search:
        return quantize_with_clip_search(weight, bits, symmetric=symmetric, group_size=group_size,
                                         scale_dtype=scale_dtype)
    return quantize(weight, bits, symmetric=symmetric, group_size=group_size, scale_dtype=scale_dtype)


def fake_quant_linear_from(
    linear: nn.Linear,
    qweight,
    act: ActQuantSpec,
    wbits: int,
) -> FakeQuantLinear:
    """Build the simulated layer for ``linear`` from its quantized weight (or ``None`` for W16).

    4-bit symmetric weights are packed (:class:`PackedW4`) and the layer multiplies the
    packed weight's dequantization, so the simulated and kernel-backed layers share it.
    """
    dtype = linear.weight.dtype
    packed = None
    if qweight is None:
        weight = linear.weight.data
    elif qweight.bits == 4 and qweight.zero is None:
        packed = PackedW4.from_quantized(qweight)
        weight = packed.dequantize(dtype)
    else:
        weight = qweight.dequantize(dtype)
    layer = FakeQuantLinear(weight, linear.bias, act, input_transform_of(linear), packed, wbits)
    if qweight is not None:
        layer.weight_groups = int(qweight.scale.shape[-1])
        layer.weight_zero_points = qweight.zero is not None  # asymmetric grids store a zero point per scale
    return layer.to(linear.weight.device)
