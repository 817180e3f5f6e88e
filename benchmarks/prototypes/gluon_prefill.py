"""Kept: a Gluon starting point for a prefill GEMM whose products stay in flight across K steps.

A prefill W4A4 GEMM in Gluon whose tensor-core products stay in flight while the next K step is unpacked.

The swapped Triton GEMM (``w4a4_gemm_swapped_triton``: ``Cᵀ = W Aᵀ``, the unpacked weights the ``wgmma``
instruction's register operand, the ``split8`` activations its shared-memory operand) waits for every product
before the next step: Triton 3.6 keeps a ``wgmma`` in flight across loop iterations only when its register operand
is defined outside the loop. So each step's shared-memory loads of the weights and
their unpacking run while the warpgroup's tensor-core work is drained; only the SM's other warpgroups fill it.

Gluon (Triton's explicit-layout dialect) issues ``wgmma`` asynchronously and waits when told. This kernel has the
Triton kernel's tiles (128 weight rows × 128 tokens × 128 K values a step, 8 warps, two programs an SM) and a
4-slot ``cp.async`` ring, and per step:

1. waits for its copies of step ``i`` and meets the other warps at a barrier;
2. issues the copies of step ``i + 2`` into the slot of step ``i - 2`` (every warpgroup is past it);
3. loads the packed weights of step ``i`` into registers, unpacks both halves as ``16 q``, and issues their two
   ``wgmma`` (even and odd values) asynchronously;
4. ``PAIR``: at odd steps waits for both steps' products (the second step's loads and unpacking ran under the
   first's products); else waits for them every step (Triton's schedule, for comparison).

Products in flight across loop iterations (a wait down to the two just issued) gave wrong sums: the register
operands of the products in flight were reused. ``warpgroup_mma_wait``'s ``deps``, which would hold them, take no
8-bit values in Triton 3.6, and an asm reading them after the wait holds them only within one iteration.

Dense only (no residual blocks), M, N multiples of 128 and K of 256: a prototype to measure what the overlap is
worth before building on it. Variants, GEMM alone on ``split8`` activations (weights rotated through more than L2,
medians of CUDA-graph replays, interleaved rounds; each output first checked bit for bit against the Triton
kernel's):

- ``t_split`` / ``t_joined``: the Triton swapped GEMM with a dot per nibble half / one dot on the joined halves;
- ``g_sync``: the Gluon kernel waiting for its products every step;
- ``g_pair``: in flight within pairs of steps.

    PYTHONPATH=. python3 benchmarks/prototypes/gluon_prefill.py [--ms 2048,8192] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from gluon_zipper import _hi16, _lo16  # noqa: E402  (the 16 q unpacking as inline PTX)
from merged_walk import time_variants  # noqa: E402

from mosaicquant.harness.results import source_fingerprint  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_swapped_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROTATE_BYTES = 180 * 2**20
BN, BM, BKP = 128, 128, 64  # weight rows, tokens and packed K bytes of a program's step (host side)

@gluon.jit
def _keep(lo, hi):
    """An empty asm reading ``lo`` and ``hi``: their registers stay allocated until here. ``warpgroup_mma_wait``'s
    ``deps`` would say so, but its lowering takes no 8-bit values (Triton 3.6)."""
    return gl.inline_asm_elementwise("", "=r,=r,0,1", [lo, hi], dtype=(gl.int8, gl.int8), is_pure=False, pack=4)


@gluon.jit
def _issue(w_slot, ae_slot, ao_slot, w_ptrs, a_ptrs, step, live):
    """cp.async of step ``step``'s packed weights ``[128, 64]`` and its even / odd activation tiles ``[128, 64]``."""
    async_copy.async_copy_global_to_shared(w_slot, w_ptrs + step * 64, mask=live)
    async_copy.async_copy_global_to_shared(ae_slot, a_ptrs + step * 128, mask=live)
    async_copy.async_copy_global_to_shared(ao_slot, a_ptrs + step * 128 + 64, mask=live)


