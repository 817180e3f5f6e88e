"""Speed path on the CPU: shape models, data-free speed forms, executable forms, the decode
mechanism of the throughput suite, and the runner's handling of GPU-only suites.

Timings here are plumbing only (CPU wall clock); the numbers come from the GPU runs.
"""

import pytest
import torch

from mosaicquant.errors import Unavailable, UserInputError
from mosaicquant.harness import shapes
from mosaicquant.harness.cli import main
from mosaicquant.harness.context import QuantContext, SuiteContext
from mosaicquant.harness.models import resolve_model
from mosaicquant.harness.results import load_records
from mosaicquant.harness.speedforms import FLOAT_PATH, executable, speed_form
from mosaicquant.harness.suites import speed
from mosaicquant.kernels._tiles import SWAP_MIN_M
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear, weight_memory
from mosaicquant.registry import get_method, get_suite

TINY = shapes.ShapeModel("tiny-llama-shapes", "llama", 64, 128, 2, 4, 2, 16, 256, False)
TINY_QWEN = shapes.ShapeModel("tiny-qwen3-shapes", "qwen3", 64, 128, 2, 4, 2, 32, 256, True)


@pytest.fixture
def tiny_shapes(monkeypatch):
    monkeypatch.setitem(shapes.SHAPE_MODELS, TINY.name, TINY)
    monkeypatch.setitem(shapes.SHAPE_MODELS, TINY_QWEN.name, TINY_QWEN)
    return TINY.name


def _ctx():
    return QuantContext(calibration=lambda: None, seed=0, device=torch.device("cpu"))


def _form(method, model, **options):
    entry = get_method(method)
    ctx = _ctx()
    speed_form(method, model, entry.config(**options), ctx)
    return ctx


def test_shape_models_cover_the_spec_and_resolve():
    spec_sizes = {"llama-3-8b-shapes": (4096, 14336, 32, 8), "qwen3-8b-shapes": (4096, 12288, 32, 8),
                  "qwen3-32b-shapes": (5120, 25600, 64, 8), "llama-3.2-3b-shapes": (3072, 8192, 24, 8),
                  "qwen3-4b-shapes": (2560, 9728, 32, 8), "qwen3-14b-shapes": (5120, 17408, 40, 8)}
    for name, sizes in spec_sizes.items():
        s = shapes.SHAPE_MODELS[name]
        assert (s.hidden, s.intermediate, s.heads, s.kv_heads) == sizes
        assert resolve_model(name).kind == "shapes"
    with pytest.raises(UserInputError, match="Did you mean: llama-3-8b-shapes"):
        resolve_model("llama-3-8B-shapes")


@pytest.mark.parametrize("name", [TINY.name, TINY_QWEN.name])
def test_build_shape_model_has_the_shapes(tiny_shapes, name):
    model = shapes.build_shape_model(name, dtype=torch.bfloat16)
    s = shapes.SHAPE_MODELS[name]
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.weight.shape == (s.hidden, s.intermediate)
    assert layer.self_attn.q_proj.weight.shape == (s.heads * s.head_dim, s.hidden)
    assert layer.self_attn.k_proj.weight.shape == (s.kv_heads * s.head_dim, s.hidden)
    assert next(model.parameters()).dtype == torch.bfloat16 and len(model.model.layers) == s.layers
    assert 0.01 < layer.mlp.up_proj.weight.float().std().item() < 0.04  # transformers' init, not zeros


@pytest.mark.parametrize("method, options, kv", [
    ("rtn", {}, None), ("quarot", {}, (True, 0.95, True)), ("spinquant", {}, (True, 1.0, True)),
    ("atom", {"n_outliers": 8, "group_size": 16}, (True, 1.0, False)), ("mosaicquant", {}, None),
    ("mosaicquant", {"kvbits": 4}, (True, 0.95, True)), ("quarot", {"kvbits": 16}, None)])
