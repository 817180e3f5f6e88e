"""Spread independent CPU work over threads, each running PyTorch single-threaded.

PyTorch parallelises each op over its intra-op threads and synchronises them after every
op; for element-wise work on a small machine that costs more than it gains (on 2 cores an
element-wise op ran 1.3–2.6× *slower* on two threads than on one, a matmul 1.24× faster).
Independent pieces of work — row blocks of a search, chunks of a perplexity run — instead
go one per thread with one intra-op thread each: no per-op synchronisation, every core busy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["map_single_threaded"]

T = TypeVar("T")
R = TypeVar("R")


def map_single_threaded(fn: Callable[[T], R], items: Sequence[T], device: torch.device | str = "cpu") -> list[R]:
    """``[fn(item) for item in items]``, spread over PyTorch's CPU threads.

    On a CPU with more than one thread and more than one item, the items run concurrently
    on ``min(threads, len(items))`` Python threads with PyTorch's intra-op threads set to
    one (restored afterwards); results come back in the order of ``items``. Otherwise (a GPU,
    one thread, one item) it is the plain loop. ``fn`` must not depend on thread-local
    state set by the caller (e.g. enter ``torch.inference_mode()`` inside ``fn``).
    """
    threads = torch.get_num_threads()
    if torch.device(device).type != "cpu" or threads < 2 or len(items) < 2:
        return [fn(item) for item in items]
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(min(threads, len(items))) as pool:
            return list(pool.map(fn, items))
    finally:
        torch.set_num_threads(threads)
