"""CPU micro-benchmarks (pytest-benchmark). Not collected by the default ``pytest`` run (testpaths = tests).

Torch runs on ``MOSAICQUANT_BENCH_THREADS`` threads (default 1): one thread gives the most
stable medians on a shared CI machine, which is what a regression check needs.
"""

import os

import torch

if not torch.cuda.is_available():
    # kernels modules are imported here too; Triton's interpreter needs this before their import
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("MOSAICQUANT_BENCH_THREADS", "1")))
