"""Every family of the architecture table: the float transforms keep the logits, every method's
quantized run completes with finite logits, and the fused decoder refuses what it does not run.

Tiny random-weight float64 models of each family (2 layers, hidden 64); Gemma 3 with head size 32,
one sliding-window and one global layer, tied and scaled embeddings, norms whose ``1 + w`` factor
is not 1. HF's RMSNorms compute in float32, so float64 models agree to about 1e-7 relative.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from mosaicquant.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES, architecture_of
from mosaicquant.baselines.spinquant import LearnedRotations, apply_rotations, rotation_loss
from mosaicquant.errors import UserInputError
from mosaicquant.harness.context import QuantContext
from mosaicquant.harness.runtime import fused_reason
from mosaicquant.methods.rotation import (FusedProjection, model_parts, online_transforms, random_orthogonal,
                                          rotate_model)
from mosaicquant.methods.smoothing import smooth_model, smoothing_input_names
from mosaicquant.registry import get_method

VOCAB = 151
# relative max-abs logit change a float transform may cause (float32 norms inside float64 models)
FLOAT_RTOL = 1e-5
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3")


def tiny_model(family: str) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    if family == "llama":
        cfg, cls = LlamaConfig(tie_word_embeddings=True, **common), LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = Qwen3Config(head_dim=32, **common), Qwen3ForCausalLM
    elif family == "mistral":
        cfg, cls = MistralConfig(head_dim=16, sliding_window=8, **common), MistralForCausalLM
    elif family == "phi3":
        cfg, cls = Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **common), Phi3ForCausalLM
    elif family == "gemma3":
        cfg = Gemma3TextConfig(head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                               tie_word_embeddings=True, **common)
        cls = Gemma3ForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(1)
    offset = ARCHITECTURES[type(model).__name__].norm_offset
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # factors in [0.5, 1.5) whatever the norm's convention
                param.copy_(0.5 + torch.rand(param.shape, generator=gen) - offset)
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
    return model


def tokens(shape, seed) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


IDS = tokens((2, 20), 3)  # longer than the sliding windows (8)
CALIB = tokens((4, 16), 4)


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def context(calib=CALIB) -> QuantContext:
    return QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cpu"), log=lambda _: None)


def test_table_covers_the_families():
    names = {type(tiny_model(f)).__name__ for f in FAMILIES}
    assert names == set(SUPPORTED_ARCHITECTURES)
    with pytest.raises(UserInputError, match="Unsupported model class Linear .*Gemma3ForCausalLM"):
        architecture_of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rotation", ["hadamard", "orthogonal"])
def test_rotation_keeps_logits(family, rotation):
    model = tiny_model(family)
    ref = logits(model)
    desc = rotate_model(model, seed=1, rotation=rotation, online_o=True)
    assert rel_err(logits(model), ref) < FLOAT_RTOL
    outputs = [t["module"] for t in online_transforms(model) if t["side"] == "output"]
    if family == "gemma3":  # the rotation cannot pass the post-norms' elementwise weight: online after them
        assert outputs == sorted(desc["online_outputs"]) and len(outputs) == 4
        assert all(n.endswith(("post_attention_layernorm", "post_feedforward_layernorm")) for n in outputs)
    else:
        assert outputs == [] and desc["online_outputs"] == {}


def test_phi3_fused_projections_are_split_without_changing_the_function():
    model = tiny_model("phi3")
    ref = logits(model)
    parts = model_parts(model)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedProjection) and parts.layers[0].q_proj is attn.q_proj
    assert "model.layers.0.self_attn.qkv_proj.weight" not in model.state_dict()
    assert rel_err(logits(model), ref) < FLOAT_RTOL
    model_parts(model)  # a second call finds the split model
    assert rel_err(logits(model), ref) < FLOAT_RTOL


@pytest.mark.parametrize("family", FAMILIES)
def test_smoothing_keeps_logits(family):
    model = tiny_model(family)
    ref = logits(model)
    gen = torch.Generator().manual_seed(7)
    names = smoothing_input_names(model, smooth_vo=True, smooth_up_down=True)
    modules = dict(model.named_modules())
    absmax = {n: 0.1 + 5 * torch.rand(modules[n].in_features, generator=gen, dtype=torch.float64) for n in names}
    smooth_model(model, absmax, 0.5, smooth_vo=True, smooth_up_down=True)
    assert rel_err(logits(model), ref) < FLOAT_RTOL


@pytest.mark.parametrize("family", FAMILIES)
def test_learned_rotations_fold_and_train_on_the_same_function(family):
    model = tiny_model(family)
    ref = logits(model)
    rotate_model(model, seed=0, online_o=False)
    parts = model_parts(model)
    rot = LearnedRotations(r1=random_orthogonal(parts.hidden_size, 5),
                           r2=[random_orthogonal(layer.head_dim, 6 + layer.index) for layer in parts.layers])
    with torch.no_grad():
        loss = float(rotation_loss(model, IDS, rot.r1, rot.r2))
    apply_rotations(model, rot)
    out = logits(model)
    assert rel_err(out, ref) < FLOAT_RTOL
    expect = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))
    assert loss == pytest.approx(float(expect), rel=1e-6)


METHODS = {
    "fp16": {}, "rtn": {}, "smoothquant": {"alpha_grid": (0.5,)}, "quarot": {"w_clip_search": False},
    "spinquant": {"steps": 2, "w_clip_search": False}, "resq": {}, "atom": {}, "mosaicquant": {},
}


@pytest.mark.parametrize("family", FAMILIES[3:])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_runs_on_the_new_families(family, method):
    model = tiny_model(family).to(torch.float32)
    entry = get_method(method)
    ctx = context()
    entry.fn(model, entry.config(**METHODS[method]), ctx)
    out = logits(model)
    assert out.shape == (*IDS.shape, VOCAB) and torch.isfinite(out).all()
    if method in ("quarot", "spinquant") and family == "gemma3":
        assert any(t["side"] == "output" for t in online_transforms(model))
        assert ctx.info["online_transforms"] == online_transforms(model)


@pytest.mark.parametrize("family", FAMILIES[3:])
def test_cpu_library_baselines_run(family):
    pytest.importorskip("torchao.quantization")
    model = tiny_model(family).to(torch.float32)
    entry = get_method("torchao")
    entry.fn(model, entry.config(recipe="int8_dyn"), context())
    assert torch.isfinite(logits(model)).all()


@pytest.mark.parametrize("family", FAMILIES[3:])
def test_fused_decoder_refuses_by_name(family):
    reason = fused_reason(tiny_model(family))
    assert reason is not None and type(tiny_model(family)).__name__ in reason and "LlamaForCausalLM" in reason


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_conversion_handles_the_new_families(family):
    from mosaicquant.kernels.convert import kernelize

    model = tiny_model(family).to(torch.float32)
    entry = get_method("quarot")
    entry.fn(model, entry.config(w_clip_search=False), context())
    report = kernelize(model, kernel="torch")
    # every decoder linear (7 per layer, Phi-3's split ones included) takes the kernel path
    assert len(report.converted) == 7 * len(model.model.layers), report
    assert torch.isfinite(logits(model)).all()
