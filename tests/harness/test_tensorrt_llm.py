"""TensorRT-LLM backend: trtllm-bench's documented report parsed, availability, commands, runner cells.

Fixtures (``fixtures/``) are the sample outputs TensorRT-LLM's documentation prints for
``trtllm-bench``, copied verbatim from the NVIDIA/TensorRT-LLM repository:

- ``trtllm_bench_perf_overview.txt``: ``docs/source/developer-guide/perf-overview.md`` (commit
  585c756579dc), section "Running the Benchmark", the block after "The results will be printed
  to the terminal upon benchmark completion. For example," (current layout, with the TPOT /
  TTFT / request latency breakdowns).
- ``trtllm_bench_multimodal_pytorch.txt``: ``docs/source/developer-guide/perf-benchmarking.md``
  (commit b93e14ca093e), section "Running multi-modal models in the PyTorch Workflow", the
  "Sample output" block (REQUEST DETAILS, WORLD + RUNTIME, PERFORMANCE OVERVIEW, DATASET DETAILS).
- ``trtllm_bench_pytorch_legacy.txt``: the same file, section "Running with the PyTorch
  Workflow", the "# Example output" block (the earlier layout: ``Token Throughput``).
- ``trtllm_bench_throughput_engine_log.txt``: ``docs/source/performance/perf-benchmarking.md``
  (commit 04276b44f20b), section "Max Throughput Benchmark", the console output after the
  ``trtllm-bench ... throughput`` command, log lines included.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.harness import tensorrt_llm as trt
from mosaicquant.harness.backends import BackendRequest, parse_backend_spec
from mosaicquant.harness.cli import main
from mosaicquant.harness.results import load_records
from mosaicquant.methods.modelopt_recipes import RECIPES

FIXTURES = Path(__file__).parent / "fixtures"


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def _request(tmp_path, suite="throughput", method="modelopt", label="modelopt:recipe=int4_awq",
             config=None) -> BackendRequest:
    return BackendRequest(model="smollm2-135m", method_name=method, method_label=label,
                          method_config=config or {"recipe": "int4_awq", "calib_batch_size": 4}, suite_name=suite,
                          suite_label=suite, suite_config={}, seed=0, out_dir=str(tmp_path), calib_samples=8,
                          calib_seqlen=1024, corpus="enwiki-sample")


# --- the parser, on the documented outputs ---------------------------------------------------

def test_parse_current_layout_with_breakdowns():
    rep = trt.parse_trtllm_bench(_fixture("trtllm_bench_perf_overview.txt"))
    m = rep.metrics
    assert m["output_throughput"].value == 5530.7382 and m["output_throughput"].unit == "tok/s"
    assert m["output_throughput"].higher_is_better
    assert m["request_throughput"].value == 43.2089
    assert m["total_token_throughput"].value == 94022.5497
    assert m["per_user_output_speed"].value == 5.4656
    assert m["request_latency_avg_ms"].value == 75903.4456 and not m["request_latency_avg_ms"].higher_is_better
    assert m["ttft_avg_ms"].value == 52667.0339 and m["tpot_avg_ms"].value == 182.9639
    assert m["request_latency_p50_ms"].value == 78509.2102 and m["request_latency_max_ms"].value == 111668.0964
    assert m["ttft_p99_ms"].value == 106563.4497 and m["tpot_min_ms"].value == 32.8005
    # 10 overview lines + 3 breakdowns x 7 statistics; each breakdown's AVERAGE is the overview's average
    assert len(m) == 10 + 3 * 7 - 3 and rep.unrecognised == {}


def test_parse_multimodal_sample_sections():
    rep = trt.parse_trtllm_bench(_fixture("trtllm_bench_multimodal_pytorch.txt"))
    assert rep.metrics["request_throughput"].value == 1.4439
    assert rep.metrics["per_gpu_output_throughput"].value == 185.8351
    assert rep.metrics["request_latency_p90_ms"].value == 5514.4701
    assert "ttft_avg_ms" not in rep.metrics  # not streamed: the sample has no TTFT
    # workload lines outside PERFORMANCE OVERVIEW stay information, not metrics
    assert rep.info["REQUEST DETAILS/Number of requests"] == "10"
    assert rep.info["WORLD + RUNTIME INFORMATION/Max Runtime Batch Size"] == "4"
    assert rep.info["DATASET DETAILS/Dataset Path"] == "/workspaces/tensorrt_llm/mm_data.jsonl"
    assert "num_requests" not in rep.metrics


def test_parse_earlier_layout_and_log_lines():
    legacy = trt.parse_trtllm_bench(_fixture("trtllm_bench_pytorch_legacy.txt"))
    assert legacy.metrics["token_throughput"].value == 20685.5510
    assert legacy.metrics["request_throughput"].value == 161.6059
    assert legacy.metrics["total_latency_ms"].value == 18563.6825
    assert legacy.metrics["num_requests"].value == 3000
    assert legacy.info["PYTORCH BACKEND/Quantization"] == "FP8"

    logged = trt.parse_trtllm_bench(_fixture("trtllm_bench_throughput_engine_log.txt"))
    assert logged.metrics["token_throughput"].value == 28390.4265
    assert logged.metrics["request_throughput"].value == 221.8002
    assert logged.info["ENGINE DETAILS/Engine Directory"] == "/tmp/meta-llama/Llama-3.1-8B/tp_1_pp_1"
    # log lines before the first section and after the closing rule are not part of the report
    assert not any("version" in k.lower() and "TensorRT-LLM]" in k for k in logged.info)
    assert not any("Thread" in k or "Refreshed" in k for k in logged.info)


def test_parse_refuses_output_without_a_report():
    with pytest.raises(ValueError, match="no PERFORMANCE OVERVIEW values"):
        trt.parse_trtllm_bench("[TRT-LLM] [I] Starting benchmark...\nKilled\n")
    workload_only = "=====\n= PERFORMANCE OVERVIEW\n=====\nNumber of requests:  3\n"
    with pytest.raises(ValueError):
        trt.parse_trtllm_bench(workload_only)


# --- availability and the commands -----------------------------------------------------------

def test_availability_here_names_each_missing_piece():
    trt.check_availability.cache_clear()
    have = trt.check_availability()
    if have.available:
        pytest.skip("TensorRT-LLM is installed here")
    import importlib.util
    import shutil

    assert (importlib.util.find_spec("tensorrt_llm") is None) == any("tensorrt_llm is not importable" in r
                                                                      for r in have.reasons)
    assert (shutil.which("trtllm-bench") is None) == ("trtllm-bench is not on PATH" in have.reasons)
    assert (not torch.cuda.is_available()) == any("no CUDA GPU" in r for r in have.reasons)
    assert have.reason == "; ".join(have.reasons)


def test_commands_a_user_runs(tmp_path):
    config = trt.TensorRTLLMConfig()
    ckpt = trt.checkpoint_dir(tmp_path, "smollm2-135m", "modelopt:recipe=int4_awq")
    assert ckpt == tmp_path / "tensorrt-llm" / "smollm2-135m__modelopt_recipe=int4_awq"
    export, prepare, bench = trt.plan_commands(_request(tmp_path), config)
    dataset = str(ckpt / "synthetic_isl128_osl128_n512.jsonl")
    assert shlex.join(prepare) == (
        f"trtllm-bench --model {ckpt} prepare-dataset --output {dataset} token-norm-dist --num-requests 512 "
        "--input-mean 128 --output-mean 128 --input-stdev 0 --output-stdev 0")
    assert shlex.join(bench) == (f"trtllm-bench --model {ckpt} throughput --dataset {dataset} --backend pytorch "
                                 "--max_batch_size 32")
    latency = trt.plan_commands(_request(tmp_path, suite="latency"), config)[2]
    assert latency[3] == "latency" and "--max_batch_size" not in latency
    # step 1 is a runnable Python call with the sweep's calibration settings
    assert export[:2] == ["python", "-c"]
    call = ast.parse(export[2]).body[1].value
    assert call.func.id == "export_for_trtllm"
    assert [a.value for a in call.args] == ["smollm2-135m", "modelopt:recipe=int4_awq", str(ckpt)]
    kwargs = {k.arg: k.value.value for k in call.keywords}
    assert kwargs == {"corpus": "enwiki-sample", "calib_samples": 8, "calib_seqlen": 1024, "seed": 0, "device": "cuda"}


def test_int4_recipes_name_the_partial_group_of_smollm2(tmp_path, monkeypatch):
    """ModelOpt's export refuses int4 groups that do not fill 128 input channels: the cell says so."""
    monkeypatch.setattr(trt, "check_availability", lambda: trt.Availability("test", "trtllm-bench", "test GPU", ()))
    outcome = trt.tensorrt_llm_backend(_request(tmp_path), trt.TensorRTLLMConfig())
    assert outcome.status == "unavailable"
    assert outcome.reason == "ModelOpt's int4 export needs input sizes that are multiples of 128 (smollm2-135m: hidden_size 576)"
    assert "intermediate_size" not in outcome.reason  # 1536 = 12 x 128
    assert len(outcome.commands) == 3  # still the commands, for a model whose shapes fit
    int8 = _request(tmp_path, label="modelopt:recipe=int8_sq", config={"recipe": "int8_sq"})
    assert trt._int4_group_problem(int8) is None


