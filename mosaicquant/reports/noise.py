"""Seed-to-seed uncertainty of the accuracy comparison, per test corpus, from records only.

A method's perplexity depends on its calibration seed (the calibration windows drawn, the random
rotation, ...). With the same method run at several seeds on the same test text, this module shows
for each (model, test corpus, suite configuration, method label) the mean over the ``ok`` seeds,
the sample standard deviation across them (``n - 1`` in the denominator), the range, and which
other methods are **within noise** of it.

Within noise, defined: two methods are within noise of each other when a two-sided Welch t-test at
level :data:`NOISE_ALPHA` (5%) on their per-seed values does not reject equal means, i.e. its
p-value is at least 0.05. Welch's test is used since the methods' spreads differ by orders of
magnitude (a deterministic method has none, a collapsed one thousands). It needs
:data:`MIN_SEEDS` (3) seeds on both sides; with fewer, the pair is shown as not tested, never
guessed. Two methods without any spread (both deterministic in the seed) are within noise only when
their values are equal. With three seeds the test is weak: "within noise" says the seeds cannot
tell the methods apart, not that they are equal. Only the calibration seed varies here; the test
text is fixed, so a second corpus is what shows how much a ranking depends on the text.

The p-value comes from Student's t distribution with the Welch–Satterthwaite degrees of freedom,
through the regularized incomplete beta function (:func:`student_t_two_sided_p`), so no
statistics package is needed.

Example:
    >>> welch_test([13.9, 13.9, 13.9], [25.1, 24.3, 26.0]).p < NOISE_ALPHA
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from mosaicquant.reports.cells import format_number, natural_key
from mosaicquant.reports.markdown import render_markdown

__all__ = ["NOISE_ALPHA", "MIN_SEEDS", "SeedSpread", "WelchResult", "student_t_two_sided_p", "welch_test",
           "seed_spreads", "within_noise", "noise_table", "noise_section"]

#: level of the two-sided Welch t-test that decides "within noise"
NOISE_ALPHA = 0.05
#: seeds each of two methods needs before they are tested
MIN_SEEDS = 3
#: the suite and metric the section compares
SUITE = "accuracy"
METRIC = "ppl"
# continued-fraction evaluation of the incomplete beta function: terms and relative accuracy
_BETA_TERMS = 300
_BETA_EPS = 1e-14
_TINY = 1e-300


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of ``I_x(a, b)`` (modified Lentz), accurate for ``x < (a + 1) / (a + b + 2)``."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    result = d
    for m in range(1, _BETA_TERMS + 1):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            result *= c * d
        if abs(c * d - 1.0) < _BETA_EPS:
            break
    return result


def _regularized_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)``, the regularized incomplete beta function, for ``0 <= x <= 1``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    # the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction in its fast-converging range
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_two_sided_p(t: float, df: float) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``df`` (real, > 0) degrees of freedom.

    Args:
        t: the statistic (``±inf`` gives 0).
        df: degrees of freedom, any positive real (Welch's are not integers).

    Returns:
        The two-sided p-value, ``I_{df/(df+t²)}(df/2, 1/2)``.

    Raises:
        ValueError: ``df`` is not a positive finite number, or ``t`` is NaN.

    Example:
        >>> round(student_t_two_sided_p(2.7764451, 4), 4)
        0.05
    """
    if not (isinstance(df, (int, float)) and math.isfinite(df) and df > 0):
        raise ValueError(f"degrees of freedom must be a positive finite number, got {df!r}")
    if math.isnan(t):
        raise ValueError("the t statistic is NaN")
    if math.isinf(t):
        return 0.0
    return _regularized_beta(df / 2.0, 0.5, df / (df + t * t))


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


@dataclass(frozen=True)
class WelchResult:
    """A two-sided Welch t-test of equal means.

    Attributes:
        t: the statistic (``inf`` where both spreads are zero and the means differ, 0 where they are equal).
        df: the Welch–Satterthwaite degrees of freedom (``inf`` where both spreads are zero).
        p: the two-sided p-value.
    """

    t: float
    df: float
    p: float


