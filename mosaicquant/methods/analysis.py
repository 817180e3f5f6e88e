"""Distortion analysis of MosaicQuant's residual selection (SPEC §1.8).

For each analysed linear of a transformed float model, with ``Ŵ`` its weight, ``base`` the
dequantized 4-bit base (RTN or GPTQ on calibration statistics) and ``H`` the input
second-moment matrix, the *exact* output distortion is ``D(Δ) = tr(Δ H Δᵀ)`` (``‖X̂Δᵀ‖²``
up to the token count). The fraction recovered by a correction ``C`` is
``(D(Ŵ − base) − D(Ŵ − base − C)) / D(Ŵ − base)``, measured on **held-out** calibration
tokens (``H_heldout``), while the selection only sees the calibration statistics.

Compared, at each budget ρ (fraction of blocks; channels at the equal number of stored
elements):

- block scores: ``hessian`` (least-squares fit, greedy), ``delta`` (SPEC §1.4),
  ``exact-greedy``, ``frobenius`` (``‖E_b‖²``), ``random``;
- channel allocation: whole input channels, whole output channels (``channel-in``,
  ``channel-out``), plain 4-bit residual values;
- per-layer budget against an across-layer budget (``global``: the same total number of
  blocks, allocated to the blocks with the largest *relative* gain over all analysed
  layers — for the greedy scores the picks at a smaller budget are a prefix of those at a
  larger one, so a layer's marginal gains are known from one greedy run).

The greedy selectors may stop before the budget when no block lowers the distortion (e.g.
``exact-greedy`` on a GPTQ base, whose error cancels across columns): their numbers are
then what they reached, which is the honest comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mosaicquant.methods.calibration import _capture_layer_inputs, _run_layer, _with_kwargs, collect_stats, decoder_layers
from mosaicquant.methods.gptq import gptq_quantize
from mosaicquant.methods.qlinear import quantize_weight
from mosaicquant.methods.residual import (
    channel_residual,
    num_kept_blocks,
    output_distortion,
    select_residual,
)

__all__ = ["AnalysisSpec", "analyse_layer", "distortion_analysis", "parse_layers"]

BLOCK_SCORES = ("hessian", "delta", "exact-greedy", "frobenius", "random")
CHANNEL_ALLOCATIONS = ("channel-in", "channel-out")


@dataclass(frozen=True)
class AnalysisSpec:
    budgets: tuple[float, ...]
    scores: tuple[str, ...]
    block_shape: tuple[int, int]
    base: str
    channel: bool = True
    seed: int = 0


def parse_layers(text: str, n_layers: int) -> list[int]:
    """``"all"``, ``"every:K"`` or a comma list of indices (negative from the end).

    Raises:
        ValueError: an index out of range or an unreadable spec.
    """
    text = str(text).strip()
    if text == "all":
        return list(range(n_layers))
    if text.startswith("every:"):
        step = int(text.split(":", 1)[1])
        if step < 1:
            raise ValueError(f"layers={text!r}: step must be >= 1")
        out = list(range(0, n_layers, step))
        if out[-1] != n_layers - 1:
            out.append(n_layers - 1)
        return out
    out = []
    for part in text.replace(";", ",").split(","):
        idx = int(part)
        idx = idx + n_layers if idx < 0 else idx
        if not 0 <= idx < n_layers:
            raise ValueError(f"layers={text!r}: index {part} outside 0..{n_layers - 1}")
        out.append(idx)
    return sorted(set(out))


def _base(w_hat: torch.Tensor, hessian: torch.Tensor, base: str) -> torch.Tensor:
    if base == "gptq":
        qt = gptq_quantize(w_hat, hessian, 4, symmetric=True, percdamp=0.01, act_order=True, clip_search=True,
                           scale_dtype=torch.float16)
    else:
        qt = quantize_weight(w_hat, 4, symmetric=True, clip_search=True)
    return qt.dequantize(torch.float32)


def _prefix_distortions(residual, hessian, block_shape, coords, q, scales) -> list[float]:
    """Exact ``D(E − C_k)`` for every prefix ``C_k`` of the picked blocks, incrementally.

    With ``G = E H``, subtracting a block correction ``c`` on rows ``I``, columns ``J``
    changes the distortion by ``−2 Σ c ⊙ G[I, J] + Σ (c H[J, J]) ⊙ c`` and ``G[I] −= c H[J]``:
    one pass instead of a full ``N·K²`` product per prefix.
    """
    bn, bk = block_shape
    n, k = residual.shape
    g = residual @ hessian
    d = float((residual * g).sum())
    out = [d]
    deq = q.to(torch.float64) * scales.to(torch.float64).unsqueeze(-1)
    for b, (i, j) in enumerate(coords.tolist()):
        r0, r1 = i * bn, min((i + 1) * bn, n)
        c0, c1 = j * bk, min((j + 1) * bk, k)
        c = deq[b, : r1 - r0, : c1 - c0]
        d += float(-2.0 * (c * g[r0:r1, c0:c1]).sum() + ((c @ hessian[c0:c1, c0:c1]) * c).sum())
        g[r0:r1] -= c @ hessian[c0:c1]
        out.append(d)
    return out


def analyse_layer(w_hat: torch.Tensor, h_calib: torch.Tensor, h_heldout: torch.Tensor, spec: AnalysisSpec):
    """All selections of one linear at every budget.

    Returns:
        ``(rows, marginal)``: ``rows`` a list of dicts ``{score, budget, recovered, kept}``;
        ``marginal[score]`` the held-out distortion reduction of each greedy pick in order
        plus the base distortion, for the across-layer allocation.
    """
    w_hat = w_hat.to(torch.float64)
    h_calib = h_calib.to(torch.float64)
    h_heldout = h_heldout.to(torch.float64)
    base = _base(w_hat.float(), h_calib.float(), spec.base).to(torch.float64)
    residual = w_hat - base
    d0 = output_distortion(residual, h_heldout)
    rows = []
    marginal: dict[str, dict] = {}
    bmax = max(spec.budgets)
    shape = tuple(residual.shape)
    n_blocks = (-(-shape[0] // spec.block_shape[0])) * (-(-shape[1] // spec.block_shape[1]))
    for score in spec.scores:
        # one run at the largest budget: every selector returns its picks best first, and the
        # greedy ones are prefix-consistent, so smaller budgets are prefixes
        coords, q, scales = select_residual(score, residual, spec.block_shape, bmax, hessian=h_calib,
                                            h_diag=torch.diagonal(h_calib), seed=spec.seed)
        prefix_d = _prefix_distortions(residual, h_heldout, spec.block_shape, coords, q, scales)
        for budget in spec.budgets:
            k = min(num_kept_blocks(budget, n_blocks), coords.shape[0])
            d = prefix_d[k]
            rows.append({"score": score, "budget": budget, "recovered": (d0 - d) / d0 if d0 > 0 else 0.0,
                         "kept": int(k)})
        if score in ("hessian", "delta", "exact-greedy"):
            gains = [prefix_d[i] - prefix_d[i + 1] for i in range(len(prefix_d) - 1)]
            marginal[score] = {"d0": d0, "gains": gains, "n_blocks": n_blocks}
    if spec.channel:
        h_diag = torch.diagonal(h_calib)
        for axis, label in (("input", "channel-in"), ("output", "channel-out")):
            for budget in spec.budgets:
                _, corr = channel_residual(residual, h_diag, budget, axis=axis, group_size=spec.block_shape[1])
                d = output_distortion(residual - corr.to(torch.float64), h_heldout)
                rows.append({"score": label, "budget": budget, "recovered": (d0 - d) / d0 if d0 > 0 else 0.0,
                             "kept": None})
    return rows, marginal


def _global_allocation(marginals: dict[str, dict], budget: float) -> float:
    """Mean relative recovery when the total block budget goes to the best relative gains."""
    total_blocks = sum(m["n_blocks"] for m in marginals.values())
    k_total = num_kept_blocks(budget, total_blocks)
    items = []
    for name, m in marginals.items():
        if m["d0"] <= 0:
            continue
        for gain in m["gains"]:
            items.append((gain / m["d0"], name))
    # per layer the greedy gains are (nearly) decreasing; taking the best relative gains
    # overall is the greedy across-layer allocation
    items.sort(key=lambda t: -t[0])
    recovered = {name: 0.0 for name in marginals}
    taken = {name: 0 for name in marginals}
    for rel, name in items[:k_total]:
        recovered[name] += rel
        taken[name] += 1
    return sum(recovered.values()) / len(recovered)


def distortion_analysis(
    model,
    calib_tokens: torch.Tensor,
    heldout_tokens: torch.Tensor,
    layers: list[int],
    spec: AnalysisSpec,
    *,
    batch_size: int = 4,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run the analysis on an already-transformed float model.

    Returns:
        ``{"per_layer": [...rows with layer/linear...], "mean": {(score, budget): value},
        "global": {(score, budget): value}}``.
    """
    all_layers = decoder_layers(model)
    device = next(model.parameters()).device
    calib_in, calib_kw = _capture_layer_inputs(model, calib_tokens, batch_size, device)
    held_in, held_kw = _capture_layer_inputs(model, heldout_tokens, batch_size, device)
    per_layer = []
    marginals: dict[str, dict[str, dict]] = {}
    wanted = set(layers)
    for index, layer in enumerate(all_layers):
        if index > max(wanted):
            break
        calib_in, held_in = _with_kwargs(calib_in, calib_kw[index]), _with_kwargs(held_in, held_kw[index])
        if index in wanted:
            st_c = collect_stats(layer, calib_in)
            st_h = collect_stats(layer, held_in)
            for name, st in st_c.items():
                w_hat = layer.get_submodule(name).weight.data.float()
                rows, marginal = analyse_layer(w_hat, st.hessian, st_h[name].hessian, spec)
                for r in rows:
                    per_layer.append({"layer": index, "linear": name, **r})
                for score, m in marginal.items():
                    marginals.setdefault(score, {})[f"{index}.{name}"] = m
            if log is not None:
                log(f"[mosaicquant]   analysed layer {index}")
        calib_in = _run_layer(layer, calib_in)
        held_in = _run_layer(layer, held_in)
    mean: dict[tuple[str, float], float] = {}
    for r in per_layer:
        mean.setdefault((r["score"], r["budget"]), []).append(r["recovered"])
    mean = {k: sum(v) / len(v) for k, v in mean.items()}
    glob = {(score, b): _global_allocation(m, b) for score, m in marginals.items() for b in spec.budgets}
    return {"per_layer": per_layer, "mean": mean, "global": glob}