def test_backend_spec_and_config_errors():
    entry, config = parse_backend_spec("tensorrt-llm:input_len=1024:max_batch_size=8")
    assert entry.name == "tensorrt-llm" and (config.input_len, config.max_batch_size) == (1024, 8)
    assert parse_backend_spec("torch") is None and parse_backend_spec(None) is None
    with pytest.raises(UserInputError, match="Unknown backend 'tensorrt'. Did you mean: tensorrt-llm?"):
        parse_backend_spec("tensorrt")
    with pytest.raises(UserInputError, match="max_batch_size=0 is out of range"):
        parse_backend_spec("tensorrt-llm:max_batch_size=0")


# --- runner cells ----------------------------------------------------------------------------

@pytest.fixture
def speed_suite(monkeypatch):
    """The ``throughput`` suite name, registered for the sweep's parser if no suite module has it."""
    from dataclasses import dataclass

    from mosaicquant.config import Config
    from mosaicquant.registry import SUITES, Entry

    if "throughput" not in SUITES.names():
        @dataclass(frozen=True)
        class ThroughputNameOnly(Config):
            pass

        def never_runs_in_process(model, config, ctx):
            raise AssertionError("a backend cell must not run the in-process suite")

        monkeypatch.setitem(SUITES._entries, "throughput", Entry("throughput", never_runs_in_process,
                                                                 ThroughputNameOnly, "suite", "test", ""))
    return "throughput"


