"""GPU timing the way the speed suites and ``benchmarks/`` measure: CUDA graphs, medians, spread.

:func:`time_calls` times a list of closures called in turn (e.g. one per layer, so the
weights rotate through more memory than the L2 cache holds, as in a real forward pass):
it warms them up on a side stream, captures enough of them back to back in one CUDA
graph to last ``min_us``, replays the graph ``replays`` times and returns the median time
per call with its spread. Launch overhead is excluded, as in decoding under CUDA graphs.
Without a GPU it falls back to wall-clock timing of one pass (only for plumbing tests:
CPU numbers are never reported as speed).

A capture that fails (a call that synchronises with the host, say) raises
:class:`CaptureFailed` and leaves the process usable: PyTorch ends a failed capture without
taking the CUDA generators out of capture mode, after which every random op of the process
fails ("Offset increment outside graph capture"), so :func:`time_calls` puts a copy of each
generator's state taken before the capture back in place.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Timing", "CaptureFailed", "time_calls", "half_iqr"]


@dataclass(frozen=True)
class Timing:
    """What :func:`time_calls` measured.

    Attributes:
        median_us: median µs per call over the replays.
        spread_us: half the interquartile range, µs.
        how: ``"cudagraph"``, ``"cuda-events"`` or ``"cpu-wall"``.
        calls: calls made inside the timed replays (for per-call energy).
        window: telemetry of the window after the timed replays, when a :class:`Telemetry` was passed.
        window_calls: calls run inside that window.
    """

    median_us: float
    spread_us: float
    how: str
    calls: int = 0
    window: object = None
    window_calls: int = 0


class CaptureFailed(RuntimeError):
    """The timed calls could not be captured in a CUDA graph (the process stays usable)."""


def _generators() -> list:
    return [torch.cuda.default_generators[i] for i in range(torch.cuda.device_count())]


def capture_graph(seq: Sequence[Callable[[], object]]):
    """A CUDA graph of ``seq`` called in order.

    Raises:
        CaptureFailed: the capture failed; the CUDA generators' states from before it are back in
            place, so later captures and random ops of the process run.
    """
    generators = _generators()
    saved = [g.clone_state() for g in generators]
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for c in seq:
                c()
    except Exception as exc:
        for generator, state in zip(generators, saved):
            generator.graphsafe_set_state(state)
        del graph
        torch.cuda.synchronize()
        raise CaptureFailed(
            f"CUDA graph capture of the timed calls failed ({type(exc).__name__}: {str(exc).strip()[:300]}); "
            "the step does something a capture does not allow (a host synchronisation, a host-to-device copy); "
            "time it without graphs (throughput:cuda_graphs=false)") from exc
    return graph


def half_iqr(values: Sequence[float]) -> float:
    """Half the interquartile range (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / 2


def time_calls(calls: Sequence[Callable[[], object]], min_us: float = 400.0, replays: int = 15,
               graphs: bool = True, telemetry=None, telemetry_s: float = 2.0) -> Timing:
    """Median µs per call of ``calls`` (closures cycled in order).

    Args:
        calls: closures with static inputs and outputs (graph capture replays them as captured).
        min_us: a captured sequence lasts at least this long (repeats ``calls`` up to 64 times).
        replays: timed replays; the median and spread are over these.
        graphs: capture a CUDA graph (else time eager launches with CUDA events).
        telemetry: a :class:`mosaicquant.harness.telemetry.Telemetry`; after the timed replays the
            sequence is replayed for at least ``telemetry_s`` seconds inside one telemetry window
            (NVML's energy counter moves in steps of tens of ms: a sub-second window is noise).
        telemetry_s: length of that window.
    """
    calls = list(calls)
    if not calls:
        raise ValueError("time_calls needs at least one call")
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for c in calls:
            c()
        return Timing((time.perf_counter() - t0) / len(calls) * 1e6, 0.0, "cpu-wall", len(calls))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        c()
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end) * 1e3 / len(calls)
    reps = max(1, math.ceil(min_us / max(est, 1e-3) / len(calls)))
    seq = calls * min(reps, 64)
    graph = None
    if graphs:
        graph = capture_graph(seq)
        graph.replay()
        torch.cuda.synchronize()

    def run():
        if graph is not None:
            graph.replay()
        else:
            for c in seq:
                c()

    times = []
    for _ in range(replays):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(seq))
    window, window_calls = None, 0
    if telemetry is not None:
        torch.cuda.synchronize()
        opened = telemetry.start()
        t0 = time.perf_counter()
        runs = 0
        while True:
            run()
            runs += 1
            torch.cuda.synchronize()
            if time.perf_counter() - t0 >= telemetry_s:
                break
        window = telemetry.stop(opened, time.perf_counter() - t0)
        window_calls = runs * len(seq)
    return Timing(statistics.median(times), half_iqr(times), "cudagraph" if graphs else "cuda-events",
                  replays * len(seq), window, window_calls)
