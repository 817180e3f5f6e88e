"""The analysis suite on a tiny random Llama: records the curves, plots them, refuses quantized models."""

from mosaicquant.harness.cli import main
from mosaicquant.harness.results import load_records


def test_analysis_records_and_plot(tmp_path, tiny_llama_dir, tiny_corpus):
    out = tmp_path / "res"
    rc = main(["run", "--model", tiny_llama_dir, "--methods", "fp16,rtn", "--suites",
               "analysis:block=16:budgets=0.1,0.3:layers=all", "--corpus", tiny_corpus, "--calib-samples", "4",
               "--calib-seqlen", "32", "--out", str(out)])
    recs = {r["method"]["label"]: r for r in load_records(out)}
    assert rc == 1  # the rtn cell fails by design: the analysis reads the float model
    assert recs["rtn"]["status"] == "failed" and "--methods fp16" in recs["rtn"]["error"]["message"]
    rec = recs["fp16"]
    assert rec["status"] == "ok"
    # fp16 does not calibrate, the suite does: the record names the calibration set it read
    assert rec["calibration"]["n_samples"] == 4 and rec["calibration"]["seqlen"] == 32
    m = {k: v["value"] for k, v in rec["metrics"].items()}
    for score in ("hessian", "delta", "exact-greedy", "frobenius", "random", "channel-in", "channel-out"):
        for budget in ("0.1", "0.3"):
            assert f"recovered/{score}/{budget}" in m
    for score in ("hessian", "exact-greedy"):
        # greedy selections: never harmful, monotone in budget
        assert 0 <= m[f"recovered/{score}/0.1"] <= m[f"recovered/{score}/0.3"] <= 1
    assert "recovered_global/hessian/0.1" in m
    per_layer = [k for k in m if k.startswith("layer/1/mlp.down_proj/")]
    assert per_layer
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "budget_curves.png" in report and (out / "budget_curves.png").stat().st_size > 10_000
    assert "[analysis: rotation, rtn base, block 16]" in report


def test_prefix_distortions_match_direct_computation():
    import torch

    from mosaicquant.methods.analysis import _prefix_distortions
    from mosaicquant.methods.residual import output_distortion, select_residual, selected_dense

    g = torch.Generator().manual_seed(0)
    e = torch.randn(45, 70, generator=g, dtype=torch.float64)
    x = torch.randn(200, 70, generator=g, dtype=torch.float64)
    h = x.T @ x / 200
    coords, q, s = select_residual("frobenius", e, (16, 32), 0.5, hessian=h)
    fast = _prefix_distortions(e, h, (16, 32), coords, q, s)
    for k in range(coords.shape[0] + 1):
        corr = selected_dense((45, 70), (16, 32), coords[:k], q[:k], s[:k]).double()
        direct = output_distortion(e - corr, h)
        assert abs(fast[k] - direct) <= 1e-9 * abs(direct), (k, fast[k], direct)
