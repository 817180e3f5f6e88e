"""Random-weight models of real shapes, for the speed suites (SPEC §4).

Speed depends on shapes and formats, not on trained values, so the throughput, latency and
memory suites can run on the layer shapes of the models the papers report (Llama-3-8B,
Qwen3-8B, ...) without downloading them. A shape model is built directly on the target
device with transformers' own initialisation (normal, std ``initializer_range``), so an
8B model appears on a GPU in about a second; it has no tokenizer, and suites that read
text (``accuracy``, ``zeroshot``, ``analysis``) refuse it before any work starts.

Example:
    >>> model = build_shape_model("llama-3-8b-shapes", dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
    >>> model.config.intermediate_size  # doctest: +SKIP
    14336
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mosaicquant.errors import UserInputError, unknown_name

__all__ = ["ShapeModel", "SHAPE_MODELS", "SHAPE_SUFFIX", "SHAPES_CAVEAT", "is_shape_model", "shape_model",
           "build_shape_model", "TEXT_SUITES"]

SHAPE_SUFFIX = "-shapes"
SHAPES_CAVEAT = ("Random weights of the real model's shapes: speed and memory only; every method runs its "
                 "data-free speed form (its format with round-to-nearest integers), see mosaicquant.harness.speedforms.")
#: suites that need real weights and a tokenizer
TEXT_SUITES = ("accuracy", "zeroshot", "analysis")


@dataclass(frozen=True)
class ShapeModel:
    """Architecture and sizes of one model (from its published config).

    Attributes:
        name: the model spec (``<model>-shapes``).
        architecture: ``"llama"`` or ``"qwen3"``.
        hidden, intermediate, layers, heads, kv_heads, head_dim, vocab: the config sizes.
        tied: input and output embeddings shared.
    """

    name: str
    architecture: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @property
    def class_name(self) -> str:
        """The transformers model class the shape model is built as."""
        return {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.architecture]

    @property
    def description(self) -> str:
        return (f"random weights of the {self.name[: -len(SHAPE_SUFFIX)]} shapes ({self.architecture}, {self.layers} "
                f"layers, d {self.hidden}, ffn {self.intermediate}, {self.heads} q / {self.kv_heads} kv heads) "
                "for the speed suites")


SHAPE_MODELS: dict[str, ShapeModel] = {m.name: m for m in (
    ShapeModel("llama-3-8b-shapes", "llama", 4096, 14336, 32, 32, 8, 128, 128256, False),
    ShapeModel("llama-3.2-3b-shapes", "llama", 3072, 8192, 28, 24, 8, 128, 128256, True),
    ShapeModel("qwen3-4b-shapes", "qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True),
    ShapeModel("qwen3-8b-shapes", "qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False),
    ShapeModel("qwen3-14b-shapes", "qwen3", 5120, 17408, 40, 40, 8, 128, 151936, False),
    ShapeModel("qwen3-32b-shapes", "qwen3", 5120, 25600, 64, 64, 8, 128, 151936, False),
)}


def is_shape_model(spec: str) -> bool:
    """True for a ``<model>-shapes`` spec (known or not: unknown ones fail in :func:`shape_model`)."""
    return isinstance(spec, str) and spec.endswith(SHAPE_SUFFIX) and "/" not in spec


def shape_model(spec: str) -> ShapeModel:
    """The :class:`ShapeModel` of ``spec``; a did-you-mean error for an unknown name."""
    if spec not in SHAPE_MODELS:
        raise unknown_name("shape model", spec, SHAPE_MODELS)
    return SHAPE_MODELS[spec]


def _config(shape: ShapeModel, layers: int | None):
    common = dict(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=layers or shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab,
                  tie_word_embeddings=shape.tied, max_position_embeddings=40960)
    if shape.architecture == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM, LlamaConfig(**common, rope_theta=500000.0)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(**common, rope_theta=1000000.0)


def build_shape_model(spec: str, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                      seed: int = 0, layers: int | None = None) -> torch.nn.Module:
    """Build a random-weight model of ``spec``'s shapes on ``device``, in eval mode.

    Args:
        spec: a key of :data:`SHAPE_MODELS`.
        dtype: parameter dtype (BF16 is what the speed suites time).
        device: built there directly (no CPU copy).
        seed: generator seed of the initialisation.
        layers: build only this many decoder layers (tests); default all.

    Raises:
        UserInputError: unknown spec, non-float dtype or bad ``layers``.
    """
    shape = shape_model(spec)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UserInputError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise UserInputError(f"layers={layers!r} must be an integer >= 1")
    cls, config = _config(shape, layers)
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()
