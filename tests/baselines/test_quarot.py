"""QuaRot: float settings keep the function, the pieces are installed, rotations help against
outliers, and configs validate."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from mosaicquant.baselines.quarot import QuaRotConfig, quarot
from mosaicquant.baselines.rtn import RTNConfig, rtn
from mosaicquant.errors import UserInputError
from mosaicquant.harness.context import QuantContext
from mosaicquant.methods.hadamard import OnlineHadamard
from mosaicquant.methods.kvcache import KV_ATTENTION_NAMES, kv_quant_spec_of
from mosaicquant.methods.qlinear import FakeQuantLinear, quantize_weight
from mosaicquant.registry import get_method

# float64 models; HF's RMSNorm runs in float32 internally (see tests/methods/test_rotation.py)
FP64_MODEL_RTOL = 1e-5
VOCAB = 151
# with residual-stream outliers, QuaRot's A4 logit error must be below this fraction of RTN's
ROTATION_GAIN = 0.7


def tiny_model(arch: str, *, outliers: float = 0.0) -> nn.Module:
    """Tiny random float64 model (hidden sizes with Hadamard orders, ragged head counts).

    ``outliers > 0`` scales three embedding channels by that factor: residual-stream channels
    that dominate every token (massive activations), the structure rotations exist to spread.
    """
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if arch == "llama":  # hidden 96 = 12·8, intermediate 160 = 20·8, GQA 6/2, tied, biases
        cfg = LlamaConfig(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
                          tie_word_embeddings=True, attention_bias=True, mlp_bias=True, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":  # hidden 80 = 20·4, MQA 5/1, q/k/v biases
        cfg = Qwen2Config(hidden_size=80, intermediate_size=112, num_attention_heads=5, num_key_value_heads=1,
                          tie_word_embeddings=False, **common)
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":  # 4 heads of 32 (o_proj input 128 != hidden 96), QK-norm
        cfg = Qwen3Config(hidden_size=96, intermediate_size=192, num_attention_heads=4, num_key_value_heads=4,
                          head_dim=32, tie_word_embeddings=False, **common)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
        if outliers:
            model.get_input_embeddings().weight[:, [3, 17, 41]] *= outliers
    return model


def tokens(shape, seed) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def context(calib: torch.Tensor, seed: int = 0) -> QuantContext:
    return QuantContext(calibration=lambda: calib, seed=seed, device=torch.device("cpu"), log=lambda _: None)


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


CALIB = tokens((6, 24), seed=11)
IDS = tokens((2, 19), seed=12)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("rotation", ["hadamard", "orthogonal"])
def test_float_settings_preserve_function(arch, rotation):
    model = tiny_model(arch)
    ref = logits(model, IDS)
    ctx = context(CALIB, seed=5)
    quarot(model, QuaRotConfig(wbits=16, abits=16, kvbits=16, rotation=rotation), ctx)
    err = float((logits(model, IDS) - ref).abs().max() / ref.abs().max())
    assert err < FP64_MODEL_RTOL, f"{arch}/{rotation}: rotated float model differs by {err:.2e}"
    assert ctx.info["kv_bits"] == 16 and ctx.info["wbits"] == 16 and ctx.info["abits"] == 16
    assert ctx.info["transform"]["seed"] == 5


def test_kv_rotation_alone_preserves_function():
    model = tiny_model("llama")
    ref = logits(model, IDS)
    cfg = QuaRotConfig(wbits=16, abits=16, kvbits=16)
    quarot(model, cfg, context(CALIB))
    # QuaRot's Q/K rotation is installed with KV4; here it runs with 16-bit K/V
    from mosaicquant.methods.kvcache import KVQuantSpec, enable_kv_quant

    enable_kv_quant(model, KVQuantSpec(bits=16, rotate_qk=True))
    err = float((logits(model, IDS) - ref).abs().max() / ref.abs().max())
    assert err < FP64_MODEL_RTOL, f"Q/K rotation changed the rotated float model by {err:.2e}"


def test_w4a4kv4_installs_every_piece():
    model = tiny_model("qwen3")
    ref = logits(model, IDS)
    ctx = context(CALIB)
    quarot(model, QuaRotConfig(), ctx)
    layer = model.model.layers[0]
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
        linear = layer.get_submodule(name)
        assert isinstance(linear, FakeQuantLinear) and linear.wbits == 4
        assert linear.packed is not None, "4-bit symmetric weights are packed"
        assert linear.act.bits == 4 and linear.act.symmetric and linear.act.clip_ratio == 0.9
    assert isinstance(layer.mlp.down_proj.input_transform, OnlineHadamard)
    assert isinstance(layer.self_attn.o_proj.input_transform, OnlineHadamard)
    assert layer.self_attn.q_proj.input_transform is None
    assert not isinstance(model.lm_head, FakeQuantLinear), "the output head stays in 16 bits"
    spec = kv_quant_spec_of(model)
    assert spec.bits == 4 and not spec.symmetric and spec.clip_ratio == 0.95 and spec.rotate_qk
    assert model.config._attn_implementation == KV_ATTENTION_NAMES["sdpa"]
    assert ctx.info["kv_bits"] == 4 and ctx.info["quantized_linears"] == 2 * 7
    err = rel_err(logits(model, IDS), ref)
    assert 1e-3 < err < 1.0, f"W4A4KV4 relative logit error {err:.2e} is not plausible"


def test_kvbits16_installs_no_kv_quantization():
    model = tiny_model("llama")
    quarot(model, QuaRotConfig(wbits=16, kvbits=16), context(CALIB))
    spec = kv_quant_spec_of(model)
    assert spec is not None and not spec.active


def test_rotation_beats_rtn_with_activation_outliers():
    """With outlier channels in the residual stream, per-token A4 RTN loses far more than QuaRot."""
    model = tiny_model("llama", outliers=25.0)
    ref = logits(model, IDS)
    rotated = copy.deepcopy(model)
    quarot(rotated, QuaRotConfig(wbits=16, kvbits=16), context(CALIB))
    plain = copy.deepcopy(model)
    rtn(plain, RTNConfig(wbits=16, abits=4, a_clip=0.9), context(CALIB))
    err_quarot = rel_err(logits(rotated, IDS), ref)
    err_rtn = rel_err(logits(plain, IDS), ref)
    assert err_quarot < ROTATION_GAIN * err_rtn, f"QuaRot A4 error {err_quarot:.3e} vs RTN A4 {err_rtn:.3e}"


def test_gptq_weights_beat_rtn_weights_after_rotation():
    model = tiny_model("qwen2")
    ref = logits(model, IDS)
    errs = {}
    for wbits in (3, 16):
        m = copy.deepcopy(model)
        quarot(m, QuaRotConfig(wbits=wbits, abits=16, kvbits=16), context(CALIB))
        errs[wbits] = rel_err(logits(m, IDS), ref)
    assert errs[16] < FP64_MODEL_RTOL < errs[3], errs


@pytest.mark.parametrize("clip_search", [False, True])
def test_rtn_weights_skip_gptq_and_round_the_rotated_weights_to_the_4bit_grid(monkeypatch, clip_search):
    """``w_quant=rtn`` (QuaRot-RTN): no calibration, no GPTQ; each weight is the rotated one on the 4-bit grid."""
    model = tiny_model("qwen3")
    rotated = copy.deepcopy(model)
    quarot(rotated, QuaRotConfig(wbits=16, abits=16, kvbits=16), context(CALIB, seed=3))

    def no_calibration():
        raise AssertionError("QuaRot-RTN read calibration tokens")

    def no_gptq(*args, **kwargs):
        raise AssertionError("QuaRot-RTN ran GPTQ")

    monkeypatch.setattr("mosaicquant.baselines.quarot.gptq_quantize_model", no_gptq)
    ctx = QuantContext(calibration=no_calibration, seed=3, device=torch.device("cpu"), log=lambda _: None)
    quarot(model, QuaRotConfig(w_quant="rtn", w_clip_search=clip_search, kvbits=16), ctx)
    assert ctx.info["weight_quantizer"] == "rtn" and ctx.info["quantized_linears"] == 2 * 7
    for name, linear in model.named_modules():
        if not isinstance(linear, FakeQuantLinear):
            continue
        assert linear.wbits == 4 and linear.packed is not None, name
        ints = linear.packed.int_weight()
        assert int(ints.min()) >= -8 and int(ints.max()) <= 7, name
        grid = ints.to(torch.float64) * linear.packed.scales.to(torch.float64)
        assert torch.equal(linear.weight, grid), f"{name}: the weight is not its integers times its row scales"
        float_weight = rotated.get_submodule(name).weight.to(torch.float32)
        expected = quantize_weight(float_weight, 4, clip_search=clip_search)
        assert torch.equal(ints, expected.q), f"{name}: not round-to-nearest of the rotated weight"
    assert isinstance(model.model.layers[0].mlp.down_proj.input_transform, OnlineHadamard)
    assert not isinstance(model.lm_head, FakeQuantLinear), "the output head stays in 16 bits"


@pytest.mark.parametrize("key, value, word", [
    ("wbits", 1, "wbits=1"),
    ("abits", 9, "abits=9"),
    ("kvbits", 12, "kvbits=12"),
    ("a_clip", 0.0, "a_clip=0.0"),
    ("kv_clip", 1.2, "kv_clip=1.2"),
    ("rotation", "hadamrd", "rotation='hadamrd'"),
    ("w_group_size", 1, "w_group_size=1"),
    ("kv_group_size", 0, "kv_group_size=0"),
    ("percdamp", -0.1, "percdamp=-0.1"),
    ("w_quant", "awq", "w_quant='awq'"),
])
def test_config_validation(key, value, word):
    with pytest.raises(UserInputError, match=word):
        QuaRotConfig(**{key: value})


def test_config_round_trip_and_registry():
    cfg = QuaRotConfig.from_dict({"kvbits": "16", "w_group_size": "128", "act_order": "false"})
    assert cfg.kvbits == 16 and cfg.w_group_size == 128 and cfg.act_order is False
    assert QuaRotConfig.from_json(cfg.to_json()) == cfg
    assert QuaRotConfig.from_yaml(cfg.to_yaml()) == cfg
    assert get_method("quarot").config is QuaRotConfig
    defaults = QuaRotConfig()
    assert (defaults.wbits, defaults.abits, defaults.kvbits) == (4, 4, 4)
    assert (defaults.a_clip, defaults.kv_clip, defaults.percdamp, defaults.act_order) == (0.9, 0.95, 0.01, True)


def test_group_size_that_does_not_divide_fails_clearly():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="group_size=7"):
        quarot(model, QuaRotConfig(w_group_size=7, kvbits=16), context(CALIB))
