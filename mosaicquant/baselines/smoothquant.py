"""SmoothQuant W4A4: per-channel smoothing folded into the norms, then RTN (SPEC §3).

1. **Statistics**: per-channel ``max|X_j|`` of the inputs of q/k/v_proj and gate/up_proj
   over the calibration tokens (:func:`mosaicquant.methods.smoothing.collect_input_absmax`).
2. **Smoothing** (:func:`mosaicquant.methods.smoothing.smooth_model`, function-preserving):
   ``s_j = max|X_j|^α / max|W_j|^(1-α)``, ``1/s`` folded into ``input_layernorm`` and
   ``post_attention_layernorm``, ``s`` into the columns of the linears reading them.
   α = 0.85 (the authors' value for Llama-2/3).
3. **RTN W4A4** (as the ``rtn`` baseline): weights per output channel, symmetric, with the
   RTN clipping search; activations per token, symmetric, clip ``a_clip`` (1.0 by default).
   The output head stays in 16 bits; the KV cache is not quantized (SmoothQuant's W4A4
   variant as others report it quantizes the linears only).

**α search** (``alpha_search=true``): one α for the whole model, chosen from
``alpha_grid`` (0.30, 0.35, …, 0.95) by a calibration loss computed without running the
model once per α. From the same forward pass that measures ``max|X_j|``, every
``search_stride``-th token row of each smoothed input is kept (``X``, float model, before
smoothing). For each α and each smoothed linear ``W`` of each layer,

    ``loss_W(α) = ‖Qa(X / s) · Qw(W diag(s))ᵀ − X Wᵀ‖²_F / ‖X Wᵀ‖²_F``

with ``Qa``/``Qw`` the method's activation and weight quantizers (by default without the
weight clip search, which would cost 80 quantizations per candidate; ``search_clip=true``
includes it) and ``s`` the smoothing scales of that α; the calibration loss is the mean of ``loss_W`` over all
smoothed linears (a normalised output error, so wide and narrow layers weigh alike). The α
with the lowest loss is used; every α's loss is reported in ``ctx.info``. The search sees
float inputs (it does not model error propagation between layers) and picks one global α,
like the authors' α sweeps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mosaicquant.config import Config, check_range
from mosaicquant.errors import UserInputError
from mosaicquant.methods.qlinear import ActQuantSpec, fake_quant_linear_from, quantize_weight, replace_linears
from mosaicquant.methods.quant import Quantized
from mosaicquant.methods.rotation import TRANSFORM_SUPPORTS, model_parts
from mosaicquant.methods.smoothing import (
    DEFAULT_ALPHA,
    collect_input_absmax,
    smooth_model,
    smooth_scales,
    smoothing_input_names,
)
from mosaicquant.methods.speed_form import check_w4a4, dense_w4
from mosaicquant.registry import register_method

__all__ = [
    "DEFAULT_ALPHA_GRID",
    "SmoothQuantConfig",
    "smoothed_output_loss",
    "search_alpha",
    "collect_smoothing_inputs",
    "smoothquant",
]

#: 0.30, 0.35, ..., 0.95
DEFAULT_ALPHA_GRID = tuple(round(0.30 + 0.05 * i, 2) for i in range(14))


@dataclass(frozen=True)
class SmoothQuantConfig(Config):
    """SmoothQuant options (command line: ``smoothquant:alpha_search=true:a_clip=0.9``).

    Attributes:
        alpha: migration strength in [0, 1] (used when ``alpha_search`` is off).
        alpha_search: choose α from ``alpha_grid`` by the calibration loss (module docstring).
        alpha_grid: candidate α values, each in [0, 1].
        search_stride: keep every ``search_stride``-th calibration token row for the search.
        search_clip: use the weight clip search inside the α search too (off by default: it
            costs 80 weight quantizations per candidate; the final weights always use
            ``w_clip_search``).
        wbits / abits: weight / activation bits, 2..8, or 16 (unquantized).
        w_clip_search: search a per-channel clip ratio for the weights.
        a_clip: fraction of each token's activation range kept, (0, 1].
        calib_batch: calibration sequences per forward pass.
    """

    description = "SmoothQuant (alpha 0.85, optional alpha search) + RTN W4A4 (per-channel W, per-token A)"

    alpha: float = DEFAULT_ALPHA
    alpha_search: bool = False
    alpha_grid: tuple[float, ...] = DEFAULT_ALPHA_GRID
    search_stride: int = 32
    search_clip: bool = False
    wbits: int = 4
    abits: int = 4
    w_clip_search: bool = True
    a_clip: float = 1.0
    calib_batch: int = 4

    def validate(self):
        check_range("alpha", self.alpha, 0.0, 1.0)
        if not self.alpha_grid:
            raise UserInputError("alpha_grid is empty: give at least one value in [0, 1]")
        for value in self.alpha_grid:
            check_range("alpha_grid entry", value, 0.0, 1.0)
        check_range("search_stride", self.search_stride, 1, None, integer=True)
        check_range("wbits", self.wbits, 2, 8, integer=True, extra=(16,))
        check_range("abits", self.abits, 2, 8, integer=True, extra=(16,))
        check_range("a_clip", self.a_clip, 0.01, 1.0)
        check_range("calib_batch", self.calib_batch, 1, None, integer=True)

    def act_spec(self) -> ActQuantSpec:
        """Per-token symmetric activation quantizer."""
        return ActQuantSpec(bits=self.abits, symmetric=True, clip_ratio=self.a_clip)

    def quantize_weight(self, weight: torch.Tensor, clip_search: bool | None = None) -> Quantized | None:
        """The RTN-quantized weight (``None`` for ``wbits=16``); ``clip_search`` overrides ``w_clip_search``."""
        if self.wbits == 16:
            return None
        search = self.w_clip_search if clip_search is None else clip_search
        return quantize_weight(weight, self.wbits, symmetric=True, clip_search=search)


def _smoothed_groups(model: nn.Module) -> list[tuple[str, list[nn.Linear]]]:
    """``(statistics name, linears sharing that input)`` per smoothed group, as smooth_model."""
    parts = model_parts(model)
    names = smoothing_input_names(model)
    groups = []
    for layer in parts.layers:
        for readers in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            groups.append((layer.name(readers[0]), [getattr(layer, r) for r in readers]))
    if [g[0] for g in groups] != names:
        raise ValueError("internal mismatch between the smoothed groups and smoothing_input_names")
    return groups


def collect_smoothing_inputs(
    model: nn.Module, calib_tokens: torch.Tensor, *, stride: int, batch_size: int = 4
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``max|X_j|`` of every smoothed input and every ``stride``-th token row of it (one pass).

    Args:
        model: the float model (before smoothing).
        calib_tokens: ``LongTensor [n, seqlen]``.
        stride: keep token rows ``0, stride, 2·stride, ...`` of each batch (flattened).
        batch_size: sequences per forward pass.

    Returns:
        ``(absmax, samples)``: ``{name: [K]}`` and ``{name: float32 [rows, K]}`` on the CPU,
        keyed by :func:`~mosaicquant.methods.smoothing.smoothing_input_names`.

    Raises:
        ValueError / UserInputError: as :func:`~mosaicquant.methods.smoothing.collect_input_absmax`.
    """
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride={stride!r} must be a positive integer")
    names = smoothing_input_names(model)
    modules = dict(model.named_modules())
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    def make_hook(name):
        def hook(_module, args):
            x = args[0].detach()
            rows[name].append(x.reshape(-1, x.shape[-1])[::stride].to("cpu", torch.float32))

        return hook

    handles = [modules[n].register_forward_pre_hook(make_hook(n)) for n in names]
    try:
        absmax = collect_input_absmax(model, calib_tokens, names, batch_size=batch_size)
    finally:
        for h in handles:
            h.remove()
    return absmax, {n: torch.cat(r) for n, r in rows.items()}


