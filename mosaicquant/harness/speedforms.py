"""Executable forms for the speed suites: each method's format on any model, kernels included.

Two things live here.

1. :func:`executable` turns a quantized model into what the speed suites time: every
   simulated 4-bit layer the W4A4 kernels can run becomes a kernel-backed layer
   (:func:`mosaicquant.kernels.convert.kernelize`: online input transform, activation
   quantization, dense W4A4 GEMM or ZipperEngine). If any quantized layer cannot run on the
   kernels, it raises :class:`~mosaicquant.errors.Unavailable` naming the layer and
   the reason: a method with no fast path is never timed on a stand-in.

2. :func:`speed_form` builds a method's *format* on a random-weight shape model
   (:mod:`mosaicquant.harness.shapes`) without calibration data, with the speed form the method
   registered (``@register_method(..., speed_form=fn)``, shared pieces in
   :mod:`mosaicquant.methods.speed_form`): the same transforms the
   method applies (QuaRot-style rotation with online Hadamards for ``quarot``,
   ``spinquant`` and ``mosaicquant``), the same weight and activation formats, with
   round-to-nearest integers in place of GPTQ (GPTQ changes the integers, not the format)
   and, for MosaicQuant, residual blocks chosen by the method's ``random`` score at the
   configured budget and block shape (the selection score changes which blocks, not how
   many); for Atom, seeded random salient channels (its ``diag(XᵀX)`` order needs data) kept
   at ``outlier_bits``, the rest in groups, round-to-nearest. The method's configured options
   (bits, clip ratios, budget, block, ``online_o``, outliers, group size) are honoured; a configuration the kernels cannot run is built anyway, and then
   :func:`executable` says why it has no fast path. The KV cache is the method's: its spec
   (:mod:`mosaicquant.methods.kvcache`; QuaRot's, SpinQuant's and Atom's 4-bit caches by default,
   MosaicQuant's with ``kvbits=4``) is installed as the method installs it, the fused decoder
   runs it as a 4-bit cache where its kernels can, and the records say ``kv_bits``.
   Methods registered with no speed form raise
   :class:`~mosaicquant.errors.Unavailable`. Methods registered ``data_free=True`` (they need no
   data at all: ``torchao``) run as they are and execute on their own kernels; one whose info
   names a ``torch_compile`` mode (``torchao:compile=true``) runs each quantized linear through
   ``torch.compile`` (:func:`compile_linears`).
"""

from __future__ import annotations

import torch
from torch import nn

from mosaicquant.errors import Unavailable
from mosaicquant.kernels.convert import FusedProjections, kernelize
from mosaicquant.kernels.hadamard_quant import fused_hadamard_reason
from mosaicquant.kernels.mixed_gemm import MixedQuantLinear
from mosaicquant.kernels.quant_linear import QuantLinear
from mosaicquant.kernels.tile_table import table_for
from mosaicquant.methods.calibration import decoder_layers
from mosaicquant.methods.kvcache import enable_kv_quant
from mosaicquant.methods.qlinear import FakeQuantLinear
from mosaicquant.registry import METHODS, get_method

__all__ = ["executable", "speed_form", "compile_linears", "FLOAT_PATH", "RECOMPILE_LIMIT"]

FLOAT_PATH = "torch BF16 (cuBLAS)"
#: compiled specializations a linear's forward may hold: each (input shape, weight shape) the suites
#: run is one (``dynamic=False``); past it a call fails instead of running eager unnoticed
RECOMPILE_LIMIT = 256
# token counts at which the execution path looks for QuantLinear's mid route (33 tokens to the prefill tiles)
MID_PROBE_M = (33, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2047)


def _merged_walk_on(device: torch.device) -> bool:
    """Whether kernel-backed layers on ``device`` run the swapped GEMM's merged walk where they hold its operands."""
    return table_for(device).merged_walk


def _has_kernel_layers(model: nn.Module) -> bool:
    return any(hasattr(m, "weight_nbytes") for m in model.modules())


