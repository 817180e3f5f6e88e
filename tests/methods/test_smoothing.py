"""SmoothQuant scaling: the scale formula, statistics collection, function preserved."""

from __future__ import annotations

import copy

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

from mosaicquant.errors import UserInputError
from mosaicquant.methods.smoothing import (
    collect_input_absmax,
    smooth_model,
    smooth_scales,
    smoothing_input_names,
)

# float64 models; HF's RMSNorm casts to float32 internally (~1e-7 relative)
FP64_MODEL_RTOL = 1e-5
# scales are float64 arithmetic on float64 statistics
SCALE_RTOL = 1e-12
# a smoothing that skips the norm fold moves outputs by O(1) relative
BROKEN_MIN_RTOL = 1e-2
VOCAB = 211


def _tiny(arch: str) -> nn.Module:
    """Tiny random float64 models: GQA Llama (tied), MQA Qwen2 (q/k/v bias), MHA Qwen3."""
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64)
    if arch == "llama":
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
    elif arch == "qwen2":
        cfg = Qwen2Config(
            hidden_size=80,
            intermediate_size=112,
            num_attention_heads=5,
            num_key_value_heads=1,
            **common,
        )
        cls = Qwen2ForCausalLM
    else:
        cfg = Qwen3Config(
            hidden_size=96,
            intermediate_size=192,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            **common,
        )
        cls = Qwen3ForCausalLM
    cfg._attn_implementation = "eager"
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
        # outlier channels in the residual stream, as in real LLMs
        model.model.embed_tokens.weight[:, [3, 17]] *= 25.0
    return model


