"""SIGKILL and SIGINT at random points of a sweep, then the same command: nothing lost, nothing twice, same numbers."""

import random
import signal
import time

import pytest

from mosaicquant.harness.cli import main
from mosaicquant.harness.results import LOCK_NAME, load_records, read_valid_record
from mosaicquant.reports.tables import write_tables

N_CELLS = 6  # the tiny sweep: 3 method specs x 2 suites x 1 seed


def _numbers(out):
    return {(r["method"]["label"], r["suite"]["label"], r["seed"]): {k: m["value"] for k, m in r["metrics"].items()}
            for r in load_records(out)}


def _summary(out, report_dir):
    """The report's summary table of ``out``, written into ``report_dir``."""
    write_tables(out, report_dir / "report.md")
    return (report_dir / "summary.csv").read_text()


# two seeds of the kill point per signal (a child process costs seconds on a loaded CI machine); the seed
# picks how many records to wait for and a delay after, so the kill lands in a load, a quantization or a suite:
# seeds 1 and 3 after 1 record, 5 after 4, 7 after 2
@pytest.mark.parametrize("sig, seed", [(signal.SIGKILL, 1), (signal.SIGINT, 3), (signal.SIGKILL, 5),
                                       (signal.SIGINT, 7)])
def test_killed_sweep_resumes_to_the_uninterrupted_result(tmp_path, tiny_llama_dir, tiny_corpus, reference_sweep,
                                                          rel, capsys, sig, seed):
    ref_out, ref_records = reference_sweep
    rng = random.Random(seed)
    wait_for_records, extra_delay = rng.randint(0, N_CELLS - 1), rng.uniform(0.0, 0.5)
    out = tmp_path / "res"
    args = rel.sweep_args(tiny_llama_dir, out)
    child = rel.start_child(args)
    deadline = time.monotonic() + 90
    # the kill point: once the run holds the folder, after `wait_for_records` records and a random delay
    while not ((out / LOCK_NAME).exists() and (out / LOCK_NAME).read_text()
               and len(rel.record_files(out)) >= wait_for_records):
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.02)
    time.sleep(extra_delay)
    child.send_signal(sig)
    _, err = child.communicate(timeout=60)
    if child.returncode != 0:  # it may have finished before the signal came
        assert child.returncode == (-9 if sig == signal.SIGKILL else 130), (child.returncode, err[-2000:])
    if sig == signal.SIGINT and child.returncode == 130:
        assert "interrupted; finished records are kept and a rerun resumes" in err
    # what the kill left: only whole, valid records (the writer renames complete files)
    survivors = {}
    for path in rel.record_files(out):
        record, why = read_valid_record(path)
        assert why is None, (path.name, why)
        survivors[path.name] = path.read_bytes()
    assert all(name in ref_records for name in survivors)

    capsys.readouterr()
    assert main(args) == 0  # the same command (in this process: one child start fewer)
    stdout = capsys.readouterr().out
    assert f"{N_CELLS} cells: {len(survivors)} finished, {N_CELLS - len(survivors)} to run" in stdout
    files = rel.record_files(out)
    assert sorted(p.name for p in files) == sorted(ref_records)  # each cell once, none missing
    for name, content in survivors.items():
        assert (out / name).read_bytes() == content, name  # kept as it was, not recomputed
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert _numbers(out) == _numbers(ref_out)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _summary(out, tmp_path / "a") == _summary(ref_out, tmp_path / "b")
