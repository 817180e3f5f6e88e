"""What a method and a suite get from the runner besides the model and their config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["QuantContext", "SuiteContext"]


@dataclass
class QuantContext:
    """Inputs a method may use, and the place it reports what it did.

    Attributes:
        calibration: callable returning the sweep's shared calibration tokens
            ``LongTensor [n_samples, seqlen]`` (computed once, on first use).
        seed: the cell's seed (rotations, random choices).
        device: where the method computes.
        tokenizer: the model's tokenizer.
        info: filled by the method: ``wbits``, ``abits``, ``kv_bits``, ``exec_path``,
            memory, notes — copied into every record of the cell.
        log: progress printer.
    """

    calibration: Callable[[], torch.Tensor]
    seed: int
    device: torch.device
    tokenizer: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = print

    def calib_tokens(self) -> torch.Tensor:
        return self.calibration()


@dataclass
class SuiteContext:
    """Inputs a suite may use.

    Attributes:
        model_name: the model spec string.
        tokenizer: the model's tokenizer.
        corpus: the text corpus name (perplexity).
        test_tokens: callable returning the corpus's tokenized test split (cached per sweep).
        seed: the cell's seed.
        device: where the suite runs.
        method_info: what the method reported (bits, KV bits, execution path, ...).
        calibration: as in :class:`QuantContext` (for analyses that need held-out statistics).
        log: progress printer.
    """

    model_name: str
    tokenizer: Any
    corpus: str
    test_tokens: Callable[[], torch.Tensor]
    seed: int
    device: torch.device
    method_info: dict[str, Any]
    calibration: Callable[[], torch.Tensor] | None = None
    log: Callable[[str], None] = print
