"""How far apart runs of the same code land: the data behind the CI gate's threshold.

Reads several ``--benchmark-json`` files of the micro-benchmarks, all of one unchanged
checkout on one machine, and for every ordered pair of runs (A as baseline, B as the change)
and every benchmark takes the ratio ``B.min / A.min`` -- what the gate
``--benchmark-compare-fail=min:T%`` compares. It prints, per benchmark, the spread of the
minimum over the runs and the largest ratio seen, then how many (pair, benchmark) comparisons
a threshold of T% would have failed: the gate's false-alarm rate on unchanged code.

Usage (from the repository root):

    python benchmarks/micro/calibrate.py runs/*.json --threshold 25

Exit 0 when no comparison of unchanged code passes the threshold, 1 when some do (the
threshold is too tight for this machine), 2 on bad input.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path


def load_minima(path: Path) -> dict[str, float]:
    """``{benchmark fullname: min seconds}`` of one pytest-benchmark JSON file.

    Raises:
        ValueError: not a pytest-benchmark JSON file, or a benchmark without a positive min.
    """
    try:
        data = json.loads(path.read_text())
        benchmarks = data["benchmarks"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a pytest-benchmark JSON file ({type(exc).__name__}: {exc})") from None
    minima = {}
    for bench in benchmarks:
        value = bench.get("stats", {}).get("min")
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{path}: benchmark {bench.get('fullname')!r} has min={value!r}: a positive time is needed")
        minima[bench["fullname"]] = float(value)
    return minima


def pair_ratios(runs: list[dict[str, float]]) -> dict[str, list[float]]:
    """For each benchmark present in every run: ``B.min / A.min`` over all ordered pairs (A, B), A != B.

    Raises:
        ValueError: fewer than two runs, or runs that share no benchmark.
    """
    if len(runs) < 2:
        raise ValueError(f"{len(runs)} run(s) given: at least 2 are needed to form a pair")
    names = sorted(set.intersection(*(set(r) for r in runs)))
    if not names:
        raise ValueError("the runs share no benchmark")
    return {name: [b[name] / a[name] for a, b in itertools.permutations(runs, 2)] for name in names}


def false_alarms(ratios: dict[str, list[float]], threshold_pct: float) -> int:
    """How many (pair, benchmark) comparisons fail ``min:threshold_pct%`` (ratio above 1 + pct/100)."""
    limit = 1.0 + threshold_pct / 100.0
    return sum(r > limit for values in ratios.values() for r in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="pytest-benchmark JSON files of unchanged code")
    parser.add_argument("--threshold", type=float, required=True, help="the gate's threshold in percent, e.g. 25")
    args = parser.parse_args(argv)
    if args.threshold <= 0:
        print(f"error: --threshold={args.threshold} is not allowed: give a percentage above 0", file=sys.stderr)
        return 2
    try:
        runs = [load_minima(path) for path in args.runs]
        ratios = pair_ratios(runs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs, {len(runs) * (len(runs) - 1)} ordered pairs, {len(ratios)} benchmarks")
    print(f"{'benchmark':<44} {'min of mins ms':>14} {'max of mins ms':>14} {'max ratio':>9}")
    for name, values in ratios.items():
        mins = [run[name] * 1e3 for run in runs]
        print(f"{name.split('::')[-1]:<44} {min(mins):>14.3f} {max(mins):>14.3f} {max(values):>9.3f}")
    comparisons = sum(len(v) for v in ratios.values())
    worst = max(max(v) for v in ratios.values())
    alarms = false_alarms(ratios, args.threshold)
    print(f"largest ratio {worst:.3f}; min:{args.threshold:g}% fails {alarms} of {comparisons} comparisons "
          f"({alarms / comparisons:.1%}) of unchanged code")
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
