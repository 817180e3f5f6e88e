"""Known gaps, each fixed: a zero perplexity in the Pareto figure; scores given in another order."""

from mosaicquant.harness.results import SCHEMA, Metric, record_path, write_record
from mosaicquant.harness.spec import parse_plugin_spec
from mosaicquant.reports.tables import write_tables

ACC, SPEED = "smollm2-135m", "llama-3-8b-shapes"


def _record(out, model, label, suite, metrics):
    rec = {"schema": SCHEMA, "status": "ok", "seed": 0, "model": {"name": model, "spec": model},
           "method": {"name": label, "label": label, "config": {}},
           "suite": {"name": suite, "label": suite, "config": {}}, "method_info": {},
           "metrics": {k: Metric(*v).to_dict() for k, v in metrics.items()}}
    write_record(record_path(out, model, label, suite, 0), rec)


def test_zero_perplexity_draws_the_pareto_figure(tmp_path):
    # before: max(values) / min(values) raised ZeroDivisionError and no report was written
    out = tmp_path / "res"
    for label, ppl, tok_s in (("fp16", 13.9, 400.0), ("rtn", 0.0, 1000.0), ("awq", 200.0, 900.0)):
        _record(out, ACC, label, "accuracy", {"ppl": (ppl, False)})
        _record(out, SPEED, label, "throughput", {"decode_tok_s/b4": (tok_s, True, "tok/s", 1.0)})
    report = write_tables(out).read_text()
    pareto = [p.name for p in out.glob("pareto__*.png")]
    assert len(pareto) == 1 and f"]({pareto[0]})" in report, (pareto, report)


def test_analysis_scores_in_another_order_are_one_config():
    a = parse_plugin_spec("analysis:scores=random,hessian", "suite")
    b = parse_plugin_spec("analysis:scores=hessian,random", "suite")
    c = parse_plugin_spec("analysis:scores=hessian,random,hessian", "suite")
    assert a.label == b.label == c.label == "analysis:scores=hessian,random"
    assert a.config == b.config == c.config
    # the default, however ordered, is the default (no option in the label)
    shuffled = parse_plugin_spec("analysis:scores=random,frobenius,exact-greedy,delta,hessian", "suite")
    assert shuffled.label == "analysis"
