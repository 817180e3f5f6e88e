"""What PyTorch users would pick instead of TensorRT-LLM on Hopper: torchao's ``quantize_`` recipes.

=========  ==================================================  =============================================
recipe     torchao config                                      what runs
=========  ==================================================  =============================================
int8_dyn   ``Int8DynamicActivationInt8WeightConfig()``         W8A8: weights int8 per output channel
                                                               (symmetric), activations int8 per token,
                                                               quantized at run time; the product is an int8
                                                               GEMM (``torchao.kernel.int_scaled_matmul`` →
                                                               ``torch._int_mm``) on CPU and CUDA alike
int4_wo    ``Int4WeightOnlyConfig(group_size=128,              W4A16: int4 weights in groups of 128 with
           int4_packing_format="tile_packed_to_4d")``          zero points (tinygemm layout); the product is
                                                               ``aten._weight_int4pack_mm`` (CUDA, bfloat16)
=========  ==================================================  =============================================

Choices:

- ``int4_wo`` uses the tinygemm layout, whose kernel ships inside PyTorch itself (the one
  gpt-fast uses), rather than torchao's default ``plain`` layout, whose kernels need the separate
  ``mslk`` package. That kernel exists on CUDA for bfloat16 only: on any other device or dtype
  the method raises :class:`NotAvailableError` before quantizing anything, so the runner records
  the cell as unavailable with that reason (never a stand-in).
- ``compile=true``: the form torchao documents as its fast one, ``quantize_`` then ``torch.compile``
  with ``mode="max-autotune"``. The speed suites compile each quantized linear (inductor fuses the
  activation quantizer, the int8 product and the rescale) before timing, and record the form as
  ``compiled``, the mode, and the first call's seconds per measured shape (which compiles it)
  apart from the timings (:func:`mosaicquant.harness.speedforms.compile_linears`). The mode run is
  ``max-autotune-no-cudagraphs``: the same kernels, tuned the same way, without inductor's own CUDA
  graphs, because the suites capture each whole step in one graph themselves. Perplexity is the
  same function, so the accuracy suite runs it uncompiled.
- ``set_inductor_config=False``: torchao's default changes global ``torch._inductor`` settings;
  the harness changes no global state.
- Every ``nn.Linear`` but the output head is quantized (by module type; the head is the module
  ``model.get_output_embeddings()`` returns). Linears whose input size is not a multiple of the
  group are left in float by torchao (``int4_wo``); ``quantized_linears`` counts what was
  converted. The KV cache is not quantized (``kv_bits`` 16).

Install: ``pip install 'mosaicquant[torchao]'`` (torchao 0.17/0.18 are built against torch 2.11;
their pure-Python paths, which is all ``int8_dyn`` needs on a CPU, also run with torch 2.13).

Example:
    ``mosaicquant run --model smollm2-135m --methods fp16,torchao:recipe=int8_dyn --suites accuracy``;
    ``--methods fp16,torchao:recipe=int8_dyn,torchao:recipe=int8_dyn:compile=true --suites throughput``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mosaicquant.config import Config
from mosaicquant.errors import NotAvailableError, import_optional
from mosaicquant.methods.qlinear import output_head_name
from mosaicquant.registry import register_method

__all__ = ["TorchAOConfig", "INSTALL_HINT", "COMPILE_MODE", "import_torchao", "recipe_config", "torchao"]

INSTALL_HINT = "pip install 'mosaicquant[torchao]' (torchao>=0.17,<0.19)"

#: torchao's documented ``mode="max-autotune"`` less inductor's CUDA graphs (the speed suites capture the step)
COMPILE_MODE = "max-autotune-no-cudagraphs"
_RECIPE_BITS = {"int8_dyn": (8, 8), "int4_wo": (4, 16)}
_EXEC_PATH = {
    "int8_dyn": "torchao int8 GEMM (Int8Tensor: int_scaled_matmul -> torch._int_mm)",
    "int4_wo": "torchao int4 weight-only (Int4TilePackedTo4dTensor -> aten._weight_int4pack_mm, tinygemm)",
}


@dataclass(frozen=True)
class TorchAOConfig(Config):
    """torchao options.

    Attributes:
        recipe: ``int8_dyn`` (int8 dynamic activations, int8 weights) or ``int4_wo`` (int4
            weight-only, groups of 128, CUDA bfloat16).
        compile: the speed suites time the quantized linears through ``torch.compile``
            (:data:`COMPILE_MODE`), the form torchao documents for speed; false times them eager.
    """

    description = "torchao quantize_ recipes: int8 dynamic-activation W8A8, int4 weight-only (group 128)"

    recipe: Literal["int8_dyn", "int4_wo"] = "int8_dyn"
    compile: bool = False


def import_torchao():
    """``torchao.quantization`` and torchao's version.

    Raises:
        NotAvailableError: torchao is not installed, with what to install.
    """
    return import_optional("torchao.quantization", "torchao", "torchao", INSTALL_HINT)


def recipe_config(quantization, recipe: str):
    """The torchao config object of ``recipe``."""
    if recipe == "int8_dyn":
        return quantization.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    return quantization.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d",
                                             set_inductor_config=False)


def _check_device(recipe: str, version: str, device: torch.device, dtype: torch.dtype) -> None:
    if recipe == "int4_wo" and (device.type != "cuda" or dtype != torch.bfloat16):
        raise NotAvailableError(
            f"torchao {version} recipe 'int4_wo' (Int4WeightOnlyConfig, tinygemm layout) runs only on a CUDA GPU "
            f"with bfloat16 weights; this cell has {device.type} and {str(dtype).removeprefix('torch.')} "
            "(use --device cuda --dtype bfloat16)"
        )


@register_method("torchao", config=TorchAOConfig, description=TorchAOConfig.description, data_free=True,
                 seeded=False)
def torchao(model, config: TorchAOConfig, ctx):
    """Quantize every linear but the output head with torchao's ``quantize_``.

    Raises:
        NotAvailableError: torchao missing, or the recipe cannot run on this device/dtype.
    """
    quantization, version = import_torchao()
    dtype = next(model.parameters()).dtype
    _check_device(config.recipe, version, ctx.device, dtype)
    head = output_head_name(model)
    head_module = model.get_submodule(head) if head else None
    ao_config = recipe_config(quantization, config.recipe)

    def is_target(module: torch.nn.Module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and module is not head_module

    quantization.quantize_(model, ao_config, filter_fn=is_target)
    converted = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear) and _is_torchao_tensor(m.weight))
    wbits, abits = _RECIPE_BITS[config.recipe]
    ctx.info.update(
        wbits=wbits, abits=abits, kv_bits=16, recipe=config.recipe, torchao_version=version,
        torchao_config=type(ao_config).__name__, torchao_config_repr=repr(ao_config), output_head=head,
        quantized_linears=converted, exec_path=_EXEC_PATH[config.recipe],
    )
    if config.compile:
        ctx.info["torch_compile"] = COMPILE_MODE
    return model


def _is_torchao_tensor(weight) -> bool:
    # a converted weight is a torchao tensor subclass (Int8Tensor, Int4TilePackedTo4dTensor, ...)
    return type(weight).__module__.startswith("torchao.")
