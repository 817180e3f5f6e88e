"""QuaRot-style rotation of a decoder-only transformer (function-preserving in float).

Supported: the families of :data:`mosaicquant.architectures.ARCHITECTURES` (Llama, Qwen2/3,
Mistral, Phi-3 with its fused projections split, Gemma 3 with ``1 + w`` norms and norms on the
block outputs, after which the residual rotation runs online). Layers are found by
module type and fully qualified name (``model.layers.{i}.self_attn.q_proj`` ...); anything
else raises :class:`~mosaicquant.errors.UserInputError` naming the class or part.

Conventions: ``nn.Linear`` computes ``y = x Wᵀ + b`` with ``W [out, in]``; activations are
row vectors. Steps of :func:`rotate_model`, in order:

1. **Untie** the embeddings: ``lm_head`` gets its own weight (SmolLM2 ties them) and the
   config says ``tie_word_embeddings=False`` so nothing re-ties them.
2. **Fuse RMSNorm weights** ``g`` into the linears that read the norm's output
   (``input_layernorm → q/k/v``, ``post_attention_layernorm → gate/up``,
   final ``norm → lm_head``): ``W ← W diag(g)``, ``g ← 1``. RMSNorm (no mean subtraction)
   then commutes with any orthogonal ``Q``: ``rms(hQ) = rms(h)``.
3. **Residual rotation** ``Q [d, d]`` (random Hadamard ``H_d diag(±1) / √d`` by default, or a
   Haar-random orthogonal matrix), seeded: embeddings ``E ← E Q``; linears reading the
   residual stream (q/k/v, gate/up, lm_head) ``W ← W Q``; linears writing it (o_proj,
   down_proj) ``W ← Qᵀ W``, ``b ← b Q``.
4. **Per-head Hadamard** ``H_h = H_{head_dim} / √head_dim`` (offline): every value head
   ``W_v,h ← H_hᵀ W_v,h`` (``b_v,h ← b_v,h H_h``) and every o_proj input head
   ``W_o,h ← W_o,h H_h``. Attention mixes value rows linearly, so the rotation passes through
   it; grouped-query heads share the one ``H_h``.
5. **Online Hadamard** ``H = H_n / √n`` on the input of down_proj (``n`` = intermediate size)
   and optionally o_proj (``n = num_heads · head_dim``, the full size: e.g. SmolLM2's 9 heads
   have no 9×9 Hadamard but 576 = 36·16 works): ``W ← W H`` offline and
   ``x ← x H`` at run time through :func:`attach_input_transform`.

Qwen3's ``q_norm``/``k_norm`` act on the outputs of q/k_proj per head; an input rotation
leaves those outputs unchanged, so they need no change.

The transforms are computed in float64 and the weights cast back to their dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mosaicquant.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES, Architecture, architecture_of
from mosaicquant.errors import UserInputError, unknown_name
from mosaicquant.methods.hadamard import (
    OnlineHadamard,
    apply_hadamard,
    hadamard_factorization,
    is_hadamard_size,
    random_signs,
)
from mosaicquant.registry import Supports

__all__ = [
    "ROTATIONS",
    "SUPPORTED_ARCHITECTURES",
    "TRANSFORM_SUPPORTS",
    "DecoderLayerParts",
    "ModelParts",
    "FusedProjection",
    "DenseRotation",
    "model_parts",
    "split_fused_projections",
    "attach_input_transform",
    "attach_output_transform",
    "untie_embeddings",
    "fuse_layer_norms",
    "random_orthogonal",
    "residual_rotation",
    "rotate_model",
    "online_transforms",
]

ROTATIONS = ("hadamard", "orthogonal")
#: what a method whose transforms go through :func:`model_parts` can run (its registry entry's ``supports``)
TRANSFORM_SUPPORTS = Supports(architectures=SUPPORTED_ARCHITECTURES)

# Rows (or columns) transformed at a time: bounds the float64 working copy of large
# matrices such as a 150k-token embedding.
_CHUNK = 4096


# --------------------------------------------------------------------------------------
# Architecture discovery
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Classes:
    entry: Architecture
    causal_lm: type
    decoder_layer: type
    attention: type
    mlp: type
    rms_norm: type


def _classes() -> dict[str, _Classes]:
    # Imported here: transformers' model modules are slow to import and only needed when a
    # model is actually transformed.
    import importlib

    out = {}
    for name, entry in ARCHITECTURES.items():
        mod = importlib.import_module(f"transformers.models.{entry.module}.modeling_{entry.module}")
        p = entry.prefix
        out[name] = _Classes(entry, getattr(mod, name), getattr(mod, f"{p}DecoderLayer"),
                             getattr(mod, f"{p}Attention"), getattr(mod, f"{p}MLP"), getattr(mod, f"{p}RMSNorm"))
    return out


class FusedProjection(nn.Module):
    """Stands in for a fused projection (Phi-3's ``qkv_proj``, ``gate_up_proj``) split into linears.

    ``forward(x)`` concatenates the outputs of the parent's linears ``names`` (looked up on the
    parent at call time, so a quantized or kernel replacement of a member is what runs), which
    is what the fused linear computed. The members are the parent's own submodules; this
    module holds none, so each weight is stored once.
    """

    def __init__(self, parent: nn.Module, names: tuple[str, ...]):
        super().__init__()
        object.__setattr__(self, "_parent", parent)  # not a submodule: no cycle in the module tree
        self.names = tuple(names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self._parent, n)(x) for n in self.names], dim=-1)

    def extra_repr(self) -> str:
        return ", ".join(self.names)


def _split_linear(parent: nn.Module, attr: str, names: tuple[str, ...], sizes: tuple[int, ...]) -> bool:
    fused = getattr(parent, attr)
    if isinstance(fused, FusedProjection):
        return False
    if not isinstance(fused, nn.Linear) or sum(sizes) != fused.out_features:
        raise UserInputError(f"'{attr}' is {type(fused).__name__} with {getattr(fused, 'out_features', '?')} "
                             f"outputs, expected an nn.Linear of {sum(sizes)} = {' + '.join(map(str, sizes))}")
    start = 0
    for name, size in zip(names, sizes):
        part = nn.Linear(fused.in_features, size, bias=fused.bias is not None,
                         device=fused.weight.device, dtype=fused.weight.dtype)
        with torch.no_grad():
            part.weight.copy_(fused.weight[start:start + size])
            if fused.bias is not None:
                part.bias.copy_(fused.bias[start:start + size])
        part.weight.requires_grad_(fused.weight.requires_grad)
        parent.add_module(name, part)
        start += size
    setattr(parent, attr, FusedProjection(parent, names))
    return True


def split_fused_projections(model: nn.Module) -> list[str]:
    """Split fused projections into separate linears, in place; the function is unchanged.

    Phi-3's ``self_attn.qkv_proj`` becomes ``self_attn.q_proj``/``k_proj``/``v_proj`` and
    ``mlp.gate_up_proj`` becomes ``mlp.gate_proj``/``up_proj`` (rows split in the order the
    model's forward slices them); the fused attribute becomes a :class:`FusedProjection` that
    concatenates them. Families without fused projections are left alone. Calling it again is a
    no-op.

    Returns:
        Names of the fused projections split by this call.

    Raises:
        UserInputError: unsupported model class, or a fused projection of unexpected shape.
    """
    entry = architecture_of(model)
    split = []
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if entry.fused_qkv:
            hd = int(attn.head_dim)
            q = model.config.num_attention_heads * hd
            kv = model.config.num_key_value_heads * hd
            if _split_linear(attn, entry.fused_qkv, ("q_proj", "k_proj", "v_proj"), (q, kv, kv)):
                split.append(f"model.layers.{index}.self_attn.{entry.fused_qkv}")
        if entry.fused_gate_up:
            n = getattr(mlp, entry.fused_gate_up)
            half = (n.out_features // 2) if isinstance(n, nn.Linear) else 0
            if _split_linear(mlp, entry.fused_gate_up, ("gate_proj", "up_proj"), (half, half)):
                split.append(f"model.layers.{index}.mlp.{entry.fused_gate_up}")
    return split


@dataclass(frozen=True)
class DecoderLayerParts:
    """The modules of one decoder layer and their fully qualified names.

    Attributes:
        index: layer index.
        prefix: name of the layer module, e.g. ``"model.layers.3"``.
        input_norm: the norm the attention reads; post_attention_norm: the norm the MLP reads
            (Gemma 3's ``pre_feedforward_layernorm``).
        q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: the linears.
        num_heads, num_kv_heads, head_dim: attention geometry.
        attn_output_norm, mlp_output_norm: norms on the attention / MLP output before the
            residual add (Gemma 3), else ``None``.
        suffixes: part name to module name inside the layer.
    """

    index: int
    prefix: str
    input_norm: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    post_attention_norm: nn.Module
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attn_output_norm: nn.Module | None = None
    mlp_output_norm: nn.Module | None = None
    suffixes: dict = field(default_factory=lambda: dict(DecoderLayerParts.SUFFIXES))

    SUFFIXES = {
        "input_norm": "input_layernorm",
        "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj",
        "o_proj": "self_attn.o_proj",
        "post_attention_norm": "post_attention_layernorm",
        "gate_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj",
        "down_proj": "mlp.down_proj",
    }

    def name(self, part: str) -> str:
        """Fully qualified module name of ``part`` (a key of ``SUFFIXES``), e.g. ``q_proj``.

        Raises:
            UserInputError: unknown part.
        """
        if part not in self.suffixes:
            raise unknown_name("layer part", part, self.suffixes)
        return f"{self.prefix}.{self.suffixes[part]}"

    @property
    def output_norms(self) -> tuple[nn.Module, ...]:
        """The norms on the block outputs (empty unless the family has them)."""
        return tuple(n for n in (self.attn_output_norm, self.mlp_output_norm) if n is not None)


@dataclass(frozen=True)
class ModelParts:
    """The modules a transform touches, found by type and fully qualified name.

    Attributes:
        architecture: model class name (one of :data:`SUPPORTED_ARCHITECTURES`).
        entry: its row of :data:`mosaicquant.architectures.ARCHITECTURES`.
        embed_tokens: ``model.embed_tokens``.
        layers: one :class:`DecoderLayerParts` per decoder layer.
        final_norm: ``model.norm``.
        lm_head: ``lm_head``.
        hidden_size, intermediate_size: residual and MLP widths.
    """

    architecture: str
    embed_tokens: nn.Embedding
    layers: tuple[DecoderLayerParts, ...]
    final_norm: nn.Module
    lm_head: nn.Linear
    hidden_size: int
    intermediate_size: int
    entry: Architecture

    def gain(self, norm: nn.Module) -> torch.Tensor:
        """The float64 per-channel factor ``norm`` multiplies by (Gemma: ``1 + weight``)."""
        return norm.weight.detach().to(torch.float64) + self.entry.norm_offset

    def set_gain(self, norm: nn.Module, gain: torch.Tensor) -> None:
        """Make ``norm`` multiply by ``gain`` (in place, cast to the weight's dtype)."""
        w = norm.weight
        w.data.copy_((gain.to(w.device, torch.float64) - self.entry.norm_offset).to(w.dtype))


def _expect(module: object, kind: type | tuple[type, ...], name: str, architecture: str) -> None:
    if not isinstance(module, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise UserInputError(
            f"{architecture}: module '{name}' is {type(module).__name__}, expected "
            f"{' or '.join(k.__name__ for k in kinds)}; equivalence transforms run on the float "
            "model, before any layer is replaced"
        )


def model_parts(model: nn.Module) -> ModelParts:
    """Find the embeddings, norms, linears and head geometry of a supported model.

    Fused projections (Phi-3) are split first (:func:`split_fused_projections`), so every
    family presents separate q/k/v and gate/up linears.

    Args:
        model: a causal LM of a class in :data:`mosaicquant.architectures.ARCHITECTURES`.

    Returns:
        :class:`ModelParts`.

    Raises:
        UserInputError: unsupported model class (message names it and the supported ones),
            or a part of unexpected type (message names the part), e.g. an already
            quantized linear.
    """
    entry = architecture_of(model)
    arch = _classes()[entry.class_name]
    arch_name = entry.class_name
    _expect(model, arch.causal_lm, "(model)", arch_name)
    split_fused_projections(model)
    decoder = model.model
    _expect(decoder.embed_tokens, nn.Embedding, "model.embed_tokens", arch_name)
    _expect(decoder.norm, arch.rms_norm, "model.norm", arch_name)
    _expect(model.lm_head, nn.Linear, "lm_head", arch_name)
    suffixes = dict(DecoderLayerParts.SUFFIXES, post_attention_norm=entry.mlp_norm)
    if entry.output_norms:
        suffixes |= dict(zip(("attn_output_norm", "mlp_output_norm"), entry.output_norms, strict=True))
    layers = []
    for index, layer in enumerate(decoder.layers):
        prefix = f"model.layers.{index}"
        _expect(layer, arch.decoder_layer, prefix, arch_name)
        attn, mlp = layer.self_attn, layer.mlp
        _expect(attn, arch.attention, f"{prefix}.self_attn", arch_name)
        _expect(mlp, arch.mlp, f"{prefix}.mlp", arch_name)
        modules = {part: layer.get_submodule(suffix) for part, suffix in suffixes.items()}
        for part, module in modules.items():
            kind = arch.rms_norm if part.endswith("norm") else nn.Linear
            _expect(module, kind, f"{prefix}.{suffixes[part]}", arch_name)
        head_dim = int(attn.head_dim)
        num_heads = attn.q_proj.out_features // head_dim
        num_kv_heads = attn.v_proj.out_features // head_dim
        if (
            num_heads * head_dim != attn.q_proj.out_features
            or num_kv_heads * head_dim != attn.v_proj.out_features
            or attn.o_proj.in_features != num_heads * head_dim
            or num_heads % num_kv_heads
        ):
            raise UserInputError(
                f"{arch_name}: attention of '{prefix}' has inconsistent shapes (head_dim "
                f"{head_dim}, q_proj out {attn.q_proj.out_features}, v_proj out "
                f"{attn.v_proj.out_features}, o_proj in {attn.o_proj.in_features})"
            )
        layers.append(
            DecoderLayerParts(
                index=index,
                prefix=prefix,
                **modules,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                suffixes=suffixes,
            )
        )
    if not layers:
        raise UserInputError(f"{arch_name}: the model has no decoder layers")
    return ModelParts(
        architecture=arch_name,
        embed_tokens=decoder.embed_tokens,
        layers=tuple(layers),
        final_norm=decoder.norm,
        lm_head=model.lm_head,
        hidden_size=decoder.embed_tokens.embedding_dim,
        intermediate_size=layers[0].down_proj.in_features,
        entry=entry,
    )


# --------------------------------------------------------------------------------------
# Online transforms (contract with the harness's quantized linears)
# --------------------------------------------------------------------------------------


def _apply_input_transform(module: nn.Module, args: tuple) -> tuple:
    return (module.input_transform(args[0]),) + tuple(args[1:])


def _set_transform(module: nn.Module, transform: nn.Module, side: str) -> None:
    if not isinstance(transform, nn.Module):
        raise ValueError(f"attach_{side}_transform takes an nn.Module transform, got {type(transform).__name__}")
    current = getattr(module, f"{side}_transform", None)
    if current is not None:
        raise ValueError(f"this module already has an {side} transform ({current!r}); transforms are attached once")
    setattr(module, f"{side}_transform", transform)


def attach_input_transform(linear: nn.Linear, transform: nn.Module) -> None:
    """Make ``transform`` run on the input of ``linear`` (an online transform).

    Sets ``linear.input_transform = transform`` (a registered submodule, so it follows
    ``.to()`` and appears in the state dict) and registers a forward pre-hook applying it, so
    the float model works at once. A quantized linear that replaces ``linear`` reads
    ``getattr(linear, "input_transform", None)`` and applies it to its input before
    activation quantization (the hook leaves with the replaced module).

    Args:
        linear: the layer whose input is transformed.
        transform: module mapping ``[..., in_features]`` to ``[..., in_features]``.

    Raises:
        ValueError: ``linear`` is not an ``nn.Linear``, ``transform`` not an ``nn.Module``,
            or ``linear`` already has an input transform.
    """
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"attach_input_transform takes an nn.Linear, got {type(linear).__name__}")
    _set_transform(linear, transform, "input")
    linear.register_forward_pre_hook(_apply_input_transform)


def _apply_output_transform(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return module.output_transform(output)


def attach_output_transform(module: nn.Module, transform: nn.Module) -> None:
    """Make ``transform`` run on the output of ``module`` (an online transform, e.g. a norm's).

    Sets ``module.output_transform = transform`` (a registered submodule) and registers a
    forward hook applying it; the hook reads the attribute at call time, so replacing
    ``module.output_transform`` replaces the transform.

    Raises:
        ValueError: ``transform`` not an ``nn.Module``, or ``module`` already has one.
    """
    _set_transform(module, transform, "output")
    module.register_forward_hook(_apply_output_transform)


class DenseRotation(nn.Module):
    """``x ↦ x @ R`` for a dense ``[n, n]`` matrix (the buffer ``matrix``, kept in float64).

    Computed in float32 for half-precision inputs, in the input's dtype otherwise, and cast
    back to the input's dtype.
    """

    def __init__(self, matrix: torch.Tensor):
        super().__init__()
        if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"DenseRotation takes a square matrix, got shape {tuple(matrix.shape)}")
        self.register_buffer("matrix", matrix.detach().to(torch.float64).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        return (x.to(dtype) @ self.matrix.to(dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"size={self.matrix.shape[0]}"


# --------------------------------------------------------------------------------------
# Model surgery helpers
# --------------------------------------------------------------------------------------


def untie_embeddings(model: nn.Module) -> bool:
    """Give ``lm_head`` its own weight if it shares the embedding's, and record it in the config.

    Args:
        model: a supported model (see :func:`model_parts`).

    Returns:
        ``True`` if the weights were tied (and are now separate).

    Raises:
        UserInputError: unsupported model.
    """
    parts = model_parts(model)
    head, embed = parts.lm_head, parts.embed_tokens
    tied = head.weight is embed.weight or (
        head.weight.data_ptr() == embed.weight.data_ptr()
        and head.weight.shape == embed.weight.shape
    )
    if tied:
        head.weight = nn.Parameter(
            embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad
        )
    # Stop transformers from tying them again (tie_weights() reads the config).
    model.config.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {}
    return tied


def _fold_into_linear(parts: ModelParts, norm: nn.Module, linears: list[nn.Linear]) -> None:
    g = parts.gain(norm)
    for linear in linears:
        w = linear.weight
        w.data.copy_((w.detach().to(torch.float64) * g.to(w.device)[None, :]).to(w.dtype))
    parts.set_gain(norm, torch.ones_like(g))


def fuse_layer_norms(model: nn.Module) -> list[str]:
    """Fold every input norm's factor into the linears reading its output and set it to 1.

    ``input_layernorm → q/k/v_proj``, the MLP's norm (``post_attention_layernorm``; Gemma 3's
    ``pre_feedforward_layernorm``) ``→ gate/up_proj``, ``model.norm → lm_head``. Gemma's norms
    multiply by ``1 + weight``: that factor is folded and the weight set to 0. Norms on block
    outputs (Gemma 3's ``post_attention_layernorm`` / ``post_feedforward_layernorm``) feed the
    residual add, not a linear, and keep their weights. Tied embeddings are untied first (the
    final norm belongs in ``lm_head`` only). The model computes the same function afterwards.

    Args:
        model: a supported model.

    Returns:
        Names of the norms whose weights were folded.

    Raises:
        UserInputError: unsupported model or part.
    """
    parts = model_parts(model)
    untie_embeddings(model)
    fused = []
    with torch.no_grad():
        for layer in parts.layers:
            _fold_into_linear(parts, layer.input_norm, [layer.q_proj, layer.k_proj, layer.v_proj])
            _fold_into_linear(parts, layer.post_attention_norm, [layer.gate_proj, layer.up_proj])
            fused += [layer.name("input_norm"), layer.name("post_attention_norm")]
        _fold_into_linear(parts, parts.final_norm, [parts.lm_head])
        fused.append("model.norm")
    return fused


def random_orthogonal(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Haar-random orthogonal ``[n, n]`` matrix (QR of a seeded Gaussian, signs fixed by diag(R)).

    Raises:
        ValueError: ``n`` not a positive integer or ``seed`` not an integer.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n={n!r} must be a positive integer")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r} must be an integer")
    gen = torch.Generator().manual_seed(seed)
    gauss = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return (q * signs[None, :]).to(dtype)


def _check_rotation(rotation: str) -> None:
    if rotation not in ROTATIONS:
        raise unknown_name("rotation", str(rotation), ROTATIONS)


def residual_rotation(
    n: int, *, seed: int = 0, rotation: str = "hadamard", dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The residual-stream rotation ``Q`` that :func:`rotate_model` uses, as a dense matrix.

    Args:
        n: hidden size.
        seed: seed (sign vector of the random Hadamard, or the Gaussian of the orthogonal).
        rotation: ``"hadamard"`` (``H_n diag(random_signs(n, seed)) / √n``) or ``"orthogonal"``
            (:func:`random_orthogonal`).
        dtype: result dtype.

    Returns:
        ``[n, n]`` orthogonal matrix.

    Raises:
        UserInputError: unknown rotation. ValueError: no Hadamard matrix of order ``n``.
    """
    _check_rotation(rotation)
    if rotation == "orthogonal":
        return random_orthogonal(n, seed, dtype)
    eye = torch.eye(n, dtype=torch.float64)
    return apply_hadamard(eye, signs=random_signs(n, seed)).to(dtype)


def _right_multiplier(n: int, seed: int, rotation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x ↦ x @ Q`` on float64 ``[..., n]`` for the residual rotation ``Q``."""
    if rotation == "hadamard":
        signs = random_signs(n, seed)
        return lambda x: apply_hadamard(x, signs=signs)
    q = random_orthogonal(n, seed)
    return lambda x: x @ q.to(x.device)


def _hadamard_multiplier(x: torch.Tensor) -> torch.Tensor:
    return apply_hadamard(x)


def _right_(t: torch.Tensor, fn: Callable, block: int | None = None) -> None:
    """In place ``t ← t @ diag(R, R, ...)`` along the last dim (blocks of ``block``)."""
    if t.dim() == 1:
        n = t.shape[0]
        t.copy_(fn(t.to(torch.float64).reshape(-1, block or n)).reshape(n).to(t.dtype))
        return
    n = t.shape[-1]
    for start in range(0, t.shape[0], _CHUNK):
        rows = t[start : start + _CHUNK]
        out = fn(rows.to(torch.float64).reshape(rows.shape[0], -1, block or n))
        rows.copy_(out.reshape(rows.shape).to(t.dtype))


def _left_(w: torch.Tensor, fn: Callable, block: int | None = None) -> None:
    """In place ``w ← diag(R, R, ...)ᵀ w`` for ``w [n, cols]`` (blocks of ``block`` rows)."""
    n = w.shape[0]
    size = block or n
    for start in range(0, w.shape[1], _CHUNK):
        cols = w[:, start : start + _CHUNK]
        # (Rᵀ W_b)ᵀ = W_bᵀ R: transform the columns of each row block
        grouped = cols.to(torch.float64).reshape(n // size, size, -1).transpose(1, 2)
        out = fn(grouped).transpose(1, 2).reshape(n, -1)
        cols.copy_(out.to(w.dtype))


def _check_size(n: int, what: str, architecture: str) -> None:
    if not is_hadamard_size(n):
        try:
            hadamard_factorization(n)
        except ValueError as err:
            raise UserInputError(f"{architecture}: {what} = {n} cannot be rotated: {err}") from None


def _factor(n: int) -> list[int]:
    m, k = hadamard_factorization(n)
    return [m, k]


def rotate_model(
    model: nn.Module,
    *,
    seed: int = 0,
    rotation: str = "hadamard",
    online_down: bool = True,
    online_o: bool = False,
) -> dict:
    """Rotate a model QuaRot-style in place; the float model computes the same function.

    See the module docstring for the steps and conventions.

    Args:
        model: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` with plain
            ``nn.Linear`` layers.
        seed: seed of the residual rotation.
        rotation: ``"hadamard"`` (random Hadamard, needs a Hadamard order for the hidden
            size) or ``"orthogonal"`` (Haar-random orthogonal).
        online_down: absorb ``H_intermediate`` into down_proj and attach an
            :class:`~mosaicquant.methods.hadamard.OnlineHadamard` to its input.
        online_o: the same on the o_proj input (size ``num_heads · head_dim``).

    Returns:
        A JSON-serialisable description: ``architecture``, ``rotation``, ``seed``,
        ``untied_embeddings``, ``fused_norms`` (names), ``residual`` (size, kind, factor
        ``[m, k]`` or ``None``), ``per_head`` (size, factor, ``linears``), ``online``
        (``{linear name: {"size", "factor", "kind"}}``).

    Raises:
        UserInputError: unsupported architecture or part, unknown ``rotation``, a size with
            no Hadamard matrix, or a linear that already has an input transform. All checks
            run before the model is modified.

    Example:
        >>> desc = rotate_model(model, seed=0)          # doctest: +SKIP
        >>> sorted(desc["online"])[:1]                   # doctest: +SKIP
        ['model.layers.0.mlp.down_proj']
    """
    _check_rotation(rotation)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserInputError(f"seed={seed!r} must be an integer")
    for flag_name, flag in (("online_down", online_down), ("online_o", online_o)):
        if not isinstance(flag, bool):
            raise UserInputError(f"{flag_name}={flag!r} must be True or False")
    parts = model_parts(model)
    arch = parts.architecture
    d = parts.hidden_size
    if rotation == "hadamard":
        _check_size(d, "hidden_size", arch)
    head_dims = sorted({layer.head_dim for layer in parts.layers})
    if len(head_dims) != 1:
        raise UserInputError(f"{arch}: layers have different head_dim values {head_dims}")
    _check_size(head_dims[0], "head_dim", arch)
    online_targets: list[tuple[str, nn.Linear]] = []
    for layer in parts.layers:
        if online_down:
            online_targets.append((layer.name("down_proj"), layer.down_proj))
        if online_o:
            online_targets.append((layer.name("o_proj"), layer.o_proj))
    for name, linear in online_targets:
        _check_size(linear.in_features, f"input size of {name}", arch)
        if getattr(linear, "input_transform", None) is not None:
            raise UserInputError(f"{arch}: '{name}' already has an input transform")
    output_targets = [
        (layer.name(part), getattr(layer, part))
        for layer in parts.layers
        for part in ("attn_output_norm", "mlp_output_norm")
        if getattr(layer, part) is not None
    ]
    for name, norm in output_targets:
        if getattr(norm, "output_transform", None) is not None:
            raise UserInputError(f"{arch}: '{name}' already has an output transform")

    untied = untie_embeddings(model)
    fused = fuse_layer_norms(model)
    right_q = _right_multiplier(d, seed, rotation)
    online: dict[str, dict] = {}
    with torch.no_grad():
        _right_(parts.embed_tokens.weight.data, right_q)
        for layer in parts.layers:
            for reader in (
                layer.q_proj,
                layer.k_proj,
                layer.v_proj,
                layer.gate_proj,
                layer.up_proj,
            ):
                _right_(reader.weight.data, right_q)
            # a block with an output norm writes the residual through that norm: the writers
            # stay in the model's basis and the rotation runs online on the norm's output
            for writer in () if layer.output_norms else (layer.o_proj, layer.down_proj):
                _left_(writer.weight.data, right_q)
                if writer.bias is not None:
                    _right_(writer.bias.data, right_q)
            hd = layer.head_dim
            _left_(layer.v_proj.weight.data, _hadamard_multiplier, block=hd)
            if layer.v_proj.bias is not None:
                _right_(layer.v_proj.bias.data, _hadamard_multiplier, block=hd)
            _right_(layer.o_proj.weight.data, _hadamard_multiplier, block=hd)
        _right_(parts.lm_head.weight.data, right_q)
        for name, linear in online_targets:
            _right_(linear.weight.data, _hadamard_multiplier)
            attach_input_transform(
                linear, OnlineHadamard(linear.in_features).to(linear.weight.device)
            )
            online[name] = {
                "size": linear.in_features,
                "factor": _factor(linear.in_features),
                "kind": "hadamard",
            }
        online_outputs: dict[str, dict] = {}
        for name, norm in output_targets:
            if rotation == "hadamard":
                transform = OnlineHadamard(d, signs=random_signs(d, seed))
            else:
                transform = DenseRotation(random_orthogonal(d, seed))
            attach_output_transform(norm, transform.to(norm.weight.device))
            online_outputs[name] = {"size": d, "kind": f"residual_{rotation}"}
    return {
        "architecture": arch,
        "rotation": rotation,
        "seed": seed,
        "untied_embeddings": untied,
        "fused_norms": fused,
        "residual": {
            "size": d,
            "kind": "random_hadamard" if rotation == "hadamard" else "random_orthogonal",
            "factor": _factor(d) if rotation == "hadamard" else None,
        },
        "per_head": {
            "size": parts.layers[0].head_dim,
            "factor": _factor(parts.layers[0].head_dim),
            "linears": [
                name
                for layer in parts.layers
                for name in (layer.name("v_proj"), layer.name("o_proj"))
            ],
        },
        "online": online,
        "online_outputs": online_outputs,
    }


def online_transforms(model: nn.Module) -> list[dict]:
    """Every online transform installed on ``model``, read from the model itself.

    Returns:
        One ``{"module", "side", "transform", "size"}`` per module with an ``input_transform``
        (``side="input"``, e.g. the Hadamard on down_proj's input) or an ``output_transform``
        (``side="output"``, e.g. the residual rotation after a Gemma 3 output norm), in module
        order.
    """
    found = []
    for name, module in model.named_modules():
        for side in ("input", "output"):
            transform = getattr(module, f"{side}_transform", None)
            if isinstance(transform, nn.Module):
                size = getattr(transform, "size", None)
                if size is None and isinstance(getattr(transform, "matrix", None), torch.Tensor):
                    size = int(transform.matrix.shape[0])
                found.append({"module": name, "side": side, "transform": type(transform).__name__,
                              "size": size})
    return found