def _tokens(shape=(3, 13), seed=0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _outputs(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return list(out.hidden_states[1:-1]) + [out.logits]


def _max_rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def test_smooth_scales_formula():
    gen = torch.Generator().manual_seed(0)
    act = torch.rand(37, generator=gen, dtype=torch.float64) * 10 + 0.1
    weight = torch.rand(37, generator=gen, dtype=torch.float64) + 0.01
    for alpha in (0.0, 0.5, 0.85, 1.0):
        expected = act**alpha / weight ** (1 - alpha)
        torch.testing.assert_close(
            smooth_scales(act, weight, alpha), expected, rtol=SCALE_RTOL, atol=0
        )


def test_smooth_scales_balances_ranges_at_half():
    gen = torch.Generator().manual_seed(1)
    act = torch.rand(29, generator=gen, dtype=torch.float64) * 50 + 0.5
    weight = torch.rand(29, generator=gen, dtype=torch.float64) + 0.05
    s = smooth_scales(act, weight, alpha=0.5)
    torch.testing.assert_close(act / s, weight * s, rtol=SCALE_RTOL, atol=0)


def test_smooth_scales_zero_guard():
    act = torch.tensor([0.0, 4.0, 2.0, 0.0], dtype=torch.float64)
    weight = torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    s = smooth_scales(act, weight, alpha=0.85)
    assert s[0] == 1 and s[1] == 1 and s[3] == 1
    torch.testing.assert_close(s[2], torch.tensor(2.0**0.85 / 0.5**0.15, dtype=torch.float64))
    assert torch.isfinite(s).all()


@pytest.mark.parametrize(
    ("act", "weight", "alpha", "match"),
    [
        (torch.ones(4), torch.ones(5), 0.5, "same length"),
        (torch.ones(2, 2), torch.ones(2, 2), 0.5, "1-D"),
        (torch.tensor([1.0, -1.0]), torch.ones(2), 0.5, "act_absmax must hold finite values >= 0"),
        (torch.ones(2), torch.tensor([1.0, float("nan")]), 0.5, "weight_absmax"),
        (torch.ones(2), torch.ones(2), 1.5, r"alpha=1.5 .*\[0, 1\]"),
        (torch.ones(2), torch.ones(2), True, "alpha=True"),
    ],
)
def test_smooth_scales_rejects_bad_input(act, weight, alpha, match):
    with pytest.raises(ValueError, match=match):
        smooth_scales(act, weight, alpha)


def test_collect_input_absmax_matches_direct_computation():
    model = _tiny("llama")
    ids = _tokens((5, 11))
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    stats = collect_input_absmax(model, ids, names, batch_size=2)
    with torch.no_grad():
        layer0 = model.model.layers[0]
        expected_q = layer0.input_layernorm(model.model.embed_tokens(ids)).abs().amax(dim=(0, 1))
    torch.testing.assert_close(stats[names[0]], expected_q.float(), rtol=0, atol=0)
    assert stats[names[1]].shape == (160,)
    again = collect_input_absmax(model, ids, names, batch_size=5)
    assert all(torch.equal(stats[n], again[n]) for n in names)
    assert all(not m._forward_pre_hooks for m in model.modules()), "hooks left behind"


def test_collect_input_absmax_rejects_bad_input():
    model = _tiny("qwen2")
    with pytest.raises(
        UserInputError, match="Unknown module 'model.layers.0.self_attn.q_prj'.*q_proj"
    ):
        collect_input_absmax(model, _tokens(), ["model.layers.0.self_attn.q_prj"])
    with pytest.raises(ValueError, match="2-D integer"):
        collect_input_absmax(model, torch.rand(2, 5), ["lm_head"])
    with pytest.raises(ValueError, match="batch_size=0"):
        collect_input_absmax(model, _tokens(), ["lm_head"], batch_size=0)
    with pytest.raises(ValueError, match="module_names is empty"):
        collect_input_absmax(model, _tokens(), [])


def test_smoothing_input_names():
    model = _tiny("qwen3")
    assert smoothing_input_names(model) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.gate_proj",
    ]
    full = smoothing_input_names(model, smooth_vo=True, smooth_up_down=True)
    assert "model.layers.1.self_attn.o_proj" in full and "model.layers.0.mlp.down_proj" in full


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("extra", [False, True])
def test_smoothing_preserves_function(arch, extra):
    model = _tiny(arch)
    calib, ids = _tokens((4, 17), seed=1), _tokens()
    names = smoothing_input_names(model, smooth_vo=extra, smooth_up_down=extra)
    stats = collect_input_absmax(model, calib, names, batch_size=2)
    smoothed = copy.deepcopy(model)
    desc = smooth_model(smoothed, stats, alpha=0.85, smooth_vo=extra, smooth_up_down=extra)
    err = _max_rel_err(_outputs(smoothed, ids), _outputs(model, ids))
    assert err < FP64_MODEL_RTOL, f"{arch}: max relative error {err:.2e}"
    assert len(desc["groups"]) == len(names)
    assert max(g["max_scale"] for g in desc["groups"]) > 2.0, "nothing was smoothed"
    # activation ranges of the smoothed model are the old ones divided by s
    new_stats = collect_input_absmax(smoothed, calib, names, batch_size=2)
    q_name = "model.layers.0.self_attn.q_proj"
    q_weight = torch.stack(
        [
            model.get_submodule(q_name.replace("q_proj", p)).weight.abs().amax(0)
            for p in ("q_proj", "k_proj", "v_proj")
        ]
    ).amax(0)
    s = smooth_scales(stats[q_name], q_weight, 0.85)
    ratio = (new_stats[q_name].double() * s / stats[q_name].double() - 1).abs().max()
    assert ratio < FP64_MODEL_RTOL, f"q_proj input range is not act/s (off by {ratio:.2e})"


def test_vo_smoothing_shares_scales_across_grouped_query_heads():
    model = _tiny("llama")  # 6 query heads on 2 KV heads
    calib = _tokens((4, 17), seed=2)
    names = smoothing_input_names(model, smooth_vo=True)
    stats = collect_input_absmax(model, calib, names)
    v_before = model.model.layers[0].self_attn.v_proj.weight.detach().clone()
    o_before = model.model.layers[0].self_attn.o_proj.weight.detach().clone()
    smoothed = copy.deepcopy(model)
    smooth_model(smoothed, stats, smooth_vo=True)
    attn = smoothed.model.layers[0].self_attn
    o_scale = (attn.o_proj.weight / o_before).mean(0)  # s per o_proj input channel
    per_head = o_scale.reshape(2, 3, attn.head_dim)
    torch.testing.assert_close(per_head, per_head[:, :1].expand_as(per_head), rtol=1e-10, atol=0)
    assert (o_scale.max() / o_scale.min()) > 1.5, "v→o scales are trivial"
    # v_proj rows carry 1/s of their KV head (after the q/k/v column scaling)
    ids = _tokens()
    err = _max_rel_err(_outputs(smoothed, ids), _outputs(model, ids))
    assert err < FP64_MODEL_RTOL, f"max relative error {err:.2e}"
    assert not torch.equal(attn.v_proj.weight, v_before)


def test_skipping_the_norm_fold_breaks_equivalence():
    # negative control: the tolerance above detects a wrong transform
    model = _tiny("qwen3")
    calib, ids = _tokens((4, 17), seed=1), _tokens()
    stats = collect_input_absmax(model, calib, smoothing_input_names(model))
    smoothed = copy.deepcopy(model)
    smooth_model(smoothed, stats)
    with torch.no_grad():
        for i in range(2):
            smoothed.model.layers[i].input_layernorm.weight.copy_(
                model.model.layers[i].input_layernorm.weight
            )
    err = _max_rel_err(_outputs(smoothed, ids), _outputs(model, ids))
    assert err > BROKEN_MIN_RTOL, f"undoing the norm fold changed outputs by only {err:.2e}"


def test_smooth_model_errors_leave_model_untouched():
    model = _tiny("qwen2")
    stats = collect_input_absmax(model, _tokens(), smoothing_input_names(model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    partial = {k: v for k, v in stats.items() if "layers.1.mlp" not in k}
    with pytest.raises(
        UserInputError, match=r"model\.layers\.1\.mlp\.gate_proj, model\.layers\.1\.mlp\.up_proj"
    ):
        smooth_model(model, partial)
    bad_shape = dict(stats, **{"model.layers.0.self_attn.q_proj": torch.ones(7)})
    with pytest.raises(UserInputError, match=r"shape \(7,\), expected \(80,\)"):
        smooth_model(model, bad_shape)
    with pytest.raises(ValueError, match="alpha=-0.1"):
        smooth_model(model, stats, alpha=-0.1)
    with pytest.raises(UserInputError, match="smooth_vo"):
        smooth_model(model, stats, smooth_vo="yes")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(UserInputError, match="Unsupported model class Sequential"):
        smooth_model(nn.Sequential(nn.Linear(2, 2)), stats)
