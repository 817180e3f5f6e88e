"""Turn a simulated (fake-quant) model into its kernel-backed form.

Every :class:`~mosaicquant.methods.qlinear.FakeQuantLinear` that holds a packed 4-bit
weight (:class:`~mosaicquant.methods.format.PackedW4`, per-output-channel scales) and
quantizes its activations 4-bit, symmetric, per token, is replaced by a
:class:`KernelLinear`: the layer's online input transform (if any), then
:class:`~mosaicquant.kernels.quant_linear.QuantLinear` on the same integers, scales and
bias, then a cast back to the model's dtype. Layers in a mixed 4-bit + 8-bit format (Atom, ResQ)
become :class:`~mosaicquant.kernels.mixed_gemm.MixedQuantLinear`
(:func:`~mosaicquant.kernels.mixed_gemm.mixed_from_fake`). Any other layer is left as it is and listed in the
returned report, so a caller can say plainly which layers have no fast path — nothing is
silently timed on a stand-in.

Two execution changes that keep the layer's function:

- an :class:`~mosaicquant.methods.hadamard.OnlineHadamard` input transform runs fused with
  the activation quantizer (:mod:`mosaicquant.kernels.hadamard_quant`) on the Triton path,
  where that kernel takes the size and dtype;
- sibling projections that read the same input (``q_proj``/``k_proj``/``v_proj``,
  ``gate_proj``/``up_proj``; :data:`SHARED_INPUT_GROUPS`) run as one
  :class:`FusedProjections`: the input is quantized once and one GEMM covers the
  concatenated outputs, which each sibling's :class:`ProjectionSlice` returns as a view.
  Mixed-precision siblings fuse alike where they share the format, the channel order and the
  input transform (Atom's salient channels and ResQ's basis belong to the input, not the linear).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from mosaicquant.kernels._common import check_input_features, resolve_kernel
from mosaicquant.kernels.hadamard_quant import fused_hadamard_reason, hadamard_quantize_triton
from mosaicquant.kernels.mixed_gemm import MixedQuantLinear, MixedWeights, mixed_from_fake
from mosaicquant.kernels.quant_linear import QuantLinear
from mosaicquant.methods.format import PackedW4
from mosaicquant.methods.mixed import MixedActQuant
from mosaicquant.methods.qlinear import FakeQuantLinear, set_module

__all__ = [
    "KernelLinear",
    "FusedProjections",
    "ProjectionSlice",
    "KernelizeReport",
    "kernelize",
    "kernel_path_reason",
    "SHARED_INPUT_GROUPS",
]

#: sibling linears (attribute names under one parent) that Hugging Face decoder layers call on
#: the same input tensor
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _run_quant(quant: QuantLinear, x: torch.Tensor, transform: nn.Module | None, fuse_transform: bool) -> torch.Tensor:
    """``transform`` (if any), activation quantization and the GEMM; output in ``x``'s dtype.

    Raises:
        UserInputError: ``x`` is not ``[..., in_features]`` (checked before the transform, which would fail on it
            with a less telling error).
    """
    if isinstance(quant, MixedQuantLinear):  # its own input transform and quantizer
        return quant(x)
    check_input_features(x, quant.in_features)
    if transform is not None and fuse_transform:
        backend = resolve_kernel(quant.kernel, x.device)
        if backend == "triton" and fused_hadamard_reason(transform, x.dtype) is None:
            lead = x.shape[:-1]
            x2 = x.reshape(-1, quant.in_features).contiguous()
            if quant.uses_swapped(x2.shape[0], backend):
                a_split, a_scale = hadamard_quantize_triton(x2, transform, quant.act_clip_ratio, layout="split8")
                y = quant.forward_split8(a_split, a_scale)
            else:
                a_packed, a_scale = hadamard_quantize_triton(x2, transform, quant.act_clip_ratio)
                y = quant.forward_quantized(a_packed, a_scale, backend)
            return y.reshape(*lead, quant.out_features).to(x.dtype)
    if transform is not None:
        x = transform(x)
    return quant(x).to(x.dtype)


class KernelLinear(nn.Module):
    """Online input transform + :class:`QuantLinear`, output in the input's dtype.

    Args:
        quant: the kernel layer.
        input_transform: optional module applied to the input first.
        fuse_transform: run an :class:`~mosaicquant.methods.hadamard.OnlineHadamard` fused
            with the activation quantizer where the Triton kernel takes it (same function).
    """

    def __init__(self, quant: QuantLinear, input_transform: nn.Module | None, fuse_transform: bool = True):
        super().__init__()
        self.quant = quant
        self.input_transform = input_transform
        self.fuse_transform = bool(fuse_transform)

    @property
    def in_features(self) -> int:
        return self.quant.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_quant(self.quant, x, self.input_transform, self.fuse_transform)


class FusedProjections(nn.Module):
    """Linears that share an input, run as one :class:`QuantLinear` over their stacked outputs.

    Called through its :class:`ProjectionSlice` members: the first member called with an
    input runs the GEMM once and keeps the result until every member has taken its slice
    for that same input tensor; a member called with another tensor (or twice) recomputes.

    Args:
        quant: the stacked layer (``N = Σ N_i``): a :class:`QuantLinear`, or a :class:`MixedQuantLinear`
            (which runs its input transform itself: ``input_transform`` is then ``None``).
        names: member names, in stacking order.
        sizes: each member's ``N_i``.
        input_transform: the members' common input transform, if any.
        fuse_transform: as in :class:`KernelLinear`.
    """

    def __init__(self, quant: QuantLinear, names: list[str], sizes: list[int],
                 input_transform: nn.Module | None = None, fuse_transform: bool = True):
        super().__init__()
        if sum(sizes) != quant.out_features or len(names) != len(sizes):
            raise ValueError(f"member sizes {sizes} do not add up to the stacked layer's {quant.out_features}")
        self.quant = quant
        self.names = list(names)
        self.sizes = list(sizes)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.input_transform = input_transform
        self.fuse_transform = bool(fuse_transform)
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served: set[int] = set()

    def output_for(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member ``index``'s output ``[..., N_index]`` (a view of the stacked output)."""
        if self._input is not x or index in self._served:
            self._input, self._served = x, set()
            self._output = _run_quant(self.quant, x, self.input_transform, self.fuse_transform)
        out = self._output[..., self.offsets[index]:self.offsets[index] + self.sizes[index]]
        self._served.add(index)
        if len(self._served) == len(self.sizes):
            self._input = self._output = None
            self._served = set()
        return out

    def extra_repr(self) -> str:
        return f"members={self.names}, sizes={self.sizes}"


