"""Layer-wise calibration: per-linear Hessians equal a direct computation; shared inputs share stats."""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from mosaicquant.methods import calibration as cal
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear, set_module

HESSIAN_RTOL = 1e-5


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


def _direct_inputs(model, tokens):
    """Inputs of every linear, recorded with plain hooks on the float model."""
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: seen.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1])))
             for n, m in model.named_modules() if isinstance(m, nn.Linear) and "layers." in n]
    with torch.no_grad():
        model(input_ids=tokens, use_cache=False)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def test_float_propagation_hessians_and_kept_inputs_match_direct_computation():
    model = _tiny()
    tokens = torch.randint(0, 101, (5, 13), generator=torch.Generator().manual_seed(1))
    direct = _direct_inputs(model, tokens)
    got = {}

    def record(index, layer, stats):
        for name, st in stats.items():
            got[f"model.layers.{index}.{name}"] = st

    cal.calibrate_layerwise(model, tokens, record, batch_size=2, propagate="float", keep_inputs=True)
    assert set(got) == set(direct)
    for name, x in direct.items():
        h = x.T @ x / x.shape[0]
        st = got[name]
        err = (st.hessian - h).norm() / h.norm()
        assert err < HESSIAN_RTOL, f"{name}: {err:.2e}"
        assert st.n_tokens == 5 * 13
        assert torch.allclose(st.absmax, x.abs().amax(0))
        assert torch.equal(st.inputs, x), name
    assert got["model.layers.0.self_attn.q_proj"] is got["model.layers.0.self_attn.v_proj"]
    assert got["model.layers.0.mlp.gate_proj"] is got["model.layers.0.mlp.up_proj"]
    assert got["model.layers.0.mlp.down_proj"] is not got["model.layers.0.mlp.up_proj"]


def test_quantized_propagation_feeds_quantized_outputs():
    model = _tiny()
    tokens = torch.randint(0, 101, (3, 11), generator=torch.Generator().manual_seed(2))
    h_first = {}

    def quantize_all(index, layer, stats):
        h_first[index] = stats["self_attn.q_proj"].hessian.clone()
        for name, st in stats.items():
            lin = layer.get_submodule(name)
            set_module(layer, name, FakeQuantLinear(lin.weight.data, lin.bias, ActQuantSpec(bits=3)))

    cal.calibrate_layerwise(model, tokens, quantize_all, batch_size=3)
    float_model = _tiny()
    direct = _direct_inputs(float_model, tokens)
    x0 = direct["model.layers.0.self_attn.q_proj"]
    x1 = direct["model.layers.1.self_attn.q_proj"]
    # layer 0 sees float inputs; layer 1 sees what the quantized layer 0 produced
    assert torch.allclose(h_first[0], x0.T @ x0 / x0.shape[0], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(h_first[1], x1.T @ x1 / x1.shape[0], rtol=1e-3, atol=1e-5)
    assert all(isinstance(m, FakeQuantLinear) for n, m in model.named_modules() if n.endswith("proj"))


def test_nan_activation_rejected():
    st = cal.LinearStats(4)
    try:
        st.add(torch.tensor([[1.0, float("nan"), 0.5, 2.0]]))
    except ValueError as exc:
        assert "NaN" in str(exc)
    else:
        raise AssertionError("NaN activations were accepted")
