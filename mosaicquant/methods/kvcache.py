"""KV-cache quantization in simulation: one option every method can turn on.

A :class:`KVQuantSpec` says how keys and values are stored; :func:`enable_kv_quant` installs
it in a ``transformers`` 5.x causal LM (Llama, Qwen2, Qwen3 families) through the library's
own attention-function registry (``transformers.AttentionInterface``), with no patching of
torch or transformers code:

- two attention functions are registered once, under :data:`KV_ATTENTION_NAMES`
  (``"mosaicquant_kv_sdpa"``, ``"mosaicquant_kv_eager"``), each with the attention-mask
  builder of the implementation it wraps (``AttentionMaskInterface``), so masks are exactly
  the ones sdpa / eager attention get;
- the model (and every sub-config, through ``set_attn_implementation``) is switched to the
  wrapper of its current implementation (sdpa or eager); each attention module carries its
  spec as the attribute ``kv_quant_spec``.

The wrapper receives ``(module, query, key, value, attention_mask, **kwargs)`` with RoPE
already applied, and computes, per attention module:

1. ``rotate_qk``: ``Q ← Q H``, ``K ← K H`` with ``H = H_d / √d`` the orthonormal Hadamard
   matrix of the head dimension ``d`` (QuaRot's online Q/K rotation). Function-preserving:
   ``(Q H)(K H)ᵀ = Q Kᵀ``; it spreads the outlier channels RoPE leaves in the keys, so the
   4-bit key grid loses less.
2. ``K ← fake_quantize(K)``, ``V ← fake_quantize(V)`` along the head dimension: one group per
   (token, head) when ``group_size`` is ``None``, else groups of ``group_size`` channels of
   a head; symmetric or asymmetric, with ``clip_ratio`` — the conventions of
   :func:`mosaicquant.methods.quant.fake_quantize`. With ``rotate_v`` the values are quantized
   in the head dimension's Hadamard basis, ``V ← fake_quantize(V H) Hᵀ``: the cache holds ``V H``
   and the ``Hᵀ``, applied after the attention product, is the per-head rotation QuaRot folds
   into o_proj's input (the simulation applies it to the dequantized values, the same function).
3. The wrapped sdpa / eager attention on the transformed tensors.

Simulation notes: the attention function runs after the cache update, so a ``Cache`` keeps
float keys and values and every step re-quantizes them; quantization is per token, so a
token's quantized K/V are the same at every step — the function equals a cache that stores
the integers (memory savings are not simulated). When autograd is recording and the
inputs require gradients (rotation training), the quantizer is
:func:`fake_quantize_ste`: the same forward values, straight-through gradients.

Example:
    >>> info = enable_kv_quant(model, KVQuantSpec(bits=4, symmetric=False,
    ...                                           clip_ratio=0.95, rotate_qk=True))  # doctest: +SKIP
    >>> info["kv_bits"]                                                              # doctest: +SKIP
    4
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from mosaicquant.errors import UserInputError
from mosaicquant.methods.calibration import decoder_layers
from mosaicquant.methods.hadamard import apply_hadamard, is_hadamard_size
from mosaicquant.methods.quant import MAX_BITS, MIN_BITS, fake_quantize

__all__ = [
    "KVQuantSpec",
    "KV_ATTENTION_NAMES",
    "enable_kv_quant",
    "disable_kv_quant",
    "kv_quant_spec_of",
    "register_attention",
    "quantize_qkv",
    "fake_quantize_ste",
]

#: attention implementation wrapped -> name of the quantizing wrapper in transformers' registry
KV_ATTENTION_NAMES = {"sdpa": "mosaicquant_kv_sdpa", "eager": "mosaicquant_kv_eager"}
_SPEC_ATTR = "kv_quant_spec"


@dataclass(frozen=True)
class KVQuantSpec:
    """How the KV cache is quantized (simulated).

    Attributes:
        bits: 16 = off (keys and values stay float); else 2..8.
        group_size: ``None`` = one group per head per token; ``g`` = groups of ``g`` channels
            of the head dimension (must divide it).
        symmetric: signed symmetric grid (True) or asymmetric with a zero point.
        clip_ratio: fraction of each group's range kept, in (0, 1].
        rotate_qk: online Hadamard over the head dimension on Q and K after RoPE, before K
            is quantized (function-preserving; applied even when ``bits`` is 16).
        rotate_v: quantize V in the head dimension's Hadamard basis (see the module docstring);
            no change when ``bits`` is 16.

    Raises:
        ValueError: a field out of range (names the value and the allowed set).
    """

    bits: int = 16
    group_size: int | None = None
    symmetric: bool = True
    clip_ratio: float = 1.0
    rotate_qk: bool = False
    rotate_v: bool = False

    def __post_init__(self):
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not (
            self.bits == 16 or MIN_BITS <= self.bits <= MAX_BITS
        ):
            raise ValueError(f"kv bits={self.bits!r} is out of range: allowed {MIN_BITS}..{MAX_BITS} or 16 (off)")
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1
        ):
            raise ValueError(f"kv group_size={self.group_size!r} is not allowed: None or a positive integer")
        for name in ("symmetric", "rotate_qk", "rotate_v"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kv {name}={getattr(self, name)!r} must be True or False")
        if isinstance(self.clip_ratio, bool) or not isinstance(self.clip_ratio, (int, float)) or not (
            0.0 < self.clip_ratio <= 1.0
        ):
            raise ValueError(f"kv clip_ratio={self.clip_ratio!r} is out of range: allowed (0, 1]")

    @property
    def enabled(self) -> bool:
        """Whether K/V are quantized."""
        return self.bits < 16

    @property
    def active(self) -> bool:
        """Whether the spec changes anything in the attention computation."""
        return self.enabled or self.rotate_qk

    def to_dict(self) -> dict:
        """JSON-serialisable fields."""
        return dataclasses.asdict(self)


def fake_quantize_ste(
    x: torch.Tensor,
    bits: int,
    *,
    symmetric: bool = True,
    group_size: int | None = None,
    clip_ratio: float = 1.0,
) -> torch.Tensor:
    """:func:`~mosaicquant.methods.quant.fake_quantize` with straight-through gradients.

    Same forward values bit for bit (it is the shared quantizer with ``ste=True``).
    """
    return fake_quantize(x, bits, symmetric=symmetric, group_size=group_size, clip_ratio=clip_ratio, ste=True)


def _fake_quant(x: torch.Tensor, spec: KVQuantSpec) -> torch.Tensor:
    quantizer = fake_quantize_ste if (torch.is_grad_enabled() and x.requires_grad) else fake_quantize
    return quantizer(x, spec.bits, symmetric=spec.symmetric, group_size=spec.group_size, clip_ratio=spec.clip_ratio)


def quantize_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spec: KVQuantSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply a spec to attention inputs ``[batch, heads, tokens, head_dim]`` (after RoPE).

    Args:
        query, key, value: the attention inputs; the head dimension is the last.
        spec: what to do (Q/K rotation, K/V fake quantization).

    Returns:
        ``(query, key, value)`` transformed as the module docstring describes.

    Raises:
        ValueError: the head dimension has no Hadamard matrix (``rotate_qk``, ``rotate_v``) or is
            not a multiple of ``group_size``.
    """
    if spec.rotate_qk:
        query = apply_hadamard(query)
        key = apply_hadamard(key)
    if spec.enabled:
        key = _fake_quant(key, spec)
        if spec.rotate_v:
            value = apply_hadamard(_fake_quant(apply_hadamard(value), spec), transpose=True)
        else:
            value = _fake_quant(value, spec)
    return query, key, value


