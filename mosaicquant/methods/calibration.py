"""Layer-by-layer calibration: per-linear input statistics with sequential propagation.

The calibration tokens run through the embeddings once; then each decoder layer in turn:

1. runs on its inputs with hooks on its linears that accumulate, per linear, the input
   second-moment matrix ``H = mean_t x_t x_tᵀ`` (the GPTQ Hessian up to a factor 2; its
   diagonal is SPEC §1.4's ``h_k``), the per-channel absolute maximum, and the token count.
   The input seen is the one the quantized layer will see: after any online transform
   (e.g. the Hadamard on the down_proj input), before activation quantization;
2. hands the statistics to a callback that quantizes the layer in place;
3. runs again — now quantized — to produce the next layer's inputs, so later layers are
   calibrated on what they will actually receive (``propagate="quantized"``; the GPTQ
   convention). ``propagate="float"`` keeps float inputs throughout.

Decoder layers are found by module structure (``model.get_decoder().layers``), never by the
model's name; the keyword arguments a layer receives (rotary embeddings, masks, positions)
are captured from a real forward pass and replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mosaicquant import progress
from mosaicquant.methods.gptq import accumulate_hessian, gptq_quantize
from mosaicquant.methods.qlinear import ActQuantSpec, fake_quant_linear_from, set_module

__all__ = ["LinearStats", "decoder_layers", "calibrate_layerwise", "collect_stats", "gptq_quantize_model"]


@dataclass
class LinearStats:
    """Input statistics of one linear layer."""

    in_features: int
    hessian: torch.Tensor = None
    absmax: torch.Tensor = None
    n_tokens: int = 0
    keep_hessian: bool = True
    keep_inputs: bool = False
    #: the inputs themselves, ``[n_tokens, K]`` float32, when ``keep_inputs`` (else ``None``)
    inputs: torch.Tensor = None

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        batch_absmax = x.abs().amax(dim=0)  # NaN and Inf propagate: one check of [K] values covers x
        if not torch.isfinite(batch_absmax).all():
            raise ValueError("calibration activations hold NaN or Inf values")
        if self.absmax is None:
            self.absmax = torch.zeros(self.in_features, device=x.device)
            if self.keep_hessian:
                self.hessian = torch.zeros(self.in_features, self.in_features, device=x.device)
        self.absmax = torch.maximum(self.absmax, batch_absmax)
        if self.keep_hessian:
            self.hessian, self.n_tokens = accumulate_hessian(self.hessian, x, self.n_tokens)
        else:
            self.n_tokens += x.shape[0]
        if self.keep_inputs:
            self.inputs = x.clone() if self.inputs is None else torch.cat([self.inputs, x])

    @property
    def diag(self) -> torch.Tensor:
        return torch.diagonal(self.hessian).clone()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (``model.get_decoder().layers``).

    Raises:
        ValueError: the model has no such structure (names the class).
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.get_decoder().layers)")
    return layers


class _Stop(Exception):
    pass


def _capture_layer_inputs(model: nn.Module, tokens: torch.Tensor, batch_size: int, device):
    """Layer 0's hidden states and every layer's keyword arguments, per batch.

    The keyword arguments are captured layer by layer because they can differ between layers
    (Gemma 3's sliding-window layers get their own mask and rotary table); the pass stops
    before the last layer runs.
    """
    layers = decoder_layers(model)
    hidden0: list[torch.Tensor] = []
    kwargs_of: list[list[dict]] = [[] for _ in layers]

    def hook(module, args, kwargs, _index):
        hidden = args[0] if args else kwargs.get("hidden_states")
        kw = {k: v for k, v in kwargs.items()
              if k not in ("hidden_states", "past_key_values", "past_key_value", "use_cache")}
        if _index == 0:
            hidden0.append(hidden.detach())
        kwargs_of[_index].append(kw)
        if _index == len(layers) - 1:
            raise _Stop

    handles = [layer.register_forward_pre_hook(lambda m, a, k, _i=i: hook(m, a, k, _i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    starts = range(0, tokens.shape[0], batch_size)
    try:
        for start in progress.bar(starts, desc="calibration inputs", unit="batch"):
            batch = tokens[start:start + batch_size].to(device)
            try:
                model(input_ids=batch, use_cache=False)
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return [(h, kw) for h, kw in zip(hidden0, kwargs_of[0], strict=True)], kwargs_of


def _with_kwargs(inputs, kwargs: list[dict]) -> list[tuple[torch.Tensor, dict]]:
    """``inputs``' hidden states paired with one layer's captured keyword arguments."""
    return [(hidden, kw) for (hidden, _), kw in zip(inputs, kwargs, strict=True)]


def _run_layer(layer: nn.Module, inputs) -> list[tuple[torch.Tensor, dict]]:
    out = []
    for hidden, kw in inputs:
        y = layer(hidden, **kw)
        y = y[0] if isinstance(y, (tuple, list)) else y
        out.append((y.detach(), kw))
    return out


def collect_stats(layer: nn.Module, inputs, keep_hessian: bool = True,
                  keep_inputs: bool = False) -> dict[str, LinearStats]:
    """Run ``layer`` on ``inputs`` and return the input statistics of each of its ``nn.Linear``.

    Linears that read the same input tensor (q/k/v, gate/up) share one :class:`LinearStats`
    object, so each distinct input's Hessian is accumulated once (and, with ``keep_inputs``, its
    inputs stored once).
    """
    stats: dict[str, LinearStats] = {}
    seen: dict[int, tuple[torch.Tensor, str]] = {}
    handles = []
    for name, mod in layer.named_modules():
        if isinstance(mod, nn.Linear):
            stats[name] = LinearStats(mod.in_features, keep_hessian=keep_hessian, keep_inputs=keep_inputs)

            def hook(module, args, output, _name=name):
                x = args[0]
                first = seen.get(id(x))
                if first is not None and first[0] is x:
                    stats[_name] = stats[first[1]]
                    return
                # keep a reference so the id cannot be reused by another tensor in this batch
                seen[id(x)] = (x, _name)
                stats[_name].add(x)

            handles.append(mod.register_forward_hook(hook))
    try:
        for batch in inputs:
            seen.clear()
            _run_layer(layer, [batch])
    finally:
        seen.clear()
        for h in handles:
            h.remove()
    return stats


@torch.no_grad()
def calibrate_layerwise(
    model: nn.Module,
    tokens: torch.Tensor,
    quantize_layer: Callable[[int, nn.Module, dict[str, LinearStats]], None],
    *,
    batch_size: int = 4,
    propagate: str = "quantized",
    keep_hessian: bool = True,
    keep_inputs: bool = False,
    log: Callable[[str], None] | None = None,
) -> None:
    """Calibrate and quantize a causal LM one decoder layer at a time.

    Args:
        model: the (already transformed) float model.
        tokens: ``LongTensor [n_samples, seqlen]`` calibration tokens.
        quantize_layer: ``fn(index, layer, stats)`` replacing the layer's linears in place;
            ``stats`` maps the linear's name inside the layer (e.g. ``"mlp.down_proj"``) to
            its :class:`LinearStats`.
        batch_size: sequences per forward pass.
        propagate: ``"quantized"`` (next layer sees the quantized layer's output) or ``"float"``.
        keep_hessian: accumulate the full ``K × K`` matrix (else only absmax/count).
        keep_inputs: also hand over each linear's inputs (``LinearStats.inputs``, one layer's at a
            time: ``n_samples · seqlen · K`` float32 values per distinct input).

    Raises:
        ValueError: bad ``propagate`` or no decoder layers.
    """
    if propagate not in ("quantized", "float"):
        raise ValueError(f"propagate={propagate!r} is not allowed: choose 'quantized' or 'float'")
    layers = decoder_layers(model)
    device = next(model.parameters()).device
    inputs, kwargs_of = _capture_layer_inputs(model, tokens, batch_size, device)
    for index, layer in enumerate(progress.bar(layers, desc="calibrate + quantize", unit="layer")):
        inputs = _with_kwargs(inputs, kwargs_of[index])
        stats = collect_stats(layer, inputs, keep_hessian=keep_hessian, keep_inputs=keep_inputs)
        float_out = None if propagate == "quantized" else _run_layer(layer, inputs)
        quantize_layer(index, layer, stats)
        inputs = _run_layer(layer, inputs) if propagate == "quantized" else float_out
        if log is not None and (index == len(layers) - 1 or index % 5 == 0):
            log(f"[mosaicquant]   layer {index + 1}/{len(layers)} quantized")


def gptq_quantize_model(
    model: nn.Module,
    calib_tokens: torch.Tensor,
    *,
    wbits: int,
    act: ActQuantSpec,
    w_group_size: int | None = None,
    percdamp: float = 0.01,
    act_order: bool = True,
    clip_search: bool = True,
    batch_size: int = 4,
    log=None,
) -> int:
    """Replace every decoder linear by its simulated quantized layer, GPTQ layer by layer.

    Each linear's input Hessian is taken on what it will see (after its online transform,
    with the earlier layers already quantized); weights are GPTQ'd symmetric with FP16
    scales when 4-bit (then packed), activations quantized by ``act``. ``wbits=16`` keeps
    float weights (no Hessians are accumulated) and only installs ``act``.

    Args:
        model: the (rotated) causal LM; changed in place.
        calib_tokens: ``LongTensor [n, seqlen]``.
        wbits: 2..8 or 16.
        act: the activation quantizer of every replaced linear.
        w_group_size / percdamp / act_order / clip_search: as
            :func:`~mosaicquant.methods.gptq.gptq_quantize`.
        batch_size: calibration sequences per forward pass.
        log: progress printer or ``None``.

    Returns:
        The number of linears replaced.

    Raises:
        ValueError: as :func:`~mosaicquant.methods.gptq.gptq_quantize` (e.g. a group size that does not divide K) or
            :func:`calibrate_layerwise`.
    """
    replaced = 0

    def quantize_layer(index, layer, stats):
        nonlocal replaced
        for name, st in stats.items():
            linear = layer.get_submodule(name)
            qweight = None
            if wbits < 16:
                qweight = gptq_quantize(
                    linear.weight.data.to(torch.float32), st.hessian, wbits, symmetric=True,
                    group_size=w_group_size, percdamp=percdamp, act_order=act_order, clip_search=clip_search,
                    scale_dtype=torch.float16 if wbits == 4 else None)
            set_module(layer, name, fake_quant_linear_from(linear, qweight, act, wbits))
            replaced += 1

    calibrate_layerwise(model, calib_tokens, quantize_layer, batch_size=batch_size, keep_hessian=wbits < 16,
                        log=log)
    return replaced
