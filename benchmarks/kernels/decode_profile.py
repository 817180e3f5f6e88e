"""Where a decode step's time goes, per method and decoder runtime (GPU).

For each method on a random-weight shape model: the step time as the throughput suite
measures it (CUDA graph, median), then the same step run eagerly under the PyTorch profiler,
its GPU kernels summed by category (µs per step): the 4-bit GEMMs, activation quantization
(with the fused online Hadamard), the norm fused with the quantizer, BF16 GEMMs (cuBLAS: the
BF16 linears, the output head), attention, norms, RoPE + KV write, SiLU·mul, and everything
else. ``graph - kernels`` is what the graph still spends between kernels.

Runtimes (``--runtimes``): ``fused`` (the default fused decoder), ``fused_nq`` (its quantizers
as kernels of their own), ``fused_sh`` / ``fused_nsh`` (SiLU·mul inside ``down_proj``'s fused
online Hadamard + quantizer, or in a kernel of its own), ``transformers`` (eager).

Variants (``--variant LABEL:VAR=VALUE[,VAR=VALUE]``, repeatable): kernel settings the kernels
read at launch (fields of :class:`mosaicquant.settings.KernelSettings`, e.g. ``pdl_chain``,
``prefetch_mib``, ``pdl=false``) or entries of the tile table (``silu_in_gate_up=false``), each
timed on the same model right after the others (``--rounds`` times, interleaved); the row's
runtime reads ``fused[LABEL]``. With programmatic dependent launch a kernel's programs may start
before its predecessor ends and wait, so the profiler's per-kernel times then include waiting:
compare graph steps across variants, categories within one.

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/decode_profile.py --out OUT \\
        --model llama-3-8b-shapes --methods fp16,rtn,quarot,mosaicquant --batches 4,32
    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/decode_profile.py --out OUT --runtimes fused \\
        --variant off:pdl_chain=off --variant on:pdl_chain=on --rounds 2

``--timeline`` also profiles replays of the captured step: per kernel its duration and its
*increment* (how far it moves the step's end; the increments sum to the step), by kernel name and
for one decoder layer in order (medians over the layers). Unlike the eager profile, this is the
graph's own schedule, with programmatic dependent launch overlapping neighbours:

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/decode_profile.py --out OUT --methods quarot,mosaicquant \
        --batches 4,32 --runtimes fused --no-profile --timeline

``--prefill LEN`` profiles a prefill of one ``LEN``-token sequence instead of the decode steps (the
throughput suite's prefill: its graph median, then the same kernels by category), e.g. to see where a
model's prefill ratio goes:

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/decode_profile.py --out OUT --model qwen3-14b-shapes \
        --methods fp16,quarot,mosaicquant --runtimes fused --prefill 2048

Methods take their options as on the command line (``--methods quarot:kvbits=16,quarot`` times QuaRot
with a 16-bit and with its default 4-bit KV cache).

Writes ``OUT/decode_profile.json`` (every kernel name with its category and µs per step; with
``--timeline`` each row's kernels in order) and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from mosaicquant import settings  # noqa: E402
from mosaicquant.harness.context import QuantContext  # noqa: E402
from mosaicquant.harness.spec import parse_plugin_spec  # noqa: E402
from mosaicquant.harness.results import source_fingerprint  # noqa: E402
from mosaicquant.harness.runtime import FusedDecoder  # noqa: E402
from mosaicquant.harness.shapes import build_shape_model  # noqa: E402
from mosaicquant.harness.speedforms import executable, speed_form  # noqa: E402
from mosaicquant.harness.suites.speed import decode_step, fused_decode_step  # noqa: E402
from mosaicquant.harness.timing import time_calls  # noqa: E402

CATEGORIES = (
    ("w4a4 gemm", r"_w4a4_gemm_kernel|_w4a4_swapped_kernel|_zipper_kernel|_zipper_parallel_kernel|_gemv_kernel|_residual_add_kernel|_mixed_gemm"),
    ("act-quant", r"_act_quant_kernel|_hadamard_quant_kernel|_mixed_act_quant"),
    ("attention", r"_attn_|flash|fmha|attention|softmax"),
    ("norm+quant", r"_rmsnorm_quant_kernel"),
    ("norm", r"_rmsnorm_kernel"),
    ("rope+kv", r"_rope_kv_kernel"),
    ("silu*mul", r"_silu_mul_kernel"),
    ("bf16 gemm", r"gemm|nvjet|cutlass|sm90_xmma|ampere|cublas"),
)


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other"


def profile_step(step, steps: int = 5) -> dict[str, float]:
    """µs per step of every GPU kernel the eager step runs."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name] += evt.device_time / steps
    return dict(per_kernel)