def welch_test(a: list[float], b: list[float]) -> WelchResult:
    """Welch's two-sided t-test of ``mean(a) == mean(b)``, unequal variances allowed.

    Args:
        a, b: per-seed values, at least two finite numbers each.

    Returns:
        The :class:`WelchResult`; without any spread on either side the p-value is 1 for equal
        means and 0 otherwise.

    Raises:
        ValueError: fewer than two values on a side, or a value that is not finite.

    Example:
        >>> round(welch_test([1.0, 2.0, 3.0], [1.5, 2.5, 3.5]).p, 3)
        0.573
    """
    for side, values in (("a", a), ("b", b)):
        if len(values) < 2:
            raise ValueError(f"Welch's test needs at least 2 values per side, got {len(values)} in {side}")
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"Welch's test needs finite values, got {values!r} in {side}")
    (mean_a, std_a), (mean_b, std_b) = _mean_std(a), _mean_std(b)
    var_a, var_b = std_a ** 2 / len(a), std_b ** 2 / len(b)
    standard_error = math.sqrt(var_a + var_b)
    if standard_error == 0.0:
        return WelchResult(0.0, math.inf, 1.0) if mean_a == mean_b else WelchResult(math.inf, math.inf, 0.0)
    t = (mean_a - mean_b) / standard_error
    df = (var_a + var_b) ** 2 / (var_a ** 2 / (len(a) - 1) + var_b ** 2 / (len(b) - 1))
    return WelchResult(t, df, student_t_two_sided_p(t, df))


@dataclass(frozen=True)
class SeedSpread:
    """One method's metric over its seeds, on one model, test corpus and suite configuration.

    Attributes:
        model / corpus / suite / method: the group (``corpus`` the record's ``test_corpus``; ``suite``
            the suite label) and the method label.
        values: the metric per ``ok`` seed, in seed order.
        seeds: those seeds.
        corpus_summary: the corpus summary one of the records carries (``None`` in older records).
        seed_independent: the method's one record is seed-independent (it ran once, at the sweep's first
            seed); ``values`` repeat its value at every seed that the group's other methods ran.
    """

    model: str
    corpus: str
    suite: str
    method: str
    values: tuple[float, ...]
    seeds: tuple[int, ...]
    corpus_summary: dict[str, Any] | None = None
    seed_independent: bool = False

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return _mean_std(list(self.values))[0]

    @property
    def std(self) -> float | None:
        """Sample standard deviation across seeds; ``None`` with a single seed."""
        return _mean_std(list(self.values))[1] if self.n > 1 else None

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.values)


def seed_spreads(records: list[dict[str, Any]], suite: str = SUITE, metric: str = METRIC) -> list[SeedSpread]:
    """Group the ``ok`` records of ``suite`` by (model, test corpus, suite label, method label).

    Args:
        records: as :func:`mosaicquant.harness.results.load_records` returns them.
        suite: the suite name whose records are read.
        metric: the metric compared.

    Returns:
        One :class:`SeedSpread` per group that has the metric, in the order first seen; a record
        without a ``test_corpus`` is grouped under its run's ``corpus``. A method whose records are
        all seed-independent stands at every seed its (model, corpus, suite) group ran.
    """
    groups: dict[tuple[str, str, str, str], dict[int, float]] = {}
    summaries: dict[tuple[str, str, str, str], dict[str, Any] | None] = {}
    seeded_keys: set[tuple[str, str, str, str]] = set()
    for rec in records:
        if rec.get("status") != "ok" or rec["suite"]["name"] != suite:
            continue
        m = (rec.get("metrics") or {}).get(metric)
        if m is None or m.get("value") is None:
            continue
        corpus = rec.get("test_corpus") or rec.get("corpus") or "not recorded"
        key = (rec["model"]["name"], corpus, rec["suite"]["label"], rec["method"]["label"])
        groups.setdefault(key, {})[int(rec.get("seed") or 0)] = float(m["value"])
        if not rec.get("seed_independent"):
            seeded_keys.add(key)
        if summaries.get(key) is None:
            summaries[key] = rec.get("corpus_summary")
    seeds_of: dict[tuple[str, str, str], set[int]] = {}
    for key in seeded_keys:
        seeds_of.setdefault(key[:3], set()).update(groups[key])
    spreads = []
    for key, by_seed in groups.items():
        once = key not in seeded_keys and len(by_seed) == 1
        if once:
            by_seed = dict.fromkeys(seeds_of.get(key[:3], set()) | set(by_seed), next(iter(by_seed.values())))
        spreads.append(SeedSpread(*key, values=tuple(by_seed[s] for s in sorted(by_seed)),
                                  seeds=tuple(sorted(by_seed)), corpus_summary=summaries.get(key),
                                  seed_independent=once))
    return spreads