def _run(tmp_path, model, corpus, methods, suites, backend):
    return main(["run", "--model", model, "--methods", methods, "--suites", suites, "--corpus", corpus,
                 "--calib-samples", "4", "--calib-seqlen", "32", "--out", str(tmp_path / "res"), "--backend", backend])


def test_unavailable_cells_are_recorded_with_reason_and_commands(tmp_path, tiny_llama_dir, tiny_corpus, speed_suite,
                                                                 capsys):
    trt.check_availability.cache_clear()
    if trt.check_availability().available:
        pytest.skip("TensorRT-LLM is installed here")
    reason = trt.check_availability().reason
    rc = _run(tmp_path, tiny_llama_dir, tiny_corpus, "fp16,modelopt:recipe=int8_sq,rtn",
              f"{speed_suite},accuracy:seqlen=32", "tensorrt-llm")
    assert rc == 0  # not available is not a failure
    out = capsys.readouterr().out
    assert "6 not available here" in out and "loaded" not in out  # no model was loaded
    recs = {(r["method"]["label"], r["suite"]["name"]): r for r in load_records(tmp_path / "res")}
    assert len(recs) == 6 and all(r["status"] == "unavailable" and r["metrics"] == {} for r in recs.values())
    cell = recs[("modelopt:recipe=int8_sq@tensorrt-llm", "throughput")]
    assert cell["backend"]["reason"] == reason and cell["error"]["message"] == reason
    assert cell["method"]["spec_label"] == "modelopt:recipe=int8_sq" and cell["backend"]["name"] == "tensorrt-llm"
    assert cell["method_info"]["trtllm_quant_algo"] == "W8A8_SQ_PER_CHANNEL" and cell["method_info"]["abits"] == 8
    commands = cell["backend"]["commands"]
    assert len(commands) == 3 and commands[2].startswith("trtllm-bench --model ") and " throughput " in commands[2]
    assert "export_for_trtllm(" in commands[0]
    assert "has no TensorRT-LLM format" in recs[("rtn@tensorrt-llm", "throughput")]["backend"]["reason"]
    assert "runs the speed suites" in recs[("fp16@tensorrt-llm", "accuracy")]["backend"]["reason"]

    assert main(["report", str(tmp_path / "res")]) == 0
    report = (tmp_path / "res" / "report.md").read_text()
    row = next(line for line in report.splitlines()
               if line.startswith("| ") and "modelopt:recipe=int8_sq@tensorrt-llm" in line)
    assert "not available" in row and "tensorrt_llm" in row.replace("\\_", "_")


