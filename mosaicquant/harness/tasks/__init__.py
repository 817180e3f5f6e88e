"""lm-eval task definitions of the zero-shot suite, run on local JSONL files.

Each ``mq_<task>.yaml`` restates one of lm-eval's own task definitions (prompt, target,
choices, metrics) with ``dataset_path: json``, so that no Hugging Face hub access is
needed. The data file is a placeholder (``"@DATA_FILE@"``) that
:func:`mosaicquant.harness.taskdata.write_task_definitions` replaces with the cached
JSONL path when it writes the runnable task folder. ``mq_task_utils.py`` holds the
document processing of HellaSwag and WinoGrande; it is copied next to the YAML files
because lm-eval resolves ``!function`` relative to the YAML file.
"""
