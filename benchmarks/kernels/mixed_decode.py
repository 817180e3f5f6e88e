"""Atom's mixed-precision decode kernels on the Llama-3-8B linears: the activation quantizer's programs a token and
the mixed GEMM's tiles, timed against RTN's 4-bit GEMM and BF16 cuBLAS in one run (GPU).

Atom's format: 128 salient channels at 8 bits, the rest 4-bit in groups of 128 (symmetric). For each linear and
each M the script times

- the activation quantizer (``mixed_act_quant_triton``) with a token's groups dealt over 1 program and over the
  ``chunks`` values of ``--chunks`` (``auto``: the default rule); each must give the 1-program bits;
- the quantizer then the GEMM, the pair a decode step runs;
- the mixed GEMM on its default tiles and on every tile of a grid (tile width, warps, stages, K split, groups a
  K step, 16q unpacking); each must match the reference;
- RTN's ``QuantLinear`` GEMM on the same shape (the same 4-bit bytes less Atom's group scales and 8-bit
  channels) and BF16 ``F.linear``.

Weights rotate through more than L2; medians of CUDA-graph replays.

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/mixed_decode.py --ms 4,16,32 --out OUT

Prints a table last: per linear and M, µs of BF16, RTN, the default mixed GEMM, the best grid tile (and which), and
the quantizer at 1 program a token against the default.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from zipper import MODELS, ROTATE_BYTES, check, measure_ceilings, time_calls, versions  # noqa: E402

from mosaicquant.errors import UserInputError  # noqa: E402
from mosaicquant.kernels.mixed_gemm import (  # noqa: E402
    MixedFormat,
    MixedTileConfig,
    act_quant_chunks,
    mixed_act_quant_triton,
    mixed_gemm_reference,
    mixed_gemm_triton,
    mixed_weights,
    pick_mixed_config,
)
from mosaicquant.kernels.quant_linear import QuantLinear  # noqa: E402
from mosaicquant.methods.format import PackedW4  # noqa: E402

N_HI = 128
GROUP = 128
ROTATE = ROTATE_BYTES  # --dry (CPU, Triton's interpreter): two copies of tiny shapes
DRY_LINEARS = {"qkv": (96, 512), "down": (64, 1024)}


def grid(spec: str) -> list[MixedTileConfig]:
    """The tiles of ``--grid`` (``block_n x warps x stages x split x groups a step x 16q unpacking`` lists,
    ``;``-separated)."""
    parts = [[int(v) for v in p.split(",")] for p in spec.split(";")]
    if len(parts) != 6:
        raise UserInputError(f"--grid={spec!r}: six ';'-separated lists (block_n; warps; stages; split; "
                             "groups_per_step; x16 0/1)")
    return [MixedTileConfig(16, bn, GROUP // 2, 64, num_warps=w, num_stages=s, split_k=sk, groups_per_step=g,
                            x16=bool(x)) for bn, w, s, sk, g, x in itertools.product(*parts)]


def label(cfg: MixedTileConfig) -> str:
    return (f"n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}k{cfg.split_k}g{cfg.groups_per_step}"
            f"{'x' if cfg.x16 else ''}")


def atom_format(k: int) -> MixedFormat:
    return MixedFormat(k_lo=k - N_HI, k_hi=N_HI, group_size=GROUP, lo_clip=0.9)


def weights_copies(n: int, fmt: MixedFormat, device, gen: torch.Generator) -> list:
    def ints(shape, lo, hi):
        return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int8)

    w = mixed_weights(ints((n, fmt.k_lo), -8, 7), (torch.rand(n, fmt.n_groups, generator=gen) * 0.05 + 0.01).half(),
                      ints((n, fmt.k_hi), -127, 127), torch.rand(n, generator=gen) * 0.004 + 0.001, fmt)
    w = type(w)(*(t.to(device) for t in w))
    nbytes = sum(t.numel() * t.element_size() for t in w)
    return [w] + [type(w)(*(t.clone() for t in w)) for _ in range(max(2, math.ceil(ROTATE / nbytes)) - 1)]


def bench(name: str, n: int, k: int, ms: list[int], chunk_opts: list, tiles: list[MixedTileConfig], device, rows):
    gen = torch.Generator().manual_seed(n + k)
    fmt = atom_format(k)
    ws = weights_copies(n, fmt, device, gen)
    perm = torch.randperm(k, generator=gen).to(device=device, dtype=torch.int32)
    w_bf = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    w_bfs = [w_bf] + [w_bf.clone() for _ in range(max(2, math.ceil(ROTATE / w_bf.numel() / 2)) - 1)]
    rtn = []
    for _ in range(max(2, math.ceil(ROTATE / (n * k // 2)))):
        qw = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        rtn.append(QuantLinear(PackedW4((n, k), qw, (torch.rand(n, 1, device=device) * 0.01 + 0.001).half())).to(device))
    for m in ms:
        x = (torch.randn(m, k, device=device) * 2).to(torch.bfloat16)
        row = {"layer": name, "n": n, "k": k, "m": m}
        us, _, _ = time_calls([lambda w=w: F.linear(x, w) for w in w_bfs])
        row["bf16_us"] = us
        us, _, _ = time_calls([lambda q=q: q(x) for q in rtn])
        row["rtn_us"] = us
        # the quantizer: 1 program a token is the reference bits; each chunking must match them
        one = mixed_act_quant_triton(x, fmt, perm, chunks=1)
        row["quant_us"] = {}
        for c in chunk_opts:
            chunks = act_quant_chunks(m, fmt.n_groups, device) if c == "auto" else int(c)
            got = mixed_act_quant_triton(x, fmt, perm, chunks=chunks)
            same = all(a is None and b is None or torch.equal(a, b) for a, b in zip(got, one))
            us, _, _ = time_calls([lambda chunks=chunks: mixed_act_quant_triton(x, fmt, perm, chunks=chunks)])
            row["quant_us"][f"{c}" if c != "auto" else f"auto({chunks})"] = us
            row.setdefault("quant_bits_ok", True)
            row["quant_bits_ok"] &= same
        # the pair a decode step runs: the quantizer, then the GEMM on its default tiles
        row["pair_us"], _, _ = time_calls([lambda w=w: mixed_gemm_triton(mixed_act_quant_triton(x, fmt, perm), w, fmt)
                                           for w in ws])
        acts = one
        ref = mixed_gemm_reference(acts, ws[0], fmt, out_fp32=True)
        default = pick_mixed_config(m, n, fmt, device)
        results = {}
        for cfg in [default] + tiles:
            key = label(cfg)
            if key in results:
                continue
            try:
                ok, _ = check(mixed_gemm_triton(acts, ws[0], fmt, config=cfg), ref)
                us, _, _ = time_calls([lambda w=w, cfg=cfg: mixed_gemm_triton(acts, w, fmt, config=cfg) for w in ws])
            except Exception as exc:  # a tile the device cannot run (shared memory, registers): recorded as failed
                results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
                continue
            results[key] = {"us": us, "ok": ok}
        row["default"] = label(default)
        row["gemm"] = results
        rows.append(row)
        good = {key: r["us"] for key, r in results.items() if r.get("ok")}
        best = min(good, key=good.get) if good else None
        print(f"{name} M={m}: bf16 {row['bf16_us']:.2f} rtn {row['rtn_us']:.2f} mixed default {row['default']} "
              f"{results[row['default']].get('us', float('nan')):.2f} best {best} {good.get(best, float('nan')):.2f}; "
              f"quant {row['quant_us']} bits {'ok' if row['quant_bits_ok'] else 'DIFFER'}; pair {row['pair_us']:.2f}",
              flush=True)
        print("  fastest: " + ", ".join(f"{key} {good[key]:.2f}" for key in sorted(good, key=good.get)[:6]), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="4,16,32")
    parser.add_argument("--layers", default="qkv,o,gate_up,down")
    parser.add_argument("--chunks", default="1,2,4,8,16,auto")
    parser.add_argument("--grid", default="32,64,128;4;3,6;1,2,4;1,2;0,1")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): the script runs")
    args = parser.parse_args(argv)
    global ROTATE
    device = torch.device("cpu" if args.dry else "cuda")
    if args.dry:
        ROTATE = 0
    ms = [int(v) for v in args.ms.split(",")]
    chunk_opts = [c for c in args.chunks.split(",") if c]
    tiles = grid(args.grid)
    linears = DRY_LINEARS if args.dry else MODELS["llama3-8b"]
    rows: list[dict] = []
    ceilings = measure_ceilings(device)
    print(f"ceilings: {ceilings}", flush=True)
    for name in [v for v in args.layers.split(",") if v in linears]:
        n, k = linears[name]
        bench(name, n, k, ms, chunk_opts, tiles, device, rows)
        if args.out:  # after each linear: a run cut off keeps what it finished
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results.json").write_text(json.dumps({"versions": versions(device), "ceilings": ceilings,
                                                               "rows": rows}, indent=1))
    print("\n| layer | M | BF16 us | RTN us | mixed default | best tile | best us | quant 1 prog | quant default "
          "| pair |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        good = {key: g["us"] for key, g in r["gemm"].items() if g.get("ok")}
        best = min(good, key=good.get)
        auto = next(v for key, v in r["quant_us"].items() if key.startswith("auto"))
        print(f"| {r['layer']} | {r['m']} | {r['bf16_us']:.2f} | {r['rtn_us']:.2f} | {r['default']} "
              f"{r['gemm'][r['default']].get('us', float('nan')):.2f} | {best} | {good[best]:.2f} | "
              f"{r['quant_us'].get('1', float('nan')):.2f} | {auto:.2f} | {r['pair_us']:.2f} |")
    bad = [r for r in rows if not r["quant_bits_ok"] or any(not g.get("ok", True) for g in r["gemm"].values())]
    print(f"checks: {'all passed' if not bad else f'{len(bad)} rows with a failed check'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