def test_export_for_trtllm_writes_the_checkpoint_tensorrt_llm_reads(tmp_path, tiny_llama_dir, tiny_corpus):
    pytest.importorskip("modelopt.torch.export", reason="nvidia-modelopt is not installed")
    # int8_sq: the tiny model's K = 64 holds no whole int4 group of 128, which the int4 export refuses
    ckpt = trt.export_for_trtllm(tiny_llama_dir, "modelopt:recipe=int8_sq", tmp_path / "ckpt", corpus=tiny_corpus,
                                 calib_samples=2, calib_seqlen=32, device="cpu")
    quant = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == RECIPES["int8_sq"].trtllm_quant_algo == "W8A8_SQ_PER_CHANNEL"
    assert "lm_head" in quant["exclude_modules"]
    assert (ckpt / "tokenizer.json").exists() and (ckpt / "config.json").exists()
    done = json.loads((ckpt / "mosaicquant_export.json").read_text())
    assert done["method_info"]["recipe"] == "int8_sq" and done["calib_samples"] == 2
    with pytest.raises(UserInputError, match="method 'rtn' has no TensorRT-LLM checkpoint"):
        trt.export_for_trtllm(tiny_llama_dir, "rtn", tmp_path / "x", corpus=tiny_corpus, device="cpu")


def test_available_path_runs_the_commands_and_parses_the_report(tmp_path, tiny_llama_dir, tiny_corpus, speed_suite,
                                                                monkeypatch):
    """Where TensorRT-LLM is available: the cell runs the planned commands and records the parsed
    report. Here a stand-in ``trtllm-bench`` (it prints the documented sample) replaces the tool;
    the checkpoint export is real."""
    pytest.importorskip("modelopt.torch.export", reason="nvidia-modelopt is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.jsonl"
    fake = bin_dir / "trtllm-bench"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, pathlib, sys\n"
        "args = sys.argv[1:]\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(args) + '\\n')\n"
        "if 'prepare-dataset' in args:\n"
        "    pathlib.Path(args[args.index('--output') + 1]).write_text('{}\\n')\n"
        "else:\n"
        f"    print(open({str(FIXTURES / 'trtllm_bench_perf_overview.txt')!r}).read())\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(trt, "check_availability",
                        lambda: trt.Availability("test", str(fake), "test GPU", ()))
    label = "modelopt:recipe=int8_sq"
    ckpt = trt.checkpoint_dir(tmp_path / "res", tiny_llama_dir, label)
    trt.export_for_trtllm(tiny_llama_dir, label, ckpt, corpus=tiny_corpus, calib_samples=2,
                          calib_seqlen=32, device="cpu")  # step 1, done here in-process to keep the test short

    rc = _run(tmp_path, tiny_llama_dir, tiny_corpus, label, speed_suite, "tensorrt-llm:num_requests=8:export_device=cpu")
    assert rc == 0
    (rec,) = load_records(tmp_path / "res")
    assert rec["status"] == "ok" and rec["metrics"]["output_throughput"]["value"] == 5530.7382
    assert rec["metrics"]["request_latency_p50_ms"]["higher_is_better"] is False
    argv = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [a[2] for a in argv] == ["prepare-dataset", "throughput"]
    assert ["trtllm-bench", *argv[1]] == shlex.split(rec["backend"]["commands"][2])
    assert rec["method_info"]["recipe"] == "int8_sq" and rec["backend"]["export"]["calib_samples"] == 2
    assert rec["method"]["label"] == f"{label}@tensorrt-llm"


def test_backend_records_carry_the_in_process_record_head(tmp_path, tiny_llama_dir, tiny_corpus, speed_suite):
    trt.check_availability.cache_clear()
    common = ["run", "--model", tiny_llama_dir, "--corpus", tiny_corpus, "--seeds", "0,1",
              "--calib-samples", "4", "--calib-seqlen", "32"]
    assert main([*common, "--methods", "fp16", "--suites", "accuracy:seqlen=32", "--out", str(tmp_path / "local")]) == 0
    (local,) = load_records(tmp_path / "local")
    # the speed suite is seeded, accuracy is not: fp16 / accuracy is seed-independent, fp16 / throughput is not
    assert main([*common, "--methods", "fp16", "--suites", f"accuracy:seqlen=32,{speed_suite}",
                 "--out", str(tmp_path / "res"), "--backend", "tensorrt-llm"]) == 0
    recs = load_records(tmp_path / "res")
    cells = sorted((r["suite"]["name"], r["seed"], r["seed_independent"]) for r in recs)
    assert cells == [("accuracy", 0, True), ("throughput", 0, False), ("throughput", 1, False)]
    expected = set(local) - {"quantized_cache"}  # a backend cell loads no model, so it has no quantized-model cache
    for rec in recs:
        assert expected - set(rec) == set(), f"{rec['suite']['name']}: missing {sorted(expected - set(rec))}"
        assert rec["preset"] is None and rec["command"] == local["command"]  # both ran under this test process
    assert main(["export", str(tmp_path / "res"), "--check-schema"]) == 0