def executable(model: nn.Module, info: dict) -> str:
    """Make ``model`` run on the kernels in place (once) and return the execution path.

    The form that runs is recorded as ``info["speed"]["form"]``: ``bf16`` (a float model on
    cuBLAS), ``native`` (a method whose layers execute on their own kernels, e.g. torchao's tensor
    subclasses) or ``kernels`` (the simulated format on this package's W4A4 / mixed kernels).

    Args:
        model: a float model, a simulated (fake-quant) model, or an already converted one.
        info: the method's info dict; ``exec_path_speed``, ``kernel_layers`` and ``speed.form`` are set there.

    Raises:
        Unavailable: a quantized layer has no kernel path (the message names it and why).
    """

    simulated = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    if not simulated and not _has_kernel_layers(model):
        # a float model, or a method whose layers are executable as they are (e.g. torchao's)
        path = info.get("exec_path") if info.get("wbits", 16) < 16 and info.get("exec_path") else FLOAT_PATH
        form = "bf16" if path == FLOAT_PATH else "native"
        mode = info.get("torch_compile")
        if mode and path != FLOAT_PATH:
            compiled = compile_linears(model, mode)
            path += f"; torch.compile(mode={mode!r}, dynamic=False) of each of {compiled} quantized linears"
            form = "compiled"
            info.setdefault("speed", {})["compile_mode"] = mode
        info["exec_path_speed"] = path
        info.setdefault("speed", {})["form"] = form
        return path
    if simulated:
        report = kernelize(model)
        if report.skipped:
            name, reason = next(iter(report.skipped.items()))
            raise Unavailable(f"no fast path: {len(report.skipped)} quantized linear(s) cannot run on the W4A4 "
                              f"or mixed 4/8-bit kernels, e.g. {name}: {reason}")
        info["kernel_layers"] = len(report.converted)
    fused = any(getattr(getattr(m, "quant", None), "block_shape", None) is not None for m in model.modules())
    w4 = [m for m in model.modules() if isinstance(getattr(m, "quant", None), QuantLinear)]
    mixed = [m for m in model.modules() if isinstance(m, MixedQuantLinear)]
    transformed = [m.input_transform for m in w4 if m.input_transform is not None]
    in_kernel = sum(1 for t in transformed if fused_hadamard_reason(t, torch.bfloat16) is None)
    groups = sorted({"/".join(m.names) for m in model.modules()
                     if isinstance(m, FusedProjections) and isinstance(m.quant, QuantLinear)})
    mixed_groups = sorted({"/".join(m.names) for m in model.modules()
                           if isinstance(m, FusedProjections) and isinstance(m.quant, MixedQuantLinear)})
    parts = []
    if w4:
        part = "Triton W4A4: act-quant + " + ("ZipperEngine (dense + fused residual)" if fused else "dense GEMM")
        if transformed:
            part += f"; online Hadamard on {len(transformed)} linear inputs"
            part += (" (fused with act-quant)" if in_kernel == len(transformed) else
                     f" ({in_kernel} fused with act-quant, {len(transformed) - in_kernel} in PyTorch)")
        if groups:
            part += "; one GEMM per " + ", ".join(groups)
        swapped = {m.quant.swap_min_m for m in w4 if m.quant.swap_ok and m.quant.swap_min_m is not None}
        merged = sum(1 for m in w4 if getattr(m.quant, "res_merged", None) is not None)
        if swapped:
            part += (f"; calls of >= {min(swapped)} tokens whose 128x128 output tiles fill the GPU (prefill): "
                     f"int8 activations + operand-swapped GEMM"
                     + (" with the residual blocks in its tail" if fused else "")
                     + (f" ({'every' if merged == len(w4) else f'{merged} of {len(w4)}'} residual layer"
                        f"{'s' if merged != 1 else ''}: base and residual of a kept block as one int8 operand, its "
                        f"dense steps skipped)" if merged and _merged_walk_on(w4[0].quant.qweight.device) else ""))
        top = max((m.quant.swap_decode[1] for m in w4 if m.quant.swap_decode is not None), default=0)
        for res, who in ((False, "layers without residual" if fused else "calls"), (True, "layers with residual")):
            decode = [m_ for m_ in range(1, top + 1) if any(
                (m.quant.block_shape is not None) == res and m.quant.swap_route(m_) == "decode" for m in w4)]
            if decode:
                kind = [m for m in w4 if (m.quant.block_shape is not None) == res]
                on = sum(1 for m in kind if m.quant.swap_route(decode[-1]) == "decode")
                part += (f"; {who} of {decode[0]}-{decode[-1]} tokens"
                         + (f" on {on} of {len(kind)} linears" if on < len(kind) else "")
                         + ": the swapped GEMM at decode tiles"
                         + (" with the residual blocks in its tail" if res else "")
                         + (f" (the other {len(kind) - on} on the packed kernel's wide tiles)"
                            if on < len(kind) and not res else ""))
        mid = [m for m in w4 if any(m.quant.swap_route(m_) == "mid" for m_ in MID_PROBE_M)]
        if mid:
            part += (f"; mid-sized calls on {len(mid)} of {len(w4)} linears, where they are short of output tiles: "
                     f"the swapped GEMM on mid tiles with split-K"
                     + (" (residual blocks of power-of-two scales in its int32 accumulator)"
                        if any(m.quant.block_shape is not None for m in mid) else ""))
        parallel = sorted(m_ for m_ in range(2, 33) if any(m.quant.uses_parallel_residual(m_) for m in w4))
        if parallel:
            part += (f"; calls of {parallel[0]}-{parallel[-1]} tokens on "
                     f"{sum(1 for m in w4 if m.quant.uses_parallel_residual(parallel[0]))} of {len(w4)} linears: "
                     f"the residual blocks in programs of their own")
            rows = sum(1 for m in w4 if m.quant.parallel_mode(parallel[0]) == "parallel_rows")
            if rows:
                part += f" (one per block row on {rows})"
        # stacked gate/up GEMMs whose MLP's down_proj quantizer does not take SiLU·mul (an online Hadamard)
        gate_ups = [mlp.fused_gate_up for mlp in model.modules()
                    if isinstance(getattr(mlp, "fused_gate_up", None), FusedProjections)
                    and getattr(getattr(mlp, "down_proj", None), "input_transform", None) is not None]
        gated = [m_ for m_ in range(2, 33) if any(g.quant.writes_gated(m_) for g in gate_ups)]
        if gated:
            part += (f"; {sum(1 for g in gate_ups if g.quant.writes_gated(gated[0]))} gate/up GEMMs writing "
                     f"SiLU·mul themselves at {gated[0]}-{gated[-1]} tokens (fused decoder, BF16)")
        gemv = sum(1 for m in w4 if m.quant.uses_gemv(1))
        if gemv:
            part += ("; calls of 1 token: the dp4a decode GEMV" + (" (residual included)" if fused else "")
                     + (f" on {gemv} of {len(w4)} linears" if gemv < len(w4) else ""))
        parts.append(part)
    if mixed:
        def describe(fmt):
            low = f"{fmt.lo_bits}-bit {'sym' if fmt.lo_symmetric else 'asym'}" + (
                f" g{fmt.group_size}" if fmt.group_size else "")
            return low + (f" + {fmt.k_hi} ch {fmt.hi_bits}-bit" if fmt.k_hi else "")
        formats = sorted({describe(m.fmt) for m in mixed})
        stacked = [m for m in model.modules() if isinstance(m, FusedProjections) and isinstance(m.quant, MixedQuantLinear)]
        inside = {id(g.quant) for g in stacked}
        n_linears = sum(len(g.names) for g in stacked) + sum(1 for m in mixed if id(m) not in inside)
        part = (f"Triton mixed-precision GEMM on {n_linears} linears (act-quant with gathered channels; "
                f"{'; '.join(formats[:3])}{'; ...' if len(formats) > 3 else ''})")
        if mixed_groups:
            part += "; one GEMM per " + ", ".join(mixed_groups)
        kinds = sorted({type(m.input_transform).__name__ for m in mixed if m.input_transform is not None})
        if kinds:
            part += "; input transforms in PyTorch (" + ", ".join(kinds) + ")"
        parts.append(part)
    path = " | ".join(parts)
    info["exec_path_speed"] = path
    info.setdefault("speed", {})["form"] = "kernels"
    return path