@gluon.jit
def _pair(i, acc, w_smem, ae_smem, ao_smem, w_ptrs, a_ptrs, k_steps, op_a: gl.constexpr, STAGES: gl.constexpr):
    """K steps ``i`` and ``i + 1``: the second step's loads and unpacking run while the first's products are in
    flight; both are waited for at the end (no register operand lives across loop iterations)."""
    lo_a, hi_a, acc = _issue_products(i, acc, w_smem, ae_smem, ao_smem, w_ptrs, a_ptrs, k_steps, op_a, STAGES)
    lo_b, hi_b, acc = _issue_products(i + 1, acc, w_smem, ae_smem, ao_smem, w_ptrs, a_ptrs, k_steps, op_a, STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    _keep(lo_a, hi_a)
    _keep(lo_b, hi_b)
    return acc


@gluon.jit
def _issue_products(i, acc, w_smem, ae_smem, ao_smem, w_ptrs, a_ptrs, k_steps, op_a: gl.constexpr,
                    STAGES: gl.constexpr):
    """Step ``i``'s copies awaited, step ``i + STAGES - 2``'s issued, step ``i``'s two products issued (not
    waited for); returns their register operands and the accumulator."""
    async_copy.wait_group(STAGES - 3)
    gl.thread_barrier()
    nxt = i + STAGES - 2
    slot_n = nxt % STAGES
    _issue(w_smem.index(slot_n), ae_smem.index(slot_n), ao_smem.index(slot_n), w_ptrs, a_ptrs, nxt, nxt < k_steps)
    async_copy.commit_group()
    slot = i % STAGES
    w = w_smem.index(slot).load(op_a)
    lo = _lo16(w)
    hi = _hi16(w)
    acc = warpgroup_mma(lo, ae_smem.index(slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(hi, ao_smem.index(slot).permute((1, 0)), acc, is_async=True)
    return lo, hi, acc


@gluon.jit
def _gp_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, KP, stride_am, stride_wn, stride_om,
               STAGES: gl.constexpr, PAIR: gl.constexpr, GROUP_N: gl.constexpr):
    BN: gl.constexpr = 128  # weight rows
    BM: gl.constexpr = 128  # tokens
    BKP: gl.constexpr = 64  # packed bytes (128 K values) a step
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 128, 32])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])  # [128, 64] bytes, 16 B a copy
    st: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 8], [0, 1])  # the transposed store, 16 B a thread
    w_sh: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=2, max_phase=4, order=[1, 0])
    a_sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)

    # grouped tile order: GROUP_N weight tiles share their token tiles
    pid = gl.program_id(0)
    num_n = N // BN
    num_m = M // BM
    group = GROUP_N * num_m
    first_n = (pid // group) * GROUP_N
    size_n = gl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % group) % size_n
    pid_m = (pid % group) // size_n
    n0 = pid_n * BN
    m0 = pid_m * BM

    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
    w_ptrs = w_ptr + (n0 + rows).to(gl.int64)[:, None] * stride_wn + cols[None, :]
    a_ptrs = a_ptr + (m0 + rows).to(gl.int64)[:, None] * stride_am + cols[None, :]
    w_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BN, BKP], w_sh)
    ae_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BM, 64], a_sh)
    ao_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BM, 64], a_sh)
    k_steps = KP // BKP
    for s in gl.static_range(STAGES - 2):
        _issue(w_smem.index(s), ae_smem.index(s), ao_smem.index(s), w_ptrs, a_ptrs, s, s < k_steps)
        async_copy.commit_group()

    acc = gl.zeros([BN, BM], gl.int32, mma)
    if PAIR:  # pairs of steps (K a multiple of 256)
        for i in range(0, k_steps, 2):
            acc = _pair(i, acc, w_smem, ae_smem, ao_smem, w_ptrs, a_ptrs, k_steps, op_a, STAGES)
    else:
        for i in range(k_steps):
            lo, hi, acc = _issue_products(i, acc, w_smem, ae_smem, ao_smem, w_ptrs, a_ptrs, k_steps, op_a, STAGES)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _keep(lo, hi)
    async_copy.wait_group(0)

    offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    offs_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    w_scale = gl.load(w_scale_ptr + offs_n).to(gl.float32)
    a_scale = gl.load(a_scale_ptr + offs_m)
    # the Triton kernel's order of float operations: the same bits
    y = acc.to(gl.float32) * w_scale[:, None]
    y = y * 0.0625
    y = y * a_scale[None, :]
    y = gl.convert_layout(y.to(gl.bfloat16), st)
    sn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, st))
    sm = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, st))
    gl.store(out_ptr + sm.to(gl.int64)[None, :] * stride_om + sn[:, None], y)


