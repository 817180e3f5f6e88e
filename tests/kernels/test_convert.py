"""The kernel-backed model computes the simulated model's function (SPEC §1: same format, same scales)."""

import copy

import pytest
import torch

from mosaicquant.harness.context import QuantContext
from mosaicquant.kernels.convert import KernelLinear, kernelize
from mosaicquant.methods.mosaicquant import MosaicQuantConfig, mosaicquant
from mosaicquant.methods.qlinear import FakeQuantLinear

from ._helpers import DEVICE, needs_triton

# logits of the kernel model vs the simulated model with BF16-rounded layer outputs: what is
# left is float accumulation order (and the rare 4-bit activation it moves across a rounding
# boundary), relative to the logit range
MODEL_REL_TOL = 1e-2


def _tiny_quantized(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(seed))
    ctx = QuantContext(calibration=lambda: calib, seed=seed, device=torch.device("cpu"), log=lambda s: None)
    config = MosaicQuantConfig(block="16x32", budget=0.3, base="rtn")
    return mosaicquant(model, config, ctx), ctx


@pytest.mark.parametrize("kernel", ["torch", pytest.param("triton", marks=needs_triton())])
def test_kernel_model_equals_simulated_model(kernel):
    sim, ctx = _tiny_quantized()
    assert ctx.info["memory_bytes"]["residual_values"] > 0
    fast = copy.deepcopy(sim)
    report = kernelize(fast, kernel=kernel)
    n_sim = sum(isinstance(m, FakeQuantLinear) for m in sim.modules())
    assert len(report.converted) == n_sim == 14 and not report.skipped
    assert sum(isinstance(m, KernelLinear) for m in fast.modules()) == n_sim
    for m in sim.modules():
        if isinstance(m, FakeQuantLinear):
            m.output_rounding = torch.bfloat16
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = sim(input_ids=ids).logits
        sim_dev = fast.to(DEVICE)
        out = sim_dev(input_ids=ids.to(DEVICE)).logits.float().cpu()
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < MODEL_REL_TOL, f"kernel model deviates from the simulated model: {err:.3g}"


def test_layers_without_a_fast_path_are_reported():
    sim, _ = _tiny_quantized()
    name = "model.layers.0.self_attn.q_proj"
    layer = sim.get_submodule(name)
    layer.packed = None
    report = kernelize(sim, kernel="torch")
    assert name in report.skipped and "packed 4-bit" in report.skipped[name]
