"""Effective bits of a quantized model, read from its modules and the tensors they store.

Methods are compared at equal cost only when the cost is measured the same way for all of
them, so the numbers here come from the quantized model object, never from a method's name
or options. :func:`model_bits` walks the model's modules and, per linear layer (every
``nn.Linear`` but the output head, which every method keeps in 16 bits), counts:

**Weights** (bits per weight element, stored format):

- packed 4-bit layers (:class:`~mosaicquant.methods.format.PackedW4`): the bytes of the
  packed values, of the FP16 scales and of the sparse residual (its packed values, per-row FP16
  scales, ``int32`` block coordinates and row pointer), as stored;
- mixed-precision layers (``weight_segments``: Atom's groups and outlier columns, ResQ's low and
  high subspaces): each segment's integers at its bit width, one 16-bit scale (and zero point,
  if asymmetric) per row of a segment;
- other simulated layers: ``wbits`` per weight and one 16-bit scale per row and group (and a
  16-bit zero point where the grid is asymmetric);
- kernel-backed layers (``weight_nbytes()``): the bytes of the format they store (the
  execution-only copies a layer may keep beside it, ``exec_operands``, are not format);
- torchao layers (a weight tensor subclass): the bytes of every inner tensor the subclass
  flattens to (``__tensor_flatten__``: values, scales, zero points);
- ModelOpt layers (``weight_quantizer``): the quantizer's value bits (an ``(E, M)`` float
  format counts ``1 + E + M``), one 16-bit scale per calibrated ``amax`` element;
- unquantized linears: 16 bits (the BF16/FP16 deployment the float reference stands for,
  whatever dtype a CPU simulation runs in).

**Activations** (bits per element of a linear's input): the integer width of each input channel,
so outlier channels kept at 8 or 16 bits raise the mean (Atom with ``h`` outlier channels at 8
bits of ``K`` gives ``4 + 4·h/K``). The scales (and zero points) that the activation quantizer
computes at run time per token or group are counted apart (``activation_scales``: one 16-bit
scale per token and group over the group's channels), since nothing of them is stored. Unquantized
inputs count 16.

**KV cache** (bits per cached K or V element): the installed
:class:`~mosaicquant.methods.kvcache.KVQuantSpec` of each attention module: its bit width plus a
16-bit scale (and zero point, if asymmetric) per group of ``group_size`` channels, or per head
(``head_dim`` channels) and token; 16 where the cache is not quantized.

Model means: weights are averaged over all weight elements of the counted linears, activations
over their input elements (each linear weighted by its input width ``K``; linears that share an
input count once each), the KV cache over attention modules.

What is not counted: the 16-bit embeddings, norms and output head (the same for every method);
the parameters of online input transforms (a Hadamard transform stores nothing; ResQ's
per-linear basis matrices are the simulation's stand-in for bases the paper folds into the
weights). A layer in a format this module does not know raises :class:`UnknownFormat`
naming it, rather than a guess.

Example:
    >>> bits = model_bits(model)                      # doctest: +SKIP
    >>> bits.metrics()["bits/weight"]                 # doctest: +SKIP
    4.125
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mosaicquant.methods.format import parse_block_shape
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear

__all__ = [
    "SCALE_BITS",
    "FLOAT_BITS",
    "UnknownFormat",
    "LinearBits",
    "ModelBits",
    "model_bits",
    "linear_bits",
    "activation_bits",
    "kv_bits",
    "mosaicquant_weight_bits",
    "budget_for_weight_bits",
]

#: bits of a scale or zero point where a format keeps no tensor of its own dtype (FP16 storage)
SCALE_BITS = 16
#: bits of an unquantized weight, activation or cache element (BF16 / FP16)
FLOAT_BITS = 16
#: bits of the int32 coordinates and row pointer of the residual format
INDEX_BITS = 32


class UnknownFormat(ValueError):
    """A quantized layer whose stored format the bits accounting does not know."""


@dataclass(frozen=True)
class LinearBits:
    """Bits of one linear layer.

    Attributes:
        name: the layer's qualified name.
        n / k: output and input features.
        weight_values: total bits of the weight's integer (or float) values, high-precision
            segments included.
        weight_scales: total bits of the weight's scales and zero points.
        weight_residual: total bits of a sparse residual (values, scales, indices); 0 without.
        act_values: bits per input element (mean over the ``k`` channels).
        act_scales: bits per input element of the run-time activation scales and zero points.
    """

    name: str
    n: int
    k: int
    weight_values: float
    weight_scales: float
    weight_residual: float
    act_values: float
    act_scales: float

    @property
    def weight_bits(self) -> float:
        """Bits per weight element, everything stored included."""
        return (self.weight_values + self.weight_scales + self.weight_residual) / (self.n * self.k)


@dataclass(frozen=True)
class ModelBits:
    """Per-layer bits of a model and their means (see the module docstring).

    Attributes:
        linears: one :class:`LinearBits` per counted linear.
        kv_values: bits per K/V element of the cache's values, or ``None`` (no attention module
            found).
        kv_scales: bits per K/V element of the cache's scales and zero points, or ``None``.
    """

    linears: list[LinearBits]
    kv_values: float | None
    kv_scales: float | None

    def metrics(self) -> dict[str, float]:
        """The record's metrics group: ``bits/weight`` (with its parts ``bits/weight_values``,
        ``bits/weight_scales``, ``bits/weight_residual``), ``bits/activation`` (and
        ``bits/activation_scales``), ``bits/kv`` (scales included; with ``bits/kv_values``).
        Empty for a model with no linear layer."""
        if not self.linears:
            return {}
        weights = sum(lb.n * lb.k for lb in self.linears)
        inputs = sum(lb.k for lb in self.linears)
        out = {
            "bits/weight": sum(lb.weight_values + lb.weight_scales + lb.weight_residual
                               for lb in self.linears) / weights,
            "bits/weight_values": sum(lb.weight_values for lb in self.linears) / weights,
            "bits/weight_scales": sum(lb.weight_scales for lb in self.linears) / weights,
            "bits/weight_residual": sum(lb.weight_residual for lb in self.linears) / weights,
            "bits/activation": sum(lb.k * lb.act_values for lb in self.linears) / inputs,
            "bits/activation_scales": sum(lb.k * lb.act_scales for lb in self.linears) / inputs,
        }
        if self.kv_values is not None:
            out["bits/kv"] = self.kv_values + self.kv_scales
            out["bits/kv_values"] = self.kv_values
        return out


def _scale_share(width: int, group_size: int | None, symmetric: bool) -> float:
    """Bits per element of one 16-bit scale (and zero point) per group of ``group_size`` of ``width`` channels."""
    if width == 0:
        return 0.0
    groups = 1 if group_size is None else math.ceil(width / group_size)
    return groups * SCALE_BITS * (1 if symmetric else 2) / width


def activation_bits(act, k: int) -> tuple[float, float]:
    """Bits per input element of an activation quantizer over ``k`` channels: ``(values, scales)``.

    Args:
        act: an :class:`~mosaicquant.methods.qlinear.ActQuantSpec`, or a quantizer that says its
            own cost through ``effective_bits(k) -> (values, scales)`` (e.g. Atom's and ResQ's
            mixed-precision quantizer).
        k: the input width.

    Raises:
        UnknownFormat: a quantizer of another kind.
    """
    if isinstance(act, ActQuantSpec):
        if not act.enabled:
            return float(FLOAT_BITS), 0.0
        return float(act.bits), _scale_share(k, act.group_size, act.symmetric)
    if hasattr(act, "effective_bits"):
        values, scales = act.effective_bits(k)
        return float(values), float(scales)
    raise UnknownFormat(f"activation quantizer {type(act).__name__} does not say its bits "
                        "(an ActQuantSpec, or a module with effective_bits(k))")


def _tensor_bits(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() * 8


def _fake_quant_weight(layer: FakeQuantLinear) -> tuple[float, float, float]:
    n, k = layer.weight.shape
    if layer.packed is not None:
        parts = layer.packed.nbytes()
        residual = parts["residual_values"] + parts["residual_scales"] + parts["residual_indices"]
        return 8.0 * parts["base_values"], 8.0 * parts["base_scales"], 8.0 * residual
    segments = getattr(layer, "weight_segments", None)
    if segments:
        values = scales = 0.0
        for _, qt in segments:
            values += qt.q.numel() * qt.bits
            scales += qt.scale.numel() * SCALE_BITS * (1 if qt.zero is None else 2)
        return values, scales, 0.0
    wbits = layer.wbits
    if wbits >= FLOAT_BITS:
        return float(FLOAT_BITS * n * k), 0.0, 0.0
    if float(wbits) != int(wbits):
        raise UnknownFormat(f"a simulated layer with a mean of {wbits} bits per weight and no weight_segments: "
                            "its segments are not known")
    groups = int(getattr(layer, "weight_groups", 1))
    zeros = bool(getattr(layer, "weight_zero_points", False))
    return float(wbits * n * k), float(n * groups * SCALE_BITS * (2 if zeros else 1)), 0.0


def _num_bits(num_bits) -> int:
    """Bits of a ModelOpt ``num_bits``: an integer width, or ``(E, M)`` of a float format (sign included)."""
    if isinstance(num_bits, (tuple, list)):
        return 1 + int(num_bits[0]) + int(num_bits[1])
    return int(num_bits)


def _modelopt_quantizers(quantizer) -> list:
    subs = list(quantizer) if hasattr(quantizer, "__iter__") and not hasattr(quantizer, "num_bits") else [quantizer]
    return [q for q in subs if getattr(q, "is_enabled", False)]


def _modelopt_bits(name: str, module: nn.Module) -> LinearBits:
    n, k = module.weight.shape
    enabled = _modelopt_quantizers(module.weight_quantizer)
    if enabled:
        values = float(_num_bits(enabled[0].num_bits) * n * k)
        scales = float(sum(q.amax.numel() * SCALE_BITS for q in enabled if getattr(q, "amax", None) is not None))
    else:
        values, scales = float(FLOAT_BITS * n * k), 0.0
    inputs = _modelopt_quantizers(getattr(module, "input_quantizer", None)) if hasattr(module, "input_quantizer") else []
    act = float(_num_bits(inputs[0].num_bits)) if inputs else float(FLOAT_BITS)
    # ModelOpt's activation scales are static (calibrated per tensor): nothing per token or group
    return LinearBits(name, n, k, values, scales, 0.0, act, 0.0)


def _torchao_bits(name: str, module: nn.Module) -> LinearBits:
    weight = module.weight
    n, k = weight.shape
    inner, meta = weight.__tensor_flatten__()
    values = scales = 0.0
    for attr in inner:
        t = getattr(weight, attr)
        if t is None:
            continue
        if t.numel() * 4 >= n * k:  # the values (packed or not); the rest are scales and zero points
            values += _tensor_bits(t)
        else:
            scales += _tensor_bits(t)
    act_kwargs = (meta or {}).get("act_quant_kwargs") if isinstance(meta, dict) else None
    act_kwargs = act_kwargs if act_kwargs is not None else getattr(weight, "act_quant_kwargs", None)
    if act_kwargs is None:
        return LinearBits(name, n, k, values, scales, 0.0, float(FLOAT_BITS), 0.0)
    found = re.search(r"(?:Int|Float)(\d+)", type(act_kwargs).__name__)
    if found is None:
        raise UnknownFormat(f"{name}: torchao activation quantization {type(act_kwargs).__name__} has no bit "
                            "width in its name")
    # dynamic per-token scales (torchao's int8 dynamic recipe); a zero point is kept only if asymmetric
    symmetric = "SYMMETRIC" in str(getattr(act_kwargs, "mapping_type", "SYMMETRIC")).upper()
    return LinearBits(name, n, k, values, scales, 0.0, float(found.group(1)), _scale_share(k, None, symmetric))


def _kernel_bits(name: str, module: nn.Module) -> LinearBits:
    n, k = module.shape
    parts = module.weight_nbytes()
    residual = parts.get("residual_values", 0) + parts.get("residual_scales", 0) + parts.get("residual_indices", 0)
    fmt = getattr(module, "fmt", None)
    if fmt is not None and hasattr(fmt, "lo_bits"):  # mixed 4/8-bit layer: k_hi channels at hi_bits
        k_hi = int(fmt.k_hi)
        act = (fmt.lo_bits * (k - k_hi) + fmt.hi_bits * k_hi) / k
        scales = ((k - k_hi) * _scale_share(k - k_hi, fmt.group_size, fmt.lo_symmetric)
                  + k_hi * _scale_share(k_hi, None, getattr(fmt, "hi_symmetric", True))) / k
    elif hasattr(module, "act_clip_ratio"):  # the W4A4 kernels: 4-bit symmetric per token
        act, scales = 4.0, _scale_share(k, None, True)
    else:
        raise UnknownFormat(f"{name}: kernel layer {type(module).__name__} does not say its activation format")
    return LinearBits(name, n, k, 8.0 * parts.get("base_values", 0), 8.0 * parts.get("base_scales", 0),
                      8.0 * residual, float(act), float(scales))


def linear_bits(name: str, module: nn.Module) -> LinearBits | None:
    """Bits of one module if it is a linear layer of a known format, ``None`` if it is not a linear.

    Raises:
        UnknownFormat: a quantized linear in a format not known here.
    """
    if isinstance(module, FakeQuantLinear):
        n, k = module.weight.shape
        values, scales, residual = _fake_quant_weight(module)
        act, act_scales = activation_bits(module.act, k)
        return LinearBits(name, n, k, values, scales, residual, act, act_scales)
    if hasattr(module, "weight_nbytes") and hasattr(module, "shape"):
        return _kernel_bits(name, module)
    if isinstance(module, nn.Linear):
        if hasattr(module, "weight_quantizer"):
            return _modelopt_bits(name, module)
        if type(module.weight).__module__.startswith("torchao.") and hasattr(module.weight, "__tensor_flatten__"):
            return _torchao_bits(name, module)
        if type(module.weight) not in (torch.Tensor, nn.Parameter):
            raise UnknownFormat(f"{name}: weight of type {type(module.weight).__name__} is a format the bits "
                                "accounting does not know")
        n, k = module.weight.shape
        return LinearBits(name, n, k, float(FLOAT_BITS * n * k), 0.0, 0.0, float(FLOAT_BITS), 0.0)
    return None


def kv_bits(model: nn.Module) -> tuple[float, float] | None:
    """Bits per cached K/V element, ``(values, scales)``, averaged over attention modules, or ``None``.

    Attention modules are those with a ``head_dim``; each carries the installed
    :class:`~mosaicquant.methods.kvcache.KVQuantSpec` as ``kv_quant_spec`` (absent or 16 bits:
    an unquantized cache).
    """
    per_module = []
    for module in model.modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or isinstance(head_dim, bool):
            continue
        spec = getattr(module, "kv_quant_spec", None)
        if spec is None or not spec.enabled:
            per_module.append((float(FLOAT_BITS), 0.0))
        else:
            per_module.append((float(spec.bits), _scale_share(head_dim, spec.group_size, spec.symmetric)))
    if not per_module:
        return None
    return (sum(v for v, _ in per_module) / len(per_module), sum(s for _, s in per_module) / len(per_module))


def _skipped_heads(model: nn.Module) -> set[int]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {id(head)} if head is not None else set()


def model_bits(model: nn.Module) -> ModelBits:
    """Walk ``model`` and count its linears' and KV cache's bits (see the module docstring).

    Raises:
        UnknownFormat: a quantized layer in a format not known here (the message names it).
    """
    heads = _skipped_heads(model)
    linears = []
    inside_counted: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in heads or id(module) in inside_counted:
            continue
        lb = linear_bits(name, module)
        if lb is not None:
            linears.append(lb)
            # a counted layer's own submodules (a kernel layer's wrapped linear) are not counted again
            inside_counted.update(id(m) for m in module.modules() if m is not module)
    kv = kv_bits(model)
    return ModelBits(linears, None if kv is None else kv[0], None if kv is None else kv[1])


def mosaicquant_weight_bits(shapes: Iterable[tuple[int, int]], budget: float, block: int | str = "128",
                            group_size: int | None = None) -> float:
    """Bits per weight of MosaicQuant's packed format at a residual budget, from the layers' shapes.

    The same count :func:`model_bits` makes of a quantized model, when every layer keeps the
    budget's ``floor(ρ · blocks + 0.5)`` blocks (the Hessian fit may keep fewer where no block
    lowers the distortion; the record then says what was kept). Per layer ``[N, K]`` in blocks of
    ``Bn × Bk`` (edge blocks stored at full size):

    ``N·ceil(K/2)·8 + N·G·16`` (base values, FP16 scales; ``G`` groups per row)
    ``+ m·(Bn·Bk/2·8 + Bn·16 + 2·32) + (block rows + 1)·32`` (``m`` kept blocks: values, per-row FP16
    scales, coordinates; the row pointer, stored at every budget, 0 included).

    Args:
        shapes: ``(N, K)`` of every quantized linear.
        budget: the fraction of blocks kept per layer, [0, 1].
        block: the residual block shape (``"128"``, ``"64x128"``).
        group_size: the base's scale group along K, or ``None`` (per output channel).

    Returns:
        Bits per weight over all the layers.

    Raises:
        ValueError: an empty ``shapes`` or a budget outside [0, 1].
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 <= float(budget) <= 1.0:
        raise ValueError(f"budget={budget!r} is out of range: allowed a fraction of blocks in [0, 1]")
    bn, bk = parse_block_shape(block)
    total = weights = 0
    for n, k in shapes:
        groups = 1 if group_size is None else math.ceil(k / group_size)
        rows, cols = -(-n // bn), -(-k // bk)
        kept = int(math.floor(float(budget) * rows * cols + 0.5))
        total += n * ((k + 1) // 2) * 8 + n * groups * SCALE_BITS
        total += kept * (bn * bk // 2 * 8 + bn * SCALE_BITS + 2 * INDEX_BITS) + (rows + 1) * INDEX_BITS
        weights += n * k
    if weights == 0:
        raise ValueError("shapes is empty: give the (N, K) of at least one linear layer")
    return total / weights


def budget_for_weight_bits(target: float, shapes: Sequence[tuple[int, int]], block: int | str = "128",
                           group_size: int | None = None, resolution: float = 1e-4) -> float:
    """The residual budget whose MosaicQuant bits per weight come nearest ``target``.

    :func:`mosaicquant_weight_bits` grows with the budget in steps (whole blocks per layer); the
    budget is searched on a grid of ``resolution``; of the budgets that keep the nearest block
    counts (the smaller count on a tie), the middle one is returned, away from the rounding edges
    where a layer gains or loses a block.

    Args:
        target: bits per weight to match, e.g. a ResQ record's ``bits/weight``.
        shapes, block, group_size: as :func:`mosaicquant_weight_bits`.
        resolution: the budget grid step, (0, 0.1].

    Returns:
        A budget in [0, 1], rounded to the grid.

    Raises:
        ValueError: a non-finite target or a resolution out of range.

    Example:
        >>> budget_for_weight_bits(4.5, [(128, 1024)] * 4)
        0.1249
    """
    if not isinstance(target, (int, float)) or not math.isfinite(target):
        raise ValueError(f"target={target!r} must be a finite number of bits per weight")
    if not 0.0 < resolution <= 0.1:
        raise ValueError(f"resolution={resolution!r} is out of range: allowed (0, 0.1]")
    steps = int(round(1.0 / resolution))
    shapes = list(shapes)

    def bits_at(i: int) -> float:
        return mosaicquant_weight_bits(shapes, i / steps, block, group_size)

    def first_at_or_above(value: float) -> int:
        # the bits are non-decreasing in the budget: bisect on the grid
        lo, hi = 0, steps + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if bits_at(mid) < value:
                lo = mid + 1
            else:
                hi = mid
        return lo

    above = first_at_or_above(target)
    candidates = [i for i in (above - 1, above) if 0 <= i <= steps]
    best = min(candidates, key=lambda i: (abs(bits_at(i) - target), i))
    # the middle of the budgets that keep the same blocks, away from the rounding edges of every layer
    value = bits_at(best)
    first = first_at_or_above(value)
    last = first_at_or_above(math.nextafter(value, math.inf)) - 1
    # the ends stay the ends: no residual is budget 0 (not a budget that keeps none), every block is budget 1
    best = 0 if first == 0 else steps if last == steps else (first + last) // 2
    best_value = best / steps
    return round(best_value, 10)
