"""ResQ: PCA basis per layer input, the high-variance 1/8 at 8 bits, the rest at 4 (SPEC §3).

For each linear input with calibration Hessian ``H = mean_t x_t x_tᵀ`` (the uncentred
activation covariance, from :func:`mosaicquant.methods.calibration.calibrate_layerwise`,
i.e. on the inputs the layer will see with the earlier layers already quantized):

1. **PCA**: ``H = V Λ Vᵀ``, eigenvalues descending. The top ``r = round(K · high_fraction)``
   eigenvectors (``high_fraction`` = 1/8) span the high-variance subspace ``V_h``, the
   others the low-variance subspace ``V_l``.
2. **Rotations inside each subspace**: ``U = [V_l R_l, V_h R_h]`` with seeded Haar-random
   orthogonal ``R_l`` (``K − r`` square) and ``R_h`` (``r`` square). ``U`` is orthogonal, so
   ``y = x Wᵀ = (x U)(W U)ᵀ``: the float function is preserved. The rotations spread each
   subspace's energy evenly over its channels (as Hadamard rotations do in QuaRot), so the
   per-token 4-bit and 8-bit grids see no outlier channel inside a subspace.
3. **Activations** (:class:`~mosaicquant.methods.mixed.MixedActQuant`): the last ``r``
   channels of ``x U`` (the high-variance subspace) 8-bit per token, the first ``K − r``
   4-bit per token; asymmetric with clip ``a_clip``, as the authors' run scripts.
4. **Weights** (:func:`~mosaicquant.methods.mixed.gptq_quantize_segments`): GPTQ on
   ``W U`` against ``Uᵀ H U``: the low-subspace columns 4-bit, then the high-subspace
   columns 8-bit (one scale per output row and subspace, symmetric, RTN clip search);
   visiting the 8-bit columns last lets them absorb the 4-bit columns' error.
5. **down_proj**: all 4-bit (weights and activations) behind an online Hadamard transform
   of its input (:class:`~mosaicquant.methods.hadamard.OnlineHadamard`; sizes that are not
   powers of two through Paley factors), weight ``W H``.
6. **KV cache**: 4-bit asymmetric, one group per head and token (``kv_group_size`` None;
   with the 128-channel heads of Llama-2/3 this is the authors' group 128), with the
   online Hadamard on Q and K (:mod:`mosaicquant.methods.kvcache`).

Simplifications against the paper (a faithful-enough simulation, stated honestly):

- The paper fuses its projections offline: one PCA basis ``U_A`` for the residual stream
  (folded into the embeddings, the norms' readers and the writers of the residual) and
  per-layer bases ``U_B`` for the value/output path (folded into v_proj / o_proj). Here
  every distinct linear input gets its own basis, applied online as the linear's input
  transform (q/k/v share one basis, gate/up share one, o_proj has its own). Per-linear
  bases are at least as well adapted to each input's covariance as the fused ones, so
  this simulation is, if anything, slightly optimistic for ResQ; the quantization grids
  (which channels are 8-bit, per-token ranges) are the paper's.
- The RMSNorm weights are not fused: the basis acts on the norm's output, which is what
  the linear reads, so no fold is needed for a per-linear basis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from mosaicquant.config import Config, check_range
from mosaicquant.methods.basis import (  # noqa: F401 (BasisTransform, pca_basis: re-exported)
    HADAMARD_INPUTS, BasisTransform, input_groups, input_rotation, pca_basis, resq_basis,
)
from mosaicquant.methods.calibration import calibrate_layerwise
from mosaicquant.methods.hadamard import OnlineHadamard, apply_hadamard, is_hadamard_size
from mosaicquant.methods.kvcache import KVQuantSpec, enable_kv_quant
from mosaicquant.methods.mixed import MixedActQuant, WeightSegment, gptq_quantize_segments, mixed_weight_memory
from mosaicquant.methods.qlinear import ActQuantSpec, FakeQuantLinear, input_transform_of, replace_linears, set_module
from mosaicquant.methods.speed_form import check_w4a4, segmented_rtn_linear
from mosaicquant.registry import register_method

__all__ = ["BasisTransform", "pca_basis", "resq_basis", "ResQConfig", "resq_quantize_linear", "resq"]


@dataclass(frozen=True)
class ResQConfig(Config):
    """ResQ options (command line: ``resq:high_fraction=0.25:kvbits=16``).

    Attributes:
        wbits / abits: bits of the low-variance subspace (and of all of down_proj), 2..8.
        high_bits: bits of the high-variance subspace (weights and activations), 2..8.
        high_fraction: fraction of each input's dimensions kept at ``high_bits``, [0, 1).
        a_clip: clip ratio of the activations, (0, 1].
        a_symmetric: symmetric activation grids (default asymmetric per token).
        kvbits: KV-cache bits, 2..8, or 16 (float cache, no Q/K rotation).
        kv_group_size: K/V group along the head dim, or None (one group per head).
        percdamp: GPTQ damping relative to the mean Hessian diagonal.
        act_order: GPTQ visits each subspace's columns by decreasing Hessian diagonal.
        w_clip_search: search each weight scale's clip ratio (RTN/GPTQ convention).
        calib_batch: calibration sequences per forward pass.
    """

    description = "ResQ: per-input PCA basis, top-1/8 variance subspace at 8 bits, rest W4A4 (GPTQ), KV4"

    wbits: int = 4
    abits: int = 4
    high_bits: int = 8
    high_fraction: float = 0.125
    a_clip: float = 1.0
    a_symmetric: bool = False
    kvbits: int = 4
    kv_group_size: int | None = None
    percdamp: float = 0.01
    act_order: bool = True
    w_clip_search: bool = True
    calib_batch: int = 4

    def validate(self):
        for name in ("wbits", "abits", "high_bits"):
            check_range(name, getattr(self, name), 2, 8, integer=True)
        check_range("high_fraction", self.high_fraction, 0.0, 0.99)
        check_range("a_clip", self.a_clip, 0.01, 1.0)
        check_range("kvbits", self.kvbits, 2, 8, integer=True, extra=(16,))
        if self.kv_group_size is not None:
            check_range("kv_group_size", self.kv_group_size, 1, None, integer=True)
        check_range("percdamp", self.percdamp, 0.0, 1.0)
        check_range("calib_batch", self.calib_batch, 1, None, integer=True)

    def kv_spec(self) -> KVQuantSpec:
        """Asymmetric K/V with the online Q/K Hadamard when ``kvbits < 16``."""
        return KVQuantSpec(bits=self.kvbits, group_size=self.kv_group_size, symmetric=False,
                           rotate_qk=self.kvbits < 16)

    def n_high(self, in_features: int) -> int:
        """High-precision dimensions of an input of ``in_features`` channels."""
        return int(round(in_features * self.high_fraction))


def resq_quantize_linear(
    linear: nn.Linear,
    hessian: torch.Tensor,
    config: ResQConfig,
    *,
    basis: torch.Tensor | None,
) -> FakeQuantLinear:
    """Quantize one linear in a given input basis (ResQ), or behind an online Hadamard.

    Args:
        linear: the float layer (must carry no input transform of its own).
        hessian: ``[K, K]`` Hessian of the layer's input, in the original basis.
        config: :class:`ResQConfig`.
        basis: ``U`` from :func:`resq_basis` (mixed precision, the last
            ``config.n_high(K)`` channels high), or ``None`` for the all-low-precision path
            behind an online Hadamard transform (down_proj).

    Returns:
        :class:`FakeQuantLinear` with ``input_transform`` (:class:`BasisTransform` or
        :class:`~mosaicquant.methods.hadamard.OnlineHadamard`) and attributes ``n_high``,
        ``wbits`` (mean bits per weight) and ``weight_groups``.

    Raises:
        ValueError: the linear already has an input transform, its size has no Hadamard
            matrix (``basis=None``), or as :func:`gptq_quantize_segments`.
    """
    if input_transform_of(linear) is not None:
        raise ValueError("ResQ applies its own input basis; this linear already has an input transform")
    k = linear.in_features
    w = linear.weight.data.to(torch.float64)
    h = hessian.to(device=w.device, dtype=torch.float64)
    low_act = ActQuantSpec(bits=config.abits, symmetric=config.a_symmetric, clip_ratio=config.a_clip)
    transform, rot = input_rotation(k, basis, w.device)
    n_high = 0 if basis is None else config.n_high(k)
    w_rot = w @ rot
    h_rot = rot.T @ h @ rot
    segments = [WeightSegment(torch.arange(k - n_high), config.wbits, clip_search=config.w_clip_search)]
    if n_high:
        segments.append(WeightSegment(torch.arange(k - n_high, k), config.high_bits, clip_search=config.w_clip_search))
    result = gptq_quantize_segments(w_rot, h_rot, segments, percdamp=config.percdamp, act_order=config.act_order)
    if n_high:
        act = MixedActQuant(torch.arange(k - n_high, k), torch.arange(k - n_high), k,
                            high=ActQuantSpec(bits=config.high_bits, symmetric=config.a_symmetric,
                                              clip_ratio=config.a_clip),
                            low=low_act)
    else:
        act = low_act
    layer = FakeQuantLinear(result.dequantized.to(linear.weight.dtype), linear.bias, act, transform, None,
                            result.storage_bits() / linear.weight.numel())
    layer.weight_groups = result.scale_groups
    layer.n_high = n_high
    # the integers and scales per segment, for the kernel path (mosaicquant.kernels.mixed_gemm)
    layer.weight_segments = [(seg.columns, q) for seg, q in zip(segments, result.segments)]
    return layer.to(linear.weight.device)


def _speed_form(model, config: ResQConfig, ctx):
    """ResQ's deployed format on a random-weight model: the bases folded into the weights (a random
    orthogonal basis of random weights is random weights), the last ``n_high(K)`` channels of each
    input at ``high_bits``, the rest at ``wbits``/``abits``, down_proj all low behind its online
    Hadamard; round-to-nearest integers in place of GPTQ."""
    check_w4a4("resq", config.wbits, config.abits)
    low = ActQuantSpec(bits=config.abits, symmetric=config.a_symmetric, clip_ratio=config.a_clip)
    high = ActQuantSpec(bits=config.high_bits, symmetric=config.a_symmetric, clip_ratio=config.a_clip)

    def make(name, linear):
        k = linear.in_features
        if name.endswith(HADAMARD_INPUTS):
            if not is_hadamard_size(k):
                raise ValueError(f"down_proj input size {k} has no Hadamard matrix for the online transform")
            linear.weight.data = apply_hadamard(linear.weight.data.to(torch.float32)).to(linear.weight.dtype)
            return segmented_rtn_linear(linear, [(torch.arange(k), config.wbits, 1.0)], low, OnlineHadamard(k))
        n_high = config.n_high(k)
        lo_cols, hi_cols = torch.arange(k - n_high), torch.arange(k - n_high, k)
        columns = [(lo_cols, config.wbits, 1.0)] + ([(hi_cols, config.high_bits, 1.0)] if n_high else [])
        act = MixedActQuant(hi_cols, lo_cols, k, high=high, low=low) if n_high else low
        return segmented_rtn_linear(linear, columns, act.to(linear.weight.device) if n_high else act)

    n = len(replace_linears(model, make))
    return n, {"bases": "folded into the weights (random orthogonal on random weights)",
               "high_fraction": config.high_fraction, "high_bits": config.high_bits}


@register_method("resq", config=ResQConfig, description=ResQConfig.description, speed_form=_speed_form)
def resq(model, config: ResQConfig, ctx):
    """Quantize ``model`` in place with ResQ; fills ``ctx.info``."""
    t0 = time.perf_counter()
    calib = ctx.calib_tokens()
    kv = enable_kv_quant(model, config.kv_spec())
    high_channels: dict[str, int] = {}
    captured: dict[str, float] = {}

    def quantize_layer(index, layer, stats):
        groups, hadamard = input_groups(stats)
        for g_index, group in enumerate(groups):
            hessian = stats[group[0]].hessian
            k = hessian.shape[0]
            n_high = config.n_high(k)
            basis = resq_basis(hessian, n_high, seed=ctx.seed * 100003 + index * 16 + 2 * g_index)
            h64 = hessian.to(torch.float64)
            high = basis[:, k - n_high:].to(h64.device)
            # variance share of the 8-bit subspace: trace(U_hᵀ H U_h) / trace(H)
            captured[f"layers.{index}.{group[0]}"] = round(float((high.T @ h64 @ high).trace() / h64.trace()), 5)
            for name in group:
                new = resq_quantize_linear(layer.get_submodule(name), stats[name].hessian, config, basis=basis)
                set_module(layer, name, new)
                high_channels[f"layers.{index}.{name}"] = n_high
        for name in hadamard:
            new = resq_quantize_linear(layer.get_submodule(name), stats[name].hessian, config, basis=None)
            set_module(layer, name, new)
            high_channels[f"layers.{index}.{name}"] = 0

    calibrate_layerwise(model, calib, quantize_layer, batch_size=config.calib_batch, log=ctx.log)
    ctx.info.update(
        wbits=f"{config.wbits}/{config.high_bits}", abits=f"{config.abits}/{config.high_bits}",
        kv_bits=config.kvbits, kv_cache=kv,
        exec_path="simulated (fake-quant; per-linear PCA basis applied online, online Hadamard on down_proj)",
        weight_quantizer="gptq (segments: 4-bit low-variance subspace, then 8-bit high-variance subspace)",
        high_fraction=config.high_fraction,
        high_precision_channels=high_channels,
        variance_in_high_subspace_calib=captured,
        variance_in_high_subspace_calib_mean=(sum(captured.values()) / len(captured)) if captured else None,
        quantized_linears=len(high_channels),
        memory_bytes=mixed_weight_memory(model),
        timing={"total_s": round(time.perf_counter() - t0, 2)},
    )
    return model
