"""SpinQuant: Cayley SGD stays on the manifold and descends; learned rotations fold without
changing the float function; the training forward is the folded model; configs validate."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from mosaicquant.baselines.spinquant import (
    LearnedRotations,
    SpinQuantConfig,
    apply_rotations,
    cayley_sgd_step,
    cosine_lr,
    rotation_loss,
    spinquant,
    train_rotations,
)
from mosaicquant.errors import UserInputError
from mosaicquant.harness.context import QuantContext
from mosaicquant.methods.kvcache import kv_quant_spec_of
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear
from mosaicquant.methods.rotation import random_orthogonal, rotate_model
from mosaicquant.registry import get_method
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

ORTHO_ATOL = 1e-5
FP64_MODEL_RTOL = 1e-5
# the training forward (functional weights) and the folded model, both float64 models; the
# training loss takes its cross-entropy in float32
LOSS_MATCH_RTOL = 1e-6


VOCAB = 151


def tiny_model(arch: str, *, outliers: float = 0.0):
    """Tiny random float64 model; ``outliers`` scales three embedding channels (residual-stream outliers)."""
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if arch == "llama":  # GQA 6/2, head_dim 16, tied, biases
        cfg = LlamaConfig(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
                          tie_word_embeddings=True, attention_bias=True, mlp_bias=True, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":  # MQA 5/1, q/k/v biases
        cfg = Qwen2Config(hidden_size=80, intermediate_size=112, num_attention_heads=5, num_key_value_heads=1,
                          tie_word_embeddings=False, **common)
        cls = Qwen2ForCausalLM
    else:  # qwen3: 4 heads of 32, o_proj input 128 != hidden 96, QK-norm
        cfg = Qwen3Config(hidden_size=96, intermediate_size=192, num_attention_heads=4, num_key_value_heads=4,
                          head_dim=32, tie_word_embeddings=False, **common)
        cls = Qwen3ForCausalLM
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


def _tokens(shape, seed):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


CALIB = _tokens((6, 24), seed=11)
IDS = _tokens((2, 19), seed=12)


def context(calib, seed=0):
    return QuantContext(calibration=lambda: calib, seed=seed, device=torch.device("cpu"), log=lambda _: None)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _orth_err(x: torch.Tensor) -> float:
    return float((x.T @ x - torch.eye(x.shape[1], dtype=x.dtype)).abs().max())


@pytest.mark.parametrize("n, p", [(7, 7), (24, 24), (13, 5)])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_cayley_steps_stay_orthogonal(n, p, momentum):
    gen = torch.Generator().manual_seed(n + p)
    x = random_orthogonal(n, seed=n)[:, :p]
    buffer = None
    for step in range(25):
        grad = torch.randn(n, p, generator=gen, dtype=torch.float64) * (10.0 if step % 2 else 0.1)
        x, buffer = cayley_sgd_step(x, grad, 1.5, momentum=momentum, buffer=buffer)
    assert _orth_err(x) < ORTHO_ATOL, f"XᵀX - I reached {_orth_err(x):.2e}"
    x32, _ = cayley_sgd_step(x.float(), torch.randn(n, p, generator=gen), 0.5)
    assert _orth_err(x32) < ORTHO_ATOL


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_cayley_sgd_solves_a_procrustes_problem(momentum):
    """min_R ‖A R − B‖² over rotations R with B = A R*: the loss must fall towards 0.

    Cayley steps stay in the connected component of the start (det +1), so R* is a rotation.
    """
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(40, 9, generator=gen, dtype=torch.float64)
    target = random_orthogonal(9, seed=4)
    if torch.linalg.det(target) < 0:
        target[:, 0] = -target[:, 0]
    b = a @ target
    x = torch.eye(9, dtype=torch.float64)
    losses, buffer = [], None
    steps = 100
    for step in range(steps):
        xr = x.clone().requires_grad_(True)
        loss = ((a @ xr - b) ** 2).sum() / a.shape[0]
        loss.backward()
        losses.append(float(loss.detach()))
        x, buffer = cayley_sgd_step(x, xr.grad, cosine_lr(step, steps, 1.0), momentum=momentum, buffer=buffer)
    final = float(((a @ x - b) ** 2).sum() / a.shape[0])
    assert final < 0.05 * losses[0], f"loss {losses[0]:.3f} -> {final:.3f}"
    assert _orth_err(x) < ORTHO_ATOL


def test_cayley_step_rejects_bad_input():
    x = torch.eye(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="lr=-1"):
        cayley_sgd_step(x, x, -1)
    with pytest.raises(ValueError, match="momentum=1.0"):
        cayley_sgd_step(x, x, 0.1, momentum=1.0)
    with pytest.raises(ValueError, match=r"\[n, p\]"):
        cayley_sgd_step(x, torch.ones(3, 4), 0.1)
    with pytest.raises(ValueError, match="NaN"):
        cayley_sgd_step(x, torch.full((4, 4), float("nan")), 0.1)


def test_cosine_schedule():
    assert cosine_lr(0, 100, 1.5) == 1.5
    assert math.isclose(cosine_lr(50, 100, 1.5), 0.75)
    assert 0 < cosine_lr(99, 100, 1.5) < 1e-3
    with pytest.raises(ValueError, match="step=100"):
        cosine_lr(100, 100, 1.5)


def _random_rotations(model, seed: int) -> LearnedRotations:
    d = model.config.hidden_size
    hd = model.model.layers[0].self_attn.head_dim
    layers = len(model.model.layers)
    return LearnedRotations(r1=random_orthogonal(d, seed),
                            r2=[random_orthogonal(hd, seed + 1 + i) for i in range(layers)])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_folded_rotations_preserve_function_and_match_training_forward(arch):
    model = tiny_model(arch)
    ref = logits(model, IDS)
    rotate_model(model, seed=2, online_down=True, online_o=False)
    rot = _random_rotations(model, seed=7)
    train_loss = rotation_loss(model, IDS, rot.r1, rot.r2)
    apply_rotations(model, rot)
    out = logits(model, IDS)
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < FP64_MODEL_RTOL, f"{arch}: learned-rotation fold changed the function by {err:.2e}"
    folded_loss = F.cross_entropy(out[:, :-1].reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))
    assert math.isclose(float(train_loss.detach()), float(folded_loss), rel_tol=LOSS_MATCH_RTOL)


def test_apply_rotations_rejects_wrong_shapes():
    model = tiny_model("llama")
    rotate_model(model, seed=0)
    with pytest.raises(UserInputError, match="R1 has shape"):
        apply_rotations(model, LearnedRotations(r1=torch.eye(5), r2=[torch.eye(16)] * 2))
    with pytest.raises(UserInputError, match="1 R2 factors"):
        apply_rotations(model, LearnedRotations(r1=torch.eye(96), r2=[torch.eye(16)]))


def test_training_lowers_the_quantized_loss_and_stays_orthogonal():
    model = tiny_model("llama", outliers=25.0)
    rotate_model(model, seed=0, online_down=True, online_o=False)
    act = ActQuantSpec(bits=4, symmetric=False)
    batch = CALIB[:2]
    result = train_rotations(model, batch, act=act, steps=12, lr=1.5, batch_size=2)
    assert len(result.losses) == 12
    assert _orth_err(result.r1) < ORTHO_ATOL
    assert all(_orth_err(r) < ORTHO_ATOL for r in result.r2)
    # the quantized loss at the learned rotations, measured like the first step's
    from mosaicquant.baselines.spinquant import _act_quant_hooks
    from mosaicquant.methods.rotation import model_parts

    handles = _act_quant_hooks(model_parts(model), act)
    try:
        with torch.no_grad():
            final = float(rotation_loss(model, batch, result.r1, result.r2))
    finally:
        for h in handles:
            h.remove()
    assert final < result.losses[0], f"training did not lower the loss: {result.losses[0]:.4f} -> {final:.4f}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float_settings_preserve_function(arch):
    model = tiny_model(arch)
    ref = logits(model, IDS)
    ctx = context(CALIB)
    spinquant(model, SpinQuantConfig(wbits=16, abits=16, kvbits=16, steps=5), ctx)
    err = float((logits(model, IDS) - ref).abs().max() / ref.abs().max())
    assert err < FP64_MODEL_RTOL, f"{arch}: float SpinQuant changed the function by {err:.2e}"
    assert ctx.info["rotation_training"]["steps"] == 0, "nothing is quantized, so nothing is trained"


def test_w4a4kv4_pipeline():
    model = tiny_model("llama")
    ctx = context(CALIB)
    # GPTQ's clip search is tested elsewhere; off here to keep the test short
    spinquant(model, SpinQuantConfig(steps=2, train_batch=2, w_clip_search=False), ctx)
    info = ctx.info
    assert info["kv_bits"] == 4 and info["rotation_training"]["steps"] == 2
    assert len(info["rotation_training"]["losses"]) == 2
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.down_proj, FakeQuantLinear) and layer.mlp.down_proj.input_transform is not None
    assert layer.self_attn.o_proj.input_transform is None, "SpinQuant has no online o_proj Hadamard"
    assert not layer.self_attn.q_proj.act.symmetric, "activations are asymmetric"
    spec = kv_quant_spec_of(model)
    assert spec.bits == 4 and not spec.symmetric and spec.group_size is None and spec.rotate_qk


def test_config_kv_group_and_validation():
    cfg = SpinQuantConfig()
    assert cfg.kv_spec(64).group_size is None
    assert cfg.kv_spec(256).group_size == 128
    with pytest.raises(UserInputError, match="kv_group_size=96"):
        SpinQuantConfig(kv_group_size=96).kv_spec(128)
    for key, value, word in [("steps", -1, "steps=-1"), ("lr", -0.5, "lr=-0.5"), ("momentum", 1.0, "momentum=1.0"),
                             ("abits", 1, "abits=1"), ("rotation", "givens", "rotation='givens'"),
                             ("train_batch", 0, "train_batch=0")]:
        with pytest.raises(UserInputError, match=word):
            SpinQuantConfig(**{key: value})
    loaded = SpinQuantConfig.from_dict({"steps": "20", "kvbits": "16"})
    assert SpinQuantConfig.from_json(loaded.to_json()) == loaded
    assert get_method("spinquant").config is SpinQuantConfig
    assert (cfg.steps, cfg.lr) == (100, 1.5)
    assert not cfg.act_spec().symmetric and SpinQuantConfig(a_symmetric=True).act_spec().symmetric


def test_deepcopy_after_quantization_computes_the_same():
    model = tiny_model("qwen2")
    spinquant(model, SpinQuantConfig(steps=2), context(CALIB))
    assert torch.equal(logits(copy.deepcopy(model), IDS), logits(model, IDS))
