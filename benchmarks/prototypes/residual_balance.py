"""Kept: the residual's decode cost against evenly spread blocks; the prototypes share its helpers.

How much of the residual's decode cost is load imbalance: random kept blocks against evenly spread ones.

The kernels deal a block row's kept blocks to the programs of that row (round-robin over the
split-K programs), so the slowest program carries the row with the most blocks. This script
times, on the Llama-3-8B linears at decode sizes, the GEMM alone (activations quantized once,
outside the timing):

- ``w4a4``: the dense tensor-core GEMM (budget 0);
- ``zip10``: ZipperEngine with 10 % of the blocks kept at random (what the speed forms build);
- ``zip10_even``: the same number of blocks, but every block row keeps ⌊nb/rows⌋ or one more, and
  each row's blocks sit in evenly spaced block columns (so each split-K program of a row gets at
  most ⌈blocks/split⌉ of them, and the rows differ by at most one);
- ``gemv`` / ``gemv_zip10`` / ``gemv_zip10_even``: the same on the decode GEMV (M = 1);
- ``zip10_dot``: ZipperEngine with the tensor-core residual walk; on wide layers (where the dense
  GEMM takes 128 x 128-byte tiles) ``zip10_n64w{warps}s{stages}``: 64-channel tiles with the
  same 128-byte K steps (each kept block then split over two programs);
- ``zip10_par`` (M ≤ 32) / ``zip10_even_par`` (M ≤ 16): ZipperEngine's parallel mode, each kept block
  in programs of its own, summed into the dense tiles' fix-up; ``zip10_par_rows`` one program per
  block row walking its blocks instead; on gate/up
  ``zip10_par[_rows]_silu`` that GEMM followed by the SiLU·mul kernel and ``zip10_par[_rows]_gated``
  the GEMM writing SiLU·mul itself (``gated=True``), and the same for the dense GEMM (``w4a4_silu``,
  ``w4a4_gated``);
- ``w4a4_swapdec`` / ``zip10_swapdec`` (M = 16, 32): the operand-swapped GEMM at decode tiles, dense
  and with the kept blocks in its tail;
  ``zip10_tail`` the tail walk (what
  ``"auto"`` picks may be either); where the default tiles split K, ``w4a4_s{n}``,
  ``zip10_tail_s{n}`` and ``zip10_par_s{n}`` for the other splits of 2, 4 and 8.

Each variant is checked against its reference before it is timed (CUDA graphs, weights rotating
through copies larger than 3× L2, medians). Prints the largest blocks-per-row of each layout and
a table of µs and of the residual's cost over ``w4a4`` last.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/prototypes/residual_balance.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from zipper import (  # noqa: E402
    BLOCK,
    check,
    clone_residual,
    random_residual,
    random_w4_copies,
    report_checks_and_write,
    time_calls,
)

from mosaicquant import settings  # noqa: E402
from mosaicquant.kernels._tiles import TileConfig, pick_config, swapped_decode_config  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_triton  # noqa: E402
from mosaicquant.kernels.decoder import silu_mul, silu_mul_reference  # noqa: E402
from mosaicquant.kernels.gemv import gemv_triton  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import (  # noqa: E402
    w4a4_gemm_reference,
    w4a4_gemm_swapped_triton,
    w4a4_gemm_triton,
)
from mosaicquant.kernels.zipper import residual_block_map, zipper_gemm_reference, zipper_gemm_triton  # noqa: E402
from mosaicquant.methods.format import ResidualBlocks  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 2, 4, 8, 16, 32)


def even_residual(n: int, k: int, budget: float, device) -> ResidualBlocks:
    """As many blocks as :func:`random_residual`, spread evenly over rows and, within a row, over columns."""
    bn, bk = BLOCK
    nbr, nbc = -(-n // bn), -(-k // bk)
    nb = int(round(budget * nbr * nbc))
    coords = []
    for i in range(nbr):
        r = nb // nbr + (1 if i < nb % nbr else 0)
        cols = sorted({(i + (j * nbc) // r) % nbc for j in range(r)}) if r else []
        coords += [(i, c) for c in cols]
    coords = torch.tensor(coords, dtype=torch.int32, device=device).reshape(-1, 2)
    counts = torch.bincount(coords[:, 0].long(), minlength=nbr)
    row_ptr = torch.zeros(nbr + 1, dtype=torch.int32, device=device)
    row_ptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
    values = torch.randint(0, 256, (coords.shape[0], bn, bk // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(coords.shape[0], bn, device=device) * 0.02 + 0.001).to(torch.float16)
    return ResidualBlocks((n, k), BLOCK, coords, row_ptr, values, scales)


def capped(cap: tuple[str, int] | None, call):
    """``call`` with the tile-table entry ``name = value`` in force while it runs (launches, graph capture)."""
    if cap is None:
        return call

    def run():
        with settings.use_tiles(**{cap[0]: cap[1]}):
            return call()
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--k-steps", action="store_true",
                        help="also time wider K steps on the 64-channel layers, the L2 prefetch caps and budget 0")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ms = [int(v) for v in args.ms.split(",")]
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    rows = []
    for name, (n, k) in shapes.items():
        kp = k // 2
        qws, wss = random_w4_copies(n, kp, device)
        qweight, w_scale, copies = qws[0], wss[0], len(qws)
        layouts = {"": random_residual(n, k, 0.10, device, gen), "_even": even_residual(n, k, 0.10, device)}
        res = {}
        for tag, r in layouts.items():
            per_row = torch.diff(r.row_ptr.long())
            print(f"{name}: {tag or '_random'} {r.num_blocks} blocks, per block row max {int(per_row.max())} "
                  f"mean {per_row.float().mean():.2f}", flush=True)
            rs = [r] + [clone_residual(r) for _ in range(copies - 1)]
            res[tag] = (rs, [residual_block_map(x) for x in rs])
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ap, a_s = quantize_activations_triton(x)
            ref0 = w4a4_gemm_reference(ap, a_s, qweight, w_scale, k, out_fp32=True)
            variants = {}
            ok, rel = check(w4a4_gemm_triton(ap, a_s, qweight, w_scale, k), ref0)
            variants["w4a4"] = ([(lambda i=i: w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k)) for i in range(copies)], ok)
            if m == 1:
                ok, rel = check(gemv_triton(ap, a_s, qweight, w_scale, k), ref0)
                variants["gemv"] = ([(lambda i=i: gemv_triton(ap, a_s, qws[i], wss[i], k)) for i in range(copies)], ok)
            for tag, (rs, maps) in res.items():
                zref = zipper_gemm_reference(ap, a_s, qweight, w_scale, k, rs[0], out_fp32=True)
                ok, rel = check(zipper_gemm_triton(ap, a_s, qweight, w_scale, k, rs[0], block_map=maps[0]), zref)
                variants[f"zip10{tag}"] = ([(lambda i=i, rs=rs, maps=maps: zipper_gemm_triton(
                    ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i])) for i in range(copies)], ok)
                if m == 1:
                    ok, rel = check(gemv_triton(ap, a_s, qweight, w_scale, k, residual=rs[0]), zref)
                    variants[f"gemv_zip10{tag}"] = ([(lambda i=i, rs=rs: gemv_triton(
                        ap, a_s, qws[i], wss[i], k, residual=rs[i])) for i in range(copies)], ok)
            rs, maps = res[""]
            zref = zipper_gemm_reference(ap, a_s, qweight, w_scale, k, rs[0], out_fp32=True)
            opts = {"zip10_dot": {"residual_walk": "dot"}}
            if pick_config(m, n, kp, device).block_n == 128:  # a wide layer: narrower tiles with the same K steps
                for warps, stages in ((4, 4), (4, 3), (8, 3)):
                    opts[f"zip10_n64w{warps}s{stages}"] = {"config": TileConfig(
                        block_m=16, block_n=64, block_kp=128, num_warps=warps, num_stages=stages)}
            if m <= 32:
                opts["zip10_par"] = {"mode": "parallel"}
                opts["zip10_par_rows"] = {"mode": "parallel_rows"}
                opts["zip10_tail"] = {"mode": "tail"}
            if m <= 16:
                cfg = pick_config(m, n, kp, device)
                for split in (2, 4, 8):
                    if cfg.split_k > 1 and cfg.split_k != split:
                        opts[f"zip10_par_s{split}"] = {"mode": "parallel", "config": replace(cfg, split_k=split)}
                        opts[f"zip10_tail_s{split}"] = {"mode": "tail", "config": replace(cfg, split_k=split)}
                        opts[f"zip10_par_rows_s{split}"] = {"mode": "parallel_rows", "config": replace(cfg, split_k=split)}
                        ok, rel = check(w4a4_gemm_triton(ap, a_s, qweight, w_scale, k,
                                                         config=replace(cfg, split_k=split)), ref0)
                        variants[f"w4a4_s{split}"] = ([(lambda i=i, c=replace(cfg, split_k=split): w4a4_gemm_triton(
                            ap, a_s, qws[i], wss[i], k, config=c)) for i in range(copies)], ok)
            for variant, kw in opts.items():
                kw = dict(kw)
                cap = kw.pop("cap", None)
                ok, rel = check(capped(cap, lambda kw=kw: zipper_gemm_triton(
                    ap, a_s, qweight, w_scale, k, rs[0], block_map=maps[0], **kw))(), zref)
                variants[variant] = ([capped(cap, lambda i=i, kw=kw: zipper_gemm_triton(
                    ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i], **kw)) for i in range(copies)], ok)
            if args.k_steps and m <= 16 and pick_config(m, n, kp, device).block_n == 64:
                # wider K steps (bytes of each weight row a step) at 64 or 32 channels, K split so that a
                # program keeps about as many steps as the default's or half as many
                base = pick_config(m, n, kp, device)
                for bn, bkp in ((64, 128), (64, 256), (32, 256)):
                    for split in sorted({max(1, base.split_k * base.block_kp // bkp * f) for f in (1, 2)}):
                        cfg_k = replace(base, block_n=bn, block_kp=bkp, split_k=split)
                        tag = f"n{bn}k{bkp}s{split}"
                        ok, rel = check(w4a4_gemm_triton(ap, a_s, qweight, w_scale, k, config=cfg_k), ref0)
                        variants[f"w4a4_{tag}"] = ([(lambda i=i, c=cfg_k: w4a4_gemm_triton(
                            ap, a_s, qws[i], wss[i], k, config=c)) for i in range(copies)], ok)
                        ok, rel = check(zipper_gemm_triton(ap, a_s, qweight, w_scale, k, rs[0], config=cfg_k), zref)
                        variants[f"zip10_{tag}"] = ([(lambda i=i, c=cfg_k: zipper_gemm_triton(
                            ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i], config=c))
                            for i in range(copies)], ok)
            if args.k_steps and 16 < m <= 32:
                # 32 tokens: the tail walk's 128-byte K steps at the default split (o, down), and the wide
                # 128-channel tiles with 32-row tiles (gate/up)
                base = pick_config(m, n, kp, device, BLOCK)
                opts32 = {}
                if base.block_n == 64 and base.split_k >= 8:
                    opts32[f"zip10_n64k128s{base.split_k}"] = replace(base, block_kp=128)
                if -(-n // 64) >= 2 * torch.cuda.get_device_properties(device).multi_processor_count:
                    opts32["zip10_wide32"] = TileConfig(block_m=32, block_n=128, block_kp=128, num_warps=8,
                                                        num_stages=3)
                for variant, cfg32 in opts32.items():
                    ok, rel = check(zipper_gemm_triton(ap, a_s, qweight, w_scale, k, rs[0], config=cfg32), zref)
                    variants[variant] = ([(lambda i=i, c=cfg32: zipper_gemm_triton(
                        ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i], config=c))
                        for i in range(copies)], ok)
            if args.k_steps and m <= 16:
                # L2 prefetch of the weights while waiting (PDL): none, or the dense GEMM's 8 MiB cap
                for mib in (0, 8):
                    variants[f"w4a4_pf{mib}"] = ([(lambda i=i, mib=mib: w4a4_gemm_triton(
                        ap, a_s, qws[i], wss[i], k, prefetch_mib=mib)) for i in range(copies)], True)
                    variants[f"zip10_pf{mib}"] = ([(lambda i=i, mib=mib: zipper_gemm_triton(
                        ap, a_s, qws[i], wss[i], k, rs[i], block_map=maps[i], prefetch_mib=mib))
                        for i in range(copies)], True)
                empty = ResidualBlocks.empty((n, k), BLOCK, device=device)  # ZipperEngine with no kept block
                ok, rel = check(zipper_gemm_triton(ap, a_s, qweight, w_scale, k, empty), ref0)
                variants["zip0"] = ([(lambda i=i: zipper_gemm_triton(ap, a_s, qws[i], wss[i], k, empty))
                                     for i in range(copies)], ok)
            if m in (16, 32):  # the swapped GEMM at decode tiles, dense and with the blocks in its tail
                a8, s8 = quantize_activations_triton(x, layout="split8")
                tiles = swapped_decode_config(m, n, kp, device)
                for variant, r0 in (("w4a4_swapdec", None), ("zip10_swapdec", rs)):
                    ok, rel = check(w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, residual=r0 and r0[0],
                                                             **tiles), zref if r0 else ref0)
                    variants[variant] = ([(lambda i=i, r0=r0: w4a4_gemm_swapped_triton(
                        a8, s8, qws[i], wss[i], k, residual=r0 and r0[i], **tiles)) for i in range(copies)], ok)
            if m <= 16 and name == "gate_up":  # SiLU·mul written by the pair fix-up, against the GEMM + SiLU·mul kernel
                gref = silu_mul_reference(zref.to(torch.bfloat16))
                for variant, mode in (("zip10_par_gated", "parallel"), ("zip10_par_rows_gated", "parallel_rows")):
                    ok, rel = check(zipper_gemm_triton(ap, a_s, qweight, w_scale, k, rs[0], mode=mode, gated=True), gref)
                    variants[variant] = ([(lambda i=i, mode=mode: zipper_gemm_triton(
                        ap, a_s, qws[i], wss[i], k, rs[i], mode=mode, gated=True)) for i in range(copies)], ok)
                for variant, mode in (("zip10_par_silu", "parallel"), ("zip10_par_rows_silu", "parallel_rows")):
                    variants[variant] = ([(lambda i=i, mode=mode: silu_mul(zipper_gemm_triton(
                        ap, a_s, qws[i], wss[i], k, rs[i], mode=mode))) for i in range(copies)], True)
                # the dense GEMM (QuaRot's gate/up) writing SiLU·mul itself, against it + the SiLU·mul kernel
                dref = silu_mul_reference(ref0.to(torch.bfloat16))
                variants["w4a4_silu"] = ([(lambda i=i: silu_mul(w4a4_gemm_triton(ap, a_s, qws[i], wss[i], k)))
                                          for i in range(copies)], True)
                ok, rel = check(w4a4_gemm_triton(ap, a_s, qweight, w_scale, k, gated=True), dref)
                variants["w4a4_gated"] = ([(lambda i=i: w4a4_gemm_triton(
                    ap, a_s, qws[i], wss[i], k, gated=True)) for i in range(copies)], ok)
            if m <= 16:
                ers, emaps = res["_even"]
                eref = zipper_gemm_reference(ap, a_s, qweight, w_scale, k, ers[0], out_fp32=True)
                ok, rel = check(zipper_gemm_triton(ap, a_s, qweight, w_scale, k, ers[0], mode="parallel"), eref)
                variants["zip10_even_par"] = ([(lambda i=i: zipper_gemm_triton(
                    ap, a_s, qws[i], wss[i], k, ers[i], block_map=emaps[i], mode="parallel")) for i in range(copies)], ok)
            for variant, (calls, ok) in variants.items():
                us, spread, how = time_calls(calls)
                rows.append({"shape": name, "n": n, "k": k, "m": m, "variant": variant, "us": us,
                             "spread_iqr_over_median": spread, "check_ok": ok})
                print(f"{name:8s} M={m:<3d} {variant:16s} {us:8.2f} µs  ok={ok}", flush=True)
    print()
    extra = sorted({r["variant"] for r in rows if r["variant"].startswith(("w4a4_n", "zip10_n", "w4a4_pf", "zip10_pf"))
                    and not r["variant"].startswith("zip10_n64w")}
                   | ({"zip0", "zip10_wide32"} & {r["variant"] for r in rows}))
    names = extra + ["w4a4", "w4a4_s2", "w4a4_s4", "w4a4_s8", "zip10", "zip10_tail", "zip10_tail_s2", "zip10_tail_s4",
             "zip10_tail_s8", "zip10_even", "zip10_dot", "zip10_par", "zip10_par_rows", "zip10_par_s2", "zip10_par_s4", "zip10_par_s8",
             "zip10_par_rows_s2", "zip10_par_rows_s4", "zip10_par_rows_s8", "zip10_par_silu", "zip10_par_gated",
             "zip10_par_rows_silu", "zip10_par_rows_gated", 
             "w4a4_silu", "w4a4_gated", "w4a4_swapdec", "zip10_swapdec",
             "zip10_even_par", "zip10_n64w4s4",
             "zip10_n64w4s3", "zip10_n64w8s3", "gemv", "gemv_zip10", "gemv_zip10_even"]
    print("| shape | M | " + " | ".join(f"{v} µs" for v in names) + " | zip10 / w4a4 | even / w4a4 | par / w4a4 |")
    print("|---|---|" + "---|" * (len(names) + 3))
    for name in shapes:
        for m in ms:
            t = {r["variant"]: r["us"] for r in rows if r["shape"] == name and r["m"] == m}
            cells = [f"{t[v]:.2f}" if v in t else "" for v in names]
            base = t.get("gemv") if m == 1 else t.get("w4a4")
            z = t.get("gemv_zip10") if m == 1 else t.get("zip10")
            ze = t.get("gemv_zip10_even") if m == 1 else t.get("zip10_even")
            print(f"| {name} | {m} | " + " | ".join(cells) + f" | {z / base:.3f} | {ze / base:.3f} |"
                  + (f" {t['zip10_par'] / base:.3f} |" if "zip10_par" in t else " |"))
    report_checks_and_write(rows, args.out, device)
    return 0


if __name__ == "__main__":
    # GEMMs timed back to back: without the decode step's PDL chain a GEMM never lets the next timed one start
    # early, so each time is one GEMM's
    with settings.use(pdl_chain="off"):
        raise SystemExit(main())