def test_speed_forms_install_the_methods_kv_cache(tiny_shapes, method, options, kv):
    # the method's own KV spec (4-bit per head and token: the fused decoder keeps a 4-bit cache), recorded
    from mosaicquant.harness.runtime import resolve_runtime
    from mosaicquant.methods.kvcache import kv_quant_spec_of

    model = shapes.build_shape_model(tiny_shapes, dtype=torch.bfloat16)
    ctx = _form(method, model, **options)
    spec = kv_quant_spec_of(model)
    assert ctx.info["kv_bits"] == (4 if kv else 16)
    if kv is None:
        assert (spec is None or not spec.active) and ctx.info["kv_cache"] is None
        assert "; KV: " not in resolve_runtime("auto", model)[1]
        return
    asym, clip, rotate = kv
    assert (spec.bits, spec.symmetric, spec.clip_ratio, spec.rotate_qk) == (4, not asym, clip, rotate)
    assert ctx.info["kv_cache"]["kv_bits"] == 4
    name, description = resolve_runtime("auto", model)
    assert name == "fused" and f"KV: 4-bit asymmetric cache (clip {clip:g})" in description
    assert ("after a Q/K Hadamard" in description) == rotate


def test_exec_path_counts_the_dense_layers_that_keep_the_wide_tiles(tiny_shapes, monkeypatch):
    # on the GPU a wide dense layer (Llama-3-8B's gate/up) keeps the packed kernel's wide tiles at 17-32 tokens
    # (_tiles.wide_decode); the execution path then names how many linears run the swapped GEMM's decode tiles
    from mosaicquant.kernels import _tiles

    model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
    ctx = _form("rtn", model)
    gate_up = 2 * model.config.intermediate_size
    monkeypatch.setattr(_tiles, "wide_decode", lambda m, n, device, residual: not residual and n >= gate_up)
    with torch.no_grad():
        path = executable(model, ctx.info)
    layers = len(model.model.layers)
    assert (f"calls of 17-32 tokens on {3 * layers} of {4 * layers} linears: the swapped GEMM at decode tiles "
            f"(the other {layers} on the packed kernel's wide tiles)") in path, path


# the linears' kernels against the simulated linears, with 16-bit caches (a 4-bit cache's integers magnify
# last-bit differences: test_speed_forms_install_the_methods_kv_cache and test_runtime cover those)
@pytest.mark.parametrize("method, options", [("rtn", {}), ("smoothquant", {}), ("quarot", {"kvbits": 16}),
                                             ("mosaicquant", {"budget": 0.25, "block": "16x64"})])
