"""SmoothQuant scaling: move activation outliers into the weights, function unchanged.

For a linear ``y = x Wᵀ`` and a per-input-channel scale ``s > 0``,
``y = (x / s) (W diag(s))ᵀ``. With

    ``s_j = max|X_j|^α / max|W_j|^(1-α)``

(``max|X_j|`` over calibration tokens, ``max|W_j|`` over the output rows of every linear
sharing that input) the activation range is divided by ``s`` and the weight range multiplied
by it, balancing the two at migration strength ``α`` (0.85 for Llama-2/3, the paper's value).

``1/s`` is folded into the op producing ``x`` so nothing runs at inference time:

- ``input_layernorm → q/k/v_proj`` and ``post_attention_layernorm → gate/up_proj`` (the
  SmoothQuant defaults for Llama-like models): RMSNorm weight ``g ← g / s``;
- optionally ``v_proj → o_proj``: v_proj rows (and bias) ``/ s``. Attention mixes value rows
  linearly, so o_proj's input channel ``(h, i)`` carries value channel ``(h // G, i)`` of the
  grouped-query KV head; the scale is shared across the ``G`` query heads of a KV head
  (``max|X|`` and ``max|W|`` reduced over the group) so one v_proj scale serves them all;
- optionally ``up_proj → down_proj``: down_proj's input is ``act(gate) * up``, linear in
  ``up``'s output, so up_proj rows (and bias) ``/ s``.

Guards: a channel whose activation or weight range is 0 (or not finite-positive) gets
``s = 1``; scales are computed in float64.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from mosaicquant.errors import UserInputError, unknown_name
from mosaicquant.methods.rotation import DecoderLayerParts, model_parts

__all__ = [
    "DEFAULT_ALPHA",
    "smooth_scales",
    "smoothing_input_names",
    "collect_input_absmax",
    "smooth_model",
]

DEFAULT_ALPHA = 0.85


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} is out of range: allowed [0, 1]")
    return float(alpha)


def smooth_scales(
    act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """SmoothQuant per-channel scales ``s_j = max|X_j|^α / max|W_j|^(1-α)``.

    Args:
        act_absmax: ``[K]`` per-input-channel max |activation| over calibration tokens.
        weight_absmax: ``[K]`` per-input-channel max |weight| over the rows of the linears
            reading that input.
        alpha: migration strength in [0, 1] (0: no change to activations beyond weight
            balancing; 1: all of the activation range moves into the weights).

    Returns:
        ``float64 [K]`` positive scales; a channel with a zero activation or weight range
        gets 1.

    Raises:
        ValueError: shapes differ or are not 1-D, a negative or non-finite entry, or
            ``alpha`` outside [0, 1].

    Example:
        >>> smooth_scales(torch.tensor([16.0, 1.0]), torch.tensor([1.0, 1.0]), alpha=0.5)
        tensor([4., 1.], dtype=torch.float64)
    """
    alpha = _check_alpha(alpha)
    if act_absmax.dim() != 1 or act_absmax.shape != weight_absmax.shape:
        raise ValueError(
            f"act_absmax and weight_absmax must be 1-D of the same length, got "
            f"{tuple(act_absmax.shape)} and {tuple(weight_absmax.shape)}"
        )
    a = act_absmax.detach().to(torch.float64)
    w = weight_absmax.detach().to(device=a.device, dtype=torch.float64)
    for name, t in (("act_absmax", a), ("weight_absmax", w)):
        if not torch.isfinite(t).all() or (t < 0).any():
            raise ValueError(f"{name} must hold finite values >= 0")
    valid = (a > 0) & (w > 0)
    ones = torch.ones_like(a)
    s = torch.where(valid, a, ones).pow(alpha) / torch.where(valid, w, ones).pow(1.0 - alpha)
    return torch.where(valid, s, ones)


def _groups(
    layer: DecoderLayerParts, smooth_vo: bool, smooth_up_down: bool
) -> list[tuple[str, list[str]]]:
    """``(source part, [reading linear parts])`` pairs of one layer, in application order."""
    groups = [
        ("input_norm", ["q_proj", "k_proj", "v_proj"]),
        ("post_attention_norm", ["gate_proj", "up_proj"]),
    ]
    if smooth_vo:
        groups.append(("v_proj", ["o_proj"]))
    if smooth_up_down:
        groups.append(("up_proj", ["down_proj"]))
    return groups


def smoothing_input_names(
    model: nn.Module, *, smooth_vo: bool = False, smooth_up_down: bool = False
) -> list[str]:
    """Names of the linears whose input statistics :func:`smooth_model` reads.

    One per group: q_proj (its input is shared by k/v_proj), gate_proj (shared by up_proj),
    and o_proj / down_proj when those groups are enabled. Pass the list to
    :func:`collect_input_absmax`.

    Raises:
        UserInputError: unsupported model.
    """
    parts = model_parts(model)
    names = []
    for layer in parts.layers:
        for _, readers in _groups(layer, smooth_vo, smooth_up_down):
            names.append(layer.name(readers[0]))
    return names


def collect_input_absmax(
    model: nn.Module,
    calib_tokens: torch.Tensor,
    module_names: Iterable[str],
    *,
    batch_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Per-channel max |input| of chosen modules over calibration batches (forward hooks).

    Args:
        model: a causal LM taking ``input_ids``.
        calib_tokens: ``int [n, seqlen]`` token ids.
        module_names: fully qualified names of modules whose input (first positional
            argument, last dim = channels) is measured.
        batch_size: sequences per forward pass.

    Returns:
        ``{name: float32 [channels]}`` on the CPU: max over all tokens of ``|x[..., j]|``.

    Raises:
        ValueError: ``calib_tokens`` not a 2-D integer tensor with at least one token,
            ``batch_size < 1``, or no module names.
        UserInputError: a name that is not a module of ``model`` (with did-you-mean).
    """
    if calib_tokens.dim() != 2 or calib_tokens.is_floating_point() or calib_tokens.numel() == 0:
        raise ValueError(
            f"calib_tokens must be a non-empty 2-D integer tensor [n, seqlen], got "
            f"{calib_tokens.dtype} of shape {tuple(calib_tokens.shape)}"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    names = list(dict.fromkeys(module_names))
    if not names:
        raise ValueError("module_names is empty: name at least one module to measure")
    modules = dict(model.named_modules())
    for name in names:
        if name not in modules:
            raise unknown_name("module", name, [n for n in modules if n])
    absmax: dict[str, torch.Tensor] = {}

    def make_hook(name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            current = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).to("cpu", torch.float32)
            previous = absmax.get(name)
            absmax[name] = current if previous is None else torch.maximum(previous, current)

        return hook

    handles = [modules[name].register_forward_pre_hook(make_hook(name)) for name in names]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for start in range(0, calib_tokens.shape[0], batch_size):
                batch = calib_tokens[start : start + batch_size].to(device)
                model(input_ids=batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return absmax


def _weight_absmax(linears: list[nn.Linear]) -> torch.Tensor:
    return torch.stack(
        [lin.weight.detach().abs().to(torch.float64).amax(dim=0) for lin in linears]
    ).amax(dim=0)


def _scale_columns_(linear: nn.Linear, s: torch.Tensor) -> None:
    w = linear.weight
    w.data.copy_((w.detach().to(torch.float64) * s.to(w.device)[None, :]).to(w.dtype))


def _scale_rows_(linear: nn.Linear, s: torch.Tensor) -> None:
    w = linear.weight
    w.data.copy_((w.detach().to(torch.float64) / s.to(w.device)[:, None]).to(w.dtype))
    if linear.bias is not None:
        b = linear.bias
        b.data.copy_((b.detach().to(torch.float64) / s.to(b.device)).to(b.dtype))


def _group_act(
    act_absmax: Mapping[str, torch.Tensor], layer: DecoderLayerParts, readers: list[str], size: int
) -> torch.Tensor:
    names = [layer.name(part) for part in readers]
    found = [act_absmax[n] for n in names if n in act_absmax]
    if not found:
        raise UserInputError(
            f"act_absmax has no entry for any of {', '.join(names)} (they share one input); "
            "collect it with collect_input_absmax(model, tokens, smoothing_input_names(model))"
        )
    for name in names:
        shape = tuple(act_absmax[name].shape) if name in act_absmax else (size,)
        if shape != (size,):
            raise UserInputError(f"act_absmax['{name}'] has shape {shape}, expected ({size},)")
    return torch.stack([t.detach().to("cpu", torch.float64) for t in found]).amax(dim=0)


def smooth_model(
    model: nn.Module,
    act_absmax: Mapping[str, torch.Tensor],
    alpha: float = DEFAULT_ALPHA,
    *,
    smooth_vo: bool = False,
    smooth_up_down: bool = False,
) -> dict:
    """Apply SmoothQuant scaling in place; the float model computes the same function.

    Args:
        model: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``.
        act_absmax: ``{linear name: [in_features]}`` max |input| of the *unsmoothed* model,
            e.g. from :func:`collect_input_absmax` with :func:`smoothing_input_names`. For a
            group of linears sharing an input (q/k/v, gate/up) any member's entry serves
            (several are combined by max).
        alpha: migration strength in [0, 1].
        smooth_vo: also smooth v_proj → o_proj (scales shared across the query heads of a
            grouped-query KV head, so it is valid for any head grouping).
        smooth_up_down: also smooth up_proj → down_proj.

    Returns:
        JSON-serialisable description: ``alpha``, ``groups`` (list of ``{"source",
        "linears", "min_scale", "max_scale"}``).

    Raises:
        ValueError: ``alpha`` out of range. UserInputError: unsupported model or part, a
            missing or misshaped ``act_absmax`` entry. Statistics are checked for every
            layer before the model is modified.
    """
    alpha = _check_alpha(alpha)
    for flag_name, flag in (("smooth_vo", smooth_vo), ("smooth_up_down", smooth_up_down)):
        if not isinstance(flag, bool):
            raise UserInputError(f"{flag_name}={flag!r} must be True or False")
    parts = model_parts(model)
    plan = []
    for layer in parts.layers:
        for source, readers in _groups(layer, smooth_vo, smooth_up_down):
            size = getattr(layer, readers[0]).in_features
            plan.append((layer, source, readers, _group_act(act_absmax, layer, readers, size)))

    groups = []
    with torch.no_grad():
        for layer, source, readers, act in plan:
            linears = [getattr(layer, part) for part in readers]
            weight = _weight_absmax(linears)
            if source == "v_proj":
                s = _shared_vo_scales(layer, act, weight, alpha)
                kv = s.reshape(
                    layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim
                )
                _scale_rows_(layer.v_proj, kv[:, 0, :].reshape(-1))
            else:
                s = smooth_scales(act, weight, alpha)
                if source == "up_proj":
                    _scale_rows_(layer.up_proj, s)
                else:
                    norm = getattr(layer, source)
                    parts.set_gain(norm, parts.gain(norm) / s.to(norm.weight.device))
            for linear in linears:
                _scale_columns_(linear, s)
            groups.append(
                {
                    "source": layer.name(source),
                    "linears": [layer.name(part) for part in readers],
                    "min_scale": float(s.min()),
                    "max_scale": float(s.max()),
                }
            )
    return {"alpha": alpha, "groups": groups}


def _shared_vo_scales(
    layer: DecoderLayerParts, act: torch.Tensor, weight: torch.Tensor, alpha: float
) -> torch.Tensor:
    """o_proj input scales ``[num_heads · head_dim]``, equal across the query heads of a KV head."""
    per_kv = (layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim)
    act_kv = act.reshape(per_kv).amax(dim=1)
    weight_kv = weight.reshape(per_kv).amax(dim=1)
    s_kv = smooth_scales(act_kv.reshape(-1), weight_kv.reshape(-1), alpha).reshape(
        layer.num_kv_heads, 1, layer.head_dim
    )
    return s_kv.expand(per_kv).reshape(-1)
