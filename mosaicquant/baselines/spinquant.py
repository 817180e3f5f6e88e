"""SpinQuant: QuaRot's structure with learned rotations R1 and R2 (SPEC §3).

Pipeline:

1. **Start from QuaRot's rotated model** (:func:`mosaicquant.methods.rotation.rotate_model`,
   ``online_down=True``, ``online_o=False``): norms folded, random Hadamard ``R1₀`` on the
   residual stream (``rotation="orthogonal"``: Haar-random), per-head Hadamard ``R2₀``
   on v_proj / o_proj, online Hadamard ``R4`` on the down_proj input.
2. **KV cache**: online Hadamard ``R3`` on Q and K after RoPE, K/V fake-quantized
   **asymmetric** in groups of ``kv_group_size`` = 128 channels of a head (one group per head
   and token when the head dim is not larger), clip ``kv_clip``
   (:mod:`mosaicquant.methods.kvcache`).
3. **Learned rotations.** Two more orthogonal factors are trained, both initialised to the
   identity, so the model's rotations start exactly at QuaRot's random Hadamard and move
   from there: ``R1 = R1₀ R1'`` (``d × d``, one for the model) and, per layer ``l``,
   ``R2_l = R2₀ R2'_l`` (``head_dim × head_dim``, shared by the layer's heads). (Cayley SGD
   is equivariant under a fixed orthogonal factor, so this is the same trajectory as
   optimising ``R1``/``R2`` from the Hadamard initialisation directly.) With the current
   weights ``W`` (after step 1), the trained model uses

   - readers of the residual stream (q/k/v, gate/up, lm_head, embeddings): ``W ← W R1'``;
   - writers (o_proj, down_proj): ``W ← R1'ᵀ W``, ``b ← b R1'``;
   - v_proj, per kv head ``h``: ``W_h ← R2'ᵀ W_h``, ``b_h ← b_h R2'``; o_proj, per head
     input block: ``W_{:,h} ← W_{:,h} R2'`` (function-preserving in float).

   **Loss**: mean next-token cross-entropy (positions 1..T-1) of the model on calibration
   sequences, ``train_batch`` per step cycling through the shared calibration set, with
   activation fake-quantization at every decoder linear input (per token, asymmetric,
   ``abits``, ``a_clip``) and the KV fake-quantization of step 2 on; weights stay float; the
   quantizers pass gradients straight through their rounding and differentiate their
   scales (:func:`mosaicquant.methods.kvcache.fake_quantize_ste`). The output head is not
   quantized.

   **Optimizer**: Cayley SGD on the Stiefel manifold (Li, Li & Todorovic, ICLR 2020), one
   step per batch for ``steps`` steps (paper: 100), learning rate ``lr`` (paper: 1.5) on a
   cosine schedule without warm-up, ``lr_t = lr · ½(1 + cos(π t / steps))``, t = 0..steps-1.
   For a matrix ``X`` with Euclidean gradient ``G`` and momentum buffer ``M``:
   ``M ← β M − G``; ``Ŵ = M Xᵀ − ½ X (Xᵀ M Xᵀ)``; ``W = Ŵ − Ŵᵀ`` (skew); ``M ← W X``;
   ``α = min(lr_t, 1 / (‖W‖_F + ε))`` (the paper's step bound ``2q/‖W‖`` with q = ½);
   ``X ← (I − α/2 W)⁻¹ (I + α/2 W) X`` — the exact Cayley transform (a linear solve in
   float64, so ``X`` stays orthogonal to float64 round-off; the paper's fixed-point
   iteration only approximates it).
4. **Fold** the learned rotations into the weights (the same formulas, in float64).
5. **Weights**: GPTQ layer by layer (percdamp 0.01, act_order, per-channel symmetric with
   clip search; :func:`mosaicquant.methods.calibration.gptq_quantize_model`).
   **Activations**: per token, asymmetric, ``a_clip``.

Defaults follow the authors' scripts: activation and KV clip ratios 1.0 (no clipping),
asymmetric activations and KV, KV group 128.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mosaicquant.config import Config, check_choice, check_range
from mosaicquant.errors import UserInputError
from mosaicquant.methods.calibration import gptq_quantize_model
from mosaicquant.methods.kvcache import KVQuantSpec, enable_kv_quant, fake_quantize_ste
from mosaicquant.methods.qlinear import ActQuantSpec, weight_memory
from mosaicquant.methods.rotation import (
    ROTATIONS,
    TRANSFORM_SUPPORTS,
    DenseRotation,
    model_parts,
    online_transforms,
    rotate_model,
)
from mosaicquant.methods.speed_form import rotated_speed_form
from mosaicquant.registry import register_method

__all__ = [
    "SpinQuantConfig",
    "spinquant",
    "cayley_sgd_step",
    "cosine_lr",
    "LearnedRotations",
    "train_rotations",
    "apply_rotations",
    "rotation_loss",
]


@dataclass(frozen=True)
class SpinQuantConfig(Config):
    """SpinQuant options (command line: ``spinquant:steps=20:kvbits=16``).

    Attributes:
        wbits / abits / kvbits: 2..8, or 16 (unquantized).
        a_clip: fraction of each token's activation range kept, (0, 1].
        a_symmetric: symmetric per-token activation grids (QuaRot's) instead of the paper's asymmetric ones;
            the rotations are trained against that grid, and the speed form then runs the W4A4 kernels
            QuaRot's does rather than the mixed-precision ones. On SmolLM2-135M (the equal-bits protocol of
            ``docs/equal-bits.md``, seed 0) perplexity 31.87 against the asymmetric grid's 25.69.
        kv_clip: fraction of each K/V group's range kept, (0, 1].
        kv_group_size: K/V group along the head dim (used when smaller than the head dim).
        w_group_size: weight group along the input dim, or None (per output channel).
        percdamp / act_order / w_clip_search: GPTQ options.
        rotation: initial residual rotation, "hadamard" (random Hadamard) or "orthogonal".
        steps: Cayley SGD steps (0 = no training: QuaRot-style Hadamard rotations).
        lr: peak learning rate of the cosine schedule.
        momentum: Cayley SGD momentum.
        train_batch: calibration sequences per training step.
        learn_r2: also learn the per-head rotations (else only R1).
        calib_batch: calibration sequences per forward pass of the GPTQ calibration.
    """

    description = "SpinQuant: Cayley-SGD-learned R1/R2 rotations + Hadamard R3/R4, GPTQ W4, asym A4/KV4"

    wbits: int = 4
    abits: int = 4
    kvbits: int = 4
    a_clip: float = 1.0
    a_symmetric: bool = False
    kv_clip: float = 1.0
    kv_group_size: int = 128
    w_group_size: int | None = None
    percdamp: float = 0.01
    act_order: bool = True
    w_clip_search: bool = True
    rotation: str = "hadamard"
    steps: int = 100
    lr: float = 1.5
    momentum: float = 0.0
    train_batch: int = 1
    learn_r2: bool = True
    calib_batch: int = 4

    def validate(self):
        for name in ("wbits", "abits", "kvbits"):
            check_range(name, getattr(self, name), 2, 8, integer=True, extra=(16,))
        check_range("a_clip", self.a_clip, 0.01, 1.0)
        check_range("kv_clip", self.kv_clip, 0.01, 1.0)
        check_range("kv_group_size", self.kv_group_size, 1, None, integer=True)
        if self.w_group_size is not None:
            check_range("w_group_size", self.w_group_size, 2, None, integer=True)
        check_range("percdamp", self.percdamp, 0.0, 1.0)
        check_choice("rotation", self.rotation, ROTATIONS)
        check_range("steps", self.steps, 0, None, integer=True)
        check_range("lr", self.lr, 0.0, None)
        check_range("momentum", self.momentum, 0.0, 0.999)
        check_range("train_batch", self.train_batch, 1, None, integer=True)
        check_range("calib_batch", self.calib_batch, 1, None, integer=True)

    def kv_spec(self, head_dim: int) -> KVQuantSpec:
        """Asymmetric K/V groups of ``kv_group_size`` (one per head when the head dim is not larger).

        Raises:
            UserInputError: ``kv_group_size`` is smaller than ``head_dim`` and does not divide it.
        """
        group = None if head_dim <= self.kv_group_size else self.kv_group_size
        if group is not None and head_dim % group:
            raise UserInputError(f"kv_group_size={self.kv_group_size} does not divide the head dimension {head_dim}")
        return KVQuantSpec(bits=self.kvbits, group_size=group, symmetric=False, clip_ratio=self.kv_clip,
                           rotate_qk=self.kvbits < 16)

    def act_spec(self) -> ActQuantSpec:
        """Per-token activation quantizer (asymmetric unless ``a_symmetric``)."""
        return ActQuantSpec(bits=self.abits, symmetric=self.a_symmetric, clip_ratio=self.a_clip)


# --------------------------------------------------------------------------------------
# Cayley SGD on the Stiefel manifold
# --------------------------------------------------------------------------------------

_EPS = 1e-8


def cosine_lr(step: int, steps: int, lr: float) -> float:
    """Cosine schedule without warm-up: ``lr · ½(1 + cos(π step / steps))``.

    Raises:
        ValueError: ``steps < 1`` or ``step`` outside ``0..steps-1``.
    """
    if steps < 1 or not 0 <= step < steps:
        raise ValueError(f"step={step!r} must lie in 0..steps-1 with steps={steps!r} >= 1")
    return lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))


def cayley_sgd_step(
    x: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    *,
    momentum: float = 0.0,
    buffer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Cayley SGD step on the Stiefel manifold (exact Cayley transform).

    ``M ← β M − G``; ``Ŵ = M Xᵀ − ½ X (Xᵀ M Xᵀ)``; ``W = Ŵ − Ŵᵀ``; ``M ← W X``;
    ``α = min(lr, 1 / (‖W‖_F + ε))``; ``X ← (I − α/2 W)⁻¹ (I + α/2 W) X``. ``W`` is skew, so
    the Cayley factor is orthogonal and ``Xᵀ X`` is preserved; to first order the step is
    ``−α`` times the Riemannian gradient (canonical metric).

    Args:
        x: ``[n, p]`` matrix with orthonormal columns (``p <= n``), float32 or float64.
        grad: Euclidean gradient of the loss at ``x``, same shape.
        lr: step size, ``>= 0``.
        momentum: ``β`` in [0, 1).
        buffer: the momentum buffer from the previous step, or ``None`` (zeros).

    Returns:
        ``(x_new, buffer)``, both float64.

    Raises:
        ValueError: shapes that differ or are not ``[n, p]`` with ``p <= n``, a negative
            ``lr``, ``momentum`` outside [0, 1), or a non-finite gradient.

    Example:
        >>> x = torch.eye(3, dtype=torch.float64)
        >>> x1, _ = cayley_sgd_step(x, torch.randn(3, 3, dtype=torch.float64), 0.1)
        >>> bool(torch.allclose(x1.T @ x1, x, atol=1e-12))
        True
    """
    if x.dim() != 2 or x.shape != grad.shape or x.shape[1] > x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and grad {tuple(grad.shape)} must both be [n, p] with p <= n")
    if not lr >= 0:
        raise ValueError(f"lr={lr!r} must be >= 0")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum={momentum!r} is out of range: allowed [0, 1)")
    if not torch.isfinite(grad).all():
        raise ValueError("the gradient holds NaN or Inf values")
    x = x.detach().to(torch.float64)
    g = grad.detach().to(device=x.device, dtype=torch.float64)
    m = -g if buffer is None else momentum * buffer.to(x.device, torch.float64) - g
    w_hat = m @ x.T - 0.5 * x @ (x.T @ m @ x.T)
    w = w_hat - w_hat.T
    m = w @ x
    alpha = min(float(lr), 1.0 / (float(w.norm()) + _EPS))
    eye = torch.eye(w.shape[0], dtype=torch.float64, device=x.device)
    x_new = torch.linalg.solve(eye - 0.5 * alpha * w, (eye + 0.5 * alpha * w) @ x)
    return x_new, m


