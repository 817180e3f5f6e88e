"""The TensorRT-LLM quantization recipes NVIDIA ModelOpt implements, and ModelOpt's import.

One table, read by the ``modelopt`` method (:mod:`mosaicquant.baselines.modelopt`, which runs a
recipe as fake-quant) and by the ``tensorrt-llm`` backend (:mod:`mosaicquant.harness.tensorrt_llm`,
which exports a recipe's checkpoint for ``trtllm-bench`` and records its bits without running it).
"""

from __future__ import annotations

from dataclasses import dataclass

from mosaicquant.errors import import_optional

__all__ = ["Recipe", "RECIPES", "DEFAULT_RECIPE", "INSTALL_HINT", "import_modelopt"]

INSTALL_HINT = "pip install 'mosaicquant[modelopt]' (nvidia-modelopt>=0.47,<0.48)"


@dataclass(frozen=True)
class Recipe:
    """One TensorRT-LLM quantization recipe as ModelOpt names it.

    Attributes:
        config_name: the attribute of ``modelopt.torch.quantization`` holding the config.
        wbits / abits: bits of weights and activations (8 for fp8 e4m3).
        weights / activations: the formats in words.
        trtllm_quant_algo: the ``quant_algo`` the exported checkpoint declares to TensorRT-LLM.
    """

    config_name: str
    wbits: int
    abits: int
    weights: str
    activations: str
    trtllm_quant_algo: str


RECIPES: dict[str, Recipe] = {
    "int4_awq": Recipe("INT4_AWQ_CFG", 4, 16, "int4 symmetric, groups of 128 along K, AWQ-lite scales",
                       "16-bit (unquantized)", "W4A16_AWQ"),
    "w4a8_awq": Recipe("W4A8_AWQ_BETA_CFG", 4, 8, "int4 symmetric, groups of 128, AWQ-lite scales, fp8 per-tensor "
                       "second-level scale", "fp8 e4m3, per tensor, static (calibrated max)", "W4A8_AWQ"),
    "int8_sq": Recipe("INT8_SMOOTHQUANT_CFG", 8, 8, "int8 symmetric, per output channel",
                      "int8 symmetric, per tensor, static, after SmoothQuant scaling", "W8A8_SQ_PER_CHANNEL"),
    "fp8": Recipe("FP8_DEFAULT_CFG", 8, 8, "fp8 e4m3, per tensor", "fp8 e4m3, per tensor, static (calibrated max)",
                  "FP8"),
}

#: the recipe of ``modelopt`` without options
DEFAULT_RECIPE = "int4_awq"


def import_modelopt():
    """``modelopt.torch.quantization`` and ModelOpt's version.

    Raises:
        NotAvailableError: ModelOpt is not installed (or fails to import), with what to install.
    """
    return import_optional("modelopt.torch.quantization", "modelopt", "NVIDIA ModelOpt", INSTALL_HINT)
