"""Bytes in flight of the packed decode tiles: their pipelining depth and K step, timed on the Llama-3-8B linears (GPU).

BF16 cuBLAS streams gate/up's weights at ~4.1 TB/s at 4 tokens (nvjet tiles 128 x 8, twelve 64-value stages: ~190 KB
of weights in flight a CTA), the 4-bit packed kernel at ~3.2 TB/s (the wide tiles: 16 KB a step, 3 stages). This
script times ``QuantLinear`` (BF16 in, BF16 out, activation quantizer included) on each Llama-3-8B linear, dense and
with 10 % random 128 x 128 kept blocks (ZipperEngine), at decode sizes, for variants of the module constants that set
those tiles (the tile table's ``wide_decode_stages``, ``wide_decode_block_kp``, ``decode_stages``). The variants change where
the bytes wait, not the arithmetic: each variant's output must equal the default's bit for bit, and the default's
must match the PyTorch reference. Weights are rotated through more than L2; medians of interleaved rounds.

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/decode_depth.py --ms 4,8,16,32 --rounds 3 --out OUT

Prints a table last: µs per variant and each variant's time ÷ the default's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from zipper import MODELS, ROTATE_BYTES, check, random_residual, time_calls  # noqa: E402

from mosaicquant import settings  # noqa: E402
from mosaicquant.kernels.act_quant import quantize_activations_reference  # noqa: E402
from mosaicquant.kernels.quant_linear import QuantLinear  # noqa: E402
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_reference  # noqa: E402
from mosaicquant.kernels.zipper import zipper_gemm_reference  # noqa: E402
from mosaicquant.methods.format import PackedW4  # noqa: E402

BUDGET = 0.10
# label -> the tile-table entries it sets (the others keep their defaults)
VARIANTS = {
    "base": {},
    "ws4": {"tiles": {"wide_decode_stages": 4}},
    "ws5": {"tiles": {"wide_decode_stages": 5}},
    "wkp256": {"tiles": {"wide_decode_block_kp": 256}},
    "wkp256s4": {"tiles": {"wide_decode_block_kp": 256, "wide_decode_stages": 4}},
    "ds3": {"tiles": {"decode_stages": 3}},
    "ds6": {"tiles": {"decode_stages": 6}},
}


@contextlib.contextmanager
def variant(label: str):
    """The variant's tile entries and kernel settings in force for a block; the defaults after."""
    with settings.use(**VARIANTS[label]):
        yield


def layers(n: int, k: int, device, gen: torch.Generator) -> list[dict[str, QuantLinear]]:
    """Copies (more than L2 together) of one random base, without and with a random 10 % residual."""
    out = []
    for _ in range(max(2, math.ceil(ROTATE_BYTES / (n * k // 2 * 1.1)))):
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        w_scale = (torch.rand(n, device=device) * 0.01 + 0.001).to(torch.float16)
        res = random_residual(n, k, BUDGET, device, gen, w_scale=w_scale)
        out.append({"dense": QuantLinear(PackedW4((n, k), qweight, w_scale.unsqueeze(1))).to(device),
                    "zip10": QuantLinear(PackedW4((n, k), qweight, w_scale.unsqueeze(1), residual=res)).to(device)})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="4,8,16,32")
    parser.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    labels = [v for v in args.variants.split(",") if v]
    unknown = [v for v in labels if v not in VARIANTS]
    if unknown or "base" not in labels:
        parser.error(f"--variants {args.variants!r}: must include 'base' and name only {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        print("decode_depth.py times GPU kernels: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    rows, table = [], []
    for name, (n, k) in MODELS[args.model].items():
        qls = layers(n, k, device, gen)
        for m in (int(v) for v in args.ms.split(",")):
            x = (torch.randn(m, k) * 2).to(torch.bfloat16)
            a_p, a_s = quantize_activations_reference(x)
            x = x.to(device)
            for kind in ("dense", "zip10"):
                ql = qls[0][kind]
                ref = (w4a4_gemm_reference(a_p, a_s, ql.qweight.cpu(), ql.w_scale.cpu(), k, out_fp32=True)
                       if ql.residual is None else
                       zipper_gemm_reference(a_p, a_s, ql.qweight.cpu(), ql.w_scale.cpu(), k, ql.residual.to("cpu"),
                                             out_fp32=True))
                base_out = ql(x)
                base_ok = check(base_out.cpu(), ref)[0]
                times = {v: [] for v in labels}
                ok = {}
                for rnd in range(args.rounds):
                    for v in labels:
                        with variant(v):
                            if rnd == 0:
                                out = ql(x)
                                ok[v] = base_ok and torch.equal(out, base_out)
                            us = time_calls([lambda q=q[kind]: q(x) for q in qls])[0]
                        times[v].append(us)
                        rows.append(dict(layer=name, n=n, k=k, m=m, kind=kind, variant=v, round=rnd, us=us,
                                         ok=ok[v]))
                med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
                table.append((name, m, kind, med))
                print(f"{name:8s} M={m:3d} {kind:5s}: " + "  ".join(f"{v} {u:.2f}{'' if ok[v] else '!'}"
                                                                      for v, u in med.items()), flush=True)
                if args.out is not None:
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    checked = [r for r in rows if r["round"] == 0]  # one check a variant, layer, M and kind (the rounds repeat it)
    failed = [r for r in checked if not r["ok"]]
    print(f"checks: {len(checked) - len(failed)} ok, {len(failed)} FAILED")
    others = [v for v in labels if v != "base"]
    print("| layer | M | kind | base µs | " + " | ".join(f"{v} ÷ base" for v in others) + " |")
    for name, m, kind, med in table:
        print(f"| {name} | {m} | {kind} | {med['base']:.2f} | "
              + " | ".join(f"{med[v] / med['base']:.3f}" for v in others) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