def graph_timeline(step, replays: int = 5) -> list[dict]:
    """The step captured in a CUDA graph and replayed under the profiler: per kernel of the step (in
    launch order, median over ``replays``), its duration and its *increment*, the µs by which it moves
    the step's end (its end minus the latest end of the kernels that started before it; the
    increments sum to the step's span). With programmatic dependent launch a kernel's duration
    includes its wait; its increment does not double-count."""
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    runs = []
    for _ in range(replays):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda t: t[0])
        latest, run = None, []
        for start, end, name in kernels:
            inc = end - start if latest is None else max(0.0, end - latest)
            latest = end if latest is None else max(latest, end)
            run.append((name, end - start, inc))
        runs.append(run)
    n = min(len(r) for r in runs)
    out = []
    for i in range(n):
        durs = sorted(r[i][1] for r in runs)
        incs = sorted(r[i][2] for r in runs)
        out.append({"name": runs[0][i][0], "category": category(runs[0][i][0]),
                    "us": durs[len(durs) // 2], "increment_us": incs[len(incs) // 2]})
    return out


def summarize_timeline(timeline: list[dict]) -> list[tuple[str, int, float, float]]:
    """``(kernel, calls, µs of duration, µs of increment)`` per kernel name, largest increment first."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for k in timeline:
        a = acc[k["name"]]
        a[0] += 1
        a[1] += k["us"]
        a[2] += k["increment_us"]
    return sorted(((n, int(a[0]), a[1], a[2]) for n, a in acc.items()), key=lambda t: -t[3])


def layer_slots(timeline: list[dict]) -> list[tuple[str, float, float]]:
    """One decoder layer's kernels in order, ``(name, µs, increment µs)`` as medians over the layers: the
    period is the shortest that repeats the kernel names best (a layer's run of kernels)."""
    names = [k["name"] for k in timeline]
    n = len(names)
    if n < 8:
        return []
    best, period = -1.0, 0
    for p in range(2, min(40, n // 3) + 1):
        match = sum(names[i] == names[i + p] for i in range(n - p)) / (n - p)
        if match > best + 1e-9:
            best, period = match, p
    mid = n // 2
    slots = []
    for j in range(period):
        idx = [mid + j + k * period for k in range(-(mid // period) + 1, (n - mid) // period)
               if 0 <= mid + j + k * period < n and names[mid + j + k * period] == names[mid + j]]
        durs = sorted(timeline[i]["us"] for i in idx)
        incs = sorted(timeline[i]["increment_us"] for i in idx)
        slots.append((names[mid + j], durs[len(durs) // 2], incs[len(incs) // 2]))
    return slots


def prefill_call(decoder: FusedDecoder, length: int):
    """A closure running the decoder's prefill of one ``length``-token sequence of random ids (static inputs,
    as graph capture needs; the last position's logits, as the throughput suite measures it)."""
    ids = torch.randint(0, decoder.embed.num_embeddings, (1, length), device=decoder.device)

    def call():
        decoder.prefill(ids)
    return call


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``LABEL:VAR=VALUE[,VAR=VALUE]`` → ``(label, {VAR: VALUE})``."""
    label, sep, rest = text.partition(":")
    env = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var.strip():
            raise SystemExit(f"--variant {text!r}: expected LABEL:VAR=VALUE[,VAR=VALUE]")
        env[var.strip()] = value.strip()
    if not label.strip() or (sep and not env):
        raise SystemExit(f"--variant {text!r}: expected LABEL:VAR=VALUE[,VAR=VALUE]")
    return label.strip(), env


class _Env:
    """Kernel settings (``KernelSettings`` fields) and tile-table entries (``TileTable`` fields) in force for a
    ``with`` block; the ones before come back after.

    Raises:
        SystemExit: a name that is neither, with the allowed names.
        UserInputError: a value the settings refuse (naming it and the allowed values).
    """

    def __init__(self, env: dict[str, str]):
        import dataclasses

        from mosaicquant.kernels.tile_table import TileTable

        fields = {f.name for f in dataclasses.fields(settings.KernelSettings)}
        entries = {f.name for f in dataclasses.fields(TileTable)}
        unknown = sorted(set(env) - fields - entries)
        if unknown:
            raise SystemExit(f"--variant: unknown {unknown}; allowed: kernel settings {sorted(fields)} "
                             f"and tile-table entries {sorted(entries)}")
        self.chosen = settings.use(**{k: v for k, v in env.items() if k in fields})
        self.tiles = settings.use_tiles(**{k: v for k, v in env.items() if k in entries and k not in fields})

    def __enter__(self):
        self.chosen.__enter__()
        self.tiles.__enter__()

    def __exit__(self, *exc):
        self.tiles.__exit__(*exc)
        self.chosen.__exit__(*exc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3-8b-shapes")
    ap.add_argument("--methods", default="fp16,rtn,quarot,mosaicquant")
    ap.add_argument("--batches", default="4,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--runtimes", default="fused,fused_nq,transformers",
                    help="fused, fused_nq (the activation quantizers as kernels of their own, not inside the "
                         "norm and the SiLU*mul), transformers")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:VAR=VALUE[,VAR=VALUE]: environment for the kernels' launches (repeatable)")
    ap.add_argument("--rounds", type=int, default=1, help="times each variant is timed, interleaved")
    ap.add_argument("--no-profile", action="store_true", help="graph steps only (no profiler pass)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="profile a prefill of this many tokens (one sequence) instead of the decode steps")
    ap.add_argument("--timeline", action="store_true",
                    help="also profile graph replays: each kernel's duration and increment of the step's end")
    args = ap.parse_args()
    if args.prefill < 0:
        raise SystemExit(f"--prefill {args.prefill}: expected a token count >= 1 (0: decode steps)")
    fused = ("fused", "fused_nq", "fused_sh", "fused_nsh")
    if args.prefill and any(r not in fused for r in args.runtimes.split(",")):
        raise SystemExit(f"--prefill runs on the fused decoder's runtimes only, not {args.runtimes!r}")
    variants = [parse_variant(v) for v in args.variant] or [("", {})]
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    rows, records = [], []
    for item in args.methods.split(","):
        spec = parse_plugin_spec(item, "method")  # options as on the command line: quarot:kvbits=16
        method = spec.label
        torch.manual_seed(0)
        model = build_shape_model(args.model, dtype=torch.bfloat16, device=device)
        ctx = QuantContext(calibration=lambda: None, seed=0, device=device)
        speed_form(spec.name, model, spec.config if spec.name != "fp16" else None, ctx)
        executable(model, ctx.info)
        decoders = {"fused": FusedDecoder(model), "fused_nq": FusedDecoder(model, fuse_quant=False),
                    "fused_sh": FusedDecoder(model, silu_in_hadamard=True),
                    "fused_nsh": FusedDecoder(model, silu_in_hadamard=False)}
        for runtime in args.runtimes.split(","):
            if runtime in ("fused_nq", "fused_sh", "fused_nsh") and spec.name == "fp16":
                continue  # nothing to quantize
            for b in ([args.prefill] if args.prefill else [int(x) for x in args.batches.split(",")]):
                steps, times = {}, defaultdict(list)
                for _ in range(max(1, args.rounds)):
                    for label, env in variants:
                        with _Env(env), torch.no_grad():
                            if label not in steps:
                                steps[label] = (prefill_call(decoders[runtime], b) if args.prefill else
                                                fused_decode_step(decoders[runtime], b, args.context)
                                                if runtime in decoders else decode_step(model, b, args.context, device))
                            times[label].append(time_calls([steps[label]], min_us=50_000.0, replays=11).median_us)
                for label, env in variants:
                    with _Env(env), torch.no_grad():
                        kernels = {} if args.no_profile else profile_step(steps[label])
                        timeline = graph_timeline(steps[label]) if args.timeline else []
                    graph_us = sorted(times[label])[len(times[label]) // 2]
                    name = f"{runtime}[{label}]" if label else runtime
                    by_cat: dict[str, float] = defaultdict(float)
                    for kname, us in kernels.items():
                        by_cat[category(kname)] += us
                    total = sum(kernels.values())
                    rows.append((method, name, b, graph_us, total, len(kernels), dict(by_cat)))
                    records.append({"method": method, "runtime": name, "variant_env": env,
                                    **({"prefill_tokens": b} if args.prefill else {"batch": b, "context": args.context}),
                                    "graph_step_us": graph_us,
                                    "graph_step_us_rounds": times[label], "kernel_sum_us": total,
                                    "categories_us": dict(by_cat),
                                    "kernels": [{"name": n, "category": category(n), "us_per_step": us}
                                                for n, us in sorted(kernels.items(), key=lambda kv: -kv[1])],
                                    "timeline": timeline})
                    if timeline:
                        span = sum(k["increment_us"] for k in timeline)
                        print(f"  graph replay timeline: {len(timeline)} kernels, span {span:.0f} us; "
                              "kernel | calls | duration us | increment us (per step)")
                        for kname, calls, dur, inc in summarize_timeline(timeline)[:14]:
                            print(f"  {kname[:60]} | {calls} | {dur:.0f} | {inc:.0f}")
                        print("  one layer (medians over layers): kernel | duration us | increment us")
                        for kname, dur, inc in layer_slots(timeline):
                            print(f"  {kname[:60]} | {dur:.2f} | {inc:.2f}")
                    print(f"{method} {name} {'prefill ' if args.prefill else 'b'}{b}: graph {graph_us:.0f} us "
                          f"(rounds {', '.join(f'{t:.0f}' for t in times[label])}), kernels {total:.0f} us", flush=True)
                del steps
        del model, decoders
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "decode_profile.json"), "w") as f:
        json.dump({"model": args.model, "mode": f"prefill {args.prefill}" if args.prefill else "decode",
                   "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                   "source_sha256": source_fingerprint(), "rows": records}, f, indent=1)
    cats = [c for c, _ in CATEGORIES] + ["other"]
    what = (f"µs per prefill of {args.prefill} tokens" if args.prefill
            else f"context {args.context}: µs per decode step")
    print(f"\n{args.model}, {what} (graph median; kernel sums from the profiler)")
    print(f"| method | runtime | {'tokens' if args.prefill else 'B'} | graph | kernels | " + " | ".join(cats) + " |")
    print("|---" * (5 + len(cats)) + "|")
    for method, runtime, b, graph_us, total, _, by_cat in rows:
        print(f"| {method} | {runtime} | {b} | {graph_us:.0f} | {total:.0f} | "
              + " | ".join(f"{by_cat.get(c, 0.0):.0f}" for c in cats) + " |")


if __name__ == "__main__":
    main()
