"""KV-cache quantization: off is exact, Q/K rotation preserves the function, 4-bit K/V equals
a hand-computed attention, incremental decoding matches the full forward, configs validate."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from mosaicquant.errors import UserInputError
from mosaicquant.methods.hadamard import hadamard_matrix
from mosaicquant.methods.kvcache import (
    KV_ATTENTION_NAMES,
    KVQuantSpec,
    disable_kv_quant,
    enable_kv_quant,
    fake_quantize_ste,
    kv_quant_spec_of,
    quantize_qkv,
)
from mosaicquant.methods.quant import fake_quantize, quantize

# float64 models; HF's RMSNorm runs in float32 internally (see test_rotation.py)
FP64_MODEL_RTOL = 1e-5
# 4-bit K/V must move the logits by at least this much (relative to the logit range)
KV4_MIN_CHANGE = 1e-3
# the hand-computed attention and the model's, both float64, except that eager attention
# takes its softmax in float32 (the transformers convention the wrapper keeps)
HAND_RTOL = 1e-6
# the straight-through gradient is scale · (1 / scale) in float32
STE_GRAD_RTOL = 1e-6
VOCAB = 173


def _tiny(arch: str, attn: str = "sdpa", **overrides) -> nn.Module:
    """Tiny random float64 model with non-trivial norms and biases."""
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if arch == "llama":  # GQA 6/2, head_dim 16
        cfg = LlamaConfig(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
                          attention_bias=True, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":  # MQA 5/1, head_dim 16, q/k/v biases
        cfg = Qwen2Config(hidden_size=80, intermediate_size=112, num_attention_heads=5, num_key_value_heads=1,
                          **common)
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":  # MHA 4/4, head_dim 32 (o_proj input 128 != hidden 96), QK-norm
        cfg = Qwen3Config(hidden_size=96, intermediate_size=192, num_attention_heads=4, num_key_value_heads=4,
                          head_dim=32, **common)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    return model


def _ids(shape=(2, 13), seed=0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_kv16_leaves_logits_unchanged(arch, attn):
    model = _tiny(arch, attn)
    ids = _ids()
    ref = _logits(model, ids)
    info = enable_kv_quant(model, KVQuantSpec(bits=16))
    assert info["attn_implementation"] == KV_ATTENTION_NAMES[attn] and info["wraps"] == attn
    assert model.config._attn_implementation == KV_ATTENTION_NAMES[attn]
    err = _rel(_logits(model, ids), ref)
    assert err < FP64_MODEL_RTOL, f"{arch}/{attn}: kv16 moved the logits by {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_rotate_qk_alone_preserves_logits(arch, attn):
    model = _tiny(arch, attn)
    ids = _ids()
    ref = _logits(model, ids)
    enable_kv_quant(model, KVQuantSpec(bits=16, rotate_qk=True))
    err = _rel(_logits(model, ids), ref)
    assert err < FP64_MODEL_RTOL, f"{arch}/{attn}: Q/K rotation changed the logits by {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_kv4_changes_logits_measurably(arch, symmetric):
    model = _tiny(arch)
    ids = _ids()
    ref = _logits(model, ids)
    enable_kv_quant(model, KVQuantSpec(bits=4, symmetric=symmetric, clip_ratio=0.95, rotate_qk=True))
    err = _rel(_logits(model, ids), ref)
    assert err > KV4_MIN_CHANGE, f"{arch}: 4-bit K/V changed the logits by only {err:.2e}"
    assert err < 1.0, f"{arch}: 4-bit K/V broke the model (relative change {err:.2e})"


def _hand_attention(attn, hidden, cos, sin, spec: KVQuantSpec) -> torch.Tensor:
    """Attention of one module written out: projections, RoPE, Q/K Hadamard, K/V quantization,
    causal softmax, o_proj (K/V quantized with :func:`quantize` and dequantized)."""
    b, t, _ = hidden.shape
    hd = attn.head_dim
    q = attn.q_proj(hidden).view(b, t, -1, hd).transpose(1, 2)
    k = attn.k_proj(hidden).view(b, t, -1, hd).transpose(1, 2)
    v = attn.v_proj(hidden).view(b, t, -1, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if spec.rotate_qk:
        h = hadamard_matrix(hd).to(q.dtype) / math.sqrt(hd)
        q, k = q @ h, k @ h
    if spec.enabled:
        k = quantize(k, spec.bits, symmetric=spec.symmetric, group_size=spec.group_size,
                     clip_ratio=spec.clip_ratio).dequantize(torch.float64)
        v = quantize(v, spec.bits, symmetric=spec.symmetric, group_size=spec.group_size,
                     clip_ratio=spec.clip_ratio).dequantize(torch.float64)
    rep = q.shape[1] // k.shape[1]
    out = torch.empty(b, q.shape[1], t, hd, dtype=q.dtype)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for head in range(q.shape[1]):
        kv_head = head // rep
        scores = q[:, head] @ k[:, kv_head].transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        out[:, head] = torch.softmax(scores, dim=-1) @ v[:, kv_head]
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("spec", [
    KVQuantSpec(bits=4, symmetric=True, clip_ratio=1.0, rotate_qk=True),
    KVQuantSpec(bits=4, symmetric=False, clip_ratio=0.95, group_size=8, rotate_qk=False),
    KVQuantSpec(bits=3, symmetric=False, clip_ratio=0.9, rotate_qk=True),
], ids=["sym-rot", "asym-g8", "3bit-asym-rot"])
def test_kv4_equals_hand_computed_attention(attn_impl, spec):
    model = _tiny("llama", attn_impl)  # GQA: 6 query heads share 2 KV heads
    enable_kv_quant(model, spec)
    ids = _ids((2, 11), seed=3)
    captured = {}
    attn = model.model.layers[0].self_attn

    def grab(module, args, kwargs, output):
        captured["hidden"] = kwargs.get("hidden_states", args[0] if args else None)
        captured["pos"] = kwargs["position_embeddings"]
        captured["out"] = output[0]

    handle = attn.register_forward_hook(grab, with_kwargs=True)
    try:
        _logits(model, ids)
    finally:
        handle.remove()
    cos, sin = captured["pos"]
    with torch.no_grad():
        want = _hand_attention(attn, captured["hidden"], cos, sin, spec)
    got = captured["out"]
    assert not torch.isnan(got).any()
    err = _rel(got, want)
    assert err < HAND_RTOL, f"{attn_impl}: quantized attention differs from the hand computation by {err:.2e}"
    with torch.no_grad():
        float_attn = _hand_attention(attn, captured["hidden"], cos, sin, KVQuantSpec())
    assert _rel(got, float_attn) > KV4_MIN_CHANGE, "the K/V quantization had no effect"


def test_cached_decoding_matches_full_forward():
    """The cache keeps float K/V and every step re-quantizes per token: same function."""
    model = _tiny("llama")
    enable_kv_quant(model, KVQuantSpec(bits=4, symmetric=False, clip_ratio=0.95, rotate_qk=True))
    ids = _ids((1, 12), seed=4)
    full = _logits(model, ids)
    with torch.no_grad():
        out = model(input_ids=ids[:, :7], use_cache=True)
        steps = [out.logits[:, -1]]
        cache = out.past_key_values
        for pos in range(7, 12):
            out = model(input_ids=ids[:, pos:pos + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
    incremental = torch.stack(steps[1:], dim=1)
    err = _rel(incremental, full[:, 7:])
    assert err < FP64_MODEL_RTOL, f"cached decoding differs from the full forward by {err:.2e}"


def test_disable_restores_and_spec_is_readable():
    model = _tiny("qwen3")
    ids = _ids()
    ref = _logits(model, ids)
    spec = KVQuantSpec(bits=4, rotate_qk=True)
    enable_kv_quant(model, spec)
    assert kv_quant_spec_of(model) == spec
    enable_kv_quant(model, KVQuantSpec(bits=6))  # re-enabling replaces the spec
    assert kv_quant_spec_of(model).bits == 6
    disable_kv_quant(model)
    assert kv_quant_spec_of(model) is None
    assert model.config._attn_implementation == "sdpa"
    assert _rel(_logits(model, ids), ref) < FP64_MODEL_RTOL


def test_deepcopy_keeps_the_spec():
    model = _tiny("llama")
    enable_kv_quant(model, KVQuantSpec(bits=4))
    ids = _ids()
    clone = copy.deepcopy(model)
    assert torch.equal(_logits(clone, ids), _logits(model, ids))


@pytest.mark.parametrize("shape, group, symmetric, clip", [
    ((3, 5, 16), None, True, 1.0),
    ((1, 7, 24), 8, False, 0.95),
    ((13, 20), 4, True, 0.9),
])
def test_ste_quantizer_forward_is_fake_quantize_and_gradient_passes(shape, group, symmetric, clip):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(shape, generator=gen) * 3).requires_grad_(True)
    ref = fake_quantize(x.detach(), 4, symmetric=symmetric, group_size=group, clip_ratio=clip)
    out = fake_quantize_ste(x, 4, symmetric=symmetric, group_size=group, clip_ratio=clip)
    assert torch.equal(out.detach(), ref), "the straight-through quantizer's forward differs from fake_quantize"
    weights = torch.randn(shape, generator=gen)
    (out * weights).sum().backward()
    assert torch.isfinite(x.grad).all()
    if symmetric and clip == 1.0:
        # nothing is clamped and only each group's absmax feeds the scale: elsewhere the
        # straight-through gradient is the upstream gradient itself
        g = shape[-1] if group is None else group
        xg = x.detach().reshape(-1, g)
        is_max = xg.abs() == xg.abs().amax(dim=-1, keepdim=True)
        passed = x.grad.reshape(-1, g)[~is_max]
        torch.testing.assert_close(passed, weights.reshape(-1, g)[~is_max], rtol=STE_GRAD_RTOL, atol=0)
    else:
        assert (x.grad != 0).float().mean() > 0.5


@pytest.mark.parametrize("kwargs, word", [
    ({"bits": 1}, "bits=1"),
    ({"bits": 9}, "bits=9"),
    ({"bits": 32}, "bits=32"),
    ({"bits": True}, "bits=True"),
    ({"bits": 4, "group_size": 0}, "group_size=0"),
    ({"bits": 4, "clip_ratio": 0.0}, "clip_ratio=0.0"),
    ({"bits": 4, "clip_ratio": 1.5}, "clip_ratio=1.5"),
    ({"bits": 4, "rotate_qk": "yes"}, "rotate_qk='yes'"),
    ({"bits": 4, "symmetric": 1}, "symmetric=1"),
    ({"bits": 4, "rotate_v": "yes"}, "rotate_v='yes'"),
])
def test_spec_validation(kwargs, word):
    with pytest.raises(ValueError, match=word.replace("(", r"\(")):
        KVQuantSpec(**kwargs)


def test_rotate_v_quantizes_values_in_the_hadamard_basis():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 7, 16, generator=g, dtype=torch.float64) for _ in range(3))
    v[..., 3] *= 25.0  # one outlier channel, as value projections have
    plain = KVQuantSpec(bits=4, symmetric=False)
    rotated = KVQuantSpec(bits=4, symmetric=False, rotate_v=True)
    h = hadamard_matrix(16) / 4.0
    _, k_plain, v_plain = quantize_qkv(q, k, v, plain)
    _, k_rot, v_rot = quantize_qkv(q, k, v, rotated)
    assert torch.equal(k_rot, k_plain), "rotate_v leaves the keys alone"
    want = fake_quantize(v @ h, 4, symmetric=False) @ h.T
    assert torch.allclose(v_rot, want, rtol=HAND_RTOL, atol=HAND_RTOL)
    assert (v_rot - v).square().sum() < (v_plain - v).square().sum()
    _, _, v16 = quantize_qkv(q, k, v, KVQuantSpec(bits=16, rotate_v=True))
    assert torch.equal(v16, v)
    from mosaicquant.harness.runtime import kv_format_reason

    assert kv_format_reason(plain, 16) is None and "Hadamard basis" in kv_format_reason(rotated, 16)


def test_enable_rejects_what_does_not_fit():
    model = _tiny("llama")  # head_dim 16
    with pytest.raises(UserInputError, match="group_size=5"):
        enable_kv_quant(model, KVQuantSpec(bits=4, group_size=5))
    assert model.config._attn_implementation == "sdpa", "a failed check must leave the model as it was"
    with pytest.raises(UserInputError, match="KVQuantSpec"):
        enable_kv_quant(model, {"bits": 4})
    odd = _tiny("llama", head_dim=10)  # 6 heads of 10: no Hadamard matrix of order 10
    with pytest.raises(UserInputError, match="head dimension 10"):
        enable_kv_quant(odd, KVQuantSpec(bits=4, rotate_qk=True))
    flex = _tiny("llama")
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(UserInputError, match="flex_attention"):
        enable_kv_quant(flex, KVQuantSpec(bits=4))
