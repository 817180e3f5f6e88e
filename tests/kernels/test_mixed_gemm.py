"""Mixed 4-bit + 8-bit kernels (Atom / ResQ): quantizer bit-exact, GEMM vs reference, layers vs simulation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mosaicquant.baselines import atom as atom_module
from mosaicquant.baselines.atom import AtomConfig, atom_quantize_linear
from mosaicquant.baselines.resq import BasisTransform, ResQConfig, resq_basis, resq_quantize_linear
from mosaicquant.errors import UserInputError
from mosaicquant.kernels.mixed_gemm import (
    MixedActs,
    MixedFormat,
    MixedQuantLinear,
    MixedTileConfig,
    mixed_act_quant,
    mixed_act_quant_reference,
    mixed_act_quant_triton,
    mixed_from_fake,
    mixed_gemm,
    mixed_gemm_reference,
    mixed_gemm_triton,
    mixed_weights,
    pack_int4_groups,
    pick_mixed_config,
    unpack_int4_groups,
)
from mosaicquant.methods.hadamard import OnlineHadamard
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear

from ._helpers import DEVICE, NAN_U8, assert_close_bf16, needs_triton

# Kernel layer vs the simulated FP32 layer: same integers, so the distance is the BF16 output
# rounding (~2^-9 relative; the interpreter truncates instead, ~2^-8) plus fp32 sum order.
LAYER_REL_TOL = 1e-2
POISON_I32 = -123456789

FORMATS = {
    # Atom-like: symmetric groups of 64 (263 = 4 * 64 + 7: ragged last group), clipped
    "atom": MixedFormat(k_lo=263, k_hi=37, group_size=64, lo_clip=0.9),
    # ResQ-like: asymmetric per token, one low group of 263 (many K steps, masked tail)
    "resq": MixedFormat(k_lo=263, k_hi=37, group_size=None, lo_symmetric=False, hi_symmetric=False),
    # odd group (padding nibble per group), 3-bit low / 6-bit high grids, mixed symmetry
    "odd": MixedFormat(k_lo=263, k_hi=21, group_size=33, lo_bits=3, hi_bits=6, lo_symmetric=False, lo_clip=0.8),
    # two unmasked K steps per group
    "g256": MixedFormat(k_lo=600, k_hi=64, group_size=256, hi_clip=0.95),
    "low-only": MixedFormat(k_lo=300, k_hi=0, lo_symmetric=False),
    "high-only": MixedFormat(k_lo=0, k_hi=40, hi_symmetric=False, hi_clip=0.95),
}
ACT_CASES = [(13, f) for f in FORMATS if f != "g256"] + [(1, "atom"), (67, "resq")]
GEMM_CASES = [(13, 77, f) for f in FORMATS] + [(1, 130, "atom"), (67, 130, "resq"), (67, 77, "odd")]


def _activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen) * 2
    x[:, :: max(1, k // 7)] *= 10
    x[:, 1::11] = x[:, 1::11].abs() + 0.5  # one-sided channels: asymmetric grids with a zero point
    return x.to(torch.bfloat16)


def _nonzero_ints(shape, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    q = torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int8)
    return torch.where(q == 0, torch.ones_like(q), q)


def _random_weights(n: int, fmt: MixedFormat, gen: torch.Generator):
    return mixed_weights(
        _nonzero_ints((n, fmt.k_lo), -8, 7, gen),
        (torch.rand(n, fmt.n_groups, generator=gen) * 0.05 + 0.01).to(torch.float16),
        _nonzero_ints((n, fmt.k_hi), -128, 127, gen),
        torch.rand(n, generator=gen) * 0.004 + 0.001,
        fmt,
    )


def _poisoned_acts(m: int, fmt: MixedFormat) -> MixedActs:
    def i32(*shape):
        return torch.full(shape, POISON_I32, dtype=torch.int32, device=DEVICE)

    return MixedActs(
        q_lo=torch.full((m, fmt.lo_bytes), NAN_U8, dtype=torch.uint8, device=DEVICE),
        s_lo=torch.full((m, fmt.n_groups), float("nan"), device=DEVICE),
        z_lo=None if fmt.lo_symmetric else i32(m, fmt.n_groups),
        q_hi=torch.full((m, fmt.k_hi), -77, dtype=torch.int8, device=DEVICE),
        s_hi=torch.full((m,), float("nan"), device=DEVICE),
        z_hi=None if fmt.hi_symmetric else i32(m),
    )


def test_group_packing_round_trip():
    gen = torch.Generator().manual_seed(1)
    for fmt in FORMATS.values():
        q = _nonzero_ints((5, fmt.k_lo), -8, 7, gen)
        packed = pack_int4_groups(q, fmt)
        assert packed.shape == (5, fmt.lo_bytes)
        assert torch.equal(unpack_int4_groups(packed, fmt), q)


@needs_triton()
@pytest.mark.parametrize("m,name", ACT_CASES)
def test_act_quant_triton_is_bit_exact(m, name):
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(m + fmt.k)
    x = _activations(m, fmt.k, gen)
    perm = torch.randperm(fmt.k, generator=gen)
    for order in (perm, None) if m <= 13 else (perm,):  # the interpreter runs one program a token
        ref = mixed_act_quant_reference(x, fmt, order)
        out = _poisoned_acts(m, fmt)
        mixed_act_quant_triton(x.to(DEVICE), fmt, None if order is None else order.to(DEVICE), out=out)
        for field in MixedActs._fields:
            got, want = getattr(out, field), getattr(ref, field)
            assert (got is None) == (want is None), field
            if got is not None:
                assert torch.equal(got.cpu(), want), f"{name} M={m} {field}: {(got.cpu() != want).sum()} entries differ"


@needs_triton()
@pytest.mark.parametrize("name,chunks", [("atom", 2), ("atom", 5), ("odd", 3), ("odd", 8), ("resq", 4),
                                         ("low-only", 2), ("high-only", 3)])
def test_act_quant_dealt_over_programs_is_bit_exact(name, chunks):
    # a token's low groups dealt over `chunks` programs (the tiles of groups narrowed to give each one), its high
    # part in one more: the same bits as the reference; "odd" has 8 groups, so 8 chunks are one group a program
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(chunks + fmt.k)
    x = _activations(3, fmt.k, gen)
    perm = torch.randperm(fmt.k, generator=gen)
    ref = mixed_act_quant_reference(x, fmt, perm)
    out = _poisoned_acts(3, fmt)
    mixed_act_quant_triton(x.to(DEVICE), fmt, perm.to(DEVICE), out=out, chunks=chunks)
    for field in MixedActs._fields:
        got, want = getattr(out, field), getattr(ref, field)
        if got is not None:
            assert torch.equal(got.cpu(), want), f"{name} chunks={chunks} {field}: {(got.cpu() != want).sum()} differ"


def test_act_quant_chunks_default_and_bad_values():
    from mosaicquant.kernels.mixed_gemm import act_quant_chunks

    assert act_quant_chunks(4, 31, torch.device("cpu")) == 1
    fmt = FORMATS["atom"]
    with pytest.raises(UserInputError, match=r"chunks=0 must be an integer >= 1"):
        mixed_act_quant_triton(torch.zeros(2, fmt.k, dtype=torch.bfloat16, device=DEVICE), fmt, chunks=0)


def test_act_quant_reference_matches_simulated_quantizer():
    from mosaicquant.methods.mixed import MixedActQuant

    fmt = FORMATS["odd"]
    gen = torch.Generator().manual_seed(2)
    x = _activations(9, fmt.k, gen).float()
    perm = torch.randperm(fmt.k, generator=gen)
    sim = MixedActQuant(perm[fmt.k_lo:], perm[:fmt.k_lo], fmt.k,
                        high=ActQuantSpec(bits=6, symmetric=True),
                        low=ActQuantSpec(bits=3, symmetric=False, group_size=33, clip_ratio=0.8))
    acts = mixed_act_quant_reference(x, fmt, perm)
    g = fmt.group
    q_lo = unpack_int4_groups(acts.q_lo, fmt).float().reshape(9, -1)
    deq = torch.empty_like(x)
    for i in range(fmt.n_groups):
        cols = perm[i * g:min((i + 1) * g, fmt.k_lo)]
        q = q_lo[:, i * g:i * g + cols.numel()]
        deq[:, cols] = (q - acts.z_lo[:, i, None].float()) * acts.s_lo[:, i, None]
    deq[:, perm[fmt.k_lo:]] = acts.q_hi.float() * acts.s_hi[:, None]
    assert torch.allclose(deq, sim(x), rtol=1e-6, atol=1e-6)


@needs_triton()
@pytest.mark.parametrize("m,n,name", GEMM_CASES)
def test_gemm_triton_matches_reference(m, n, name):
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(m * n + fmt.k)
    acts = mixed_act_quant_reference(_activations(m, fmt.k, gen), fmt, torch.randperm(fmt.k, generator=gen))
    weights = _random_weights(n, fmt, gen)
    bias = torch.randn(n, generator=gen)
    ref = mixed_gemm_reference(acts, weights, fmt, bias, out_fp32=True)
    dev_acts = MixedActs(*(None if t is None else t.to(DEVICE) for t in acts))
    dev_weights = type(weights)(*(t.to(DEVICE) for t in weights))
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mixed_gemm_triton(dev_acts, dev_weights, fmt, bias.to(DEVICE), out=out)
    assert_close_bf16(out, ref, f"mixed gemm {name} {m}x{n}")
    out32 = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEVICE)
    mixed_gemm_triton(dev_acts, dev_weights, fmt, None, out_fp32=True, out=out32,
                      config=MixedTileConfig(block_m=16, block_n=32, block_kp=32, block_k8=32))
    ref_nobias = mixed_gemm_reference(acts, weights, fmt, None, out_fp32=True)
    torch.testing.assert_close(out32.cpu(), ref_nobias, rtol=1e-5, atol=1e-5 * ref_nobias.abs().max().item())
    # split-K: groups shared out (atom, odd), or one long group's K steps (resq), zero points once
    out.fill_(float("nan"))
    mixed_gemm_triton(dev_acts, dev_weights, fmt, bias.to(DEVICE), out=out,
                      config=MixedTileConfig(block_m=16, block_n=64, block_kp=32, block_k8=32, split_k=3))
    assert_close_bf16(out, ref, f"mixed gemm {name} {m}x{n} split-K")


@needs_triton()
@pytest.mark.parametrize("name", ["atom", "odd", "resq", "g256"])
def test_gemm_groups_a_step_and_x16_unpacking_give_the_same_bits(name):
    # several groups' loads a step (the last step running past the range: atom has 5 groups of one step) and the
    # 16 * q unpacking (acc 256 * the product) leave every fp32 output bit as the one-group step's
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(fmt.k)
    acts = mixed_act_quant_reference(_activations(13, fmt.k, gen), fmt, torch.randperm(fmt.k, generator=gen))
    acts = MixedActs(*(None if t is None else t.to(DEVICE) for t in acts))
    weights = _random_weights(77, fmt, gen)
    weights = type(weights)(*(t.to(DEVICE) for t in weights))
    bkp = 32 if fmt.group_bytes <= 32 else 64
    base = MixedTileConfig(block_m=16, block_n=32, block_kp=bkp, block_k8=32, split_k=2)
    want = mixed_gemm_triton(acts, weights, fmt, out_fp32=True, config=base)
    for gps, x16 in ((2, False), (3, True), (1, True)):
        got = mixed_gemm_triton(acts, weights, fmt, out_fp32=True,
                                config=MixedTileConfig(block_m=16, block_n=32, block_kp=bkp, block_k8=32, split_k=2,
                                                       groups_per_step=gps, x16=x16))
        assert torch.equal(got.cpu(), want.cpu()), f"{name} groups_per_step={gps} x16={x16}"


def test_gemm_reference_equals_dequantized_matmul():
    fmt = FORMATS["resq"]
    gen = torch.Generator().manual_seed(4)
    x = _activations(5, fmt.k, gen)
    acts = mixed_act_quant_reference(x, fmt)
    weights = _random_weights(9, fmt, gen)
    a_lo = (unpack_int4_groups(acts.q_lo, fmt).double() - acts.z_lo.double()) * acts.s_lo.double()
    a_hi = (acts.q_hi.double() - acts.z_hi[:, None].double()) * acts.s_hi[:, None].double()
    w_lo = unpack_int4_groups(weights.q_lo, fmt).double() * weights.s_lo.double()
    w_hi = weights.q_hi.double() * weights.s_hi[:, None].double()
    expect = a_lo @ w_lo.T + a_hi @ w_hi.T
    assert_close_bf16(mixed_gemm(acts, weights, fmt, kernel="torch"), expect.float(), "reference")


# ---- layers: the kernel-backed layer computes the simulated Atom / ResQ layer ----------------


def _salient_linear(k: int, n: int, seed: int, tokens: int = 400):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64)
    x[:, torch.randperm(k, generator=gen)[:24]] *= 30.0
    q, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))
    x[:, : k // 2] += (torch.randn(tokens, 4, generator=gen, dtype=torch.float64) * 5) @ q[:4, : k // 2]
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(n, generator=gen))
    return linear, (x.T @ x / tokens).to(torch.float32), x.to(torch.float32)


def _check_layer(sim: FakeQuantLinear, x: torch.Tensor, kernel: str, what: str) -> MixedQuantLinear:
    sim = sim.to(DEVICE)  # both layers see the same transformed input, bit for bit
    fast = mixed_from_fake(sim, kernel=kernel)
    assert isinstance(fast, MixedQuantLinear), f"{what}: {fast}"
    inputs = x[:67].reshape(1, 67, -1).to(DEVICE)  # leading dims kept
    for rows in (inputs[:, :1], inputs[:, :13], inputs):
        with torch.no_grad():
            want = sim(rows).cpu()
            got = fast(rows).cpu()
        assert got.shape == want.shape and got.dtype == want.dtype
        rel = float((got - want).norm() / want.norm())
        assert rel < LAYER_REL_TOL, f"{what} M={rows.shape[1]}: relative error {rel:.2e}"
        assert_close_bf16(got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1]), f"{what} M={rows.shape[1]}")
    return fast


KERNELS = ["torch", pytest.param("triton", marks=needs_triton())]


@pytest.mark.parametrize("kernel", KERNELS)
def test_atom_layer_matches_simulation(kernel):
    linear, h, x = _salient_linear(300, 96, seed=5)
    sim = atom_quantize_linear(linear, h, AtomConfig())  # 128 INT8 channels, 172 = 128 + 44 in groups
    fast = _check_layer(sim, x, kernel, "atom")
    assert (fast.fmt.k_lo, fast.fmt.k_hi, fast.fmt.n_groups, fast.fmt.lo_clip) == (172, 128, 2, 0.9)
    assert fast.perm is not None and fast.w_s_lo.dtype == torch.float16
    nbytes = fast.weight_nbytes()
    # group-padded packing: the ragged group of 44 takes a full group's 64 bytes
    assert nbytes["base_values"] == 96 * (2 * 64 + 128) and nbytes["base_scales"] == 96 * (2 * 2 + 4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_atom_layer_small_groups_matches_simulation(kernel):
    linear, h, x = _salient_linear(200, 37, seed=6)
    sim = atom_quantize_linear(linear, h, AtomConfig(n_outliers=16, group_size=64))  # groups 64, 64, 56
    fast = _check_layer(sim, x, kernel, "atom g64")
    assert fast.fmt.n_groups == 3


@pytest.mark.parametrize("kernel", KERNELS)
def test_resq_layers_match_simulation(kernel):
    linear, h, x = _salient_linear(96, 80, seed=7)
    cfg = ResQConfig()
    sim = resq_quantize_linear(linear, h, cfg, basis=resq_basis(h, cfg.n_high(96), seed=0))
    fast = _check_layer(sim, x, kernel, "resq")
    assert isinstance(fast.input_transform, BasisTransform) and fast.perm is None
    assert (fast.fmt.k_lo, fast.fmt.k_hi, fast.fmt.lo_symmetric) == (84, 12, False)
    down, h_down, x_down = _salient_linear(96, 40, seed=8)
    sim_down = resq_quantize_linear(down, h_down, cfg, basis=None)  # all-4-bit behind an online Hadamard
    fast_down = _check_layer(sim_down, x_down, kernel, "resq down_proj")
    assert isinstance(fast_down.input_transform, OnlineHadamard) and fast_down.fmt.k_hi == 0


def test_weight_segments_give_the_same_layer(monkeypatch):
    captured = []

    def capture(weight, hessian, segments, **kw):
        result = gptq_segments(weight, hessian, segments, **kw)
        captured.append([(s.columns, q) for s, q in zip(segments, result.segments)])
        return result

    gptq_segments = atom_module.gptq_quantize_segments
    monkeypatch.setattr(atom_module, "gptq_quantize_segments", capture)
    linear, h, x = _salient_linear(200, 37, seed=9)
    sim = atom_quantize_linear(linear, h, AtomConfig(n_outliers=16, group_size=64))
    recovered = mixed_from_fake(sim, kernel="torch")
    sim.weight_segments = captured[0]
    from_segments = mixed_from_fake(sim, kernel="torch")
    assert isinstance(from_segments, MixedQuantLinear)
    assert torch.equal(recovered(x[:13]), from_segments(x[:13]))
    sim.weight_segments = captured[0][1:]
    assert "do not match" in mixed_from_fake(sim)


def test_layers_without_a_mixed_form_get_a_reason():
    linear, h, _ = _salient_linear(96, 16, seed=10)
    sim = resq_quantize_linear(linear, h, ResQConfig(), basis=resq_basis(h, 12, seed=0))
    assert "bfloat16" in mixed_from_fake(FakeQuantLinear(sim.weight.to(torch.bfloat16), None, sim.act, sim.input_transform))
    assert "not quantized" in mixed_from_fake(FakeQuantLinear(linear.weight, None, ActQuantSpec(16)))
    assert "2..4 bits" in mixed_from_fake(FakeQuantLinear(linear.weight, None, ActQuantSpec(8)))
    assert "not 4-bit" in mixed_from_fake(FakeQuantLinear(linear.weight, None, ActQuantSpec(4)))
    assert "not a simulated" in mixed_from_fake(linear)


@needs_triton()
def test_public_quantizer_checks_perm_values_on_the_triton_path_too(monkeypatch):
    # the Triton launcher checks perm's shape and dtype only: an entry past K gathered channels past the row,
    # a repeated one quantized a channel twice
    from mosaicquant.kernels import mixed_gemm as mixed_module

    fmt = FORMATS["atom"]
    gen = torch.Generator().manual_seed(12)
    x = _activations(3, fmt.k, gen).to(DEVICE)
    perm = torch.randperm(fmt.k, generator=gen)
    past, twice = perm.clone(), perm.clone()
    past[0] = fmt.k + 100
    twice[1] = twice[0]
    for bad in (past, twice):
        for kernel in ("triton", "torch"):
            with pytest.raises(UserInputError, match=f"perm must be a permutation of 0..{fmt.k - 1}"):
                mixed_act_quant(x, fmt, bad.to(DEVICE), kernel=kernel)
    got = mixed_act_quant(x, fmt, perm.to(DEVICE), kernel="triton")
    assert torch.equal(got.q_lo.cpu(), mixed_act_quant_reference(x.cpu(), fmt, perm).q_lo)
    # the layer checks its perm once, at construction, not at each call (that would synchronise the device)
    layer = MixedQuantLinear(fmt, _random_weights(8, fmt, gen), perm, kernel="triton").to(DEVICE)

    def no_check(perm, k):
        raise AssertionError("perm's values were read in a call")

    monkeypatch.setattr(mixed_module, "_check_perm_values", no_check)
    assert layer(x).shape == (3, 8)


def test_bad_inputs_raise_clear_errors():
    fmt = FORMATS["resq"]
    gen = torch.Generator().manual_seed(11)
    x = _activations(3, fmt.k, gen)
    acts = mixed_act_quant(x, fmt, kernel="torch")
    weights = _random_weights(8, fmt, gen)
    with pytest.raises(UserInputError, match="lo_bits=8"):
        MixedFormat(k_lo=8, k_hi=0, lo_bits=8)
    with pytest.raises(UserInputError, match="group_size=0"):
        MixedFormat(k_lo=8, k_hi=0, group_size=0)
    with pytest.raises(UserInputError, match="lo_clip"):
        MixedFormat(k_lo=8, k_hi=0, lo_clip=1.5)
    with pytest.raises(UserInputError, match=r"x must have shape \[\*, 300\]"):
        mixed_act_quant(x[:, :299], fmt, kernel="torch")
    with pytest.raises(UserInputError, match="x has dtype int32"):
        mixed_act_quant(x.to(torch.int32), fmt, kernel="torch")
    with pytest.raises(UserInputError, match="permutation"):
        mixed_act_quant(x, fmt, torch.zeros(fmt.k, dtype=torch.int64), kernel="torch")
    with pytest.raises(UserInputError, match="z_lo is None"):
        mixed_gemm(acts._replace(z_lo=None), weights, fmt, kernel="torch")
    with pytest.raises(UserInputError, match=r"weights.s_lo must have shape \[8, 1\]"):
        mixed_gemm(acts, weights._replace(s_lo=torch.ones(8, 2)), fmt, kernel="torch")
    with pytest.raises(UserInputError, match="acts.q_lo must have shape"):
        mixed_gemm(acts, weights, FORMATS["atom"], kernel="torch")
    with pytest.raises(UserInputError, match=r"bias must have shape \[8\]"):
        mixed_gemm(acts, weights, fmt, torch.ones(7), kernel="torch")
    with pytest.raises(UserInputError, match="block_kp=16"):
        MixedTileConfig(block_m=16, block_n=32, block_kp=16, block_k8=32)
    with pytest.raises(UserInputError, match="split_k=0"):
        MixedTileConfig(block_m=16, block_n=32, block_kp=32, block_k8=32, split_k=0)
    with pytest.raises(UserInputError, match=r"q_lo holds values in \[-9"):
        mixed_weights(torch.full((2, fmt.k_lo), -9), torch.ones(2, 1), torch.ones(2, fmt.k_hi), torch.ones(2), fmt)
    layer = MixedQuantLinear(fmt, weights, kernel="torch")
    with pytest.raises(UserInputError, match="input has 299 features"):
        layer(x[:, :299])
    with pytest.raises(UserInputError, match=r"input has shape \[\] \(a 0-d tensor\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(UserInputError, match="permutation"):
        MixedQuantLinear(fmt, weights, torch.ones(fmt.k, dtype=torch.int64))


@pytest.mark.parametrize("m, n, k, want", [
    # the H100 grid's picks (benchmarks/results/atom_decode_h100): block_n, split
    (4, 6144, 4096, (32, 2)), (32, 6144, 4096, (64, 2)), (4, 4096, 4096, (32, 4)), (32, 4096, 4096, (64, 4)),
    (16, 28672, 4096, (64, 1)), (32, 28672, 4096, (128, 1)), (4, 4096, 14336, (32, 4)),
])
def test_decode_tiles_follow_the_measured_grid(monkeypatch, m, n, k, want):
    """On a 132-SM GPU, calls of up to 32 tokens take 16-row tiles, 3 stages, two groups a step, 16q unpacking, and
    split K while tiles x split stay within 4 programs an SM."""
    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    fmt = MixedFormat(k_lo=k - 128, k_hi=128, group_size=128, lo_clip=0.9)
    cfg = pick_mixed_config(m, n, fmt, torch.device("cuda"))
    assert (cfg.block_m, cfg.num_stages, cfg.groups_per_step, cfg.x16) == (16, 3, 2, True)
    assert (cfg.block_n, cfg.split_k) == want
    assert pick_mixed_config(m + 32, n, fmt, torch.device("cuda")).x16 is False  # above decode: the H200 table
