"""The decoder runtimes the speed suites time: transformers' eager code, or a fused decoder.

A method changes the linear layers; the rest of a decode step (norms, RoPE, the KV cache,
attention, the activation, the output head) is the same for every method, and in
transformers' eager code it is some thirty small kernels a layer — on Llama-3-8B at batch
4 about half of a BF16 step, which caps what any weight format can show end to end. The
``fused`` runtime runs the same model with those ops as single kernels
(:mod:`mosaicquant.kernels.decoder`) and calls the model's own linear modules (the
method's kernel layers, their online transforms and fused projection groups included), so
every method, the BF16 baseline included, is timed on the same lean decoder — the way a
serving engine would run it.

:class:`FusedDecoder` per layer: ``residual += x`` and RMSNorm in one kernel (which also
quantizes the activations to 4 bits when a W4A4 GEMM reads the norm's output directly:
RTN, SmoothQuant, and the rotated methods, whose rotations are folded there); the q/k/v
projections as one GEMM (a method's :class:`~mosaicquant.kernels.convert.FusedProjections`
group, or the float weights stacked once, the original linears left as views of the
stack); per-head q/k norms (Qwen3), RoPE, and the KV-cache write in one kernel;
split-KV decode attention (two kernels) or, for a prefill, PyTorch's
``scaled_dot_product_attention`` (causal, flash); ``o_proj``; the second add + RMSNorm;
gate/up as one GEMM; SiLU·mul (for a W4A4 ``down_proj`` without an online transform,
computed inside its activation quantizer); ``down_proj``. The KV cache is the model dtype (16-bit),
``[B, kv_heads, L, D]`` per layer, unless the method quantizes it (below).

:func:`fused_reason` says why a model cannot run on it (an architecture it does not know,
hooks on modules it does not call, a sliding window, an unknown attention wrapper, ...);
the suites then run transformers' code and record why.

A method's KV-cache quantizer (:mod:`mosaicquant.methods.kvcache`: optional Q/K Hadamard, K/V
quantized per token) runs in one of two ways, decided per layer (:func:`kv_format_reason`):

- **4-bit cache in the kernels** where the spec is 4-bit with one group per head and token (any
  grid and clip ratio, with or without the Q/K Hadamard; QuaRot's, SpinQuant's, Atom's and ResQ's
  defaults on a head size of 128), or 16-bit with only the rotation: the RoPE kernels rotate q and
  k and quantize each new key and value with the simulation's integers and scales
  (:class:`~mosaicquant.kernels.decoder.KVFormat`); the cache holds the packed integers
  ``[B, kv_heads, L, D/2]`` and fp32 scales and zero points ``[B, kv_heads, L]`` (for a key or a
  value 72 bytes a head and token against 256 at 16 bits, D = 128); decode attention reads the integers; a
  prefill attends over the prompt's dequantized keys and values, the simulation's values;
- **the simulation** otherwise (other bit widths, groups smaller than a head): the same PyTorch
  functions on each step's new tokens, right after they are written to a 16-bit cache; the
  values attention reads are the simulation's, and the record says the cache is 16-bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mosaicquant.architectures import ARCHITECTURES
from mosaicquant.errors import UserInputError, unknown_name

__all__ = ["RUNTIMES", "FUSED_DESCRIPTION", "FusedDecoder", "DecodeCache", "fused_reason", "resolve_runtime",
           "kv_format_reason", "kv_format_of", "kv_cache_bytes_per_token"]

#: ``auto``: fused where :func:`fused_reason` allows, else transformers (the record says why)
RUNTIMES = ("auto", "fused", "transformers")
FUSED_DESCRIPTION = ("fused decoder (Triton add+RMSNorm, fused with the 4-bit activation quantizer where a W4A4 "
                     "GEMM reads the norm directly; q/k norm + RoPE + KV write; split-KV decode attention; SiLU*mul, "
                     "inside down_proj's quantizer for W4A4 layers without an online Hadamard (with one: inside "
                     "its fused Hadamard + quantizer at 17-32 tokens), else written by gate/up's GEMM where its "
                     "fix-up can (ZipperEngine at 4-16 tokens, the dense W4A4 GEMM at 2-16), else a kernel of its "
                     "own; SDPA flash attention for prefill; q/k/v and gate/up as one "
                     "GEMM each; 16-bit KV unless noted)")
TRANSFORMERS_DESCRIPTION = "transformers eager decoder (static KV cache, 16-bit unless the method quantizes it)"

# The decoder's routes are entries of the device's tile table (mosaicquant.kernels.tile_table), measured as follows.
# silu_in_hadamard_min_m / _max_m: calls of this many tokens (first, last) run SiLU·mul inside down_proj's fused online Hadamard + quantizer
# (methods with that Hadamard: QuaRot, SpinQuant, MosaicQuant) instead of in a kernel of its own, where the
# FusedDecoder leaves it to this rule (silu_in_hadamard=None). Measured (Llama-3-8B shapes, context 512,
# CUDA-graph step, µs, its own kernel / inside / its own kernel again): at batch 24 QuaRot 3,618 / 3,548 / 3,619
# (16-bit KV), 3,592 / 3,540 / 3,576 (4-bit KV), MosaicQuant 3,770 / 3,720 / 3,782; at batch 32 QuaRot 3,593 /
# 3,528 / 3,587 and 3,501 / 3,440 / 3,480, MosaicQuant 4,003 / 3,930 / 3,991; at batch 4 and 16 inside was
# 3-6 % slower (the gated Hadamard kernel runs longer, and gate/up's GEMM writes SiLU·mul itself up to 16
# tokens). Prefill (2048 tokens, the throughput suite, rule from 17 tokens up): QuaRot 58.1k against 57.7k tok/s,
# MosaicQuant 49.7k against 49.6k, within the runs' spread: left out of the rule.
# silu_in_gate_up: SiLU·mul written by gate/up's own GEMM where it can (ZipperEngine's parallel modes and the dense W4A4 GEMM at
# decode sizes, BF16 models, down_proj's quantizer not taking it: QuantLinear.writes_gated) instead of a kernel
# of its own.
# Measured (Llama-3-8B shapes, MosaicQuant's CUDA-graph step at batch 4 / 8 / 16, µs): 3,109 / 3,244 /
# 3,546 with the kernel, 2,979 / 3,164 / 3,478 without it.
# fused_rope_attention: a decode step's RoPE + KV write inside the attention's kernel (decoder.decode_rope_attention: two kernels, the
# chunks and their combine, instead of three) for layers whose KV cache is not simulated at lower precision.
# Measured (Llama-3-8B shapes, CUDA-graph step at batch 4 / 8 / 16 / 32, µs): MosaicQuant 2,865 / 3,070 /
# 3,377 / 4,410 without, 2,765 / 3,008 / 3,303 / 4,345 with; BF16 4,853 / 5,111 / 5,206 / 5,659 and 4,847 /
# 4,971 / 5,124 / 5,592.
# prefill_sdpa_gqa: prefill attention of grouped-query models: torch's SDPA reads each KV head for its group of query heads
# (enable_gqa) instead of the keys and values copied once per query head (repeat_interleave: two copy kernels a
# layer, 23-24 µs each on Qwen3-14B shapes at 2048 tokens, 21-22 on Llama-3-8B; the attention kernel's own time
# unchanged). Measured (2048-token prefill, CUDA graph, µs, copies -> enable_gqa): Qwen3-14B shapes BF16
# 92,861 -> 91,171, QuaRot 87,112 -> 85,398, MosaicQuant 92,809 -> 90,484; Llama-3-8B shapes 49,363 -> 48,515,
# 35,236 -> 34,134, 38,836 -> 37,707 (benchmarks/kernels/decode_profile.py --prefill 2048, 2 rounds).

_STANDARD_ATTENTION = (None, "sdpa", "eager", "flash_attention_2", "flash_attention_3")
_KV_SPEC_ATTR = "kv_quant_spec"  # mosaicquant.methods.kvcache's per-attention-module spec


def _norm_ok(norm: nn.Module) -> bool:
    return (type(norm).__name__.endswith("RMSNorm") and isinstance(getattr(norm, "weight", None), torch.Tensor)
            and isinstance(getattr(norm, "variance_epsilon", None), float))


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def fused_reason(model: nn.Module) -> str | None:
    """``None`` when :class:`FusedDecoder` can run ``model``, else why not (one sentence)."""
    entry = next((ARCHITECTURES[c.__name__] for c in type(model).__mro__ if c.__name__ in ARCHITECTURES), None)
    if entry is not None and not entry.fused_runtime:
        runs = ", ".join(a.class_name for a in ARCHITECTURES.values() if a.fused_runtime)
        return f"{entry.class_name} ({entry.family}) is not implemented in the fused decoder, which runs {runs}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    config = getattr(model, "config", None)
    if layers is None or config is None or not hasattr(inner, "embed_tokens") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a decoder-only model with model.layers, embed_tokens and lm_head"
    from mosaicquant.methods.kvcache import KV_ATTENTION_NAMES

    if getattr(config, "_attn_implementation", None) not in (*_STANDARD_ATTENTION, *KV_ATTENTION_NAMES.values()):
        return (f"attention runs through '{config._attn_implementation}', a wrapper the fused decoder does not "
                "reproduce")
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r}; the fused decoder runs SiLU-gated MLPs"
    if getattr(config, "use_sliding_window", False) or (
            getattr(config, "sliding_window", None) and getattr(config, "model_type", "") == "mistral"):
        return "sliding-window attention is not implemented in the fused decoder"
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") == "dynamic":
        return "no rotary embedding module with a fixed table (model.rotary_emb; dynamic RoPE is not taken)"
    if not _norm_ok(getattr(inner, "norm", None)):
        return "the final norm is not an RMSNorm with weight and variance_epsilon"
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [layer, attn, mlp, getattr(layer, "input_layernorm", None),
                 getattr(layer, "post_attention_layernorm", None)]
        if any(p is None for p in parts) or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj",
                                                                                 "o_proj", "head_dim")):
            return f"layer {i} lacks the Llama/Qwen parts (self_attn q/k/v/o_proj, mlp, two RMSNorms)"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}'s MLP is not gate/up/down"
        if not (_norm_ok(parts[3]) and _norm_ok(parts[4])):
            return f"layer {i}'s norms are not RMSNorms with weight and variance_epsilon"
        if hasattr(attn, "q_norm") != hasattr(attn, "k_norm") or (
                hasattr(attn, "q_norm") and not (_norm_ok(attn.q_norm) and _norm_ok(attn.k_norm))):
            return f"layer {i}'s q/k norms are not RMSNorms"
        bypassed = [*parts, getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
        if any(p is not None and _hooked(p) for p in bypassed):
            return (f"layer {i} has forward hooks on a module the fused decoder does not call "
                    "(decoder layer, attention, MLP or norm)")
        d = int(attn.head_dim)
        if d < 16 or d > 256 or d & (d - 1):
            return f"head size {d}; the fused kernels take powers of two from 16 to 256"
    return None


def kv_format_reason(spec, head_dim: int) -> str | None:
    """Why the fused decoder's kernels cannot keep the KV cache as ``spec`` says (None: they can).

    They take 4-bit K/V with one group per head and token (``group_size`` None or the head size),
    any grid and clip ratio, or 16-bit K/V; either with or without the Q/K Hadamard.
    """
    if spec.bits not in (4, 16):
        return f"{spec.bits}-bit K/V (the kernels keep 4 or 16 bits)"
    if spec.bits == 4 and spec.group_size not in (None, head_dim):
        return f"K/V groups of {spec.group_size} channels (the kernels take one group per head of {head_dim})"
    if spec.enabled and spec.rotate_v:
        return "V quantized in a Hadamard basis (the kernels keep V as it is)"
    return None


def kv_format_of(spec):
    """The :class:`~mosaicquant.kernels.decoder.KVFormat` that executes ``spec`` (see :func:`kv_format_reason`).

    ``methods.kvcache`` rotates Q/K by ``apply_hadamard`` (Sylvester order for the powers of two the
    fused decoder's head sizes are), which the kernels compute by butterflies.
    """
    from mosaicquant.kernels.decoder import KVFormat

    return KVFormat(bits=spec.bits, symmetric=spec.symmetric, clip_ratio=float(spec.clip_ratio),
                    rotate=bool(spec.rotate_qk))


def kv_cache_bytes_per_token(model: nn.Module) -> int | None:
    """Bytes one token of one sequence adds to the fused decoder's KV cache (all layers), or None where the
    fused decoder cannot run ``model``: a 4-bit layer keeps ``D/2`` bytes and four fp32 scales and zeros a
    KV head, a 16-bit one (the simulation's included) ``2·D`` values of the model's dtype."""
    from mosaicquant.methods.kvcache import kv_quant_spec_of

    if fused_reason(model) is not None:
        return None
    inner = model.model
    attn = inner.layers[0].self_attn
    d = int(attn.head_dim)
    kv_heads = int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads)
    spec = kv_quant_spec_of(model)
    if (spec is not None and spec.enabled and model.config._attn_implementation not in _STANDARD_ATTENTION
            and spec.bits == 4 and kv_format_reason(spec, d) is None):
        per_head = 2 * (d // 2 + 2 * 4)
    else:
        per_head = 2 * d * inner.embed_tokens.weight.element_size()
    return len(inner.layers) * kv_heads * per_head


def _kv_note(model: nn.Module) -> str:
    from mosaicquant.methods.kvcache import kv_quant_spec_of

    spec = kv_quant_spec_of(model)
    if spec is None or not spec.active:
        return ""
    rotation = " after a Q/K Hadamard" if spec.rotate_qk else ""
    head_dim = int(model.model.layers[0].self_attn.head_dim)
    reason = kv_format_reason(spec, head_dim)
    if reason is None:
        what = (f"4-bit {'symmetric' if spec.symmetric else 'asymmetric'} cache (clip {spec.clip_ratio:g}), "
                f"packed with fp32 scales and zeros a head and token, written and read by the kernels"
                if spec.enabled else "16-bit cache")
        return f"; KV: {what}{rotation}"
    what = f"{spec.bits}-bit fake-quant of K/V" if spec.enabled else "no K/V quantization"
    return (f"; KV: {what}{rotation} on each step's new tokens in PyTorch, 16-bit cache (the method's simulation; "
            f"not in the kernels: {reason})")


def resolve_runtime(runtime: str, model: nn.Module) -> tuple[str, str]:
    """The runtime that will run ``model`` and its description for the record.

    Raises:
        UserInputError: an unknown runtime name, or ``fused`` for a model it cannot run.
    """
    if runtime not in RUNTIMES:
        raise unknown_name("runtime", runtime, RUNTIMES)
    if runtime == "transformers":
        return "transformers", TRANSFORMERS_DESCRIPTION
    reason = fused_reason(model)
    if reason is None:
        return "fused", FUSED_DESCRIPTION + _kv_note(model)
    if runtime == "fused":
        raise UserInputError(f"runtime 'fused' cannot run this model: {reason}; use --runtime transformers or auto")
    return "transformers", f"{TRANSFORMERS_DESCRIPTION}; the fused decoder was not used: {reason}"


class _Stacked:
    """Sibling projections reading one input, run as one matrix product with stacked outputs."""

    def __init__(self, parent: nn.Module, names: tuple[str, ...]):
        from mosaicquant.kernels.convert import ProjectionSlice, _run_quant
        from mosaicquant.kernels.quant_linear import QuantLinear

        self.quant = None
        mods = [getattr(parent, n) for n in names]
        self.width = sum(int(m.out_features) for m in mods)
        first = mods[0]
        group = getattr(first, "group", None)
        if (isinstance(first, ProjectionSlice) and list(group.names) == list(names)
                and all(getattr(m, "group", None) is group for m in mods)):
            self.fn = lambda x: _run_quant(group.quant, x, group.input_transform, group.fuse_transform)
            self.kind = "group"
            # a W4A4 GEMM reading its input as it is: the norm before it can quantize for it
            # (a mixed-precision group quantizes with its own gathered-channel kernel)
            self.quant = group.quant if group.input_transform is None and isinstance(group.quant, QuantLinear) else None
        elif (all(type(m) is nn.Linear and not _hooked(m) and type(m.weight.data) is torch.Tensor for m in mods)
              and len({m.weight.dtype for m in mods}) == 1):
            # float weights: one stacked tensor; the original linears become views of it (no copy kept).
            # A tensor subclass (torchao's packed weights) has no stacking: its linears run one by one
            weight = torch.cat([m.weight.data for m in mods])
            bias = None
            if any(m.bias is not None for m in mods):
                bias = torch.cat([m.bias.data if m.bias is not None else weight.new_zeros(m.out_features)
                                  for m in mods])
            start = 0
            for m in mods:
                m.weight = nn.Parameter(weight[start:start + m.out_features], requires_grad=False)
                if m.bias is not None:
                    m.bias = nn.Parameter(bias[start:start + m.out_features], requires_grad=False)
                start += m.out_features
            self.fn = lambda x: F.linear(x, weight, bias)
            self.kind = "stacked"
        else:
            self.fn = lambda x: torch.cat([m(x) for m in mods], dim=-1)
            self.kind = "separate"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _quantize_new_kv(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq: torch.Tensor,
                     positions: torch.Tensor, spec) -> torch.Tensor:
    """The method's KV simulation on the tokens just written: ``quantize_qkv`` on q and their K/V.

    Per-token quantization makes this equal to re-quantizing the whole cache every step (what
    the eager wrapper does), for the cost of the new tokens only.
    """
    from mosaicquant.methods.kvcache import quantize_qkv

    pos = positions.long()
    q, k, v = quantize_qkv(q, keys[seq, :, pos], values[seq, :, pos], spec)
    keys[seq, :, pos] = k
    values[seq, :, pos] = v
    return q.contiguous()


def _quantize_input(x: torch.Tensor, quant, transform, layout: str, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant``'s activation quantizer on ``x`` (Triton), inside ``transform``'s fused online Hadamard when given;
    ``gated``: ``x`` is ``[gate | up]`` and SiLU·mul runs inside it."""
    from mosaicquant.kernels.act_quant import quantize_activations_triton
    from mosaicquant.kernels.hadamard_quant import hadamard_quantize_triton

    if transform is not None:
        return hadamard_quantize_triton(x, transform, quant.act_clip_ratio, layout=layout, gated=gated)
    return quantize_activations_triton(x, quant.act_clip_ratio, layout=layout, gated=gated)


@dataclass
class _Layer:
    input_norm: nn.Module
    post_norm: nn.Module
    qkv: _Stacked
    o_proj: nn.Module
    gate_up: _Stacked
    down_proj: nn.Module
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    scaling: float
    kv_spec: object = None  # an active mosaicquant.methods.kvcache.KVQuantSpec the kernels do not run, or None
    kv_format: object = None  # the mosaicquant.kernels.decoder.KVFormat the kernels run the spec with, or None
    # the W4A4 layers whose activation quantizer runs inside the kernel before them (decided once)
    qkv_quant: object = None
    gate_up_quant: object = None
    down_quant: object = None  # down_proj's quantizer where it can take SiLU·mul (FusedDecoder._down_gated says when)
    down_transform: object = None  # down_proj's online Hadamard, run with SiLU·mul inside its quantizer


@dataclass
class DecodeCache:
    """The fused decoder's KV cache of ``batch`` sequences up to ``length`` tokens.

    Attributes:
        keys, values: per layer ``[batch, kv_heads, length, head_dim]`` in the model dtype, or for a
            4-bit layer uint8 ``[batch, kv_heads, length, head_dim / 2]``.
        cos, sin: rotary tables ``[length, head_dim]`` in the model dtype.
        scales: per layer the 4-bit cache's :class:`~mosaicquant.kernels.decoder.KVScales`, or None.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    scales: list = None

    def __post_init__(self):
        if self.scales is None:
            self.scales = [None] * len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes of keys, values, scales and zero points (all layers)."""
        data = sum(int(t.numel() * t.element_size()) for t in (*self.keys, *self.values))
        return data + sum(s.nbytes for s in self.scales if s is not None)

    @property
    def batch(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])


class FusedDecoder:
    """Run a Llama/Qwen-layout causal LM with fused non-linear kernels (see the module docstring).

    Args:
        model: the (quantized, kernel-converted) model; its float q/k/v and gate/up weights
            are re-stored once as stacked tensors, the original linears becoming views.
        kernel: kernel preference for the fused ops (``"torch"`` runs their references).
        fuse_quant: run the W4A4 activation quantizers inside the kernel before them (same
            integers and scales): the norm and the quantizer of a projection group that reads
            the norm directly (:func:`~mosaicquant.kernels.decoder.rmsnorm_quant`), and
            SiLU·mul inside ``down_proj``'s quantizer (``gated=True`` of the act_quant launcher, or
            of the fused online Hadamard's where ``silu_in_hadamard``).
        silu_in_hadamard: where ``down_proj`` has an online Hadamard the fused kernel runs, compute
            SiLU·mul inside it too instead of in a kernel of its own: ``True`` on every call, ``False``
            never, ``None`` on calls of the tile table's ``silu_in_hadamard_min_m`` to ``_max_m`` tokens.

    Raises:
        UserInputError: the model cannot run here (:func:`fused_reason`).

    Example:
        >>> dec = FusedDecoder(model)                                       # doctest: +SKIP
        >>> cache = dec.new_cache(batch=4, length=520)                      # doctest: +SKIP
        >>> logits = dec.prefill(prompt_ids, cache)                         # doctest: +SKIP
        >>> logits = dec.decode(next_ids, positions, cache)                 # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, kernel: str | None = None, fuse_quant: bool = True,
                 silu_in_hadamard: bool | None = None):
        reason = fused_reason(model)
        if reason is not None:
            raise UserInputError(f"the fused decoder cannot run this model: {reason}")
        self.model = model
        self.kernel = kernel
        self.fuse_quant = bool(fuse_quant)
        self.silu_in_hadamard = None if silu_in_hadamard is None else bool(silu_in_hadamard)
        inner = model.model
        cfg = model.config
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(inner.layers[0].self_attn.head_dim)
        self.embed = inner.embed_tokens
        self.final_norm = inner.norm
        self.lm_head = model.lm_head
        self.rotary = inner.rotary_emb
        self._table_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers: list[_Layer] = []
        device = self.embed.weight.device
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qn = getattr(attn, "q_norm", None)
            kn = getattr(attn, "k_norm", None)
            self.layers.append(_Layer(
                layer.input_layernorm, layer.post_attention_layernorm,
                _Stacked(attn, ("q_proj", "k_proj", "v_proj")), attn.o_proj,
                _Stacked(mlp, ("gate_proj", "up_proj")), mlp.down_proj,
                None if qn is None else qn.weight, None if kn is None else kn.weight,
                float(qn.variance_epsilon) if qn is not None else 1e-6,
                float(getattr(attn, "scaling", self.head_dim ** -0.5)),
                self._active_spec(attn)))
            lay = self.layers[-1]
            if lay.kv_spec is not None and kv_format_reason(lay.kv_spec, self.head_dim) is None:
                lay.kv_format, lay.kv_spec = kv_format_of(lay.kv_spec), None
            lay.qkv_quant = self._fusable(lay.qkv.quant, device)
            lay.gate_up_quant = self._fusable(lay.gate_up.quant, device)
            lay.down_quant, lay.down_transform = self._gated_input(mlp.down_proj, device)
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.layers[0].qkv.width != width:
            raise UserInputError(f"q/k/v projections give {self.layers[0].qkv.width} columns; the config's heads "
                                 f"give {width}")

    def _fusable(self, quant, device: torch.device):
        """``quant`` when its quantizer can run inside the kernel before it (Triton on both sides), else None."""
        from mosaicquant.kernels._common import resolve_kernel

        if quant is None or not self.fuse_quant:
            return None
        if resolve_kernel(self.kernel, device) != "triton" or resolve_kernel(quant.kernel, device) != "triton":
            return None
        return quant

    def _gated_input(self, down: nn.Module, device: torch.device) -> tuple[object, object]:
        """``(quant, transform)`` when ``down``'s quantizer can take SiLU·mul inside it, else ``(None, None)``.

        A kernel layer with no hooks takes it: with no online transform inside the plain quantizer,
        with an online Hadamard that the fused kernel runs inside that kernel (unless ``silu_in_hadamard``
        is ``False``; which calls do is :meth:`_down_gated`'s rule).
        """
        from mosaicquant.kernels.convert import KernelLinear
        from mosaicquant.kernels.hadamard_quant import fused_hadamard_reason
        from mosaicquant.kernels.quant_linear import QuantLinear

        quant = self._fusable(getattr(down, "quant", None), device)
        if type(down) is not KernelLinear or not isinstance(quant, QuantLinear) or _hooked(down):
            return None, None
        transform = down.input_transform
        if transform is None:
            return quant, None
        if (self.silu_in_hadamard is not False and down.fuse_transform
                and fused_hadamard_reason(transform, self.dtype) is None):
            return quant, transform
        return None, None

    def _active_spec(self, attn: nn.Module):
        spec = getattr(attn, _KV_SPEC_ATTR, None)
        if spec is None or not spec.active or self.model.config._attn_implementation in _STANDARD_ATTENTION:
            return None  # a spec left on a module whose wrapper was switched off does nothing
        return spec

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int, length: int) -> DecodeCache:
        """A KV cache for ``batch`` sequences of up to ``length`` tokens, with its rotary tables.

        Raises:
            UserInputError: a batch or length below 1.
        """
        if batch < 1 or length < 1:
            raise UserInputError(f"cache batch={batch} and length={length} must be >= 1")
        return self._make_cache(batch, length, torch.zeros, shared=False)

    def _scratch(self, batch: int, length: int) -> DecodeCache:
        """A cache whose layers share one layer's buffers (a prefill without a cache: each layer's keys and
        values are dropped after its attention)."""
        return self._make_cache(batch, length, torch.empty, shared=True)

    def _make_cache(self, batch: int, length: int, alloc, shared: bool) -> DecodeCache:
        """Keys and values (``alloc``-ed: packed uint8 for a 4-bit layer) and a 4-bit layer's scales, per layer
        or, ``shared``, one set per kind of layer."""
        from mosaicquant.kernels.decoder import KVScales

        made = {}
        keys, values, scales = [], [], []
        for i, lay in enumerate(self.layers):
            packed = lay.kv_format is not None and lay.kv_format.quantized
            key = packed if shared else i
            if key not in made:
                shape = (batch, self.kv_heads, length, self.head_dim // 2 if packed else self.head_dim)
                dtype = torch.uint8 if packed else self.dtype
                made[key] = (alloc(shape, dtype=dtype, device=self.device),
                             alloc(shape, dtype=dtype, device=self.device),
                             KVScales.empty(batch, self.kv_heads, length, self.device) if packed else None)
            keys.append(made[key][0])
            values.append(made[key][1])
            scales.append(made[key][2])
        cos, sin = self._tables(length)
        return DecodeCache(keys, values, cos, sin, scales)

    def _tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # kept per length: the check below synchronizes, which a CUDA-graph capture must not meet
        if length in self._table_cache:
            return self._table_cache[length]
        probe = torch.empty(1, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            cos, sin = self.rotary(probe, torch.arange(length, device=self.device)[None])
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        half = self.head_dim // 2
        if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
            raise UserInputError("the rotary tables are not [freqs, freqs]: the fused RoPE kernel cannot take them")
        self._table_cache[length] = (cos, sin)
        return cos, sin

    def _layers(self, x: torch.Tensor, attend_qkv) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers on ``x``; ``attend_qkv(qkv, i, layer)`` is layer ``i``'s attention on its q/k/v
        projections (RoPE and the KV cache included)."""
        residual = x.clone()
        h = None
        for i, lay in enumerate(self.layers):
            # the first layer's norm reads the embeddings (no residual sum yet)
            qkv = self._norm_then(x if h is None else h, lay.input_norm, None if h is None else residual,
                                  lay.qkv, lay.qkv_quant)
            a = attend_qkv(qkv, i, lay)
            gated = self._gate_up_writes_silu(lay, x.shape[0])
            gate_up = self._norm_then(lay.o_proj(a), lay.post_norm, residual, lay.gate_up, lay.gate_up_quant, gated)
            if gated:
                h = lay.down_proj(gate_up)
            else:
                down_quant, down_transform = self._down_gated(lay, x.shape[0])
                h = self._silu_down(gate_up, lay.down_proj, down_quant, down_transform)
        return h, residual

    def _gemm_after(self, q: torch.Tensor, scale: torch.Tensor, layout: str, quant,
                    gated: bool = False) -> torch.Tensor:
        """The GEMM of :meth:`_norm_then` on activations its norm already quantized (``layout``)."""
        if gated:
            return quant.forward_quantized(q, scale, "triton", gated=True)
        y = quant.forward_split8(q, scale) if layout == "split8" else quant.forward_quantized(q, scale, "triton")
        return y.to(self.dtype)

    def _rope_attend(self, positions: torch.Tensor, tokens_per_seq: int, keys, values, cos, sin, attend,
                     scales=None, dequant=None):
        """``attend_qkv`` for :meth:`_layers`: :func:`~mosaicquant.kernels.decoder.rope_kv` (and the
        method's KV simulation), then ``attend(q, k_cache, v_cache, scale)``; a 4-bit layer's cache gets
        the packed keys and values (``scales[i]``), and ``attend`` their dequantized values (``dequant``)."""
        from mosaicquant.kernels.decoder import rope_kv

        seq = []  # each token's sequence, made once where a layer simulates its KV cache

        def attend_qkv(qkv: torch.Tensor, i: int, lay: _Layer) -> torch.Tensor:
            fmt = lay.kv_format
            packed = fmt is not None and fmt.quantized
            q = rope_kv(qkv, positions, cos, sin, keys[i], values[i], self.heads, self.kv_heads, tokens_per_seq,
                        lay.q_norm, lay.k_norm, lay.qk_eps, kernel=self.kernel, kv=fmt,
                        scales=scales[i] if packed else None, dequant=dequant if packed else None)
            if packed:
                return attend(q, dequant[0], dequant[1], lay.scaling)
            if lay.kv_spec is not None:
                if not seq:
                    seq.append(torch.arange(positions.shape[0], device=positions.device) // tokens_per_seq)
                q = _quantize_new_kv(q, keys[i], values[i], seq[0], positions, lay.kv_spec)
            return attend(q, keys[i], values[i], lay.scaling)

        return attend_qkv

    def _table(self):
        """The tile table of this decoder's device, with the kernel settings' entries in force."""
        from mosaicquant.kernels.tile_table import table_for

        return table_for(self.device)

    def _down_gated(self, lay: _Layer, m: int) -> tuple[object, object]:
        """``(quant, transform)`` of ``down_proj`` taking SiLU·mul inside its quantizer on a call of ``m`` tokens
        (:meth:`_gated_input`), else ``(None, None)``: with an online Hadamard only where ``silu_in_hadamard`` says
        so, or for ``None`` where ``m`` lies in the tile table's ``silu_in_hadamard_min_m`` to ``_max_m``."""
        if lay.down_transform is None:
            return lay.down_quant, None
        inside = self.silu_in_hadamard
        if inside is None:
            table = self._table()
            inside = table.silu_in_hadamard_min_m <= m <= table.silu_in_hadamard_max_m
        return (lay.down_quant, lay.down_transform) if inside else (None, None)

    def _gate_up_writes_silu(self, lay: _Layer, m: int) -> bool:
        """Whether gate/up's GEMM writes SiLU·mul itself for ``m`` tokens (the tile table's ``silu_in_gate_up``)."""
        from mosaicquant.kernels.quant_linear import QuantLinear

        quant = lay.gate_up_quant
        return (self._table().silu_in_gate_up and self._down_gated(lay, m)[0] is None and self.dtype == torch.bfloat16
                and isinstance(quant, QuantLinear) and quant.writes_gated(m))

    def _silu_down(self, gate_up: torch.Tensor, down: nn.Module, quant, transform=None) -> torch.Tensor:
        """``down(silu_mul(gate_up))``; with ``quant`` (see :meth:`_gated_input`) SiLU·mul runs inside its
        quantizer, or inside the fused online Hadamard + quantizer with ``transform``."""
        from mosaicquant.kernels.decoder import silu_mul

        if quant is None:
            return down(silu_mul(gate_up, kernel=self.kernel))
        swapped = quant.uses_swapped(gate_up.shape[0], "triton")
        a, scale = _quantize_input(gate_up, quant, transform, "split8" if swapped else "packed", True)
        y = quant.forward_split8(a, scale) if swapped else quant.forward_quantized(a, scale, "triton")
        return y.to(gate_up.dtype)

    def _norm_then(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, stacked: _Stacked,
                   quant, gated: bool = False) -> torch.Tensor:
        """``stacked(rmsnorm(x))`` (after ``residual += x``); with ``quant`` the norm also quantizes for it;
        ``gated``: the GEMM writes SiLU·mul of its ``[gate | up]`` halves (:meth:`_gate_up_writes_silu`)."""
        from mosaicquant.kernels.decoder import rmsnorm, rmsnorm_quant

        if quant is None:
            return stacked(rmsnorm(x, norm.weight, norm.variance_epsilon, residual, kernel=self.kernel))
        layout = "split8" if not gated and quant.uses_swapped(x.shape[0], "triton") else "packed"
        a, scale = rmsnorm_quant(x, norm.weight, norm.variance_epsilon, residual, quant.act_clip_ratio, layout,
                                 kernel="triton")
        return self._gemm_after(a, scale, layout, quant, gated)

    def _head(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        from mosaicquant.kernels.decoder import rmsnorm

        x = rmsnorm(h, self.final_norm.weight, self.final_norm.variance_epsilon, residual, kernel=self.kernel)
        return self.lm_head(x)

    def _check_ids(self, ids: torch.Tensor) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise UserInputError(f"input ids must be an integer [batch, tokens] tensor, got "
                                 f"{getattr(ids, 'shape', type(ids))}")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, cache: DecodeCache | None = None) -> torch.Tensor:
        """Run ``ids [B, S]`` from position 0; return the last position's logits ``[B, vocab]``.

        With a ``cache`` (batch ``B``, length ``≥ S``) the keys and values stay there for
        :meth:`decode`; without one they go to a one-layer scratch buffer.

        Raises:
            UserInputError: bad ids, or a cache of another batch or too short.
        """
        self._check_ids(ids)
        b, s = ids.shape
        if cache is not None and (cache.batch != b or cache.length < s):
            raise UserInputError(f"cache holds batch {cache.batch} × {cache.length} tokens; the prompt is {b} × {s}")
        if cache is None:
            cache = self._scratch(b, s)
        keys, values, cos, sin = cache.keys, cache.values, cache.cos, cache.sin
        dequant = None
        if any(lay.kv_format is not None and lay.kv_format.quantized for lay in self.layers):
            # the prompt's dequantized keys and values for its attention, one layer at a time
            shape = (b, self.kv_heads, s, self.head_dim)
            dequant = (torch.empty(shape, dtype=self.dtype, device=self.device),
                       torch.empty(shape, dtype=self.dtype, device=self.device))
        positions = torch.arange(s, device=self.device).repeat(b)
        x = self.embed(ids).reshape(b * s, -1)
        group = self.heads // self.kv_heads

        def attend(q, kc, vc, scale):
            qh = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
            kh, vh = kc[:, :, :s], vc[:, :, :s]
            if group > 1 and self._table().prefill_sdpa_gqa:
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
                return o.transpose(1, 2).reshape(b * s, self.heads * self.head_dim)
            if group > 1:
                kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
            return o.transpose(1, 2).reshape(b * s, self.heads * self.head_dim)

        h, residual = self._layers(x, self._rope_attend(positions, s, keys, values, cos, sin, attend, cache.scales,
                                                        dequant))
        last = torch.arange(b, device=self.device) * s + (s - 1)
        return self._head(h[last].contiguous(), residual[last].contiguous())

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: DecodeCache,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step: token ``ids [B, 1]`` at ``positions [B]``; returns logits ``[B, vocab]``.

        The keys before each position must be in ``cache`` (from :meth:`prefill` or earlier
        steps). ``lengths`` (``positions + 1`` as int32) may be passed precomputed, e.g. for
        a captured graph. Positions must lie in ``0..cache.length - 1``: host positions are
        checked here, before any launch; device positions are checked by the kernels, which
        clamp a value out of range and set the device's fault word, raised by
        :meth:`check_ranges` (call it where the caller synchronises anyway, outside a
        captured graph).

        Raises:
            UserInputError: bad ids, positions of another shape, a cache of another batch, or
                host positions outside the cache.
        """
        self._check_ids(ids)
        b = ids.shape[0]
        if ids.shape[1] != 1 or cache.batch != b:
            raise UserInputError(f"decode takes ids [batch, 1] with the cache's batch {cache.batch}; "
                                 f"got {list(ids.shape)}")
        if not isinstance(positions, torch.Tensor) or positions.shape != (b,):
            raise UserInputError(f"positions must be a [{b}] tensor, got {getattr(positions, 'shape', positions)}")
        from mosaicquant.kernels.decoder import decode_attention, decode_rope_attention

        if lengths is None:
            lengths = (positions + 1).to(torch.int32)
        x = self.embed(ids).reshape(b, -1)

        def attend(q, kc, vc, scale):
            return decode_attention(q, kc, vc, lengths, scale, kernel=self.kernel)

        unfused = self._rope_attend(positions, 1, cache.keys, cache.values, cache.cos, cache.sin, attend)

        def attend_qkv(qkv: torch.Tensor, i: int, lay: _Layer) -> torch.Tensor:
            fmt = lay.kv_format
            if lay.kv_spec is not None or (fmt is None and not self._table().fused_rope_attention):
                return unfused(qkv, i, lay)
            # a 4-bit cache is read by this kernel only
            return decode_rope_attention(qkv, positions, cache.cos, cache.sin, cache.keys[i], cache.values[i],
                                         self.heads, self.kv_heads, lay.scaling, lay.q_norm, lay.k_norm,
                                         lay.qk_eps, kernel=self.kernel, kv=fmt,
                                         scales=cache.scales[i] if fmt is not None and fmt.quantized else None)

        h, residual = self._layers(x, attend_qkv)
        return self._head(h, residual)

    def check_ranges(self) -> None:
        """Raise if a kernel read a position or length out of range on the decoder's device since the last check.

        On a GPU the kernels check the positions and lengths they read (:meth:`decode` and :meth:`prefill` do
        not: a host check would synchronise every step and cannot run inside a captured CUDA graph) and set a
        fault word; this reads and clears it
        (:func:`~mosaicquant.kernels.decoder.check_range_faults`), a device synchronisation. The speed suites
        call it after each timed prefill or decode measurement, where the timing has synchronised; never inside
        a capture.

        Raises:
            UserInputError: naming the launcher, the input and the allowed span; the steps since the last
                check ran on clamped values, so what they computed is not valid.
        """
        from mosaicquant.kernels.decoder import check_range_faults

        check_range_faults(self.device)