# --------------------------------------------------------------------------------------
# Rotated weights, shared by training and folding
# --------------------------------------------------------------------------------------


@dataclass
class LearnedRotations:
    """The learned factors and the training record.

    Attributes:
        r1: ``[d, d]`` float64 residual factor ``R1'``.
        r2: per layer, ``[head_dim, head_dim]`` float64 per-head factor ``R2'_l``.
        losses: the training loss at every step (before that step's update).
        seconds: training wall time.
    """

    r1: torch.Tensor
    r2: list[torch.Tensor]
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _rotated_weights(parts, base: dict[str, torch.Tensor], r1: torch.Tensor, r2: list[torch.Tensor]) -> dict:
    """The weights of the decoder linears under ``R1'``/``R2'`` (keys: full parameter names)."""
    out = {}
    for layer, r2_l in zip(parts.layers, r2, strict=True):
        hd = layer.head_dim
        for part in ("q_proj", "k_proj", "gate_proj", "up_proj"):
            name = layer.name(part)
            out[f"{name}.weight"] = base[f"{name}.weight"] @ r1
            if f"{name}.bias" in base:
                out[f"{name}.bias"] = base[f"{name}.bias"]
        v = layer.name("v_proj")
        wv = base[f"{v}.weight"] @ r1
        out[f"{v}.weight"] = (r2_l.T @ wv.reshape(layer.num_kv_heads, hd, -1)).reshape(wv.shape)
        if f"{v}.bias" in base:
            out[f"{v}.bias"] = (base[f"{v}.bias"].reshape(-1, hd) @ r2_l).reshape(-1)
        o = layer.name("o_proj")
        # with output norms (Gemma 3) the writers stay in the model's basis: R1' runs online
        # after those norms instead (_output_norm_hooks, folded by apply_rotations)
        writers_rotated = not layer.output_norms
        wo = r1.T @ base[f"{o}.weight"] if writers_rotated else base[f"{o}.weight"]
        out[f"{o}.weight"] = (wo.reshape(wo.shape[0], layer.num_heads, hd) @ r2_l).reshape(wo.shape)
        down = layer.name("down_proj")
        out[f"{down}.weight"] = r1.T @ base[f"{down}.weight"] if writers_rotated else base[f"{down}.weight"]
        for writer in (o, down) if writers_rotated else ():
            if f"{writer}.bias" in base:
                out[f"{writer}.bias"] = base[f"{writer}.bias"] @ r1
    return out


