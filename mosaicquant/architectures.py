"""The model families the methods run on: one table, read by the transforms, the fused runtime
and the docs.

Each :class:`Architecture` names a transformers causal-LM class and the facts about its
decoder layer that the equivalence transforms (rotation, smoothing) need: which norm feeds the
MLP, whether norms also sit after the attention and the MLP (Gemma 3), whether the RMSNorm
multiplies by ``1 + w`` rather than ``w`` (Gemma), and which projections come fused (Phi-3).
Plain data only: nothing here imports transformers, so the registry can read the table too.

Every method in the registry runs on every family below; methods without equivalence
transforms (fp16, RTN, Atom, torchao, TensorRT-LLM) quantize whatever ``nn.Linear`` layers a
model has. ``fused_runtime`` says whether the fused decoder of ``harness/runtime.py``
reproduces the family (the others are measured on the Hugging Face model and the fused decoder
refuses them by name).
"""

from __future__ import annotations

from dataclasses import dataclass

from mosaicquant.errors import UserInputError

__all__ = ["Architecture", "ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "architecture_of", "architecture_named"]


@dataclass(frozen=True)
class Architecture:
    """One supported model family.

    Attributes:
        class_name: the transformers causal-LM class, e.g. ``"LlamaForCausalLM"``.
        module: the transformers model package, e.g. ``"llama"`` (``transformers.models.llama``).
        prefix: class-name prefix of its modules, e.g. ``"Llama"`` (``LlamaDecoderLayer`` ...).
        family: human name used in docs and records.
        mlp_norm: attribute of the decoder layer holding the norm whose output the MLP reads.
        output_norms: attributes of norms applied to the attention and MLP outputs before the
            residual add (empty when the block writes the residual stream directly).
        norm_offset: the RMSNorm scales by ``norm_offset + weight`` (1.0 for Gemma, else 0.0).
        fused_qkv: attribute of the attention's fused q/k/v projection, or ``None``.
        fused_gate_up: attribute of the MLP's fused gate/up projection, or ``None``.
        qk_norm: the attention normalises q and k per head (they need no change under input
            rotations).
        fused_runtime: the fused decoder of ``harness/runtime.py`` runs this family.
    """

    class_name: str
    module: str
    prefix: str
    family: str
    mlp_norm: str = "post_attention_layernorm"
    output_norms: tuple[str, ...] = ()
    norm_offset: float = 0.0
    fused_qkv: str | None = None
    fused_gate_up: str | None = None
    qk_norm: bool = False
    fused_runtime: bool = False


ARCHITECTURES: dict[str, Architecture] = {
    a.class_name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", "Llama", "Llama", fused_runtime=True),
        Architecture("Qwen2ForCausalLM", "qwen2", "Qwen2", "Qwen2", fused_runtime=True),
        Architecture("Qwen3ForCausalLM", "qwen3", "Qwen3", "Qwen3", qk_norm=True, fused_runtime=True),
        Architecture("MistralForCausalLM", "mistral", "Mistral", "Mistral"),
        Architecture("Phi3ForCausalLM", "phi3", "Phi3", "Phi-3", fused_qkv="qkv_proj", fused_gate_up="gate_up_proj"),
        Architecture(
            "Gemma3ForCausalLM", "gemma3", "Gemma3", "Gemma 3", mlp_norm="pre_feedforward_layernorm",
            output_norms=("post_attention_layernorm", "post_feedforward_layernorm"), norm_offset=1.0,
            qk_norm=True,
        ),
    )
}

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture_named(class_name: str, purpose: str = "equivalence transforms") -> Architecture:
    """The table entry of ``class_name``.

    Raises:
        UserInputError: a class the table does not hold (the message names it, the purpose and the
            supported classes).
    """
    if class_name not in ARCHITECTURES:
        raise UserInputError(
            f"Unsupported model class {class_name} for {purpose}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return ARCHITECTURES[class_name]


def architecture_of(model: object, purpose: str = "equivalence transforms") -> Architecture:
    """The table entry of ``model``'s class (matched by the class name along its MRO).

    Raises:
        UserInputError: as :func:`architecture_named`.
    """
    for cls in type(model).__mro__:
        if cls.__name__ in ARCHITECTURES:
            return ARCHITECTURES[cls.__name__]
    return architecture_named(type(model).__name__, purpose)