def compile_linears(model: nn.Module, mode: str) -> int:
    """Run every linear whose weight is a tensor subclass (a library's packed weights, e.g. torchao's)
    through ``torch.compile(mode=mode, dynamic=False)``, in place; returns how many.

    The compile happens at each new input shape's first call (the speed suites make that call
    before timing and record its seconds). A linear whose calls exceed :data:`RECOMPILE_LIMIT`
    specializations raises rather than falling back to eager.

    Raises:
        Unavailable: the model has no such linear (nothing to compile).
    """
    import torch._dynamo

    targets = [m for m in model.modules() if isinstance(m, nn.Linear) and type(m.weight.data) is not torch.Tensor]
    if not targets:
        raise Unavailable("torch.compile form: the model has no linear with a library's packed weights to compile")
    for module in [m for m in targets if not getattr(m, "_compiled_forward", False)]:  # once per linear
        compiled = torch.compile(module.forward, mode=mode, dynamic=False)

        def forward(*args, compiled=compiled, **kwargs):
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
                return compiled(*args, **kwargs)

        module.forward = forward
        module._compiled_forward = True
    return len(targets)


def _kv_spec(config, model: nn.Module):
    """The method's KV-cache spec from its config, or None (a method without one: a 16-bit cache)."""
    import inspect

    make = getattr(config, "kv_spec", None)
    if make is None:
        return None
    if "head_dim" in inspect.signature(make).parameters:  # SpinQuant's groups depend on the head size
        return make(int(decoder_layers(model)[0].self_attn.head_dim))
    return make()