def _base_weights(model: nn.Module, parts, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    base = {}
    for layer in parts.layers:
        for part in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            linear = getattr(layer, part)
            base[f"{layer.name(part)}.weight"] = linear.weight.detach().to(dtype)
            if linear.bias is not None:
                base[f"{layer.name(part)}.bias"] = linear.bias.detach().to(dtype)
    return base


def apply_rotations(model: nn.Module, rotations: LearnedRotations) -> None:
    """Fold ``R1'`` and ``R2'`` into the weights in place (float model's function unchanged).

    Embeddings and lm_head ``W ← W R1'``; the decoder linears as the module docstring says.
    Computed in float64, cast back to each weight's dtype.

    Raises:
        UserInputError: unsupported model, or factors whose shapes do not fit it.
    """
    parts = model_parts(model)
    _check_rotation_shapes(parts, rotations.r1, rotations.r2)
    device = parts.embed_tokens.weight.device
    r1 = rotations.r1.to(device, torch.float64)
    r2 = [r.to(device, torch.float64) for r in rotations.r2]
    with torch.no_grad():
        new = _rotated_weights(parts, _base_weights(model, parts, torch.float64), r1, r2)
        params = dict(model.named_parameters())
        for name, value in new.items():
            params[name].copy_(value.to(params[name].dtype))
        for weight in (parts.embed_tokens.weight, parts.lm_head.weight):
            weight.copy_((weight.to(torch.float64) @ r1).to(weight.dtype))
        for layer in parts.layers:
            for norm in layer.output_norms:
                norm.output_transform = nn.Sequential(norm.output_transform, DenseRotation(r1))


def _check_rotation_shapes(parts, r1: torch.Tensor, r2: list[torch.Tensor]) -> None:
    d = parts.hidden_size
    if tuple(r1.shape) != (d, d):
        raise UserInputError(f"R1 has shape {tuple(r1.shape)}, the model needs ({d}, {d})")
    if len(r2) != len(parts.layers):
        raise UserInputError(f"{len(r2)} R2 factors given for {len(parts.layers)} layers")
    for layer, r in zip(parts.layers, r2):
        if tuple(r.shape) != (layer.head_dim, layer.head_dim):
            raise UserInputError(f"R2 of layer {layer.index} has shape {tuple(r.shape)}, "
                                 f"the model needs ({layer.head_dim}, {layer.head_dim})")


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def _act_quant_hooks(parts, act: ActQuantSpec) -> list:
    """Straight-through activation fake-quantization on every decoder linear's input."""
    if not act.enabled:
        return []

    def hook(module, args):
        x = fake_quantize_ste(args[0], act.bits, symmetric=act.symmetric, group_size=act.group_size,
                              clip_ratio=act.clip_ratio)
        return (x,) + tuple(args[1:])

    handles = []
    for layer in parts.layers:
        for part in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            # registered after any online-transform hook, so it quantizes the transformed input
            handles.append(getattr(layer, part).register_forward_pre_hook(hook))
    return handles


def _embed_scale(embed: nn.Module) -> torch.Tensor | float:
    """The factor a scaled embedding (Gemma's) multiplies its rows by; 1 for a plain one."""
    scale = getattr(embed, "embed_scale", None)
    return scale.to(embed.weight.dtype) if isinstance(scale, torch.Tensor) else 1.0


def rotation_loss(
    model: nn.Module,
    ids: torch.Tensor,
    r1: torch.Tensor,
    r2: list[torch.Tensor],
    *,
    parts=None,
    base: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` with the factors ``r1``/``r2`` applied on the fly.

    The weights are recomputed from ``r1``/``r2`` (differentiably, through
    ``torch.func.functional_call``); whatever quantization hooks and KV spec the model
    carries are active.

    Args:
        model: a rotated (norm-folded, untied) supported causal LM.
        ids: ``LongTensor [batch, T]``, ``T >= 2``.
        r1: ``[d, d]``; r2: per layer ``[head_dim, head_dim]`` (same dtype as the weights).
        parts / base: cached :func:`model_parts` and base weights (computed when ``None``).

    Returns:
        Scalar loss tensor (differentiable in ``r1`` and ``r2``).

    Raises:
        ValueError: ``ids`` is not ``[batch, T]`` with ``T >= 2``.
    """
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be [batch, T] with T >= 2, got shape {tuple(ids.shape)}")
    parts = parts if parts is not None else model_parts(model)
    dtype = parts.embed_tokens.weight.dtype
    base = base if base is not None else _base_weights(model, parts, dtype)
    decoder = model.get_decoder()
    prefix = next(name for name, mod in model.named_modules() if mod is decoder) + "."
    params = {name.removeprefix(prefix): value for name, value in _rotated_weights(parts, base, r1, r2).items()}
    embeds = F.embedding(ids, parts.embed_tokens.weight) * _embed_scale(parts.embed_tokens) @ r1
    # output norms (Gemma 3): R1' after their online residual rotation
    handles = [norm.register_forward_hook(lambda m, a, out: out @ r1.to(out.dtype))
               for layer in parts.layers for norm in layer.output_norms]
    try:
        hidden = torch.func.functional_call(decoder, params, (), {"inputs_embeds": embeds, "use_cache": False})
    finally:
        for handle in handles:
            handle.remove()
    hidden = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
    # lm_head (W R1') applied as (h R1'ᵀ) Wᵀ: the head's T × d product instead of rotating a vocab × d weight
    logits = F.linear(hidden @ r1.T, parts.lm_head.weight, parts.lm_head.bias)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def train_rotations(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    act: ActQuantSpec,
    steps: int,
    lr: float,
    momentum: float = 0.0,
    batch_size: int = 1,
    learn_r2: bool = True,
    log: Callable[[str], None] | None = None,
) -> LearnedRotations:
    """Learn ``R1'`` (and ``R2'`` per layer) by Cayley SGD on the quantized model's loss.

    Activation fake-quantization (``act``, straight-through) is hooked on every decoder
    linear for the duration; the KV spec the model carries (see
    :func:`~mosaicquant.methods.kvcache.enable_kv_quant`) is used as is. Weights stay
    float and are not changed (fold the result with :func:`apply_rotations`).

    Args:
        model: a rotated (norm-folded, untied) supported causal LM.
        tokens: ``LongTensor [n, T]`` training sequences, cycled ``batch_size`` at a time.
        act: activation quantizer used during training.
        steps: optimizer steps (0 returns identities).
        lr: peak learning rate (cosine schedule, :func:`cosine_lr`).
        momentum: Cayley SGD momentum.
        batch_size: sequences per step.
        learn_r2: learn the per-head factors too (else they stay the identity).
        log: progress printer or ``None``.

    Returns:
        :class:`LearnedRotations` with float64 factors and the loss of every step.

    Raises:
        UserInputError: unsupported model. ValueError: bad ``tokens`` or step arguments.
    """
    if tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [n, T] with n >= 1 and T >= 2, got shape {tuple(tokens.shape)}")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r} must be an integer >= 0")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    parts = model_parts(model)
    device = parts.embed_tokens.weight.device
    dtype = parts.embed_tokens.weight.dtype
    r1 = torch.eye(parts.hidden_size, dtype=torch.float64, device=device)
    r2 = [torch.eye(layer.head_dim, dtype=torch.float64, device=device) for layer in parts.layers]
    result = LearnedRotations(r1=r1, r2=r2)
    if steps == 0:
        return result
    t0 = time.perf_counter()
    base = _base_weights(model, parts, dtype)
    requires = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)
    was_training = model.training
    model.eval()
    handles = _act_quant_hooks(parts, act)
    buffers: list[torch.Tensor | None] = [None] * (1 + len(r2))
    n = tokens.shape[0]
    try:
        for step in range(steps):
            rows = [(step * batch_size + i) % n for i in range(batch_size)]
            ids = tokens[rows].to(device)
            r1_t = result.r1.to(dtype).requires_grad_(True)
            r2_t = [r.to(dtype).requires_grad_(learn_r2) for r in result.r2]
            loss = rotation_loss(model, ids, r1_t, r2_t, parts=parts, base=base)
            loss.backward()
            result.losses.append(float(loss.detach()))
            lr_t = cosine_lr(step, steps, lr)
            result.r1, buffers[0] = cayley_sgd_step(result.r1, r1_t.grad, lr_t, momentum=momentum,
                                                    buffer=buffers[0])
            if learn_r2:
                for i, r in enumerate(r2_t):
                    result.r2[i], buffers[1 + i] = cayley_sgd_step(result.r2[i], r.grad, lr_t, momentum=momentum,
                                                                   buffer=buffers[1 + i])
            if log is not None and (step % 10 == 0 or step == steps - 1):
                log(f"[spinquant]   step {step + 1}/{steps}: loss {result.losses[-1]:.4f} (lr {lr_t:.3g})")
    finally:
        for handle in handles:
            handle.remove()
        for name, p in model.named_parameters():
            p.requires_grad_(requires.get(name, False))
        model.train(was_training)
    result.seconds = time.perf_counter() - t0
    return result


# no online Hadamard on o_proj's input: SpinQuant learns that rotation and folds it in
@register_method("spinquant", config=SpinQuantConfig, description=SpinQuantConfig.description,
                 speed_form=rotated_speed_form(lambda config: False), supports=TRANSFORM_SUPPORTS)
def spinquant(model, config: SpinQuantConfig, ctx):
    """Quantize ``model`` in place with SpinQuant; fills ``ctx.info``."""
    t0 = time.perf_counter()
    calib = ctx.calib_tokens()
    rotation = rotate_model(model, seed=ctx.seed, rotation=config.rotation, online_down=True, online_o=False)
    head_dim = model_parts(model).layers[0].head_dim
    kv = enable_kv_quant(model, config.kv_spec(head_dim))
    act = config.act_spec()
    trained = config.steps > 0 and (act.enabled or config.kvbits < 16)
    rotations = train_rotations(model, calib, act=act, steps=config.steps if trained else 0, lr=config.lr,
                                momentum=config.momentum, batch_size=config.train_batch,
                                learn_r2=config.learn_r2, log=ctx.log)
    apply_rotations(model, rotations)
    t_rotate = time.perf_counter() - t0
    replaced = gptq_quantize_model(
        model, calib, wbits=config.wbits, act=act, w_group_size=config.w_group_size, percdamp=config.percdamp,
        act_order=config.act_order, clip_search=config.w_clip_search, batch_size=config.calib_batch, log=ctx.log)
    ctx.info.update(
        wbits=config.wbits, abits=config.abits, kv_bits=config.kvbits,
        kv_cache=kv,
        exec_path="simulated (fake-quant; online Hadamard on down_proj inputs and Q/K)",
        weight_quantizer="gptq" if config.wbits < 16 else None,
        quantized_linears=replaced,
        transform={k: v for k, v in rotation.items() if k not in ("fused_norms", "per_head", "online")}
        | {"online_linears": len(rotation["online"])},
        rotation_training={
            "steps": len(rotations.losses), "lr": config.lr, "schedule": "cosine, no warm-up",
            "optimizer": "Cayley SGD (exact Cayley transform)", "momentum": config.momentum,
            "train_batch": config.train_batch, "learn_r2": config.learn_r2,
            "loss_first": rotations.losses[0] if rotations.losses else None,
            "loss_last": rotations.losses[-1] if rotations.losses else None,
            "losses": [round(v, 5) for v in rotations.losses],
            "seconds": round(rotations.seconds, 2),
        },
        online_transforms=online_transforms(model),
        memory_bytes=weight_memory(model),
        timing={"rotate_and_train_s": round(t_rotate, 2), "total_s": round(time.perf_counter() - t0, 2)},
    )
    return model
