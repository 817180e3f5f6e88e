"""torchao recipes: int8 dynamic W8A8 runs on the CPU as a real int8 GEMM; int4 weight-only says why not."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mosaicquant.baselines.torchao import COMPILE_MODE, TorchAOConfig, torchao
from mosaicquant.errors import NotAvailableError
from mosaicquant.errors import UserInputError
from mosaicquant.harness.context import QuantContext
from mosaicquant.harness.spec import parse_plugin_spec
from mosaicquant.harness.speedforms import executable
from mosaicquant.harness.suites.speed import first_call_s, measure_decode, measure_prefill

ao_quant = pytest.importorskip("torchao.quantization", reason="torchao is not installed: pip install "
                               "'mosaicquant[torchao]'")

VOCAB = 101
# W8A8 per-token/per-channel on a random model: close to float, but not equal
MAX_REL_CHANGE_W8A8 = 0.05
# torchao rounds x * (1 / scale): a few activations land one int8 step away from round(x / scale)
INT8_LSB_TOL = 5e-3


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def _ctx(device: str = "cpu") -> QuantContext:
    return QuantContext(calibration=lambda: pytest.fail("torchao recipes need no calibration"), seed=0,
                        device=torch.device(device), log=lambda s: None)


def test_int8_dyn_is_int8_gemm_and_keeps_head():
    model = _tiny()
    test = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(test).logits
    head_weight = model.lm_head.weight.detach().clone()
    ctx = _ctx()
    torchao(model, TorchAOConfig(recipe="int8_dyn"), ctx)

    info = ctx.info
    assert (info["wbits"], info["abits"], info["kv_bits"]) == (8, 8, 16)
    assert info["torchao_config"] == "Int8DynamicActivationInt8WeightConfig"
    assert info["torchao_version"] == __import__("torchao").__version__
    assert info["quantized_linears"] == 14 and "torch._int_mm" in info["exec_path"]
    weight = model.model.layers[0].mlp.down_proj.weight
    assert type(weight).__name__ == "Int8Tensor" and weight.qdata.dtype == torch.int8
    assert type(model.lm_head.weight) is torch.nn.Parameter and torch.equal(model.lm_head.weight, head_weight)

    # the linear computes int8(x) @ int8(w) rescaled: check one layer against that reference
    # (torchao's symmetric int8 grid: scale = absmax / ((127 - (-128)) / 2), values clamped to -128..127)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    x_scale = x.abs().amax(dim=1, keepdim=True) / 127.5
    xq = torch.round(x / x_scale).clamp(-128, 127)
    expected = (xq @ weight.qdata.float().t()) * x_scale * weight.scale.reshape(1, -1)
    with torch.no_grad():
        got = layer(x)
        weight_only = x @ weight.dequantize().t()  # what the layer would give with float activations
    tol = INT8_LSB_TOL * float(expected.abs().max())
    assert float((got - expected).abs().max()) < tol
    assert float((got - weight_only).abs().max()) > tol  # the activations really are quantized

    with torch.no_grad():
        out = model(test).logits
    rel = float((out - ref).norm() / ref.norm())
    assert 0 < rel < MAX_REL_CHANGE_W8A8, rel


def test_int4_wo_on_cpu_raises_clear_error_before_quantizing():
    model = _tiny()
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    ctx = _ctx()
    with pytest.raises(NotAvailableError, match=r"recipe 'int4_wo' .* runs only on a CUDA GPU with bfloat16 weights; "
                                                r"this cell has cpu and float32"):
        torchao(model, TorchAOConfig(recipe="int4_wo"), ctx)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before) and ctx.info == {}


@pytest.mark.gpu
def test_int4_wo_on_gpu_runs_tinygemm():
    model = _tiny().to("cuda", torch.bfloat16)
    ctx = _ctx("cuda")
    torchao(model, TorchAOConfig(recipe="int4_wo"), ctx)
    assert ctx.info["quantized_linears"] == 14 and ctx.info["wbits"] == 4
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, VOCAB, (1, 9), device="cuda")).logits).all()


def test_bad_recipe_and_missing_package():
    with pytest.raises(UserInputError, match="recipe='int4' is not allowed: choose one of 'int8_dyn', 'int4_wo'"):
        TorchAOConfig.from_dict({"recipe": "int4"})


@pytest.mark.parametrize("compile_form", [False, True])
def test_missing_torchao_says_what_to_install(monkeypatch, compile_form):
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(NotAvailableError, match=r"pip install 'mosaicquant\[torchao\]'"):
        torchao(_tiny(), TorchAOConfig(compile=compile_form), _ctx())


def test_compile_option_parses_from_a_spec_and_refuses_other_values():
    spec = parse_plugin_spec("torchao:recipe=int8_dyn:compile=true", "method")
    assert spec.config == TorchAOConfig(recipe="int8_dyn", compile=True)
    with pytest.raises(UserInputError, match="compile"):
        TorchAOConfig.from_dict({"compile": "maybe"})


def test_compiled_form_reaches_the_speed_record_and_computes_the_same():
    model = _tiny()
    test = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    ctx = _ctx()
    torchao(model, TorchAOConfig(recipe="int8_dyn", compile=True), ctx)
    assert ctx.info["torch_compile"] == COMPILE_MODE
    with torch.no_grad():
        eager = model(test).logits
    # the plumbing is the mode's: a CPU compile at max-autotune takes minutes, the default one seconds
    info = {**ctx.info, "torch_compile": "default"}
    path = executable(model, info)
    assert info["speed"]["form"] == "compiled" and info["speed"]["compile_mode"] == "default"
    assert path == info["exec_path_speed"] and "torch.compile(mode='default', dynamic=False) of each of 14" in path
    forward = model.model.layers[0].mlp.down_proj.forward
    assert executable(model, info) == path and model.model.layers[0].mlp.down_proj.forward is forward  # once
    compile_s = {}
    with torch.no_grad():
        first_call_s(lambda: model(test), compile_s, "test")
        compiled = model(test).logits
        # the suites' measurements make that first call before timing (here on the CPU's wall clock)
        measure_prefill(model, 1, 9, torch.device("cpu"), replays=3, graphs=False, compile_s=compile_s)
        measure_decode(model, 2, 5, torch.device("cpu"), replays=3, graphs=False, compile_s=compile_s)
    assert sorted(compile_s) == ["decode_b2", "prefill", "test"] and all(s > 0 for s in compile_s.values()), compile_s
    rel = ((compiled - eager).norm() / eager.norm()).item()
    assert rel < INT8_LSB_TOL, f"compiled logits {rel:.2e} from eager (relative)"
    # no compiled form: nothing is recorded
    first_call_s(lambda: pytest.fail("an eager form makes no first call"), None, "prefill")


def test_eager_torchao_is_the_native_form():
    model = _tiny()
    ctx = _ctx()
    torchao(model, TorchAOConfig(recipe="int8_dyn"), ctx)
    assert "torch_compile" not in ctx.info
    executable(model, ctx.info)
    assert ctx.info["speed"]["form"] == "native" and "torch.compile" not in ctx.info["exec_path_speed"]


def test_compiling_a_model_without_packed_linears_says_so():
    from mosaicquant.errors import Unavailable
    from mosaicquant.harness.speedforms import compile_linears

    with pytest.raises(Unavailable, match="no linear with a library's packed weights to compile"):
        compile_linears(_tiny(), COMPILE_MODE)