def _make_attention(base_name: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        spec = getattr(module, _SPEC_ATTR, None)
        if spec is not None and spec.active:
            query, key, value = quantize_qkv(query, key, value, spec)
        if base_name == "eager":
            base = _eager_attention
        else:
            base = ALL_ATTENTION_FUNCTIONS[base_name]
        return base(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"kv_quant_{base_name}_attention"
    attention.__doc__ = f"{base_name} attention on K/V quantized by the module's ``{_SPEC_ATTR}``."
    return attention


def _eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain softmax attention (the eager path every supported architecture shares)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


_REGISTERED = False


def register_attention() -> None:
    """Register the wrappers and their mask builders with transformers once (idempotent); a model reloaded with
    its attention implementation set to one of :data:`KV_ATTENTION_NAMES` needs them before it runs."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for base_name, name in KV_ATTENTION_NAMES.items():
        AttentionInterface.register(name, _make_attention(base_name))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base_name])
    _REGISTERED = True


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    try:
        layers = decoder_layers(model)
    except ValueError as err:
        raise UserInputError(str(err)) from None
    out = []
    for index, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "head_dim"):
            raise UserInputError(
                f"{type(model).__name__}: decoder layer {index} has no self_attn with a head_dim; "
                "KV quantization supports Llama, Qwen2 and Qwen3 style attention"
            )
        out.append((f"layers.{index}.self_attn", attn))
    return out


def _base_implementation(model: nn.Module) -> str:
    current = getattr(model.config, "_attn_implementation", None) or "sdpa"
    for base_name, name in KV_ATTENTION_NAMES.items():
        if current == name:
            return base_name
    if current not in KV_ATTENTION_NAMES:
        raise UserInputError(
            f"attention implementation {current!r} is not supported with KV quantization: "
            f"load the model with one of {', '.join(map(repr, KV_ATTENTION_NAMES))}"
        )
    return current


def enable_kv_quant(model: nn.Module, spec: KVQuantSpec) -> dict:
    """Install ``spec`` on every attention module of ``model`` (replacing a previous one).

    Args:
        model: a ``transformers`` causal LM (Llama / Qwen2 / Qwen3 style) using ``sdpa`` or
            ``eager`` attention.
        spec: the KV-cache quantization. An inactive spec (16 bits, no rotation) still
            installs the wrapper (a no-op), so turning it on later is one call.

    Returns:
        A JSON-serialisable description: ``kv_bits``, ``spec`` (the fields),
        ``attn_implementation`` (the wrapper's name), ``wraps`` (sdpa or eager),
        ``modules`` (how many attention modules carry the spec).

    Raises:
        UserInputError: ``spec`` is not a :class:`KVQuantSpec`, the model has no supported
            attention, its implementation is neither sdpa nor eager, or the head dimension
            does not fit the spec (no Hadamard order for ``rotate_qk``, or not a multiple of
            ``group_size``). All checks run before the model is changed.
    """
    if not isinstance(spec, KVQuantSpec):
        raise UserInputError(f"spec must be a KVQuantSpec, got {type(spec).__name__}")
    modules = _attention_modules(model)
    base_name = _base_implementation(model)
    for name, attn in modules:
        head_dim = int(attn.head_dim)
        if spec.group_size is not None and head_dim % spec.group_size:
            raise UserInputError(
                f"kv group_size={spec.group_size} does not divide the head dimension {head_dim} of '{name}'"
            )
        if (spec.rotate_qk or spec.rotate_v) and not is_hadamard_size(head_dim):
            raise UserInputError(f"rotate_qk / rotate_v: head dimension {head_dim} of '{name}' has no Hadamard matrix")
    register_attention()
    wrapper = KV_ATTENTION_NAMES[base_name]
    if model.config._attn_implementation != wrapper:
        model.set_attn_implementation(wrapper)
    if model.config._attn_implementation != wrapper:
        raise UserInputError(
            f"{type(model).__name__} does not let its attention implementation be set to {wrapper!r}"
        )
    for _, attn in modules:
        setattr(attn, _SPEC_ATTR, spec)
    return {
        "kv_bits": spec.bits,
        "spec": spec.to_dict(),
        "attn_implementation": wrapper,
        "wraps": base_name,
        "modules": len(modules),
    }


def disable_kv_quant(model: nn.Module) -> None:
    """Remove the specs and restore the wrapped attention implementation (no-op if none).

    Raises:
        UserInputError: as :func:`enable_kv_quant` for an unsupported model.
    """
    modules = _attention_modules(model)
    current = model.config._attn_implementation
    for base_name, name in KV_ATTENTION_NAMES.items():
        if current == name:
            model.set_attn_implementation(base_name)
    for _, attn in modules:
        if hasattr(attn, _SPEC_ATTR):
            delattr(attn, _SPEC_ATTR)


def kv_quant_spec_of(model: nn.Module) -> KVQuantSpec | None:
    """The spec installed on the model's first attention module, or ``None``."""
    modules = _attention_modules(model)
    return getattr(modules[0][1], _SPEC_ATTR, None)