def gluon_prefill(a_split: torch.Tensor, a_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                  out: torch.Tensor, pair: bool = True) -> torch.Tensor:
    """``bfloat16 [M, N]`` into ``out``: the Gluon kernel on split8 activations ``int8 [M, K]`` and packed weights
    (``pair``: products in flight within pairs of steps; else waited for every step)."""
    m, n, kp = a_split.shape[0], qweight.shape[0], qweight.shape[1]
    if m % BM or n % BN or kp % (2 * BKP) or a_split.shape[1] != 2 * kp:
        raise ValueError(f"the prototype takes M, N multiples of {BM} and K of 256 (got M={m}, N={n}, K={2 * kp})")
    _gp_kernel[((n // BN) * (m // BM),)](
        a_split, a_scale, qweight.view(torch.int8), w_scale.reshape(-1), out, m, n, kp, a_split.stride(0),
        qweight.stride(0), out.stride(0), STAGES=4, PAIR=bool(pair), GROUP_N=8, num_warps=8)
    return out


VARIANTS = ("bf16", "t_split", "t_joined", "g_sync", "g_pair")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="2048,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", default=",".join(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gluon_prefill.py runs Gluon kernels: it needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.layers.split(","):
        n, k = SHAPES[name]
        copies = max(2, math.ceil(ROTATE_BYTES / (n * k // 2 * 1.05)))
        qws = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen).to(device) for _ in range(copies)]
        wss = [(torch.rand(n, generator=gen) * 0.01 + 0.001).to(torch.float16).to(device) for _ in range(copies)]
        for m in (int(v) for v in args.ms.split(",")):
            x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(device)
            a8, s8 = quantize_activations_triton(x, layout="split8")
            out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            w_bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                      for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]

            def t(joined):
                return [lambda i=i: w4a4_gemm_swapped_triton(a8, s8, qws[i], wss[i], k, joined_dot=joined, out=out)
                        for i in range(copies)]

            def g(pair):
                return [lambda i=i: gluon_prefill(a8, s8, qws[i], wss[i], out, pair)
                        for i in range(copies)]

            calls = {"bf16": [lambda w=w: F.linear(x, w) for w in w_bf16], "t_split": t(False), "t_joined": t(True),
                     "g_sync": g(False), "g_pair": g(True)}
            want = calls["t_split"][0]().clone()
            status = {}
            for v in VARIANTS[2:]:
                try:
                    out.fill_(float("nan"))
                    calls[v][0]()
                    torch.cuda.synchronize()
                    same = torch.equal(out, want)
                    diff = (out.float() - want.float()).abs().max().item()
                    status[v] = (same, "bits equal to t_split" if same else f"differs: max |diff| {diff:.3g}")
                except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded, not fatal
                    status[v] = (False, f"{type(exc).__name__}: {str(exc)[:300]}")
            rows += time_variants(name, n, k, m, VARIANTS, calls, status, args.rounds)
            del w_bf16
    bad = [r for r in rows if not r["check_ok"]]
    by = {(r["layer"], r["m"], r["variant"]): r.get("us") for r in rows}
    print(f"\nchecks: {len(rows) - len(bad)} ok, {len(bad)} failed or errored")
    print("µs (time ÷ t_joined; × bf16)")
    print(f"{'layer':>7} {'M':>5} " + " ".join(f"{v:>20}" for v in VARIANTS))
    for name in args.layers.split(","):
        for m in (int(v) for v in args.ms.split(",")):
            b, j = by.get((name, m, "bf16")), by.get((name, m, "t_joined"))
            cells = []
            for v in VARIANTS:
                us = by.get((name, m, v))
                cells.append(f"{'-':>20}" if not us else
                             f"{us:7.1f} {us / j if j else float('nan'):5.3f} ({b / us:4.2f})")
            print(f"{name:>7} {m:>5} " + " ".join(cells))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gluon_prefill.json").write_text(json.dumps({
            "rows": rows, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
            "source_sha256": source_fingerprint()}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