def speed_form(method: str, model: nn.Module, config, ctx) -> nn.Module:
    """Apply ``method``'s data-free speed form to a random-weight model in place.

    Args:
        method: registered method name.
        model: a random-weight shape model.
        config: the method's config (its options are honoured).
        ctx: the :class:`~mosaicquant.harness.context.QuantContext`; ``ctx.info`` is filled.

    Raises:
        Unavailable: the method has no data-free speed form, or a configuration the W4A4
            kernels cannot run.
    """
    if method == "fp16":
        ctx.info.update(wbits=16, abits=16, kv_bits=16, exec_path=FLOAT_PATH, weights="random (speed only)")
        return model
    entry = get_method(method)
    if entry.data_free:
        model = entry.fn(model, config, ctx)
        ctx.info.update(weights="random (speed only)")
        return model
    if entry.speed_form is None:
        known = [e.name for e in METHODS.registered() if (e.speed_form is not None or e.data_free) and e.name != "fp16"]
        raise Unavailable(f"no speed form for '{method}' on a random-weight model: its format needs calibration "
                          f"data; speed forms exist for fp16, {', '.join(known)}")
    with torch.no_grad():
        n, notes = entry.speed_form(model, config, ctx)
    spec = _kv_spec(config, model)
    kv = None
    if spec is not None and spec.active:
        kv = enable_kv_quant(model, spec)
    ctx.info.update(wbits=config.wbits, abits=config.abits, kv_bits=spec.bits if spec is not None else 16,
                    kv_cache=kv, quantized_linears=n,
                    exec_path="data-free speed form (round-to-nearest integers, the method's format)",
                    weights="random (speed only)", speed_form=notes)
    return model
