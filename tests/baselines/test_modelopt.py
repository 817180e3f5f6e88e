"""ModelOpt (TensorRT-LLM's recipes) on a tiny random Llama: quantizers, recorded recipe, head, errors."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mosaicquant.baselines.modelopt import RECIPES, ModelOptConfig, modelopt
from mosaicquant.errors import NotAvailableError
from mosaicquant.errors import UserInputError
from mosaicquant.harness.context import QuantContext
from mosaicquant.methods.qlinear import output_head_name

mtq = pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed: "
                          "pip install 'mosaicquant[modelopt]'")

VOCAB = 101
# a recipe must move the logits (it quantizes) but not wreck them on a random model
MIN_REL_CHANGE = 1e-4
MAX_REL_CHANGE = 0.5


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    # hidden 128: one full int4 group of 128 per row, as on real models
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def _tokens(n: int, seqlen: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _ctx(calib: torch.Tensor) -> QuantContext:
    return QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cpu"), log=lambda s: None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("recipe", ["int8_sq", "int4_awq", "fp8"])
def test_recipe_quantizes_body_records_recipe_and_keeps_head(recipe):
    model = _tiny()
    test = _tokens(2, 24, 2)
    with torch.no_grad():
        ref = model(test).logits
        head_ref = model.lm_head(torch.randn(3, 128, generator=torch.Generator().manual_seed(5)))
    head_weight = model.lm_head.weight.detach().clone()
    ctx = _ctx(_tokens(4, 24, 1))
    modelopt(model, ModelOptConfig(recipe=recipe, calib_batch_size=3), ctx)

    spec = RECIPES[recipe]
    info = ctx.info
    assert info["recipe"] == recipe and info["modelopt_config"] == spec.config_name
    assert info["modelopt_version"] == __import__("modelopt").__version__
    assert (info["wbits"], info["abits"], info["kv_bits"]) == (spec.wbits, spec.abits, 16)
    assert info["exec_path"] == "simulated (ModelOpt fake-quant)"
    assert info["quantized_linears"] == 14 and info["output_head"] == "lm_head"

    # the inserted quantizers are the recipe's: weight bits, and activations on or off
    q_proj = model.model.layers[1].self_attn.q_proj
    weight_q = q_proj.weight_quantizer
    first = weight_q[0] if hasattr(weight_q, "__getitem__") else weight_q
    assert first.is_enabled
    expected_bits = {"int8_sq": 8, "int4_awq": 4, "fp8": (4, 3)}[recipe]
    assert first.num_bits == expected_bits
    assert q_proj.input_quantizer.is_enabled == (spec.abits < 16)

    # the head: every quantizer off, weights bit-identical, same function
    head = model.lm_head
    assert not any(getattr(m, "is_enabled", False) for m in head.modules() if m is not head)
    assert torch.equal(head.weight, head_weight)
    with torch.no_grad():
        assert torch.equal(head(torch.randn(3, 128, generator=torch.Generator().manual_seed(5))), head_ref)
        out = model(test).logits
    assert torch.isfinite(out).all()
    assert MIN_REL_CHANGE < _rel(out, ref) < MAX_REL_CHANGE, _rel(out, ref)


def test_head_found_by_identity_not_by_name():
    model = _tiny()
    model.output_proj = model.lm_head
    del model.lm_head
    model.get_output_embeddings = lambda: model.output_proj
    assert output_head_name(model) == "output_proj"


def test_bad_recipe_names_allowed_values():
    with pytest.raises(UserInputError, match="recipe='int4' is not allowed: choose one of 'int4_awq', 'w4a8_awq', "
                                             "'int8_sq', 'fp8'"):
        ModelOptConfig.from_dict({"recipe": "int4"})
    with pytest.raises(UserInputError, match="calib_batch_size=0 is out of range"):
        ModelOptConfig(calib_batch_size=0)


def test_fp8_preflight_reports_what_modelopt_cannot_run(monkeypatch):
    """ModelOpt 0.47 runs fp8 on the CPU (float8_e4m3fn casts); where a version cannot, the error
    names the recipe, the device and ModelOpt's reason before any calibration."""
    calls = []

    def refusing_quantize(model, config, forward_loop=None):
        raise RuntimeError("fp8 fake quantization needs CUDA")

    monkeypatch.setattr(mtq, "quantize", refusing_quantize)
    ctx = QuantContext(calibration=lambda: calls.append("calibration") or _tokens(2, 8, 0), seed=0,
                       device=torch.device("cpu"), log=lambda s: None)
    with pytest.raises(NotAvailableError, match=r"cannot run recipe 'fp8' \(FP8_DEFAULT_CFG\) on cpu with float32 "
                                                r"weights: RuntimeError: fp8 fake quantization needs CUDA"):
        modelopt(_tiny(), ModelOptConfig(recipe="fp8"), ctx)
    assert calls == [] and ctx.info == {}


def test_missing_modelopt_says_what_to_install(monkeypatch):
    for name in [n for n in sys.modules if n == "modelopt" or n.startswith("modelopt.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(NotAvailableError, match=r"pip install 'mosaicquant\[modelopt\]'"):
        modelopt(_tiny(), ModelOptConfig(), _ctx(_tokens(2, 8, 0)))


def test_runner_records_modelopt_cell(tmp_path, tiny_llama_dir, tiny_corpus):
    from mosaicquant.harness.cli import main
    from mosaicquant.harness.results import load_records

    rc = main(["run", "--model", tiny_llama_dir, "--methods", "fp16,modelopt:recipe=int8_sq", "--suites",
               "accuracy:seqlen=32", "--corpus", tiny_corpus, "--calib-samples", "4", "--calib-seqlen", "32",
               "--max-chunks", "2", "--out", str(tmp_path / "res")])
    assert rc == 0
    recs = {r["method"]["label"]: r for r in load_records(tmp_path / "res")}
    rec = recs["modelopt:recipe=int8_sq"]
    assert rec["status"] == "ok" and rec["method_info"]["recipe"] == "int8_sq"
    assert rec["method_info"]["trtllm_quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    ppl, ref = rec["metrics"]["ppl"]["value"], recs["fp16"]["metrics"]["ppl"]["value"]
    assert ppl != ref and abs(ppl / ref - 1) < 0.2, (ppl, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8", "w4a8_awq"])
def test_recipe_on_gpu_bfloat16(recipe):
    model = _tiny().to("cuda", torch.bfloat16)
    calib = _tokens(4, 24, 1)
    ctx = QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cuda"), log=lambda s: None)
    modelopt(model, ModelOptConfig(recipe=recipe), ctx)
    assert ctx.info["quantized_linears"] == 14 and ctx.info["recipe"] == recipe
    with torch.no_grad():
        assert torch.isfinite(model(_tokens(2, 16, 2).cuda()).logits).all()
