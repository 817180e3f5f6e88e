"""What a phase boundary costs at decode: separate kernels in a graph (plain, or chained by PDL) against one
persistent kernel whose programs meet at a grid barrier between phases.

A decode layer of a 4-bit method runs ~9 kernels a step (``benchmarks/NOTES.md`` v41: at batch 4 every kernel
moves the step by at least ~2 µs, and a GEMM call pays 5.5-9.4 µs beyond its bytes). A persistent decode layer
(one launch whose programs take the layer's GEMMs and small steps in turn, synchronising through a counter) would
trade each kernel boundary for a grid barrier, and could ask L2 for the next phase's weights before it waits there
(weights do not depend on the previous phase). This script measures that trade before such a layer is built.

The phases are int8 GEMVs whose weight bytes are those of a Llama-3-8B layer's packed 4-bit linears (q/k/v
6144 × 2048 bytes, o 4096 × 2048, gate/up 28672 × 2048, down 4096 × 7168), one layer after another, each layer
with its own weights (~109 MB a layer, far beyond L2). A phase reads the previous phase's int8 output (its first
K columns), multiplies it by its weights on the tensor cores (int8 ``tl.dot``, 16-token tiles, M real tokens), and
writes ``clamp(acc >> S, -8, 7)`` as int8. Weights and first activations are uniform on −7 … 7, and
``S = shift_for(K)`` keeps every phase's output spread over the 4-bit range (neither decaying to zeros nor
saturating). Every phase depends on the one before, as a layer's steps do. Every variant runs the same tile code
(``_phase_tiles``):

- ``sep``: a kernel a phase, grid = the phase's tiles;
- ``sep_pdl``: the same, launched with programmatic dependent launch: each kernel waits for its predecessor
  (``griddepcontrol.wait``), then lets its successor launch (the decode step's chain, ``_tl.chain_start(2)``);
- ``sep_pdl_pf``: as ``sep_pdl``, each program first asking L2 for its first tile's weights
  (``cp.async.bulk.prefetch.L2``) before it waits (as the chain's GEMMs ask L2 for their weights);
- ``pers_oN``: one kernel, ``N`` programs a SM (``--occ``), each taking tiles ``pid, pid + G, ...`` of a phase, then
  a grid barrier (an arrival counter: a release add, then acquire loads until every program of this barrier has
  arrived);
- ``pers_pf_oN``: as ``pers_oN``, each program asking L2 for its first tile of the next phase before it arrives.

Every variant's final and intermediate activations are checked bit for bit against a float64 reference first.
Times: the chain of ``--layers`` layers captured in a CUDA graph, replayed, medians of interleaved rounds; the
table gives µs a layer, the weight stream's rate, and the chain's time saved against ``sep_pdl`` ÷ its boundaries
(15 for 4 layers of 4 phases).

    PYTHONPATH=. python3 benchmarks/persistent_barrier.py [--m 4] [--layers 4] [--occ 1,2,4] [--rounds 5]
        [--out DIR]

GPU only (a grid barrier needs every program resident at once; the interpreter runs programs one by one).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

# (name, rows N, bytes a row K): the packed 4-bit bytes of Llama-3-8B's linears, as int8 GEMVs
LAYER = (("qkv", 6144, 2048), ("o", 4096, 2048), ("gate_up", 28672, 2048), ("down", 4096, 7168))
XS = max(n for _, n, _ in LAYER)  # row stride of every activation buffer
XS_C = tl.constexpr(XS)
# one bulk prefetch a program (its first thread), not one a thread
_BULK_PF = tl.constexpr("{\n.reg .pred p;\n.reg .u32 t;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
                        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}")


@triton.jit
def _prefetch_tile(w_ptr, t, K, BN: tl.constexpr):
    """Ask L2 for tile ``t``'s rows (``BN * K`` contiguous bytes) with one bulk prefetch."""
    addr = (w_ptr + t.to(tl.int64) * BN * K).to(tl.int64, bitcast=True)
    size = (BN * K).to(tl.int32)
    tl.inline_asm_elementwise(_BULK_PF, "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _phase_tiles(w_ptr, x_ptr, y_ptr, N, K, SHIFT, first, step,
                 BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """Tiles ``first, first + step, ...`` of ``y[:, :N] = clamp((x[:, :K] @ W^T) >> SHIFT, -8, 7)``, int8."""
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm = tl.arange(0, 16)
    for t in range(first, N // BN, step):
        w_row = w_ptr + (t * BN + rn).to(tl.int64)[:, None] * K + rk[None, :]
        x_col = x_ptr + rm[None, :] * XS_C + rk[:, None]
        acc = tl.zeros([BN, 16], dtype=tl.int32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            acc = tl.dot(tl.load(w_row + k), tl.load(x_col + k), acc, out_dtype=tl.int32)
        out = tl.minimum(tl.maximum(acc >> SHIFT, -8), 7).to(tl.int8)
        tl.store(y_ptr + rm[None, :] * XS_C + (t * BN + rn)[:, None], out)


@triton.jit
def _grid_barrier(bar_ptr, n_prog):
    """Every program of the grid waits here until all have arrived.

    ``bar_ptr[0]`` counts arrivals and only grows (no reset between launches): it must start at a multiple of the
    grid, which holds when a counter serves one grid size (``Chain.counter``). The CTA's threads sync, one thread
    adds with release semantics (the CTA's stores before it become visible to the GPU with it), then polls with
    acquire semantics; the threads sync again before reading others' stores. A poll that runs past ``2**18``
    rounds (programs not all resident) sets ``bar_ptr[1]`` and gives up rather than hang the GPU."""
    tl.debug_barrier()
    old = tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    target = (old // n_prog + 1) * n_prog
    cur = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (cur < target) & (spins < 262144):
        cur = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if cur < target:
        tl.atomic_xchg(bar_ptr + 1, 1)
    tl.debug_barrier()


@triton.jit
def _sep_kernel(w_ptr, x_ptr, y_ptr, N, K, SHIFT, PDL: tl.constexpr, PF: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    if PF:
        _prefetch_tile(w_ptr, pid, K, BN)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _phase_tiles(w_ptr, x_ptr, y_ptr, N, K, SHIFT, pid, tl.num_programs(0), BN, BK, STAGES)


@triton.jit
def _pers_kernel(w_ptr, x_ptr, meta_ptr, bar_ptr, n_phases, PF: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """Phases ``0 .. n_phases - 1``; ``meta_ptr``: per phase (weight byte offset, N, K, shift); activations ``p`` →
    ``p + 1``."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    for p in range(n_phases):
        # every offset, N and K are multiples of 1024 (Chain checks): the loads may be vectorised and pipelined as
        # the separate kernels' are (their arguments carry that divisibility)
        w_off = tl.multiple_of(tl.load(meta_ptr + 4 * p), 1024)
        n = tl.multiple_of(tl.load(meta_ptr + 4 * p + 1).to(tl.int32), 1024)
        k = tl.multiple_of(tl.load(meta_ptr + 4 * p + 2).to(tl.int32), 1024)
        shift = tl.load(meta_ptr + 4 * p + 3).to(tl.int32)
        x_p = x_ptr + p.to(tl.int64) * (16 * XS_C)
        _phase_tiles(w_ptr + w_off, x_p, x_p + 16 * XS_C, n, k, shift, pid, n_prog, BN, BK, STAGES)
        if p + 1 < n_phases:
            if PF:
                nw = tl.multiple_of(tl.load(meta_ptr + 4 * p + 4), 1024)
                nn = tl.load(meta_ptr + 4 * p + 5).to(tl.int32)
                nk = tl.multiple_of(tl.load(meta_ptr + 4 * p + 6).to(tl.int32), 1024)
                if pid < nn // BN:
                    _prefetch_tile(w_ptr + nw, pid, nk, BN)
            _grid_barrier(bar_ptr, n_prog)


def phases(layers: int, layer=LAYER) -> list[tuple[str, int, int]]:
    """``layers`` copies of ``layer``'s phases; each phase reads the first K columns of the one before's output."""
    out = [p for _ in range(layers) for p in layer]
    for (name, n, _), (next_name, _, k) in zip(out, out[1:]):
        if k > n:
            raise ValueError(f"phase {next_name} reads {k} columns, but {name} before it writes {n}")
    if max(n for _, n, _ in out) > XS:
        raise ValueError(f"a phase of more than {XS} rows does not fit the activation buffers")
    return out


def shift_for(k: int) -> int:
    """The right shift of ``x @ W^T`` over ``k`` products with weights uniform on −7 … 7 (std ~4.3): the largest
    that does not shrink the activations' spread (they grow by 1-2× a phase until the clamp holds them), so a chain
    of phases neither decays to zeros nor saturates."""
    return int(math.floor(math.log2(math.sqrt(k) * 4.32)))


def reference(x0: torch.Tensor, ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every phase's int8 output ``[16, N]``, in float64 (exact: |acc| < 2**53)."""
    outs, x = [], x0
    for w in ws:
        k = w.shape[1]
        acc = x[:, :k].double() @ w.double().t()
        x = torch.clamp(torch.floor(acc / 2 ** shift_for(k)), -8, 7).to(torch.int8)
        outs.append(x)
    return outs


class Chain:
    """The weights, activation buffers and launches of one configuration."""

    def __init__(self, m: int, layers: int, bn: int, bk: int, stages: int, device: torch.device, seed: int = 0,
                 layer=LAYER):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.phases = phases(layers, layer)
        for name, n, k in self.phases:
            if n % 1024 or k % 1024 or n % bn or k % bk:
                raise ValueError(f"phase {name} ({n} x {k}) must have N and K multiples of 1024, N of BN={bn} and K "
                                 f"of BK={bk}")
        self.bn, self.bk, self.stages = bn, bk, stages
        sizes = [n * k for _, n, k in self.phases]
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        self.w_all = torch.randint(-7, 8, (offsets[-1],), generator=g, dtype=torch.int8).to(device)
        self.ws = [self.w_all[o:o + s].view(n, k) for o, s, (_, n, k) in zip(offsets, sizes, self.phases)]
        self.meta = torch.tensor([v for o, (_, n, k) in zip(offsets, self.phases) for v in (o, n, k, shift_for(k))],
                                 dtype=torch.int64, device=device)
        self.x = torch.zeros(len(self.phases) + 1, 16, XS, dtype=torch.int8, device=device)
        x0 = torch.randint(-7, 8, (m, XS), generator=g, dtype=torch.int8)
        self.x[0, :m] = x0.to(device)
        self.counters: dict[int, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []
        self.weight_bytes = offsets[-1]

    def run_sep(self, pdl: bool, pf: bool) -> None:
        for p, (w, (_, n, k)) in enumerate(zip(self.ws, self.phases)):
            kw = {"launch_pdl": True} if pdl else {}
            _sep_kernel[(n // self.bn,)](w, self.x[p], self.x[p + 1], n, k, shift_for(k), PDL=pdl, PF=pf, BN=self.bn,
                                         BK=self.bk, STAGES=self.stages, num_warps=4, **kw)

    def counter(self, grid: int) -> torch.Tensor:
        """The barrier's arrival counter and failure flag for ``grid`` programs (zeroed once: launches of one grid size
        leave it at a multiple of the grid)."""
        if grid not in self.counters:
            self.counters[grid] = torch.zeros(2, dtype=torch.int32, device=self.x.device)
        return self.counters[grid]

    def run_pers(self, grid: int, pf: bool):
        return _pers_kernel[(grid,)](self.w_all, self.x, self.meta, self.counter(grid), len(self.phases), PF=pf,
                                     BN=self.bn, BK=self.bk, STAGES=self.stages, num_warps=4)

    def check(self, expect: list[torch.Tensor]) -> None:
        for grid, c in list(self.counters.items()):
            if c[1].item():
                self.retired.append(self.counters.pop(grid))  # kept alive: a captured graph may point at it
                raise AssertionError(f"the grid barrier of {grid} programs gave up: not every program was resident")
        for p, e in enumerate(expect):
            got = self.x[p + 1, :, :e.shape[1]]
            if not torch.equal(got, e):
                bad = (got != e).nonzero()[:4].tolist()
                raise AssertionError(f"phase {p} ({self.phases[p][0]}): output differs from the reference at {bad}")


def resident_programs(chain: Chain) -> tuple[int, int, int]:
    """Programs of ``_pers_kernel`` a SM can hold at once (registers rounded up to 8 a thread, shared memory, the
    thread limit), its registers a thread and its shared memory."""
    fn = chain.run_pers(1, False)  # compiles it; one program runs every phase
    torch.cuda.synchronize()
    props = torch.cuda.get_device_properties(0)
    threads = 4 * 32
    regs = -(-max(1, fn.n_regs) // 8) * 8
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs * threads)
    smem = max(1, fn.metadata.shared)
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (smem + 1024)
    return max(0, min(by_regs, by_smem, props.max_threads_per_multi_processor // threads)), fn.n_regs, smem


def graph_of(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_graph(g: torch.cuda.CUDAGraph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=4, help="real tokens (1-16)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--occ", default="1,2,4", help="persistent programs a SM to try (capped at what fits)")
    ap.add_argument("--tiles", default="16:512:4,32:256:4", help="BN:BK:STAGES configurations")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20, help="graph replays a timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("persistent_barrier.py needs a CUDA GPU (a grid barrier cannot run in the interpreter)")
        return 2
    if not 1 <= args.m <= 16:
        raise SystemExit(f"--m {args.m} is out of range: 1 to 16 tokens (one 16-row tile)")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, checks = [], 0
    for spec in args.tiles.split(","):
        bn, bk, stages = (int(v) for v in spec.split(":"))
        chain = Chain(args.m, args.layers, bn, bk, stages, dev)
        expect = reference(chain.x[0].clone(), chain.ws)
        fit, n_regs, smem = resident_programs(chain)
        variants = {"sep": lambda c=chain: c.run_sep(False, False),
                    "sep_pdl": lambda c=chain: c.run_sep(True, False),
                    "sep_pdl_pf": lambda c=chain: c.run_sep(True, True)}
        for occ in (int(v) for v in args.occ.split(",")):
            if occ > fit:
                print(f"BN={bn} BK={bk}: {occ} programs a SM do not fit (at most {fit}: {n_regs} registers a "
                      f"thread, {smem} bytes of shared memory); skipped")
                continue
            variants[f"pers_o{occ}"] = lambda c=chain, g=sms * occ: c.run_pers(g, False)
            variants[f"pers_pf_o{occ}"] = lambda c=chain, g=sms * occ: c.run_pers(g, True)
        graphs = {}
        print(f"BN={bn} BK={bk} stages={stages}: {fit} persistent programs a SM fit ({n_regs} registers a thread, "
              f"{smem} bytes of shared memory); variants {', '.join(variants)}", flush=True)
        for name, fn in list(variants.items()):
            chain.x[1:].fill_(99)  # poison every phase's output
            fn()
            torch.cuda.synchronize()
            try:
                chain.check(expect)
            except AssertionError as err:
                if not name.startswith("pers"):
                    raise
                print(f"  {name}: dropped ({err})", flush=True)  # a grid that is not all resident
                continue
            checks += 1
            graphs[name] = graph_of(fn)
            chain.x[1:].fill_(99)
            graphs[name].replay()
            torch.cuda.synchronize()
            chain.check(expect)  # the captured graph computes the same bits
            checks += 1
            print(f"  {name}: checked", flush=True)
        times = {name: [] for name in graphs}
        for _ in range(args.rounds):
            for name, g in graphs.items():
                times[name].append(time_graph(g, args.reps))
        n_layers = args.layers
        boundaries = len(chain.phases) - 1
        med = {name: statistics.median(v) for name, v in times.items()}
        for name, t in med.items():
            rows.append({"bn": bn, "bk": bk, "stages": stages, "variant": name, "us_chain": t,
                         "us_layer": t / n_layers, "tb_s": chain.weight_bytes / (t * 1e-6) / 1e12,
                         "spread": (max(times[name]) - min(times[name])) / t,
                         "vs_sep_pdl": med["sep_pdl"] / t,
                         "saved_per_boundary_us": (med["sep_pdl"] - t) / boundaries})
    print(f"\n{checks} checks passed (every phase's int8 output equal to the float64 reference, eager and graph)")
    print(f"M = {args.m}, {args.layers} layers of {len(LAYER)} phases, "
          f"{sum(n * k for _, n, k in LAYER) / 1e6:.1f} MB of weights a layer; {sms} SMs")
    print("| BN:BK:stages | variant | µs a layer | TB/s | spread | sep_pdl ÷ this "
          "| µs saved a boundary vs sep_pdl |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bn']}:{r['bk']}:{r['stages']} | {r['variant']} | {r['us_layer']:.1f} | {r['tb_s']:.2f} | "
              f"{100 * r['spread']:.1f}% | {r['vs_sep_pdl']:.3f} | {r['saved_per_boundary_us']:+.2f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from zipper import versions  # the versions every benchmark record carries (torch, triton, GPU, source)

        payload = {"versions": versions(dev), "args": vars(args), "rows": rows}
        (out / "persistent_barrier.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
