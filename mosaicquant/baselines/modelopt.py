"""TensorRT-LLM's quantization recipes through NVIDIA ModelOpt, evaluated as fake-quant (SPEC §3).

TensorRT-LLM does not quantize models itself: its checkpoints come from NVIDIA ModelOpt
(``nvidia-modelopt``), whose ``mtq.quantize(model, CFG, forward_loop)`` inserts quantizers,
calibrates them on a forward loop and fake-quantizes in plain PyTorch. The same quantized model
is what ``modelopt.torch.export.export_hf_checkpoint`` writes for TensorRT-LLM (see
:mod:`mosaicquant.harness.tensorrt_llm`), so the accuracy measured here is the accuracy of the
checkpoint TensorRT-LLM would run (up to its kernels' accumulation order).

- ``int4_awq`` (``INT4_AWQ_CFG``): weights int4, groups of 128 along K, AWQ-lite scales;
  activations 16-bit. TensorRT-LLM ``W4A16_AWQ``.
- ``w4a8_awq`` (``W4A8_AWQ_BETA_CFG``): weights int4 g128 AWQ-lite with an fp8 per-tensor second
  scale; activations fp8 e4m3, per tensor, static. TensorRT-LLM ``W4A8_AWQ``.
- ``int8_sq`` (``INT8_SMOOTHQUANT_CFG``): SmoothQuant scaling, weights int8 per output channel,
  activations int8 per tensor, static. TensorRT-LLM ``W8A8_SQ_PER_CHANNEL``.
- ``fp8`` (``FP8_DEFAULT_CFG``): weights and activations fp8 e4m3, per tensor, static
  (calibrated max). TensorRT-LLM ``FP8``.

(The TensorRT-LLM name is the ``quant_algo`` ModelOpt 0.47 writes into ``hf_quant_config.json``.)

Choices:

- Calibration uses the sweep's shared tokens (``ctx.calib_tokens()``), like every other
  baseline, in batches of ``calib_batch_size`` without a KV cache; ModelOpt's own example script
  defaults to 512 samples of its own datasets instead.
- The output head stays in 16 bits: ModelOpt's configs already disable ``*lm_head*``, and the
  quantizers of the module ``model.get_output_embeddings()`` returns are disabled by its
  fully-qualified name as well, so a head named otherwise is kept too. The KV cache is not
  quantized (no KV entry is merged into the recipes), so ``kv_bits`` is 16.
- The recipe's config is deep-copied before the head entry is appended: ModelOpt's module
  constants stay untouched.
- Int4 groups on input sizes that are not a multiple of 128 (SmolLM2: 576): ModelOpt's
  fake-quant zero-pads K, so each row has one partial group; its TensorRT-LLM export refuses such
  layers, which the ``tensorrt-llm`` backend records as the reason its cell cannot run.
- FP8 on a CPU: ModelOpt 0.47 fake-quantizes e4m3 through ``torch.float8_e4m3fn`` casts when a
  tensor is not on CUDA, so ``fp8`` runs on the CPU. Before calibrating, a preflight quantizes
  one small linear layer with the recipe on the target device; where the installed ModelOpt
  cannot run the recipe there, the method raises :class:`NotAvailableError` naming the recipe,
  the device, the ModelOpt version and ModelOpt's own error, before any long work.

Example:
    ``mosaicquant run --model smollm2-135m --methods fp16,modelopt,modelopt:recipe=int8_sq --suites accuracy``
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mosaicquant.config import Config, check_range
from mosaicquant.errors import NotAvailableError
from mosaicquant.methods.modelopt_recipes import DEFAULT_RECIPE, RECIPES, Recipe, import_modelopt
from mosaicquant.methods.qlinear import output_head_name
from mosaicquant.registry import register_method

__all__ = ["ModelOptConfig", "modelopt"]

@dataclass(frozen=True)
class ModelOptConfig(Config):
    """ModelOpt options.

    Attributes:
        recipe: one of ``int4_awq`` (W4A16), ``w4a8_awq`` (W4A8), ``int8_sq`` (W8A8 SmoothQuant),
            ``fp8`` (W8A8 e4m3).
        calib_batch_size: sequences per calibration forward pass.
    """

    description = ("TensorRT-LLM recipes through NVIDIA ModelOpt (W4A16-AWQ, W4A8-AWQ, W8A8-SmoothQuant, FP8), "
                   "fake-quant")

    recipe: Literal["int4_awq", "w4a8_awq", "int8_sq", "fp8"] = DEFAULT_RECIPE
    calib_batch_size: int = 4

    def validate(self):
        check_range("calib_batch_size", self.calib_batch_size, 1, None, integer=True)


def _recipe_config(mtq, recipe: Recipe, head: str | None) -> dict[str, Any]:
    cfg = copy.deepcopy(getattr(mtq, recipe.config_name))
    if head:
        entries = cfg["quant_cfg"]
        if isinstance(entries, dict):  # older ModelOpt: pattern -> attributes
            entries[f"{head}.*"] = {"enable": False}
        else:
            entries.append({"quantizer_name": f"{head}.*", "enable": False})
    return cfg


def _preflight(mtq, version: str, name: str, recipe: Recipe, device: torch.device, dtype: torch.dtype) -> None:
    """Quantize one 128 x 128 linear with the recipe on ``device``: a clear error before calibration."""
    probe = torch.nn.Sequential(torch.nn.Linear(128, 128, bias=False))
    with torch.no_grad():
        probe[0].weight.copy_(torch.randn(128, 128, generator=torch.Generator().manual_seed(1)) / 128**0.5)
    probe = probe.to(device=device, dtype=dtype)
    # a generator of its own: the cell's global random state stays as the runner seeded it
    x = torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    try:
        with torch.no_grad():
            mtq.quantize(probe, copy.deepcopy(getattr(mtq, recipe.config_name)), lambda m: m(x))
            probe(x)
    except Exception as exc:  # noqa: BLE001 - re-raised with the recipe, device and version named
        raise NotAvailableError(
            f"ModelOpt {version} cannot run recipe {name!r} ({recipe.config_name}) on {device.type} "
            f"with {str(dtype).removeprefix('torch.')} weights: {type(exc).__name__}: {exc}"
        ) from exc


def _count_quantized_linears(model: torch.nn.Module) -> int:
    count = 0
    for module in model.modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is not None and getattr(quantizer, "is_enabled", False):
            count += 1
    return count


@register_method("modelopt", config=ModelOptConfig, description=ModelOptConfig.description)
def modelopt(model, config: ModelOptConfig, ctx):
    """Quantize ``model`` in place with the ModelOpt config of ``config.recipe``.

    Raises:
        NotAvailableError: ModelOpt missing, or the recipe cannot run on ``ctx.device``.
    """
    mtq, version = import_modelopt()
    recipe = RECIPES[config.recipe]
    dtype = next(model.parameters()).dtype
    _preflight(mtq, version, config.recipe, recipe, ctx.device, dtype)

    head = output_head_name(model)
    calib = ctx.calib_tokens()
    batch = config.calib_batch_size

    def forward_loop(m):
        with torch.no_grad():
            for start in range(0, calib.shape[0], batch):
                m(calib[start:start + batch].to(ctx.device), use_cache=False)

    ctx.log(f"[mosaicquant]   modelopt {version}: {recipe.config_name} on {calib.shape[0]} x {calib.shape[1]} tokens")
    mtq.quantize(model, _recipe_config(mtq, recipe, head), forward_loop)
    ctx.info.update(
        wbits=recipe.wbits, abits=recipe.abits, kv_bits=16, recipe=config.recipe,
        modelopt_config=recipe.config_name, modelopt_version=version, trtllm_quant_algo=recipe.trtllm_quant_algo,
        weights=recipe.weights, activations=recipe.activations, output_head=head,
        quantized_linears=_count_quantized_linears(model), exec_path="simulated (ModelOpt fake-quant)",
    )
    return model
