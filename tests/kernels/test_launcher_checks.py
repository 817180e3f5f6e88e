"""The launchers' input checks that no other kernel test reaches: each bad input named before any launch.

Every tensor is built on the target device (a strided or offset view is sliced there: ``Tensor.to`` of a
non-dense tensor would give the device a contiguous copy, with nothing left to refuse), so the same cases
run on the interpreter and compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels.act_quant import quantize_activations_triton
from mosaicquant.kernels.decoder import (
    KVFormat,
    KVScales,
    decode_attention,
    decode_rope_attention,
    rmsnorm,
    rope_kv,
    silu_mul,
)
from mosaicquant.kernels.gemv import gemv_triton
from mosaicquant.kernels.hadamard_quant import hadamard_quantize_triton
from mosaicquant.kernels.mixed_gemm import (
    MixedFormat,
    MixedQuantLinear,
    mixed_act_quant_triton,
    mixed_gemm_triton,
    mixed_weights,
)
from mosaicquant.kernels.quant_linear import QuantLinear
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_swapped_triton, w4a4_gemm_triton
from mosaicquant.methods.hadamard import OnlineHadamard

from ._helpers import DEVICE, needs_triton

BF16 = torch.bfloat16
HEADS, KV_HEADS, D, B, SLOTS = 4, 2, 32, 2, 16
N, K = 32, 128


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _act(m: int = 3, k: int = K, dtype=BF16) -> torch.Tensor:
    return torch.randn(m, k, generator=_gen(1), device=DEVICE).to(dtype)


def _weights():
    """A random packed ``[N, K/2]`` weight and its ``[N]`` scales, on DEVICE."""
    qweight = torch.randint(0, 256, (N, K // 2), generator=_gen(2), device=DEVICE, dtype=torch.uint8)
    w_scale = torch.rand(N, generator=_gen(3), device=DEVICE) * 0.05 + 0.01
    return qweight, w_scale


def _packed_acts(m: int = 3):
    return quantize_activations_triton(_act(m))


def _rope():
    qkv = torch.randn(B, (HEADS + 2 * KV_HEADS) * D, generator=_gen(4), device=DEVICE).to(BF16)
    angles = torch.rand(SLOTS, D, generator=_gen(5), device=DEVICE) * 6
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    kc = torch.zeros(B, KV_HEADS, SLOTS, D, dtype=BF16, device=DEVICE)
    return qkv, torch.tensor([1, 2], device=DEVICE), cos, sin, kc, kc.clone()


def _mixed(fmt: MixedFormat):
    weights = mixed_weights(torch.randint(-8, 8, (N, fmt.k_lo)), torch.rand(N, fmt.n_groups) + 0.01,
                            torch.randint(-128, 128, (N, fmt.k_hi)), torch.rand(N) + 0.01, fmt)
    return type(weights)(*(t.to(DEVICE) for t in weights))


SYM = MixedFormat(k_lo=96, k_hi=32, group_size=32)
ASYM = MixedFormat(k_lo=96, k_hi=32, group_size=32, lo_symmetric=False, hi_symmetric=False)


def _strided_scales():
    scales = KVScales.empty(B, KV_HEADS, SLOTS, DEVICE)
    wide = torch.zeros(B, KV_HEADS, SLOTS * 2, dtype=torch.float32, device=DEVICE)
    return KVScales(wide[:, :, :SLOTS], scales.k_zero, scales.v_scale, scales.v_zero)


def _rope_kv(**change):
    qkv, pos, cos, sin, kc, vc = _rope()
    args = dict(qkv=qkv, positions=pos, cos=cos, sin=sin, k_cache=kc, v_cache=vc, heads=HEADS, kv_heads=KV_HEADS,
                tokens_per_seq=1)
    kwargs = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    return rope_kv(**args, kernel="triton", **kwargs)


def _rope_attention(**change):
    qkv, pos, cos, sin, kc, vc = _rope()
    args = dict(qkv=qkv, positions=pos, cos=cos, sin=sin, k_cache=kc, v_cache=vc, heads=HEADS, kv_heads=KV_HEADS,
                scale=D ** -0.5)
    kwargs = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    return decode_rope_attention(**args, kernel="triton", **kwargs)


def _attention(**change):
    qkv, _, _, _, kc, vc = _rope()
    args = dict(q=qkv[:, :HEADS * D].reshape(B, HEADS, D), k_cache=kc, v_cache=vc,
                lengths=torch.tensor([2, 3], dtype=torch.int32, device=DEVICE), scale=D ** -0.5)
    args.update(change)
    return decode_attention(**args, kernel="triton")


def _wide_cache():
    """A ``[B, kv_heads, L, D]`` view with stride 2 along D (cut from a cache twice as wide, on DEVICE)."""
    return torch.zeros(B, KV_HEADS, SLOTS, 2 * D, dtype=BF16, device=DEVICE)[..., ::2]


CASES = {
    # the Triton path's device
    "meta tensors": (lambda: quantize_activations_triton(torch.empty(2, K, dtype=BF16, device="meta")),
                     r"the Triton kernels take CUDA tensors .* got a tensor on meta"),
    # activation quantizer
    "x of rank 3": (lambda: quantize_activations_triton(_act().reshape(3, 2, K // 2)), r"x must be 2-D, got shape"),
    "x strided along K": (lambda: quantize_activations_triton(_act(3, 2 * K)[:, ::2]),
                          r"x must have unit stride along its last dimension"),
    "x without columns": (lambda: quantize_activations_triton(_act(3, 0)), r"x must have at least one column"),
    "out= with split8": (lambda: quantize_activations_triton(_act(), layout="split8", out=_packed_acts()),
                         r"out= takes the packed layout only"),
    "out not contiguous": (lambda: quantize_activations_triton(_act(), out=(
        torch.empty(3, K, dtype=torch.uint8, device=DEVICE)[:, :K // 2], torch.empty(3, device=DEVICE))),
        r"out tensors must be contiguous and on x's device"),
    # fused Hadamard + quantizer
    "transform of another type": (lambda: hadamard_quantize_triton(_act(), "hadamard"),
                                  r"transform must be an OnlineHadamard, got str"),
    "x of another width than the transform": (lambda: hadamard_quantize_triton(_act(), OnlineHadamard(64)),
                                              r"x has 128 columns; the transform is of size 64"),
    "float32 input to the fused transform": (lambda: hadamard_quantize_triton(_act(dtype=torch.float32),
                                                                              OnlineHadamard(K)),
                                             r"the fused Hadamard \+ quantization kernel cannot run this input"),
    "hadamard out= with split8": (lambda: hadamard_quantize_triton(_act(), OnlineHadamard(K), layout="split8",
                                                                   out=_packed_acts()),
                                  r"out= takes the packed layout only"),
    "hadamard out not contiguous": (lambda: hadamard_quantize_triton(_act(), OnlineHadamard(K), out=(
        torch.empty(3, K, dtype=torch.uint8, device=DEVICE)[:, :K // 2], torch.empty(3, device=DEVICE))),
        r"out tensors must be contiguous and on x's device"),
    "signs in float64": (lambda: hadamard_quantize_triton(_act(), _float64_signs()),
                         r"the transform's signs are torch.float64 on .*float32 signs"),
    # GEMMs
    "k of another type": (lambda: w4a4_gemm_triton(*_packed_acts(), *_weights(), 128.0),
                          r"k=128.0 must be a positive int"),
    "grouped weight scales": (lambda: w4a4_gemm_triton(*_packed_acts(), _weights()[0],
                                                       torch.rand(N, 2, device=DEVICE), K),
                              r"w_scale has 2 groups per channel"),
    "weight scales of another count": (lambda: w4a4_gemm_triton(*_packed_acts(), _weights()[0],
                                                                torch.rand(N + 1, device=DEVICE), K),
                                       r"w_scale must have 32 entries"),
    "GEMM out not contiguous": (lambda: w4a4_gemm_triton(*_packed_acts(), *_weights(), K, out=torch.empty(
        3, 2 * N, dtype=BF16, device=DEVICE)[:, :N]), r"out must be contiguous and on the operands' device"),
    "gated GEMM of an odd width": (lambda: w4a4_gemm_triton(*_packed_acts(), _weights()[0][:N - 1],
                                                            _weights()[1][:N - 1], K, gated=True),
                                   r"gated=True"),
    "swapped GEMM tile not a power of two": (lambda: w4a4_gemm_swapped_triton(
        *quantize_activations_triton(_act(), layout="split8"), *_weights(), K, block_n=24),
        r"block_n=24 must be a power of two >= 16"),
    "GEMV activations off a 4-byte boundary": (lambda: gemv_triton(
        _gemv_offset_acts(), torch.rand(2, device=DEVICE), *_gemv_weights(), 256),
        r"a_packed rows must start at 4-byte boundaries \(stride 132, offset 1\)"),
    "GEMV of too many tokens": (lambda: gemv_triton(*_packed_acts(64), *_weights(), K),
                                r"the decode GEMV cannot run this call"),
    # mixed-precision kernels
    "format of another type": (lambda: mixed_act_quant_triton(_act(), "atom"), r"fmt must be a MixedFormat, got str"),
    "acts of another type": (lambda: mixed_gemm_triton((1, 2), _mixed(SYM), SYM), r"acts must be a MixedActs"),
    "zero points on a symmetric grid": (lambda: mixed_gemm_triton(
        mixed_act_quant_triton(_act(), SYM)._replace(z_hi=torch.zeros(3, dtype=torch.int32, device=DEVICE)),
        _mixed(SYM), SYM), r"acts.z_hi must be None: the format's grid is symmetric"),
    "no zero points on an asymmetric grid": (lambda: mixed_gemm_triton(
        mixed_act_quant_triton(_act(), ASYM)._replace(z_lo=None), _mixed(ASYM), ASYM),
        r"acts.z_lo is None but the format's grid is asymmetric"),
    "tile config of another type": (lambda: mixed_gemm_triton(mixed_act_quant_triton(_act(), SYM), _mixed(SYM), SYM,
                                                              config={"block_m": 16}),
                                    r"config must be a MixedTileConfig, got dict"),
    "mixed layer weights of another type": (lambda: MixedQuantLinear(SYM, "weights"),
                                            r"weights must be a MixedWeights, got str"),
    "layer of another type": (lambda: QuantLinear("packed"), r"packed must be a PackedW4, got str"),
    # decoder kernels
    "norm weight not contiguous": (lambda: rmsnorm(_act(), torch.ones(2 * K, dtype=BF16, device=DEVICE)[::2], 1e-6,
                                                   kernel="triton"),
                                   r"weight (must be contiguous|must have unit stride)"),
    "odd gate/up width": (lambda: silu_mul(_act(3, K + 1), kernel="triton"), r"gate_up has an odd width 129"),
    "kv of another type": (lambda: _rope_kv(kv="4bit"), r"kv must be a KVFormat, got str"),
    "scales for a 16-bit cache": (lambda: _rope_kv(kv=KVFormat(16), scales=KVScales.empty(B, KV_HEADS, SLOTS, DEVICE)),
                                  r"scales are given for a 16-bit cache"),
    "4-bit cache scales strided": (lambda: _rope_kv(
        kv=KVFormat(4), k_cache=torch.zeros(B, KV_HEADS, SLOTS, D // 2, dtype=torch.uint8, device=DEVICE),
        v_cache=torch.zeros(B, KV_HEADS, SLOTS, D // 2, dtype=torch.uint8, device=DEVICE), scales=_strided_scales()),
        r"scales.k_scale must be contiguous"),
    "caches of other strides": (lambda: _rope_kv(v_cache=torch.zeros(B, SLOTS, KV_HEADS, D, dtype=BF16,
                                                                      device=DEVICE).transpose(1, 2)),
                                r"k_cache and v_cache must have the same strides"),
    "qkv of another width": (lambda: _rope_kv(qkv=_act(B, (HEADS + 2 * KV_HEADS) * D - 2)),
                             r"qkv has 254 columns; expected \(heads \+ 2·kv_heads\)·D = 256"),
    "tables of another width": (lambda: _rope_kv(cos=_act(SLOTS, D // 2), sin=_act(SLOTS, D // 2)),
                                r"cos/sin tables have width 16; expected the head size 32"),
    "q_norm without k_norm": (lambda: _rope_kv(q_norm=torch.ones(D, dtype=BF16, device=DEVICE)),
                              r"q_norm and k_norm are given together or not at all"),
    "dequant of another shape": (lambda: _rope_kv(
        kv=KVFormat(4), k_cache=torch.zeros(B, KV_HEADS, SLOTS, D // 2, dtype=torch.uint8, device=DEVICE),
        v_cache=torch.zeros(B, KV_HEADS, SLOTS, D // 2, dtype=torch.uint8, device=DEVICE),
        scales=KVScales.empty(B, KV_HEADS, SLOTS, DEVICE),
        dequant=(torch.zeros(B, KV_HEADS, SLOTS, D // 2, dtype=BF16, device=DEVICE),) * 2),
        r"dequant tensors \[2, 2, 16, 16\] must be \[B, kv_heads, L, D\] = \[2, 2, L, 32\]"),
    "rope out not contiguous": (lambda: _rope_kv(out=torch.empty(HEADS, B, D, dtype=BF16, device=DEVICE)
                                                 .transpose(0, 1)),
                                r"out must be contiguous, the caches unit-strided along D"),
    "attention caches strided along D": (lambda: _rope_attention(k_cache=_wide_cache(), v_cache=_wide_cache()),
                                         r"(unit-strided along D|unit stride along its last dimension)"),
    "attention out strided": (lambda: _rope_attention(out=torch.empty(B, 2 * HEADS * D, dtype=BF16,
                                                                      device=DEVICE)[:, ::2]),
                              r"out must (be unit-strided along its last dimension|have unit stride)"),
    "attention cache of another batch": (lambda: _attention(
        k_cache=torch.zeros(B + 1, KV_HEADS, SLOTS, D, dtype=BF16, device=DEVICE),
        v_cache=torch.zeros(B + 1, KV_HEADS, SLOTS, D, dtype=BF16, device=DEVICE)),
        r"k_cache shape \[3, 2, 16, 32\] does not fit q \[2, 4, 32\]"),
    "attention caches of other strides": (lambda: _attention(v_cache=torch.zeros(
        B, SLOTS, KV_HEADS, D, dtype=BF16, device=DEVICE).transpose(1, 2)),
        r"k_cache and v_cache must have the same strides"),
}


def _float64_signs() -> OnlineHadamard:
    had = OnlineHadamard(K, signs=torch.ones(K, dtype=torch.float32))
    had.signs = torch.ones(K, dtype=torch.float64, device=DEVICE)
    return had


def _gemv_weights():
    qweight = torch.randint(0, 256, (N, 128), generator=_gen(6), device=DEVICE, dtype=torch.uint8)
    return qweight, torch.rand(N, generator=_gen(7), device=DEVICE) + 0.01


def _gemv_offset_acts() -> torch.Tensor:
    """Packed activations ``[2, 128]`` whose rows start one byte past a 4-byte boundary (a view on DEVICE)."""
    return torch.randint(0, 256, (2, 132), generator=_gen(8), device=DEVICE, dtype=torch.uint8)[:, 1:129]


@needs_triton()
@pytest.mark.parametrize("case", list(CASES))
def test_launcher_names_the_bad_input(case):
    call, match = CASES[case]
    with pytest.raises(UserInputError, match=match):
        call()
