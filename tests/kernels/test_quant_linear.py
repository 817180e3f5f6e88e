import pytest
import torch

from mosaicquant import settings
from mosaicquant.errors import UserInputError
from mosaicquant.kernels import QuantLinear, resolve_kernel
from mosaicquant.kernels._tiles import GEMV_ROUTE_MAX_M
from mosaicquant.methods.format import PackedW4
from mosaicquant.methods.quant import fake_quantize, quantize

from ._helpers import DEVICE, needs_triton, random_residual

# Kernel layer vs simulated layer: same integers and scales, different float order and a
# BF16 output rounding; relative to the output range.
SIM_REL_TOL = 1e-2


def _packed(n, k, seed, residual=True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    qt = quantize(w, 4, scale_dtype=torch.float16)
    res = random_residual(n, k, (32, 64), 0.3, gen) if residual else None
    return PackedW4.from_quantized(qt, residual=res, bias=torch.randn(n, generator=gen))


def _simulated(packed, x, clip):
    return fake_quantize(x.float(), 4, clip_ratio=clip) @ packed.dequantize().T + packed.bias


@pytest.mark.parametrize(
    "kernel", ["torch", pytest.param("triton", marks=needs_triton())]
)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("residual", [True, False])
def test_kernel_layer_equals_simulated_layer(kernel, fused, residual):
    n, k, clip = 96, 200, 0.9
    packed = _packed(n, k, seed=21, residual=residual)
    gen = torch.Generator().manual_seed(22)
    x = (torch.randn(2, 13, k, generator=gen) * 3).to(torch.bfloat16)
    layer = QuantLinear(packed, act_clip_ratio=clip, kernel=kernel, fused=fused).to(DEVICE)
    y = layer(x.to(DEVICE))
    assert y.shape == (2, 13, n) and y.dtype == torch.bfloat16
    ref = _simulated(packed, x, clip)
    err = (y.float().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < SIM_REL_TOL, f"kernel={kernel} fused={fused}: relative error {err:.3g} >= {SIM_REL_TOL}"


@needs_triton()
@pytest.mark.parametrize("residual", [True, False])
def test_single_tokens_run_the_decode_gemv(residual):
    n, k, clip = 96, 200, 0.9
    packed = _packed(n, k, seed=24, residual=residual)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(25)) * 3).to(torch.bfloat16)
    layer = QuantLinear(packed, act_clip_ratio=clip, kernel="triton").to(DEVICE)
    assert layer.uses_gemv(1) and not layer.uses_gemv(GEMV_ROUTE_MAX_M + 1)
    assert not QuantLinear(packed, kernel="triton", gemv_max_m=0).uses_gemv(1)
    if residual:
        assert not QuantLinear(packed, kernel="triton", fused=False).uses_gemv(1)
    ref = _simulated(packed, x, clip)
    y = layer(x.to(DEVICE))
    err = (y.float().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < SIM_REL_TOL
    # the same call on the tensor-core kernel gives the same result up to rounding
    y_tc = QuantLinear(packed, act_clip_ratio=clip, kernel="triton", gemv_max_m=0).to(DEVICE)(x.to(DEVICE))
    assert (y.float() - y_tc.float()).abs().max().item() <= 2.0**-7 * ref.abs().max().item()


def test_residual_changes_the_output():
    packed = _packed(96, 200, seed=23)
    base_only = PackedW4(packed.shape, packed.qweight, packed.scales, bias=packed.bias)
    x = torch.randn(4, 200).to(torch.bfloat16)
    diff = (QuantLinear(packed, kernel="torch")(x).float() - QuantLinear(base_only, kernel="torch")(x).float())
    assert diff.abs().max() > 0


def test_group_wise_base_is_rejected():
    w = torch.randn(16, 64)
    packed = PackedW4.from_quantized(quantize(w, 4, group_size=32, scale_dtype=torch.float16))
    with pytest.raises(UserInputError, match="group_size=32"):
        QuantLinear(packed)


def test_bad_arguments_raise():
    with pytest.raises(UserInputError, match="gemv_max_m=9"):
        QuantLinear(_packed(16, 64, seed=1), gemv_max_m=9)
    packed = _packed(32, 64, seed=24, residual=False)
    with pytest.raises(UserInputError, match="act_clip_ratio=0"):
        QuantLinear(packed, act_clip_ratio=0)
    with pytest.raises(UserInputError, match="Unknown kernel preference 'torhc'"):
        QuantLinear(packed, kernel="torhc")
    with pytest.raises(UserInputError, match="input has 63 features"):
        QuantLinear(packed, kernel="torch")(torch.randn(2, 63))
    with pytest.raises(UserInputError, match=r"input has shape \[\] \(a 0-d tensor\): the layer takes \[\.\.\., 64\]"):
        QuantLinear(packed, kernel="torch")(torch.tensor(1.0))  # named, not an IndexError


def test_residual_indices_are_checked_once_at_construction(monkeypatch):
    from mosaicquant.methods.format import ResidualBlocks

    packed = _packed(96, 200, seed=26)
    assert packed.residual.num_blocks > 1
    # a field set after the blocks were built: the layer checks the indices as it is constructed
    packed.residual.row_ptr = packed.residual.row_ptr.clone()
    packed.residual.row_ptr[-1] += 2
    with pytest.raises(UserInputError, match=r"row_ptr\[3\] = .*CSR pointer"):
        QuantLinear(packed, kernel="torch")
    packed.residual.row_ptr[-1] -= 2
    layer = QuantLinear(packed, kernel="torch")
    # and not per call (reading them would synchronise the device)

    def no_check(self):
        raise AssertionError("the residual's indices were read in a call")

    monkeypatch.setattr(ResidualBlocks, "validate", no_check)
    assert layer(torch.randn(3, 200)).shape == (3, 96)


def test_kernel_preference_from_settings(monkeypatch):
    with settings.use(kernel="torch"):
        assert resolve_kernel() == "torch"
    with pytest.raises(UserInputError, match="Did you mean: triton"):
        resolve_kernel("tritn")
    with pytest.raises(UserInputError, match="kernel='tritn' is not allowed: choose one of 'auto', 'triton', 'torch'"):
        settings.KernelSettings(kernel="tritn")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expect = "triton" if torch.cuda.is_available() else "torch"
    assert resolve_kernel("auto") == expect
    if not torch.cuda.is_available():
        with pytest.raises(UserInputError, match="needs a CUDA device or TRITON_INTERPRET=1"):
            resolve_kernel("triton")


@needs_triton()
def test_dense_gate_up_layer_writes_silu_mul_where_the_constant_allows(monkeypatch, tile_table):
    # a layer without residual blocks: its dense GEMM's fix-up writes SiLU·mul at 2 to
    # the tile table's dense_gated_max_m tokens (single tokens run the GEMV), on the packed kernel even where a
    # plain call of 16 takes the swapped GEMM
    from mosaicquant.kernels.act_quant import quantize_activations_reference
    from mosaicquant.kernels.decoder import silu_mul, silu_mul_reference

    layer = QuantLinear(_packed(256, 512, seed=9, residual=False), kernel="triton").to(DEVICE)
    tile_table(dense_gated_max_m=0)
    assert not any(layer.writes_gated(m) for m in (1, 4, 8, 15))
    tile_table(dense_gated_max_m=16)
    assert [m for m in (1, 2, 4, 8, 15, 16, 24) if layer.writes_gated(m)] == [2, 4, 8, 15, 16]
    tile_table(wide_k_decode_min_m=0)  # a plain call of 16 tokens: the swapped GEMM
    assert layer.uses_swapped(16, "triton") and layer.writes_gated(16)
    tile_table(dense_gated_max_m=8)
    assert [m for m in (2, 8, 9, 15) if layer.writes_gated(m)] == [2, 8]
    a, s = quantize_activations_reference(torch.randn(5, 512, generator=torch.Generator().manual_seed(2)))
    got = layer.forward_quantized(a.to(DEVICE), s.to(DEVICE), "triton", gated=True)
    ref = silu_mul_reference(layer.cpu().forward_quantized(a, s, "torch"))
    assert got.shape == (5, 128) and torch.equal(layer.forward_quantized(a, s, "torch", gated=True), ref)
    layer.to(DEVICE)
    if DEVICE.type == "cuda":  # the same bits as the GEMM's BF16 output followed by the SiLU·mul kernel
        assert torch.equal(got, silu_mul(layer.forward_quantized(a.to(DEVICE), s.to(DEVICE), "triton"),
                                         kernel="triton"))
    assert (got.float().cpu() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()