def within_noise(a: SeedSpread, b: SeedSpread) -> WelchResult | None:
    """The test behind "within noise" (module docstring), or ``None`` where it cannot be made (fewer
    than :data:`MIN_SEEDS` seeds on a side, or a value that is not finite).

    Args:
        a, b: two methods of one group.

    Returns:
        The Welch test result; within noise when ``result.p >= NOISE_ALPHA``.
    """
    if a.n < MIN_SEEDS or b.n < MIN_SEEDS or not (a.finite and b.finite):
        return None
    return welch_test(list(a.values), list(b.values))


def _spread_text(s: SeedSpread) -> str:
    if not s.finite:
        return "NaN" if any(math.isnan(v) for v in s.values) else "inf"
    return format_number(s.mean) + (f" ± {format_number(s.std)}" if s.std is not None else "")


def noise_table(spreads: list[SeedSpread]) -> pd.DataFrame:
    """One group's table: method, seeds, mean ± standard deviation, range, and the methods within noise.

    Args:
        spreads: the methods of one (model, corpus, suite label) group.

    Returns:
        A table of strings, rows in the order given.
    """
    rows = []
    for s in spreads:
        if s.n < MIN_SEEDS or not s.finite:
            why = f"not tested ({s.n} seed{'s' if s.n != 1 else ''})" if s.n < MIN_SEEDS else "not tested (not finite)"
            close = why
        else:
            tested = [(o, r) for o in spreads if o is not s and (r := within_noise(s, o)) is not None]
            close = ", ".join(f"{o.method} (p={r.p:.2f})" for o, r in tested if r.p >= NOISE_ALPHA) or "none"
            untested = [o.method for o in spreads if o is not s and within_noise(s, o) is None]
            if untested:
                close += f"; not tested against {', '.join(untested)}"
        seeds = f"{s.n} (seed-independent: one run)" if s.seed_independent else str(s.n)
        rows.append({"method": s.method, "seeds": seeds, "ppl mean ± sd ↓": _spread_text(s),
                     "min – max": f"{format_number(min(s.values))} – {format_number(max(s.values))}" if s.finite else "",
                     "within noise of": close})
    return pd.DataFrame(rows)


def _corpus_line(corpus: str, summary: dict[str, Any] | None) -> str:
    test = (summary or {}).get("test") or {}
    if not test:
        return f"Test corpus `{corpus}` (its summary is not recorded)."
    return (f"Test corpus `{corpus}`: {test.get('documents')} documents, {test.get('words'):,} words, text sha256 "
            f"`{test.get('sha256')}` ({summary.get('source') or 'source not recorded'}).")


def noise_section(records: list[dict[str, Any]]) -> list[str]:
    """``## Seeds``: per model, test corpus and accuracy configuration, each method's perplexity over its
    seeds and the methods within noise of it (empty when no group has a method at two or more seeds).

    Args:
        records: as :func:`mosaicquant.harness.results.load_records` returns them.

    Returns:
        Markdown lines.
    """
    groups: dict[tuple[str, str, str], list[SeedSpread]] = {}
    for s in seed_spreads(records):
        groups.setdefault((s.model, s.corpus, s.suite), []).append(s)
    groups = {k: v for k, v in groups.items() if any(s.n > 1 for s in v)}
    if not groups:
        return []
    parts = ["## Seeds\n",
             "Perplexity over calibration seeds: mean ± sample standard deviation across the seeds, and the range. "
             f"Two methods are *within noise* of each other when a two-sided Welch t-test at {NOISE_ALPHA:.0%} on "
             f"their per-seed values does not reject equal means (p ≥ {NOISE_ALPHA}, shown); the test needs "
             f"{MIN_SEEDS} seeds on each side. Only the seed varies: the test text is fixed, so the corpora are "
             "compared in separate tables.\n"]
    for (model, corpus, suite), spreads in sorted(groups.items(), key=lambda kv: [natural_key(k) for k in kv[0]]):
        parts.append(f"### {model}, `{corpus}`, `{suite}`\n")
        parts.append(_corpus_line(corpus, next((s.corpus_summary for s in spreads if s.corpus_summary), None)) + "\n")
        parts.append(render_markdown(noise_table(spreads)))
    return parts