@torch.no_grad()
def smoothed_output_loss(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    act_absmax: torch.Tensor,
    alpha: float,
    config: SmoothQuantConfig,
) -> float:
    """Mean normalised output error of the linears sharing input ``x`` after smoothing + RTN.

    ``mean_W ‖Qa(X / s) · Qw(W diag(s))ᵀ − X Wᵀ‖²_F / ‖X Wᵀ‖²_F`` with
    ``s = smooth_scales(act_absmax, max_W |W|, alpha)`` and the config's quantizers (the
    weight clip search only with ``config.search_clip``).

    Args:
        x: ``[T, K]`` sampled inputs (float model).
        weights: the ``[N_i, K]`` weights reading ``x``.
        act_absmax: ``[K]`` max |input| over all calibration tokens.
        alpha: migration strength.
        config: the quantizers (bits, clip).

    Returns:
        The mean over ``weights`` of the normalised squared error.

    Raises:
        ValueError: as :func:`~mosaicquant.methods.smoothing.smooth_scales`.
    """
    w_absmax = torch.stack([w.detach().abs().to(torch.float64).amax(dim=0) for w in weights]).amax(dim=0)
    s = smooth_scales(act_absmax, w_absmax, alpha)
    xf = x.to(torch.float32)
    xq = config.act_spec()((x.to(torch.float64) / s).to(torch.float32))
    total = 0.0
    for w in weights:
        wf = w.detach().to(torch.float32)
        ws = (w.detach().to(torch.float64) * s[None, :]).to(torch.float32)
        qw = config.quantize_weight(ws, clip_search=config.search_clip)
        wq = ws if qw is None else qw.dequantize(torch.float32)
        ref = xf @ wf.T
        total += float(((xq @ wq.T - ref) ** 2).sum() / (ref**2).sum().clamp_min(1e-30))
    return total / len(weights)