class ProjectionSlice(nn.Module):
    """One member of a :class:`FusedProjections` group, in place of the original linear."""

    def __init__(self, group: FusedProjections, index: int):
        super().__init__()
        # a plain attribute: the group is registered once, on the parent module
        object.__setattr__(self, "group", group)
        self.index = index
        self.in_features = group.quant.in_features
        self.out_features = group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output_for(x, self.index)

    def extra_repr(self) -> str:
        return f"{self.group.names[self.index]} of the fused group, out_features={self.out_features}"


@dataclass
class KernelizeReport:
    """Which layers run on the kernels and why the others do not."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    fused_groups: list[str] = field(default_factory=list)
    mixed: list[str] = field(default_factory=list)


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


def _packed_with_bias(layer: FakeQuantLinear) -> PackedW4:
    """``layer.packed`` carrying the bias the simulated layer adds.

    :func:`~mosaicquant.methods.qlinear.fake_quant_linear_from` (RTN, QuaRot, SmoothQuant) keeps the
    bias on the layer only, ``packed.bias`` ``None``: the kernel layer then takes ``layer.bias``, so it
    computes the simulated layer's function (Qwen2's q/k/v projections have biases).
    """
    packed = layer.packed
    if packed.bias is None and layer.bias is not None:
        packed = replace(packed, bias=layer.bias.detach(), meta=dict(packed.meta))
    return packed


def _fusable_group(parent: nn.Module, names: tuple[str, ...]) -> tuple[list[FakeQuantLinear], PackedW4] | None:
    """The members and their stacked weights, or ``None`` when the group cannot be stacked."""
    members = [getattr(parent, n, None) for n in names]
    if not all(isinstance(m, FakeQuantLinear) and kernel_path_reason(m) is None for m in members):
        return None
    first = members[0]
    if any(m.in_features != first.in_features or m.act.clip_ratio != first.act.clip_ratio
           or m.input_transform is not first.input_transform or m.weight.device != first.weight.device
           for m in members):
        return None
    device = first.weight.device
    try:
        return members, PackedW4.concat_outputs([_packed_with_bias(m).to(device) for m in members])
    except ValueError:
        return None


def _same_transform(a: nn.Module | None, b: nn.Module | None) -> bool:
    """Whether two online input transforms are one function: the same module, or modules of one type whose
    tensors (a basis, say) and settings are equal."""
    if a is b:
        return True
    if a is None or b is None or type(a) is not type(b):
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return (bool(sa) and sa.keys() == sb.keys() and a.extra_repr() == b.extra_repr()
            and all(torch.equal(sa[k], sb[k]) for k in sa))


def _same_act_quant(a, b) -> bool:
    """Whether two activation quantizers are the same function (channel split and grids)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, MixedActQuant):
        return (a.low == b.low and a.high == b.high and torch.equal(a.low_channels.cpu(), b.low_channels.cpu())
                and torch.equal(a.high_channels.cpu(), b.high_channels.cpu()))
    return a == b


