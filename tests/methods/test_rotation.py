"""QuaRot-style model rotation: function preserved, online transforms installed, errors clear."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from mosaicquant.errors import UserInputError
from mosaicquant.methods.hadamard import OnlineHadamard, apply_hadamard
from mosaicquant.methods.rotation import (
    attach_input_transform,
    fuse_layer_norms,
    model_parts,
    random_orthogonal,
    residual_rotation,
    rotate_model,
)

# The models run in float64, but HF's RMSNorm casts to float32 internally, so an exact
# transform reproduces the outputs to ~1e-7 relative, not 1e-15.
FP64_MODEL_RTOL = 1e-5
FP32_MODEL_RTOL = 1e-4
# a broken transform (e.g. a missing online Hadamard) moves outputs by O(1) relative
BROKEN_MIN_RTOL = 1e-2
VOCAB = 211


def _tiny(arch: str, dtype: torch.dtype = torch.float64, **overrides) -> nn.Module:
    """Tiny random model with non-trivial norms and biases; hidden sizes need Paley factors."""
    common = dict(
        vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6
    )
    if arch == "llama":  # hidden 96 = 12·8, intermediate 160 = 20·8, GQA 6/2, tied
        cfg = LlamaConfig(
            hidden_size=96,
            intermediate_size=160,
            num_attention_heads=6,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            **common,
        )
        cls = LlamaForCausalLM
    elif arch == "qwen2":  # hidden 80 = 20·4, intermediate 112 = 28·4, q/k/v bias, MQA 5/1
        cfg = Qwen2Config(
            hidden_size=80,
            intermediate_size=112,
            num_attention_heads=5,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            **common,
        )
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":  # hidden 96, 4 heads of 32 (o_proj in 128 ≠ hidden), QK-norm, MHA
        cfg = Qwen3Config(
            hidden_size=96,
            intermediate_size=192,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            tie_word_embeddings=False,
            **common,
        )
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).to(dtype).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
    return model


def _tokens(shape=(3, 13), seed=0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _outputs(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Residual stream after every layer (before the final norm) and the logits."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return [h.double() for h in out.hidden_states[1:-1]] + [out.logits.double()]


def _max_rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rotation", ["hadamard", "orthogonal"])
@pytest.mark.parametrize("online_o", [False, True])
def test_rotation_preserves_function(arch, rotation, online_o):
    model = _tiny(arch)
    ids = _tokens()
    ref_logits = _outputs(model, ids)[-1]
    rotated = copy.deepcopy(model)
    desc = rotate_model(rotated, seed=3, rotation=rotation, online_o=online_o)
    # the residual stream itself is rotated, so compare the logits
    err = _max_rel_err([_outputs(rotated, ids)[-1]], [ref_logits])
    assert err < FP64_MODEL_RTOL, f"{arch}/{rotation}: max relative logit error {err:.2e}"
    q_before = model.model.layers[0].self_attn.q_proj.weight
    q_after = rotated.model.layers[0].self_attn.q_proj.weight
    assert (q_before - q_after).abs().max() > 0.05, "weights were not transformed"
    assert desc["architecture"] == type(model).__name__
    assert desc["rotation"] == rotation


@pytest.mark.parametrize("arch", ARCHS)
def test_residual_stream_is_rotated_by_documented_q(arch):
    model = _tiny(arch)
    ids = _tokens()
    hidden = _outputs(model, ids)[:-1]
    rotated = copy.deepcopy(model)
    rotate_model(rotated, seed=5)
    q = residual_rotation(model.config.hidden_size, seed=5)
    hidden_rot = _outputs(rotated, ids)[:-1]
    err = _max_rel_err(hidden_rot, [h @ q for h in hidden])
    assert err < FP64_MODEL_RTOL, f"{arch}: residual stream differs from h·Q by {err:.2e}"
    # embeddings: E·diag(1)·Q exactly as documented (norms are not folded into E)
    torch.testing.assert_close(
        rotated.model.embed_tokens.weight, model.model.embed_tokens.weight @ q, atol=1e-12, rtol=0
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_online_hadamard_installed_on_down_proj(arch):
    model = _tiny(arch)
    desc = rotate_model(model, seed=0)
    parts = model_parts(model)
    for layer in parts.layers:
        transform = getattr(layer.down_proj, "input_transform", None)
        assert isinstance(transform, OnlineHadamard)
        assert transform.size == parts.intermediate_size
        assert len(layer.down_proj._forward_pre_hooks) == 1
        assert getattr(layer.o_proj, "input_transform", None) is None
    assert sorted(desc["online"]) == sorted(layer.name("down_proj") for layer in parts.layers)
    assert all(v["size"] == parts.intermediate_size for v in desc["online"].values())


def test_online_o_uses_full_heads_size():
    model = _tiny("qwen3")  # o_proj input 4·32 = 128, not the hidden size 96
    desc = rotate_model(model, online_o=True)
    o_proj = model.model.layers[1].self_attn.o_proj
    assert isinstance(o_proj.input_transform, OnlineHadamard)
    assert o_proj.input_transform.size == 128
    assert desc["online"]["model.layers.1.self_attn.o_proj"]["factor"] == [1, 7]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_missing_online_transform_breaks_equivalence(arch):
    # negative control: the tolerance above does detect a wrong transform
    model = _tiny(arch)
    ids = _tokens()
    ref = _outputs(model, ids)[-1]
    rotated = copy.deepcopy(model)
    rotate_model(rotated, seed=0)
    rotated.model.layers[0].mlp.down_proj.input_transform = nn.Identity()
    err = _max_rel_err([_outputs(rotated, ids)[-1]], [ref])
    assert err > BROKEN_MIN_RTOL, f"dropping the online Hadamard changed logits by only {err:.2e}"


def test_smollm2_shapes_with_online_o():
    # SmolLM2-135M geometry: hidden 576 = 36·16, intermediate 1536 = 12·128, 9 heads of 64
    # (no Hadamard of order 9: the o_proj online transform uses the full 576).
    model = _tiny(
        "llama",
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        num_hidden_layers=1,
        attention_bias=False,
        mlp_bias=False,
    )
    ids = _tokens((1, 11))
    ref = _outputs(model, ids)[-1]
    desc = rotate_model(model, seed=0, online_o=True)
    err = _max_rel_err([_outputs(model, ids)[-1]], [ref])
    assert err < FP64_MODEL_RTOL, f"max relative logit error {err:.2e}"
    assert desc["residual"]["factor"] == [36, 4]
    assert desc["online"]["model.layers.0.mlp.down_proj"]["factor"] == [12, 7]
    assert desc["online"]["model.layers.0.self_attn.o_proj"]["factor"] == [36, 4]
    assert desc["per_head"]["size"] == 64


def test_float32_model():
    model = _tiny("qwen2", dtype=torch.float32)
    ids = _tokens()
    ref = _outputs(model, ids)[-1]
    rotate_model(model, seed=1, online_o=True)
    err = _max_rel_err([_outputs(model, ids)[-1]], [ref])
    assert err < FP32_MODEL_RTOL, f"max relative logit error {err:.2e}"
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32


def test_tied_embeddings_are_untied_and_stay_untied():
    model = _tiny("llama")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = _tokens()
    ref = _outputs(model, ids)[-1]
    desc = rotate_model(model, seed=0)
    assert desc["untied_embeddings"] is True
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config.tie_word_embeddings is False
    model.tie_weights()  # transformers must not tie them back
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    err = _max_rel_err([_outputs(model, ids)[-1]], [ref])
    assert err < FP64_MODEL_RTOL, f"max relative logit error {err:.2e}"


def test_fuse_layer_norms_alone_preserves_function_and_sets_ones():
    model = _tiny("llama")
    ids = _tokens()
    ref = _outputs(model, ids)
    fused = fuse_layer_norms(model)
    assert "model.norm" in fused and "model.layers.1.post_attention_layernorm" in fused
    for name in fused:
        weight = model.get_submodule(name).weight
        assert torch.equal(weight, torch.ones_like(weight))
    err = _max_rel_err(_outputs(model, ids), ref)
    assert err < FP64_MODEL_RTOL, f"max relative error {err:.2e}"


def test_qwen3_qk_norm_unaffected():
    model = _tiny("qwen3")
    ids = _tokens()
    rotated = copy.deepcopy(model)
    rotate_model(rotated, seed=2)

    def capture(m: nn.Module) -> dict[str, torch.Tensor]:
        seen: dict[str, torch.Tensor] = {}
        handles = [
            m.get_submodule(f"model.layers.{i}.self_attn.{part}").register_forward_hook(
                lambda _mod, _inp, out, key=f"{i}.{part}": seen.__setitem__(key, out.detach())
            )
            for i in range(2)
            for part in ("q_proj", "k_proj", "q_norm", "k_norm")
        ]
        with torch.no_grad():
            m(input_ids=ids)
        for handle in handles:
            handle.remove()
        return seen

    before, after = capture(model), capture(rotated)
    for key, value in before.items():
        err = float((after[key] - value).abs().max() / value.abs().max())
        assert err < FP64_MODEL_RTOL, f"{key} changed by {err:.2e}"
    for i in range(2):
        for norm in ("q_norm", "k_norm"):
            name = f"model.layers.{i}.self_attn.{norm}.weight"
            assert torch.equal(rotated.get_parameter(name), model.get_parameter(name))


def test_per_head_hadamard_on_values():
    model = _tiny("qwen2")
    ids = _tokens()
    rotated = copy.deepcopy(model)
    rotate_model(rotated, seed=0, online_down=False)
    seen = {}
    for tag, m in (("before", model), ("after", rotated)):
        handle = m.model.layers[0].self_attn.v_proj.register_forward_hook(
            lambda _mod, _inp, out, tag=tag: seen.__setitem__(tag, out.detach())
        )
        with torch.no_grad():
            m(input_ids=ids)
        handle.remove()
    head_dim = model.model.layers[0].self_attn.head_dim
    expected = apply_hadamard(seen["before"].unflatten(-1, (-1, head_dim))).flatten(-2)
    err = float((seen["after"] - expected).abs().max() / expected.abs().max())
    assert err < FP64_MODEL_RTOL, f"v_proj output is not per-head Hadamard-rotated ({err:.2e})"
    assert getattr(rotated.model.layers[0].mlp.down_proj, "input_transform", None) is None


def test_attach_input_transform_contract():
    gen = torch.Generator().manual_seed(4)
    linear = nn.Linear(20, 7).double()
    x = torch.randn(13, 20, generator=gen, dtype=torch.float64)
    transform = OnlineHadamard(20).double()
    attach_input_transform(linear, transform)
    assert linear.input_transform is transform
    assert dict(linear.named_modules())["input_transform"] is transform
    expected = nn.functional.linear(apply_hadamard(x), linear.weight, linear.bias)
    torch.testing.assert_close(linear(x), expected, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="already has an input transform"):
        attach_input_transform(linear, OnlineHadamard(20))
    with pytest.raises(ValueError, match="nn.Linear"):
        attach_input_transform(nn.Identity(), transform)
    with pytest.raises(ValueError, match="nn.Module"):
        attach_input_transform(nn.Linear(4, 4), lambda t: t)


def test_random_orthogonal():
    q = random_orthogonal(37, seed=1)
    torch.testing.assert_close(q @ q.T, torch.eye(37, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(q, random_orthogonal(37, seed=1))
    assert not torch.equal(q, random_orthogonal(37, seed=2))
    with pytest.raises(ValueError, match="n=0"):
        random_orthogonal(0, seed=1)


def test_unsupported_architecture_raises_naming_class():
    with pytest.raises(UserInputError, match="Sequential"):
        rotate_model(nn.Sequential(nn.Linear(4, 4)))


def test_replaced_linear_raises_naming_part():
    model = _tiny("qwen3")
    model.model.layers[1].mlp.up_proj = nn.Identity()
    with pytest.raises(UserInputError, match=r"model\.layers\.1\.mlp\.up_proj.*Identity"):
        rotate_model(model)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_size_errors_leave_model_untouched():
    # hidden 92 = 23·4 and head_dim 23 have no Hadamard matrix; intermediate 184 = 23·8 neither
    model = _tiny(
        "llama",
        hidden_size=92,
        intermediate_size=184,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=23,
    )
    before = _state(model)
    with pytest.raises(UserInputError, match="hidden_size = 92"):
        rotate_model(model, rotation="hadamard")
    with pytest.raises(UserInputError, match="head_dim = 23"):
        rotate_model(model, rotation="orthogonal")
    after = _state(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_orthogonal_rotation_for_non_hadamard_hidden_size():
    model = _tiny(
        "qwen3",
        hidden_size=92,
        intermediate_size=184,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    with pytest.raises(UserInputError, match="input size of model.layers.0.mlp.down_proj = 184"):
        rotate_model(model, rotation="orthogonal")
    ids = _tokens()
    ref = _outputs(model, ids)[-1]
    desc = rotate_model(model, rotation="orthogonal", online_down=False)
    assert desc["online"] == {} and desc["residual"]["factor"] is None
    err = _max_rel_err([_outputs(model, ids)[-1]], [ref])
    assert err < FP64_MODEL_RTOL, f"max relative logit error {err:.2e}"


def test_bad_arguments():
    model = _tiny("qwen2")
    with pytest.raises(UserInputError, match="Unknown rotation 'hadamrd'. Did you mean: hadamard"):
        rotate_model(model, rotation="hadamrd")
    with pytest.raises(UserInputError, match="seed"):
        rotate_model(model, seed="0")
    with pytest.raises(UserInputError, match="online_down"):
        rotate_model(model, online_down=1)
    rotate_model(model)
    with pytest.raises(UserInputError, match="already has an input transform"):
        rotate_model(model)