def test_speed_forms_build_the_methods_format_and_run_on_the_kernels(tiny_shapes, method, options):
    model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    ctx = _form(method, model, **options)
    layers = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    assert len(layers) == 14 and all(m.packed is not None for m in layers)
    assert ctx.info["weights"] == "random (speed only)"
    assert ctx.info["kv_bits"] == 16
    if method == "quarot":
        assert model.model.layers[0].mlp.down_proj.input_transform is not None
    if method == "mosaicquant":
        blocks = sum(m.packed.residual.num_blocks for m in layers)
        total = sum(-(-m.packed.shape[0] // 16) * -(-m.packed.shape[1] // 64) for m in layers)
        assert abs(blocks / total - 0.25) < 0.05, (blocks, total)
    memory = weight_memory(model)
    with torch.no_grad():
        simulated = model(input_ids=ids).logits
        path = executable(model, ctx.info)
    # the kernel layers store exactly the packed format; stacking q/k/v and gate/up into one layer
    # drops one int32 row-pointer entry per merged member (3 per decoder layer)
    after = weight_memory(model)
    stacked_rows = 4 * 3 * len(model.model.layers) if method == "mosaicquant" else 0
    assert after["residual_indices"] == memory["residual_indices"] - stacked_rows
    assert {k: v for k, v in after.items() if "indices" not in k and k != "total_quantized_linears"} == \
        {k: v for k, v in memory.items() if "indices" not in k and k != "total_quantized_linears"}
    with torch.no_grad():
        kernels = model(input_ids=ids).logits
    assert not any(isinstance(m, FakeQuantLinear) for m in model.modules())
    assert ("ZipperEngine" in path) == (method == "mosaicquant") and path == ctx.info["exec_path_speed"]
    # 16x64 residual blocks are narrower than the swapped GEMM's 128-value steps: that path is not claimed
    swapped = f">= {SWAP_MIN_M} tokens whose 128x128 output tiles fill the GPU (prefill): int8 activations + " \
        "operand-swapped GEMM" in path
    assert swapped == (method != "mosaicquant")
    # dense layers also run 17-32 token calls on it, at decode tiles (16 on the packed kernel's wide K steps)
    assert ("of 17-32 tokens: the swapped GEMM at decode tiles" in path) == (method != "mosaicquant")
    assert "calls of 1 token: the dp4a decode GEMV" in path
    assert ("(residual included)" in path) == (method == "mosaicquant")
    # mid-sized calls of the small dense layers take the swapped GEMM's mid tiles (the 16x64 residual blocks
    # are narrower than its 128-value steps: not claimed for MosaicQuant)
    assert ("the swapped GEMM on mid tiles with split-K" in path) == (method != "mosaicquant")
    # ZipperEngine's "auto" mode runs a few tokens' kept blocks in programs of their own
    assert ("the residual blocks in programs of their own" in path) == (method == "mosaicquant")
    # whose fix-up writes gate/up's SiLU·mul (one stacked gate/up per decoder layer)
    # (the dense GEMM's too where down_proj has an online Hadamard, so its quantizer does not take SiLU·mul)
    gated = f"{len(model.model.layers)} gate/up GEMMs writing SiLU·mul themselves"
    assert (gated in path) == (method in ("mosaicquant", "quarot"))
    # the kernels compute the simulated model's function up to BF16 outputs (which can move a later
    # 4-bit activation to the next level): far closer to it than quantization is to the float model
    # (MosaicQuant here: 0.40 with free residual scales, 0.55 with power-of-two ones; a wiring error is ~1x,
    # tests/kernels/test_convert.py)
    kernel_err = (kernels.float() - simulated).norm()
    quant_err = (simulated - reference).norm()
    assert kernel_err < 0.7 * quant_err, (kernel_err, quant_err)


def test_methods_without_a_fast_path_are_unavailable_never_stand_ins(tiny_shapes):
    with pytest.raises(Unavailable, match="W8A8"):
        _form("rtn", shapes.build_shape_model(tiny_shapes, dtype=torch.float32), wbits=8, abits=8)
    model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
    ctx = _form("rtn", model, w_group_size=32)  # group-wise weight scales with per-token activations
    with pytest.raises(Unavailable, match="no fast path: 14 quantized linear.*group-wise base scales"):
        executable(model, ctx.info)


def test_speed_form_comes_from_the_methods_registry_entry(tiny_shapes):
    """A plugin method that registers a speed form is timed with it: the harness holds no list of its own."""
    from dataclasses import dataclass

    from mosaicquant.config import Config
    from mosaicquant.methods.speed_form import dense_w4
    from mosaicquant.registry import METHODS

    @dataclass(frozen=True)
    class PluginConfig(Config):
        wbits: int = 4
        abits: int = 4

    calls = []

    def plugin_form(model, config, ctx):
        calls.append(config)
        return dense_w4(model, ActQuantSpec(bits=4, symmetric=True, clip_ratio=0.9), 4), {"plugin": True}

    get_method("rtn")  # the built-ins first: the plugin registers beside them
    METHODS.register("speed-form-demo", lambda m, c, ctx: m, PluginConfig, speed_form=plugin_form)
    try:
        model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
        ctx = _ctx()
        speed_form("speed-form-demo", model, PluginConfig(), ctx)
    finally:
        METHODS._entries.pop("speed-form-demo", None)
    assert calls == [PluginConfig()]
    assert ctx.info["speed_form"] == {"plugin": True} and ctx.info["wbits"] == 4
    assert ctx.info["quantized_linears"] == sum(isinstance(m, FakeQuantLinear) for m in model.modules()) > 0


def test_atom_speed_form_runs_on_the_mixed_kernels(tiny_shapes):
    model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        reference = model(input_ids=ids).logits.float()
    ctx = _form("atom", model, n_outliers=16, group_size=32, kvbits=16)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.act.high_channels.numel() == 16 and layer.weight_groups == -(-(layer.in_features - 16) // 32) + 1
    with torch.no_grad():
        simulated = model(input_ids=ids).logits.float()
        path = executable(model, ctx.info)
        kernels = model(input_ids=ids).logits.float()
    assert "mixed-precision GEMM on 14 linears" in path and "4-bit sym g32 + 16 ch 8-bit" in path
    assert (kernels - simulated).norm() < 0.5 * (simulated - reference).norm()


def test_resq_speed_form_runs_its_8_bit_share_on_the_mixed_kernels(tiny_shapes):
    model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        reference = model(input_ids=ids).logits.float()
    ctx = _form("resq", model, kvbits=16)
    qkv, down = model.model.layers[0].self_attn.q_proj, model.model.layers[0].mlp.down_proj
    assert qkv.act.high_channels.tolist() == list(range(56, 64)) and qkv.weight_groups == 2
    assert down.input_transform is not None and not hasattr(down.act, "high_channels")
    with torch.no_grad():
        simulated = model(input_ids=ids).logits.float()
        path = executable(model, ctx.info)
        kernels = model(input_ids=ids).logits.float()
    assert "mixed-precision GEMM on 14 linears" in path and "4-bit asym + 8 ch 8-bit" in path
    assert ctx.info["speed"]["form"] == "kernels"
    assert (kernels - simulated).norm() < 0.5 * (simulated - reference).norm()


def test_asymmetric_activations_run_on_the_mixed_kernels(tiny_shapes):
    # SpinQuant quantizes activations asymmetrically: the mixed kernels' 4-bit path with zero points
    model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    ctx = _form("spinquant", model, kvbits=16)
    with torch.no_grad():
        simulated = model(input_ids=ids).logits
        path = executable(model, ctx.info)
        kernels = model(input_ids=ids).logits
    assert "mixed-precision GEMM on 14 linears" in path and "4-bit asym" in path and not any(isinstance(m, FakeQuantLinear) for m in model.modules())
    # as in the W4A4 test above: far closer to the simulated model than quantization is to the float one
    assert (kernels.float() - simulated).norm() < 0.5 * (simulated - reference).norm()


def test_symmetric_spinquant_runs_on_the_w4a4_kernels(tiny_shapes):
    # spinquant:a_symmetric=true: QuaRot's activation grid, so the W4A4 kernels QuaRot's speed form runs
    from mosaicquant.kernels.quant_linear import QuantLinear

    model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    ctx = _form("spinquant", model, kvbits=16, a_symmetric=True)
    assert model.model.layers[0].self_attn.q_proj.act.symmetric
    with torch.no_grad():
        simulated = model(input_ids=ids).logits
        path = executable(model, ctx.info)
        kernels = model(input_ids=ids).logits
    assert "mixed-precision" not in path and path.startswith("Triton W4A4: act-quant + dense GEMM"), path
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 8  # q/k/v and gate/up stacked, 2 layers
    assert (kernels.float() - simulated).norm() < 0.5 * (simulated - reference).norm()


def test_float_model_runs_as_is():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    info = {}
    assert executable(model, info) == FLOAT_PATH == info["exec_path_speed"]


def test_decode_step_with_the_static_cache_matches_a_full_forward(tiny_shapes):
    # the throughput suite times this step, replayed many times: every call must decode the
    # same position and compute the next token's logits (the cache's write counter is reset)
    model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
    batch, context = 3, 10
    torch.manual_seed(1)
    with torch.no_grad():
        step = speed.decode_step(model, batch, context, torch.device("cpu"))
        first = step()[:, -1]
        for _ in range(12):  # more steps than the cache has spare slots (8)
            again = step()[:, -1]
        assert torch.equal(first, again)
        # the same logits as a full forward over the prompt (regenerated from the seed) + the step token
        torch.manual_seed(1)
        prompt = torch.randint(0, 256, (batch, context))
        full = model(input_ids=torch.cat([prompt, step.input_ids], 1)).logits[:, -1]
    assert torch.allclose(first, full, atol=1e-4), (first - full).abs().max()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU plumbing; the GPU test below times on the device")
def test_measurements_run_on_the_executable_model(tiny_shapes):
    model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
    ctx = _form("mosaicquant", model, budget=0.1, block="16x64")
    executable(model, ctx.info)
    cpu = torch.device("cpu")
    with torch.no_grad():
        for group in speed.LINEAR_GROUPS:
            t = speed.measure_linear_group(model, group, 5, cpu, rotate_mb=0, replays=3)
            assert t.median_us > 0 and t.how == "cpu-wall"
        assert speed.measure_prefill(model, 1, 16, cpu, replays=3).median_us > 0
        assert speed.measure_decode(model, 2, 8, cpu, replays=3).median_us > 0


def test_speed_suites_refuse_the_cpu(tiny_shapes):
    model = shapes.build_shape_model(tiny_shapes, dtype=torch.bfloat16)
    sctx = SuiteContext(model_name=tiny_shapes, tokenizer=None, corpus="enwiki-sample", test_tokens=lambda: None,
                        seed=0, device=torch.device("cpu"), method_info={})
    for name in ("throughput", "latency"):
        entry = get_suite(name)
        with pytest.raises(Unavailable, match="needs a CUDA GPU"):
            entry.fn(model, entry.config(), sctx)


@pytest.mark.parametrize("suites, message", [
    ("accuracy", "has random weights: suite(s) accuracy need a real model"),
    ("throughput", "time GPU kernels: they need --device cuda"),
])
def test_cli_rejects_suites_that_cannot_run_before_any_work(tiny_shapes, tmp_path, capsys, suites, message):
    rc = main(["run", "--model", tiny_shapes, "--methods", "fp16", "--suites", suites, "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err


def test_sweep_on_a_shape_model_records_memory_of_each_speed_form(tiny_shapes, tmp_path):
    rc = main(["run", "--model", tiny_shapes, "--methods", "fp16,mosaicquant:block=16x32,atom,resq", "--suites", "memory",
               "--dtype", "bfloat16", "--out", str(tmp_path)])
    recs = {r["method"]["label"]: r for r in load_records(tmp_path)}
    assert recs["fp16"]["status"] == "ok" and recs["mosaicquant:block=16x32"]["status"] == "ok"
    mem = recs["mosaicquant:block=16x32"]["metrics"]
    assert 0.25 < mem["linear_weight_ratio_vs_bf16"]["value"] < 0.45
    # the residual's overhead over the base linears and over the whole model without it (16-bit rest included)
    residual = sum(mem[k]["value"] for k in ("residual_values", "residual_scales", "residual_indices"))
    base = mem["base_values"]["value"] + mem["base_scales"]["value"]
    assert residual > 0 and mem["residual_overhead_vs_base"]["value"] == pytest.approx(residual / base)
    assert mem["other_params_bf16"]["value"] > 0
    assert mem["residual_overhead_vs_model"]["value"] == pytest.approx(
        residual / (base + mem["other_params_bf16"]["value"]))
    assert recs["mosaicquant:block=16x32"]["method_info"]["weights"] == "random (speed only)"
    assert recs["atom"]["status"] == "ok" and recs["atom"]["method_info"]["weights"] == "random (speed only)"
    assert recs["resq"]["status"] == "ok" and recs["resq"]["method_info"]["weights"] == "random (speed only)"
    assert recs["fp16"]["calibration"] is None
    # a token of context in the fused decoder's cache: 16-bit, or Atom's default 4-bit cache (D/2 bytes and
    # four fp32 scales and zeros a KV head)
    s = shapes.SHAPE_MODELS[tiny_shapes]
    per_layer = {"fp16": s.kv_heads * 2 * s.head_dim * 2, "atom": s.kv_heads * 2 * (s.head_dim // 2 + 8)}
    for label, want in per_layer.items():
        assert recs[label]["metrics"]["kv_cache_bytes_per_token"]["value"] == s.layers * want, label
    assert rc in (0, 1)


@pytest.mark.gpu
def test_speed_suites_on_the_gpu(monkeypatch):
    # the suites end to end on a CUDA device: kernels, CUDA-graph decode, per-layer latency;
    # dimensions that are multiples of the default 128x128 residual blocks, as in real models
    small = shapes.ShapeModel("small-llama-shapes", "llama", 256, 512, 2, 4, 2, 64, 512, False)
    monkeypatch.setitem(shapes.SHAPE_MODELS, small.name, small)
    device = torch.device("cuda")
    model = shapes.build_shape_model(small.name, dtype=torch.bfloat16, device=device)
    ctx = QuantContext(calibration=lambda: None, seed=0, device=device)
    speed_form("mosaicquant", model, get_method("mosaicquant").config(budget=0.25), ctx)
    sctx = SuiteContext(model_name=small.name, tokenizer=None, corpus="enwiki-sample", test_tokens=lambda: None,
                        seed=0, device=device, method_info=ctx.info)
    tp = get_suite("throughput")
    with torch.no_grad():
        metrics = tp.fn(model, tp.config(batches=(4, 8), prefill_len=64, context=32, replays=3), sctx)
    assert {"prefill_tok_s", "decode_tok_s/b4", "decode_tok_s/b8"} <= set(metrics)
    assert all(metrics[k].value > 0 for k in ("prefill_tok_s", "decode_tok_s/b4", "decode_tok_s/b8"))
    assert "ZipperEngine" in ctx.info["exec_path_speed"]
    # the floor measured in the same run: a step cannot beat the bytes it reads over the copy bandwidth
    assert ctx.info["speed"]["ceilings"]["copy_gb_s"] > 100
    assert all(0 < metrics[f"decode_floor_frac/b{b}"].value < 1.5 for b in (4, 8))
    assert 0 < metrics["prefill_floor_frac"].value < 1.5
    assert ctx.info["speed"]["timing"] == "CUDA graphs (prefill, decode, per-layer)"
    lat = get_suite("latency")
    with torch.no_grad():
        metrics = lat.fn(model, lat.config(ms=(1, 64), batches=(4,), prefill_len=64, context=32, replays=3), sctx)
    assert metrics["linear_us/down_proj/m64"].value > 0 and metrics["step_ms/decode_b4"].value > 0


def test_telemetry_window_reports_mean_power_over_its_wall_time():
    from mosaicquant.harness.telemetry import Telemetry

    class FakeNVML:
        NVML_CLOCK_SM = 0

        def __init__(self):
            self.counter_mj = [1000.0, 7000.0]

        def nvmlDeviceGetTotalEnergyConsumption(self, handle):
            return self.counter_mj.pop(0)

        def nvmlDeviceGetPowerUsage(self, handle):
            return 999_000  # an instantaneous reading (mW) the window must not use

        def nvmlDeviceGetClockInfo(self, handle, which):
            return 1980

    tel = Telemetry(torch.device("cpu"))
    assert not tel.active and tel.stop(None, 1.0).energy_j is None
    tel.active, tel._handle, tel._nvml = True, None, FakeNVML()
    window = tel.stop(tel.start(), 2.0)
    assert (window.energy_j, window.power_w, window.sm_clock_mhz, window.seconds) == (6.0, 3.0, 1980.0, 2.0)


def test_energy_window_length_is_checked():
    with pytest.raises(UserInputError, match="energy_s"):
        speed.ThroughputConfig(energy_s=0.0)


def test_mosaicquant_with_shifts_up_to_3_runs_the_merged_walk_and_counts_its_copies(tiny_shapes):
    # rscale_max_shift=3: every kept block's base and residual as one int8 operand, resident beside the format;
    # the execution path says so and weight memory counts the copies (exec_operands)
    from mosaicquant.kernels.quant_linear import QuantLinear

    paths, extra = {}, {}
    for cap in (4, 3):
        model = shapes.build_shape_model(tiny_shapes, dtype=torch.float32)
        ctx = _form("mosaicquant", model, budget=0.25, block="16x128", rscale_max_shift=cap)
        assert ctx.info["speed_form"]["rscale_max_shift"] == cap
        with torch.no_grad():
            paths[cap] = executable(model, ctx.info)
        extra[cap] = weight_memory(model)["exec_operands"]
        held = [m for m in model.modules() if isinstance(m, QuantLinear) and m.res_merged is not None]
        assert extra[cap] == sum(m.res_merged.numel() + 4 * m.res_steps.numel() for m in held)
        assert bool(held) == (cap == 3)
    assert extra[4] == 0 and extra[3] > 0
    assert "one int8 operand" in paths[3] and "one int8 operand" not in paths[4]