def _fusable_mixed_group(parent: nn.Module, names: tuple[str, ...], kernel: str | None) -> MixedQuantLinear | None:
    """The members of a mixed-precision sibling group as one stacked :class:`MixedQuantLinear`, or ``None``
    when a member does not convert or the members differ in format, channel order, input transform or device."""
    members = [getattr(parent, n, None) for n in names]
    if not all(isinstance(m, FakeQuantLinear) and kernel_path_reason(m) is not None for m in members):
        return None
    first = members[0]
    if any(not _same_transform(m.input_transform, first.input_transform) or m.weight.device != first.weight.device
           or not _same_act_quant(m.act, first.act) for m in members):
        return None
    parts = [mixed_from_fake(m, kernel=kernel) for m in members]
    if not all(isinstance(p, MixedQuantLinear) for p in parts):
        return None
    head = parts[0]  # its input transform serves the group (the members' are equal)
    if any(p.fmt != head.fmt or (p.perm is None) != (head.perm is None)
           or (p.perm is not None and not torch.equal(p.perm, head.perm)) for p in parts):
        return None
    weights = MixedWeights(*(torch.cat([getattr(p.weights, f) for p in parts]) for f in MixedWeights._fields))
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else p.w_s_hi.new_zeros(p.out_features) for p in parts])
    return MixedQuantLinear(head.fmt, weights, head.perm, bias, head.input_transform, kernel=kernel)


def kernelize(
    model: nn.Module, *, kernel: str | None = None, fused: bool = True,
    fuse_projections: bool = True, fuse_transform: bool = True,
) -> KernelizeReport:
    """Replace every kernel-capable simulated linear of ``model`` in place.

    Args:
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"`` (see :func:`mosaicquant.kernels.resolve_kernel`).
        fused: residual fused into the GEMM (ZipperEngine) or the unfused pipeline.
        fuse_projections: run the members of each :data:`SHARED_INPUT_GROUPS` group as one
            :class:`FusedProjections` where all of them convert and can be stacked.
        fuse_transform: run online Hadamards fused with the activation quantizer.

    Returns:
        :class:`KernelizeReport` with the converted names, the fused groups and, for the rest,
        the reason.
    """
    report = KernelizeReport()
    if fuse_projections:
        for pname, parent in list(model.named_modules()):
            for names in SHARED_INPUT_GROUPS:
                found = _fusable_group(parent, names)
                mixed = None if found is not None else _fusable_mixed_group(parent, names, kernel)
                if found is None and mixed is None:
                    continue
                sizes = [getattr(parent, n).out_features for n in names]
                if mixed is not None:
                    group = FusedProjections(mixed, list(names), sizes)
                    report.mixed.extend(f"{pname}.{n}" if pname else n for n in names)
                else:
                    members, packed = found
                    device = members[0].weight.device
                    quant = QuantLinear(packed, act_clip_ratio=members[0].act.clip_ratio, kernel=kernel,
                                        fused=fused).to(device)
                    group = FusedProjections(quant, list(names), sizes, members[0].input_transform, fuse_transform)
                gname = "fused_" + "_".join(n.removesuffix("_proj") for n in names)
                parent.add_module(gname, group)
                for i, n in enumerate(names):
                    setattr(parent, n, ProjectionSlice(group, i))
                    report.converted.append(f"{pname}.{n}" if pname else n)
                report.fused_groups.append(f"{pname}.{gname}" if pname else gname)
    for name, module in list(model.named_modules()):
        if not isinstance(module, FakeQuantLinear):
            continue
        reason = kernel_path_reason(module)
        if reason is not None:
            # mixed 4-bit + 8-bit formats (Atom's INT8 outlier channels, ResQ's 8-bit subspace) and
            # asymmetric 4-bit activations (SpinQuant, ResQ's down_proj)
            mixed = mixed_from_fake(module, kernel=kernel)
            if isinstance(mixed, str):
                report.skipped[name] = f"{reason}; mixed 4/8-bit kernels: {mixed}"
            else:
                set_module(model, name, mixed)
                report.converted.append(name)
                report.mixed.append(name)
            continue
        device = module.weight.device
        quant = QuantLinear(_packed_with_bias(module).to(device), act_clip_ratio=module.act.clip_ratio, kernel=kernel,
                            fused=fused).to(device)
        set_module(model, name, KernelLinear(quant, module.input_transform, fuse_transform))
        report.converted.append(name)
    return report
