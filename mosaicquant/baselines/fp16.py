"""The unquantized reference: the model as loaded (BF16/FP16/FP32 weights and activations)."""

from __future__ import annotations

from dataclasses import dataclass

from mosaicquant.config import Config
from mosaicquant.registry import register_method


@dataclass(frozen=True)
class FP16Config(Config):
    """No options: the float model is the reference row of every comparison."""

    description = "unquantized reference (the model's own float weights and activations)"


@register_method("fp16", config=FP16Config, description=FP16Config.description, seeded=False)
def fp16(model, config: FP16Config, ctx):
    """Return the model unchanged."""
    ctx.info.update(wbits=16, abits=16, kv_bits=16, exec_path="float (as loaded)")
    return model
