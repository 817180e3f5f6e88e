"""Perplexity by the protocol every W4A4 baseline reports (SPEC §4).

The token stream (the test documents joined with ``"\\n\\n"``, tokenized once, see
:func:`mosaicquant.harness.data.test_tokens`) is cut into non-overlapping chunks of
``seqlen`` tokens; the tail shorter than a chunk is dropped. Each chunk is one forward pass
with no context from the previous chunk. In every chunk, positions 1..seqlen-1 are predicted
from their prefixes; the mean negative log-likelihood over all those positions of all chunks
is ``nll`` and ``ppl = exp(nll)``. Log-softmax runs in float32 whatever the model's dtype,
and the sum is accumulated in float64.

Example:
    >>> result = evaluate_perplexity(model, tokens, seqlen=2048, max_chunks=8)  # doctest: +SKIP
    >>> result["ppl"]  # doctest: +SKIP
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mosaicquant import progress
from mosaicquant.errors import MosaicQuantError, UserInputError

__all__ = ["NonFiniteLogitsError", "evaluate_perplexity"]


class NonFiniteLogitsError(MosaicQuantError):
    """The model produced NaN logits (e.g. fp16 overflow in a collapsed quantized model)."""


def _check_int(label: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserInputError(f"{label} must be an integer >= {minimum}, got {value!r}")


def _model_device(model) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def _logits_of(output) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise UserInputError(
            f"The model returned {type(output).__name__}; expected a tensor of logits or an object with .logits"
        )
    return logits


def evaluate_perplexity(
    model,
    tokens: torch.Tensor,
    *,
    seqlen: int = 2048,
    max_chunks: int | None = None,
    batch_size: int = 1,
    device: str | torch.device | None = None,
) -> dict:
    """Perplexity of ``model`` on a token stream, over non-overlapping ``seqlen`` chunks.

    Args:
        model: a causal LM called as ``model(input_ids=ids, use_cache=False)`` returning logits
            ``[B, seqlen, vocab]`` (a tensor, or an object with ``.logits`` as in transformers).
            It runs in eval mode; its previous train/eval mode is restored afterwards.
        tokens: LongTensor ``[T]``, the whole test stream.
        seqlen: chunk length, >= 2 (SPEC: 2048).
        max_chunks: if given (>= 1), only the first ``max_chunks`` chunks are evaluated.
        batch_size: chunks per forward pass, >= 1 (does not change the result beyond float
            accumulation order).
        device: where the chunks go; default: the device of the model's first parameter.

    Returns:
        ``{"ppl": float, "nll": float, "n_chunks": int, "n_tokens_scored": int, "seqlen": int}``
        with ``n_tokens_scored = n_chunks * (seqlen - 1)``; ``ppl`` is ``inf`` when ``exp(nll)``
        overflows a float (a collapsed model).

    Raises:
        UserInputError: ``tokens`` is not a 1-D integer tensor, bad ``seqlen`` /
            ``max_chunks`` / ``batch_size`` / ``device``, fewer tokens than one chunk, or the model returns
            logits of the wrong shape.
        NonFiniteLogitsError: the logits of some chunk contain NaN.

    Example:
        >>> evaluate_perplexity(model, ids, seqlen=256, max_chunks=2)["n_tokens_scored"]  # doctest: +SKIP
        510
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.is_complex():
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise UserInputError(f"tokens must be a 1-D integer tensor, got {shape}")
    _check_int("seqlen", seqlen, 2)
    _check_int("batch_size", batch_size, 1)
    if max_chunks is not None:
        _check_int("max_chunks", max_chunks, 1)
    available = tokens.numel() // seqlen
    if available == 0:
        raise UserInputError(f"The token stream has {tokens.numel()} tokens, fewer than one chunk of seqlen={seqlen}")
    n_chunks = available if max_chunks is None else min(available, max_chunks)
    if device is None:
        target_device = _model_device(model)
    else:
        try:
            target_device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise UserInputError(f"Unknown device {device!r} ({error}); use e.g. 'cpu' or 'cuda:0'") from None
    chunks = tokens[: n_chunks * seqlen].to(torch.long).reshape(n_chunks, seqlen)

    was_training = model.training
    model.eval()
    total_nll = 0.0
    try:
        with torch.inference_mode():
            for first in progress.bar(range(0, n_chunks, batch_size), desc="perplexity", unit="batch"):
                batch = chunks[first: first + batch_size].to(target_device)
                logits = _logits_of(model(input_ids=batch, use_cache=False))
                if logits.dim() != 3 or logits.shape[:2] != batch.shape:
                    raise UserInputError(
                        f"Expected logits of shape [{batch.shape[0]}, {seqlen}, vocab], got {tuple(logits.shape)}"
                    )
                if torch.isnan(logits).any():
                    bad = [first + i for i in range(batch.shape[0]) if torch.isnan(logits[i]).any()]
                    raise NonFiniteLogitsError(f"The model produced NaN logits on chunk(s) {bad} of {n_chunks}")
                # One sequence at a time keeps the float32 copy at seqlen x vocab.
                for row in range(batch.shape[0]):
                    row_logits = logits[row, :-1].float()
                    row_nll = F.cross_entropy(row_logits, batch[row, 1:], reduction="sum")
                    total_nll += float(row_nll.double())
    finally:
        model.train(was_training)

    n_scored = n_chunks * (seqlen - 1)
    nll = total_nll / n_scored
    return {
        "ppl": math.exp(nll) if nll < 709.0 else math.inf,
        "nll": nll,
        "n_chunks": n_chunks,
        "n_tokens_scored": n_scored,
        "seqlen": seqlen,
    }