def search_alpha(
    groups: list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]],
    config: SmoothQuantConfig,
) -> tuple[float, dict[float, float]]:
    """Pick α from ``config.alpha_grid`` minimising the mean :func:`smoothed_output_loss`.

    Args:
        groups: ``(x samples, weights, act_absmax)`` per smoothed input.
        config: grid and quantizers.

    Returns:
        ``(best α, {α: loss})``; ties go to the first α of the grid.

    Raises:
        ValueError: no groups, or a non-finite loss.
    """
    if not groups:
        raise ValueError("search_alpha needs at least one smoothed input")
    losses: dict[float, float] = {}
    for alpha in config.alpha_grid:
        loss = sum(smoothed_output_loss(x, ws, a, alpha, config) for x, ws, a in groups) / len(groups)
        if not math.isfinite(loss):
            raise ValueError(f"the calibration loss at alpha={alpha} is not finite")
        losses[float(alpha)] = loss
    best = min(losses, key=lambda a: losses[a])
    return best, losses


def _check_absmax(absmax: Mapping[str, torch.Tensor]) -> None:
    for name, value in absmax.items():
        if not torch.isfinite(value).all():
            raise ValueError(f"calibration activations of '{name}' hold NaN or Inf values")


def _speed_form(model, config: SmoothQuantConfig, ctx):
    # the smoothing scales fold into the preceding norms and linears: no run-time op
    check_w4a4("smoothquant", config.wbits, config.abits)
    return dense_w4(model, config.act_spec(), config.wbits), {"transform": "smoothing (folded, no run-time op)"}


@register_method("smoothquant", config=SmoothQuantConfig, description=SmoothQuantConfig.description,
                 speed_form=_speed_form, supports=TRANSFORM_SUPPORTS)
def smoothquant(model, config: SmoothQuantConfig, ctx):
    """Smooth ``model`` (fixed or searched α) and quantize it with RTN W4A4; fills ``ctx.info``."""
    t0 = time.perf_counter()
    calib = ctx.calib_tokens()
    alpha, losses = config.alpha, None
    if config.alpha_search:
        absmax, samples = collect_smoothing_inputs(model, calib, stride=config.search_stride,
                                                   batch_size=config.calib_batch)
        _check_absmax(absmax)
        groups = [(samples[name], [lin.weight.data for lin in linears], absmax[name])
                  for name, linears in _smoothed_groups(model)]
        alpha, losses = search_alpha(groups, config)
        ctx.log(f"[smoothquant] alpha search: best alpha {alpha} (loss {losses[alpha]:.4g})")
    else:
        absmax = collect_input_absmax(model, calib, smoothing_input_names(model), batch_size=config.calib_batch)
        _check_absmax(absmax)
    t_search = time.perf_counter() - t0
    smoothing = smooth_model(model, absmax, alpha)
    act = config.act_spec()

    def make(name, linear):
        return fake_quant_linear_from(linear, config.quantize_weight(linear.weight.data), act, config.wbits)

    replaced = replace_linears(model, make)
    ctx.info.update(
        wbits=config.wbits, abits=config.abits, kv_bits=16, exec_path="simulated (fake-quant)",
        alpha=alpha, alpha_search=config.alpha_search,
        alpha_losses_calib={str(a): round(v, 6) for a, v in losses.items()} if losses else None,
        smoothing_scale_range=[min(g["min_scale"] for g in smoothing["groups"]),
                               max(g["max_scale"] for g in smoothing["groups"])],
        quantized_linears=len(replaced),
        timing={"stats_search_s": round(t_search, 2), "total_s": round(time.perf_counter() - t0, 2)},
    )
    return model
