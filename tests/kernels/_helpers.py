"""Shared test inputs for the kernel tests: random 4-bit layers, never zeros."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mosaicquant.kernels._common import triton_interpreting
from mosaicquant.methods.format import ResidualBlocks, pack_int4

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Kernel (fp32 scaling, BF16 out) vs fp32 reference on exact 4-bit inputs: one BF16 ulp
# relative, plus a floor of 1e-3 of the output range for entries near zero.
BF16_RTOL = 2.0**-7
ATOL_FRAC = 1e-3
NAN_U8 = 0xAB  # poison byte for uint8 outputs
REPO = Path(__file__).resolve().parents[2]


def ptxas_available() -> bool:
    """Whether Triton's NVIDIA backend (its ptxas) is here: kernels then compile for sm_90 without a GPU."""
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def sm90_compile(script: str, *args: str, timeout: int) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``script`` (Python source that compiles kernels for sm_90 through ``_offline``'s stand-in driver, which
    it imports as ``_offline``) in a subprocess, outside the interpreter, with ``args`` as its ``argv[1:]``; returns
    the process and the JSON lines it printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=REPO)
    return run, [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def assert_residual_matters(a_packed, a_scale, qweight, w_scale, k, bias, ref: torch.Tensor) -> None:
    """The dense-only product is far from ``ref`` (fp32, with the residual): a case where the blocks count."""
    from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference

    dense = w4a4_gemm_reference(a_packed, a_scale, qweight, w_scale, k, bias, out_fp32=True)
    assert (dense - ref).abs().max() > 10 * BF16_RTOL * ref.abs().max()


def needs_triton():
    """Skip marker for the Triton path where neither CUDA nor the interpreter runs it."""
    return pytest.mark.skipif(
        not (torch.cuda.is_available() or triton_interpreting()),
        reason="needs CUDA or TRITON_INTERPRET=1 (set by tests/kernels/conftest.py)",
    )


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``out`` (BF16 or fp32) within one BF16 ulp of the fp32 ``ref`` (plus the range floor)."""
    out = out.float().cpu()
    ref = ref.float().cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten poisoned entries?)"
    atol = ATOL_FRAC * ref.abs().max().item()
    err = (out - ref).abs()
    bad = err > BF16_RTOL * ref.abs() + atol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} entries off, max abs err {err.max().item():.3g} "
        f"(ref range {ref.abs().max().item():.3g})"
    )


def random_int4(shape, gen: torch.Generator) -> torch.Tensor:
    """Random signed 4-bit integers with no all-zero rows."""
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    q[..., 0] = torch.randint(1, 8, q.shape[:-1], generator=gen, dtype=torch.int8)
    return q


def random_layer(n: int, k: int, gen: torch.Generator):
    """Packed random base weights and FP16 per-channel scales."""
    q = random_int4((n, k), gen)
    scale = (torch.rand(n, generator=gen) * 0.05 + 0.01).to(torch.float16)
    return q, pack_int4(q), scale


def random_activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """BF16 activations with a few large channels (outliers)."""
    x = torch.randn(m, k, generator=gen) * 2
    x[:, :: max(1, k // 5)] *= 10
    return x.to(torch.bfloat16)


def random_residual(n: int, k: int, block: tuple[int, int], fraction: float, gen: torch.Generator) -> ResidualBlocks:
    """Random kept blocks (at least one), zero outside the layer's edge as the format stores them."""
    bn, bk = block
    nbr, nbc = -(-n // bn), -(-k // bk)
    total = nbr * nbc
    nb = max(1, int(round(fraction * total)))
    idx = torch.randperm(total, generator=gen)[:nb]
    coords = torch.stack([idx // nbc, idx % nbc], 1)
    q = random_int4((nb, bn, bk), gen)
    for b, (i, j) in enumerate(coords.tolist()):
        q[b, max(0, n - i * bn):, :] = 0
        q[b, :, max(0, k - j * bk):] = 0
    scales = torch.rand(nb, bn, generator=gen) * 0.02 + 0.002
    return ResidualBlocks.from_blocks((n, k), block, coords, q, scales)


def pow2_residual(residual: ResidualBlocks, w_scale: torch.Tensor, gen: torch.Generator,
                  max_shift: int = 4) -> ResidualBlocks:
    """``residual`` with every kept row's scale set to its base row's scale times ``2^-j`` (random ``j`` in
    0..``max_shift``)."""
    bn = residual.block_shape[0]
    n = residual.shape[0]
    rows = (residual.coords[:, 0].long().unsqueeze(1) * bn + torch.arange(bn)).clamp(max=n - 1)
    j = torch.randint(0, max_shift + 1, (residual.num_blocks, bn), generator=gen)
    scales = (w_scale.float()[rows] * 2.0 ** -j).to(torch.float16)
    return ResidualBlocks(residual.shape, residual.block_shape, residual.coords, residual.row_ptr, residual.values,
                          scales)


def pow2_layer(n: int, k: int, block: tuple[int, int], fraction: float, seed: int, max_shift: int = 4):
    """A random packed base and a power-of-two residual (:func:`pow2_residual`) from a generator seeded with
    ``seed``: ``(gen, qweight, w_scale, residual)``, the generator for the test's further draws."""
    gen = torch.Generator().manual_seed(seed)
    _, qweight, w_scale = random_layer(n, k, gen)
    residual = pow2_residual(random_residual(n, k, block, fraction, gen), w_scale, gen, max_shift=max_shift)
    return gen, qweight, w_scale, residual


def pow2_layers(n: int, k: int, block: tuple[int, int], fraction: float, gen: torch.Generator, bias: bool = False,
                max_shift: int = 4):
    """A random quantized layer with a power-of-two residual and the same base with a free-scale one:
    ``(qt, with_pow2, with_free)`` (``PackedW4``; with a random bias if ``bias``)."""
    from mosaicquant.methods.format import PackedW4
    from mosaicquant.methods.quant import quantize

    q, _, w_scale = random_layer(n, k, gen)
    qt = quantize(q.float() * w_scale.float().unsqueeze(1), 4, symmetric=True, scale_dtype=torch.float16)
    b = torch.randn(n, generator=gen) if bias else None
    base = PackedW4.from_quantized(qt)
    res = pow2_residual(random_residual(n, k, block, fraction, gen), base.scales.reshape(-1), gen, max_shift=max_shift)
    return (qt, PackedW4.from_quantized(qt, residual=res, bias=b),
            PackedW4.from_quantized(qt, residual=random_residual(n, k, block, fraction, gen), bias=b))


def swapped_dense_case(m: int, n: int, k: int, seed: int):
    """Random operands of the swapped GEMM on DEVICE (split8 activations, weights, scales, bias) and the fp32
    reference: ``((a8, s8, qweight, w_scale, k, bias), ref)``."""
    from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton
    from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference

    gen = torch.Generator().manual_seed(seed)
    x = random_activations(m, k, gen)
    _, qweight, w_scale = random_layer(n, k, gen)
    bias = torch.randn(n, generator=gen)
    packed, scale = quantize_activations_reference(x)
    ref = w4a4_gemm_reference(packed, scale, qweight, w_scale, k, bias, out_fp32=True)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    return (a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), k, bias.to(DEVICE)), ref


def tiny_quantized_llama(method: str, intermediate_size: int = 128, **options):
    """A random 2-layer Llama (hidden 64, 4 q / 2 kv heads, vocab 97) quantized by ``method`` on random tokens.

    Returns:
        ``(simulated model, float copy taken before quantization)``, both fp32 on the CPU.
    """
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from mosaicquant.harness.context import QuantContext
    from mosaicquant.registry import get_method

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    float_model = copy.deepcopy(model)
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    ctx = QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cpu"), log=lambda s: None)
    spec = get_method(method)
    return spec.fn(model, spec.config(**options), ctx), float_model
