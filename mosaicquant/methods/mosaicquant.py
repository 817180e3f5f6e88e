"""MosaicQuant: W4A4 with everything at 4 bits — a dense 4-bit base plus a sparse 4-bit
residual on the weight blocks a Hessian-guided score picks (SPEC §1).

Pipeline for a causal LM (Llama / Qwen2 / Qwen3 families):

1. **Equivalence transform** (``transform``): ``rotation`` (default; QuaRot-style: norms
   fused, random Hadamard on the residual stream, online Hadamard on the down_proj input
   and — ``online_o`` — on the o_proj input), ``pca`` (per linear input, from the calibration
   covariance of the inputs the layer sees with the earlier layers quantized: the PCA basis with
   random rotations inside its top-``high_fraction`` and remaining subspaces, applied online as
   the linear's input transform — ResQ's basis, :mod:`mosaicquant.methods.basis` — and the
   high-variance subspace quantized with its own per-token 4-bit scale; down_proj all one grid
   behind an online Hadamard), ``smoothquant`` (per-channel scales ``max|X|^α / max|W|^(1-α)``
   folded into the norms / preceding linears) or ``none``.
2. **Layer-wise calibration** (:mod:`mosaicquant.methods.calibration`): each linear's input
   Hessian ``H = mean_t x̂ x̂ᵀ`` on the transformed inputs; later layers see the
   quantized earlier ones.
3. **Dense base** (``base``): 4-bit symmetric per output channel (or per ``w_group_size``),
   with clipping search, by ``gptq`` (default) or ``rtn``; FP16 scales.
4. **Residual** ``E = Ŵ − deq(Q(Ŵ))``, tiled in ``block`` blocks (default 128×128; ragged
   edge blocks where the layer is not a multiple — no layer is skipped).
5. **Selection** (``score``) of ``budget`` (default 10%) of the blocks per layer:

   - ``hessian`` (default): per block the least-squares correction against the full ``H``,
     quantized to 4 bits, blocks picked greedily (SPEC §1.9) — measured to be the better
     one on this model family (see the analysis suite);
   - ``delta``: the paper's Δ-score with the diagonal Hessian (SPEC §1.4), on the plain
     4-bit residual ``R = Q4(E)``;
   - ``frobenius`` (``‖E_b‖²``), ``random``, ``exact-greedy`` (ablations).

6. **Format**: base and kept blocks packed in :mod:`mosaicquant.methods.format` (4-bit
   values, FP16 scales per row of a block, block coordinates). By default (``rscale=pow2``) a
   kept row's scale is its base row's scale times a power of two ``2^-j`` (``j`` = 0..4), which
   lets the kernels add the residual into the base's integer accumulator. The simulated layer
   multiplies ``Qa(x̂)`` by the packed weight's dequantization — the same integers and scales
   the kernels execute (:mod:`mosaicquant.kernels`).
7. **Activations**: 4-bit per token, symmetric (or asymmetric, ``a_symmetric``), clipped at
   ``a_clip``; with ``transform="pca"`` two 4-bit grids per token (the high-variance subspace and
   the rest). One quantization serves the base and the residual. ``a_clip_search`` chooses each
   linear input's clip ratios (one per grid) on the calibration inputs instead
   (:func:`search_act_clip`).

The output head stays in 16 bits. The KV cache is not quantized by default (``kv_bits`` 16, the
method as SPEC §1 defines it: its linear layers); ``kvbits=4`` adds QuaRot's KV recipe
(:mod:`mosaicquant.methods.kvcache`: the online Q/K Hadamard, then K/V per head and token,
asymmetric, clip ``kv_clip`` = 0.95), which the fused decoder executes as a 4-bit cache;
``kv_rotate_v`` also quantizes V in each head's Hadamard basis (simulated only). Every result records
``kv_bits``.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass

import torch

from mosaicquant.config import Config, check_choice, check_range
from mosaicquant.errors import Unavailable, UserInputError
from mosaicquant.methods.basis import input_groups, input_rotation, resq_basis
from mosaicquant.methods.calibration import calibrate_layerwise
from mosaicquant.methods.format import PackedW4, ResidualBlocks, block_shape_text, parse_block_shape
from mosaicquant.methods.gptq import gptq_quantize
from mosaicquant.methods.kvcache import KVQuantSpec, enable_kv_quant
from mosaicquant.methods.mixed import MixedActQuant, MultiPassActQuant
from mosaicquant.methods.qlinear import (
    ActQuantSpec, FakeQuantLinear, input_transform_of, quantize_weight, replace_linears, set_module, weight_memory,
)
from mosaicquant.methods.quant import all_finite, quantize
from mosaicquant.methods.residual import POW2_MAX_SHIFT, distortion_recovered, select_residual
from mosaicquant.methods.rotation import TRANSFORM_SUPPORTS, online_transforms, rotate_model
from mosaicquant.methods.smoothing import collect_input_absmax, smooth_model, smoothing_input_names
from mosaicquant.methods.speed_form import check_w4a4
from mosaicquant.registry import Supports, register_method

__all__ = ["MosaicQuantConfig", "mosaicquant", "apply_transform", "pca_input_transform", "quantize_linear_mosaic",
           "residual_base_scale", "search_act_clip", "act_output_error", "A_CLIP_GRID"]

SCORES = ("hessian", "delta", "frobenius", "random", "exact-greedy")
TRANSFORMS = ("rotation", "pca", "smoothquant", "none")
RESIDUAL_SCALES = ("free", "pow2")
#: clip ratios ``a_clip_search`` tries for each activation grid
A_CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


@dataclass(frozen=True)
class MosaicQuantConfig(Config):
    """MosaicQuant options (command line: ``mosaicquant:budget=0.1:block=64x128``).

    Attributes:
        budget: fraction of residual blocks kept per layer, 0..1 (0 = dense base only).
        block: residual block shape, ``"B"`` or ``"BNxBK"`` (rows × columns); kept as ``"B"`` when square,
            so ``16x16`` and ``16`` are one config.
        score: block selection: hessian (default), delta, frobenius, random, exact-greedy.
        transform: rotation (default), pca, smoothquant or none (see the module docstring).
        pca_group: with ``transform="pca"``, ``None`` (default: the low-variance subspace on one
            per-token grid, as ResQ), or cut it into consecutive subspaces of ``pca_group`` principal
            directions (descending variance), each rotated on its own and quantized with its own
            per-token 4-bit scale (one more 16-bit scale per token and group).
        high_passes: with ``transform="pca"``, the 4-bit passes of the high-variance subspace's
            activations, 1 (default) or 2: the second quantizes the first's error on its own per-token
            grid and multiplies the same weight columns (:class:`~mosaicquant.methods.mixed.MultiPassActQuant`),
            every operand 4-bit; counted as ``4 · high_passes`` bits per element of that subspace.
        high_fraction: with ``transform="pca"``, the share of each input's dimensions (the
            highest-variance principal subspace) quantized with its own per-token 4-bit scale, [0, 1).
        online_o: with rotation, also rotate the o_proj input online.
        alpha: SmoothQuant migration strength.
        base: dense base quantizer, gptq (default) or rtn.
        wbits: 4, or 16 to leave weights unquantized (``wbits=16:budget=0`` isolates the
            activations' share of the error).
        abits: 4, or 16 (W4A16).
        w_group_size: base scale group along K, or None (per output channel).
        a_clip: fraction of each token's activation range kept.
        a_symmetric: symmetric activation grids (default); ``False`` gives asymmetric per-token grids
            (one 16-bit scale and zero point per token and grid).
        a_clip_search: choose each linear input's activation clip ratios from :data:`A_CLIP_GRID` on the
            calibration inputs (one per grid: with ``transform="pca"`` the high subspace's and the rest's,
            by one pass of coordinate descent), minimising the output error ``‖(Qa(x) − x) Wᵀ‖²`` of the
            linears that read that input with their float weights; ``a_clip`` is the starting point.
            Off by default; the chosen ratios are recorded (``a_clip_chosen``).
        percdamp: GPTQ damping; act_order: GPTQ column order by decreasing Hessian diagonal.
        residual_damp: damping of the least-squares block fit (hessian score).
        rscale: residual scales, ``pow2`` (default: each kept block row's scale is its base row's
            scale times ``2^-j``, ``j`` = 0..4, the ``j`` of least error; same format, and the swapped
            GEMM adds the residual into the base's int32 accumulator, ``residual_walk="shared"`` in
            :mod:`mosaicquant.kernels.w4a4_gemm`) or ``free`` (each kept block row's own absmax FP16
            scale). Measured on SmolLM2-135M (8 x 1024 calibration tokens, enwiki sample, 8 chunks):
            ``pow2`` perplexity 24.79 and 16.1 % of the calibration distortion recovered, ``free``
            25.14 and 16.0 % (``benchmarks/results/smollm2_rscale``). ``pow2`` needs per-channel base
            scales (``w_group_size`` unset).
        rscale_max_shift: the largest ``j`` of ``pow2`` scales, 0..4 (default 4). At 3 a kept block's base and
            residual are one int8 operand ``8 q + 2^(3-j) r``, which the swapped prefill GEMM multiplies in place of
            the block's dense step (``residual_walk="merged"`` in :mod:`mosaicquant.kernels.w4a4_gemm`): measured on
            the H200 (Llama-3-8B linears, GEMM alone, 10 % blocks) the residual's cost over the dense GEMM went
            from +6 to +27 % to 0 to +19 % at 2048 tokens and from +2 to +17 % to -2 to +10 % at 8192; Llama-3-8B
            prefill 1.28x -> 1.32x BF16 end to end (``benchmarks/results/merged_walk_gemm``, ``llama3_8b_shapes_rshift``).
            The price: a coarser step for rows that would take ``j = 4`` (on SmolLM2-135M, the protocol above,
            perplexity 24.67 at 4 and 24.92 at 3, distortion recovered 16.1 % and 15.9 %;
            ``benchmarks/results/smollm2_rshift``), and the int8 copies resident beside the format
            (Llama-3-8B's linears 0.276x -> 0.326x of BF16); decode is unchanged.
        calib_batch: calibration sequences per forward pass.
        kvbits: KV-cache bits, 2..8, or 16 (default: float cache, no Q/K rotation).
        kv_clip, kv_symmetric: the K/V grid (default asymmetric, clip 0.95, as QuaRot's).
        kv_rotate_v: with ``kvbits < 16``, quantize V in each head's Hadamard basis (``rotate_v`` of
            :class:`~mosaicquant.methods.kvcache.KVQuantSpec`; the inverse rotation belongs in o_proj's input).
            Off by default; the fused decoder does not execute it.
    """

    description = "dense 4-bit base + Hessian-selected sparse 4-bit residual blocks, all 4-bit (W4A4)"

    budget: float = 0.10
    block: str = "128"
    score: str = "hessian"
    transform: str = "rotation"
    high_fraction: float = 0.125
    pca_group: int | None = None
    high_passes: int = 1
    online_o: bool = True
    alpha: float = 0.85
    base: str = "gptq"
    wbits: int = 4
    abits: int = 4
    w_group_size: int | None = None
    a_clip: float = 0.9
    a_symmetric: bool = True
    a_clip_search: bool = False
    percdamp: float = 0.01
    act_order: bool = True
    residual_damp: float = 0.01
    rscale: str = "pow2"
    rscale_max_shift: int = 4
    calib_batch: int = 4
    kvbits: int = 16
    kv_clip: float = 0.95
    kv_symmetric: bool = False
    kv_rotate_v: bool = False

    def validate(self):
        check_range("budget", self.budget, 0.0, 1.0)
        try:
            self.set_canonical("block", block_shape_text(self.block))
        except ValueError as exc:
            raise UserInputError(str(exc)) from None
        check_choice("score", self.score, SCORES)
        check_choice("transform", self.transform, TRANSFORMS)
        check_range("high_fraction", self.high_fraction, 0.0, 0.99)
        check_range("high_passes", self.high_passes, 1, 2, integer=True)
        if self.pca_group is not None:
            check_range("pca_group", self.pca_group, 1, None, integer=True)
        check_choice("base", self.base, ("gptq", "rtn"))
        check_choice("rscale", self.rscale, RESIDUAL_SCALES)
        check_range("rscale_max_shift", self.rscale_max_shift, 0, POW2_MAX_SHIFT, integer=True)
        if self.wbits not in (4, 16):
            raise UserInputError(f"wbits={self.wbits!r} is not allowed: MosaicQuant stores 4-bit weights "
                                 "(4), or 16 to leave them unquantized")
        if self.abits not in (4, 16):
            raise UserInputError(f"abits={self.abits!r} is not allowed: choose 4 or 16")
        if self.wbits == 16 and self.budget > 0:
            raise UserInputError(f"budget={self.budget} needs 4-bit weights: with wbits=16 set budget=0")
        if self.w_group_size is not None:
            check_range("w_group_size", self.w_group_size, 2, None, integer=True)
            if self.rscale == "pow2" and self.budget > 0:
                raise UserInputError(f"rscale=pow2 (the default) needs per-channel base scales: with "
                                     f"w_group_size={self.w_group_size} set rscale=free")
        check_range("alpha", self.alpha, 0.0, 1.0)
        check_range("a_clip", self.a_clip, 0.01, 1.0)
        check_range("percdamp", self.percdamp, 0.0, 1.0)
        check_range("residual_damp", self.residual_damp, 0.0, 1.0)
        check_range("calib_batch", self.calib_batch, 1, None, integer=True)
        check_range("kvbits", self.kvbits, 2, 8, integer=True, extra=(16,))
        check_range("kv_clip", self.kv_clip, 0.01, 1.0)
        if self.kv_rotate_v and self.kvbits == 16:
            raise UserInputError("kv_rotate_v=true needs a quantized KV cache: set kvbits (e.g. kvbits=4)")

    @property
    def block_shape(self) -> tuple[int, int]:
        return parse_block_shape(self.block)

    def act_spec(self) -> ActQuantSpec:
        """The per-token activation grid (of each subspace, with ``transform="pca"``)."""
        return ActQuantSpec(bits=self.abits, symmetric=self.a_symmetric, clip_ratio=self.a_clip)

    def n_high(self, in_features: int) -> int:
        """Dimensions of an input's high-variance subspace under ``transform="pca"``."""
        return int(round(in_features * self.high_fraction))

    def kv_spec(self) -> KVQuantSpec:
        """The KV-cache spec: Q/K rotation and K/V quantization per head and token when ``kvbits < 16``."""
        return KVQuantSpec(bits=self.kvbits, group_size=None, symmetric=self.kv_symmetric, clip_ratio=self.kv_clip,
                           rotate_qk=self.kvbits < 16, rotate_v=self.kv_rotate_v)


def apply_transform(model, transform: str, calib_tokens: torch.Tensor, *, seed: int, online_o: bool = True,
                    alpha: float = 0.85, batch_size: int = 4) -> dict:
    """Apply a function-preserving transform in place; returns its description.

    Args:
        transform: ``rotation`` (Hadamard residual stream, online Hadamard on the down_proj
            input and, with ``online_o``, on the o_proj input), ``smoothquant`` (scales with
            migration strength ``alpha`` from the calibration tokens' activation maxima,
            folded into norms and preceding linears), ``pca`` (nothing model-wide: each linear's
            basis comes from its calibration inputs, :func:`pca_input_transform`) or ``none``.
    """
    if transform == "pca":
        return {"transform": "pca", "basis": "per linear input: PCA with random rotations inside the two subspaces",
                "down_proj": "online Hadamard"}
    if transform == "rotation":
        return rotate_model(model, seed=seed, online_down=True, online_o=online_o)
    if transform == "smoothquant":
        names = smoothing_input_names(model, smooth_vo=True, smooth_up_down=True)
        absmax = collect_input_absmax(model, calib_tokens, names, batch_size=batch_size)
        return smooth_model(model, absmax, alpha, smooth_vo=True, smooth_up_down=True)
    return {"transform": "none"}


def residual_base_scale(packed: PackedW4, config: MosaicQuantConfig) -> torch.Tensor | None:
    """The base's per-channel scales for ``rscale=pow2`` residual scales, else ``None``."""
    return packed.scales.reshape(-1).to(torch.float32) if config.rscale == "pow2" else None


def pca_input_transform(linear, hessian: torch.Tensor, config: MosaicQuantConfig, *, basis: torch.Tensor | None):
    """Move one float linear into its input basis for ``transform="pca"``, in place.

    The weight becomes ``W U`` and the linear carries ``x ↦ x U`` as its input transform, so its
    float function is unchanged; with ``basis=None`` (down_proj) ``U`` is the Hadamard transform.

    Args:
        linear: the float layer, with no input transform of its own.
        hessian: ``[K, K]`` input covariance in the original basis.
        config: :class:`MosaicQuantConfig`.
        basis: ``U`` from :func:`~mosaicquant.methods.basis.resq_basis` (the last
            ``config.n_high(K)`` columns the high-variance subspace), or ``None``.

    Returns:
        ``(hessian in the new basis, activation quantizer)``: a
        :class:`~mosaicquant.methods.mixed.MixedActQuant` with the last ``n_high`` channels on their
        own grid, or the plain per-token grid where there is no high subspace.

    Raises:
        ValueError: the linear already has an input transform, or down_proj's size has no Hadamard matrix.
    """
    if input_transform_of(linear) is not None:
        raise ValueError("transform='pca' applies its own input basis; this linear already has an input transform")
    k = linear.in_features
    w = linear.weight.data.to(torch.float64)
    transform, rot = input_rotation(k, basis, w.device)
    n_high = 0 if basis is None else config.n_high(k)
    linear.weight.data = (w @ rot).to(linear.weight.dtype)
    linear.input_transform = transform.to(linear.weight.device)
    h = hessian.to(device=w.device, dtype=torch.float64)
    h_rot = (rot.T @ h @ rot).to(torch.float32)
    act = config.act_spec()
    if n_high:
        low = dataclasses.replace(act, group_size=config.pca_group)
        high = act if config.high_passes == 1 else MultiPassActQuant(act, config.high_passes)
        act = MixedActQuant(torch.arange(k - n_high, k), torch.arange(k - n_high), k, high=high, low=low)
    return h_rot, act.to(linear.weight.device) if n_high else act


def quantize_linear_mosaic(linear, hessian: torch.Tensor, config: MosaicQuantConfig, seed: int, *, act=None):
    """Quantize one transformed linear: dense 4-bit base plus selected 4-bit residual blocks.

    Args:
        act: the activation quantizer (default ``config.act_spec()``).

    Returns:
        ``(FakeQuantLinear, stats)`` where ``stats`` holds the fraction of calibration
        output distortion the residual recovers.
    """
    act = config.act_spec() if act is None else act
    w_hat = linear.weight.data.to(torch.float32)
    if not all_finite(w_hat):
        raise ValueError("weights hold NaN or Inf values")
    if config.wbits == 16:
        layer = FakeQuantLinear(linear.weight.data, linear.bias, act, input_transform_of(linear), None, 16)
        return layer, {}
    if config.base == "gptq":
        qt = gptq_quantize(w_hat, hessian, 4, symmetric=True, group_size=config.w_group_size,
                           percdamp=config.percdamp, act_order=config.act_order, clip_search=True,
                           scale_dtype=torch.float16)
    else:
        qt = quantize_weight(w_hat, 4, symmetric=True, group_size=config.w_group_size, clip_search=True)
    packed = PackedW4.from_quantized(qt, bias=None if linear.bias is None else linear.bias.data)
    base = packed.dequantize_base(torch.float32)
    stats = {}
    block_shape = config.block_shape
    if config.budget > 0:
        residual = w_hat - base
        coords, q, scales = select_residual(config.score, residual, block_shape, config.budget,
                                            hessian=hessian, h_diag=torch.diagonal(hessian), seed=seed,
                                            damp=config.residual_damp, base_scale=residual_base_scale(packed, config),
                                            max_shift=config.rscale_max_shift)
        packed.residual = ResidualBlocks.from_blocks(tuple(w_hat.shape), block_shape, coords, q, scales)
        stats["recovered"] = distortion_recovered(w_hat, base, packed.residual.to_dense(), hessian)
    else:
        packed.residual = ResidualBlocks.empty(tuple(w_hat.shape), block_shape)
    weight = packed.dequantize(linear.weight.dtype)
    layer = FakeQuantLinear(weight, linear.bias, act, input_transform_of(linear), packed, 4)
    return layer.to(linear.weight.device), stats


def act_output_error(act, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """``Σ_W ‖(act(x) − x) Wᵀ‖²``: the output error an activation quantizer alone causes.

    Args:
        act: the activation quantizer (an :class:`ActQuantSpec` or a quantizer module).
        x: ``[T, K]`` inputs in the linears' basis.
        weights: the ``[N_i, K]`` weights of the linears that read ``x``.
    """
    d = (act(x) - x).to(torch.float64)
    n_total = sum(w.shape[0] for w in weights)
    if n_total > x.shape[1]:
        gram = sum(w.to(torch.float64).T @ w.to(torch.float64) for w in weights)
        return float(((d @ gram) * d).sum())
    return float(sum((d @ w.to(torch.float64).T).square().sum() for w in weights))


def _with_clip(act, part: str, clip: float):
    """A copy of ``act`` with the clip ratio of one of its grids (``"all"``, ``"low"`` or ``"high"``) set."""
    if isinstance(act, ActQuantSpec):
        return dataclasses.replace(act, clip_ratio=clip)
    high, low = act.high, act.low
    if part == "high":
        high = dataclasses.replace(high, clip_ratio=clip)
    else:
        low = dataclasses.replace(low, clip_ratio=clip)
    return MixedActQuant(act.high_channels, act.low_channels, act.in_features, high=high, low=low).to(
        act.high_channels.device)


def search_act_clip(act, x: torch.Tensor, weights: list[torch.Tensor], grid=A_CLIP_GRID):
    """Choose an activation quantizer's clip ratios on calibration inputs.

    Each grid of ``act`` (one for an :class:`ActQuantSpec`; the rest's and then the high subspace's for a
    :class:`~mosaicquant.methods.mixed.MixedActQuant`, one pass of coordinate descent) takes the ratio of
    ``grid`` (or its current one) of least :func:`act_output_error`. A high subspace with several passes
    (:class:`~mosaicquant.methods.mixed.MultiPassActQuant`) keeps its grid.

    Returns:
        ``(quantizer, error)``: a new quantizer (``act`` is unchanged) and its output error, never above
        that of ``act``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x, w = torch.randn(256, 16, generator=g), [torch.randn(8, 16, generator=g)]
        >>> q, err = search_act_clip(ActQuantSpec(4), x, w)
        >>> err <= act_output_error(ActQuantSpec(4), x, w)
        True
    """
    parts = ["all"] if isinstance(act, ActQuantSpec) else ["low"] + (
        ["high"] if isinstance(act.high, ActQuantSpec) and act.n_high else [])
    best, best_err = act, act_output_error(act, x, weights)
    for part in parts:
        for clip in grid:
            cand = _with_clip(best, part, clip)
            err = act_output_error(cand, x, weights)
            if err < best_err:
                best, best_err = cand, err
    return best, best_err


def _clip_ratios(act) -> list[float]:
    """The clip ratios of a quantizer's grids (the rest's first, then the high subspace's), for the record."""
    if isinstance(act, ActQuantSpec):
        return [act.clip_ratio]
    high = getattr(act.high, "clip_ratio", None)
    return [act.low.clip_ratio] + ([high] if high is not None and act.n_high else [])


def _speed_form(model, config: MosaicQuantConfig, ctx):
    """The method's format with round-to-nearest integers and residual blocks chosen by the ``random`` score."""
    check_w4a4("mosaicquant", config.wbits, config.abits)
    if config.transform == "pca" or not config.a_symmetric:
        raise Unavailable(f"no fast path: mosaicquant with transform={config.transform!r}, a_symmetric="
                          f"{config.a_symmetric}; the fused runtime executes one symmetric per-token 4-bit "
                          "activation grid behind a rotation, SmoothQuant or no transform")
    if config.transform == "rotation":
        rotate_model(model, seed=ctx.seed, online_down=True, online_o=config.online_o)
    act = config.act_spec()
    block_shape = config.block_shape
    counter = iter(range(1 << 30))

    def make(name, linear):
        w = linear.weight.data.to(torch.float32)
        qt = quantize(w, 4, symmetric=True, group_size=config.w_group_size, scale_dtype=torch.float16)
        packed = PackedW4.from_quantized(qt, bias=None if linear.bias is None else linear.bias.data)
        if config.budget > 0:
            coords, q, scales = select_residual("random", w - packed.dequantize_base(torch.float32), block_shape,
                                                config.budget, seed=ctx.seed * 7919 + next(counter),
                                                base_scale=residual_base_scale(packed, config),
                                                max_shift=config.rscale_max_shift)
            packed.residual = ResidualBlocks.from_blocks(tuple(w.shape), block_shape, coords, q, scales)
        else:
            packed.residual = ResidualBlocks.empty(tuple(w.shape), block_shape)
        layer = FakeQuantLinear(packed.dequantize(linear.weight.dtype), linear.bias, act,
                                getattr(linear, "input_transform", None), packed, 4)
        return layer.to(linear.weight.device)

    n = len(replace_linears(model, make))
    return n, {"transform": config.transform, "residual_selection": "random (data-free speed form)",
               "budget": config.budget, "block": list(block_shape), "rscale": config.rscale,
               "rscale_max_shift": config.rscale_max_shift}


def _supports(config: MosaicQuantConfig) -> Supports:
    """The transforms' architectures; with ``transform="none"`` any causal LM (only linears are replaced)."""
    return Supports() if config.transform == "none" else TRANSFORM_SUPPORTS


@register_method("mosaicquant", config=MosaicQuantConfig, description=MosaicQuantConfig.description,
                 speed_form=_speed_form, supports=_supports)
def mosaicquant(model, config: MosaicQuantConfig, ctx):
    """Quantize ``model`` in place with MosaicQuant; fills ``ctx.info``."""
    t0 = time.perf_counter()
    calib = ctx.calib_tokens()
    transform_info = apply_transform(model, config.transform, calib, seed=ctx.seed, online_o=config.online_o,
                                     alpha=config.alpha, batch_size=config.calib_batch)
    kv = enable_kv_quant(model, config.kv_spec()) if config.kvbits < 16 else None
    t_transform = time.perf_counter() - t0
    recovered: dict[str, float] = {}
    clips: dict[str, list[float]] = {}

    def pca_layer(index, layer, stats):
        groups, hadamard = input_groups(stats, method="MosaicQuant transform='pca'")
        out = {}
        for g_index, group in enumerate(groups):
            hessian = stats[group[0]].hessian
            basis = resq_basis(hessian, config.n_high(hessian.shape[0]), seed=ctx.seed * 100003 + index * 16 + 2 * g_index,
                               low_group=config.pca_group)
            for name in group:
                out[name] = pca_input_transform(layer.get_submodule(name), stats[name].hessian, config, basis=basis)
        for name in hadamard:
            out[name] = pca_input_transform(layer.get_submodule(name), stats[name].hessian, config, basis=None)
        return out

    def quantize_layer(index, layer, stats):
        prefix = f"layers.{index}."
        acts = pca_layer(index, layer, stats) if config.transform == "pca" else {}
        per_input: dict[int, object] = {}  # one input's chosen quantizer
        for name, st in stats.items():
            linear = layer.get_submodule(name)
            hessian, act = acts.get(name, (st.hessian, None))
            if config.a_clip_search:
                if id(st) not in per_input:
                    # with pca the basis was set after the inputs were taken; other transforms ran before
                    transform = input_transform_of(linear) if acts else None
                    x = st.inputs if transform is None else transform(st.inputs)
                    shared = [layer.get_submodule(n).weight.data for n, s in stats.items() if s is st]
                    per_input[id(st)], _ = search_act_clip(config.act_spec() if act is None else act, x, shared)
                    clips[prefix + name] = _clip_ratios(per_input[id(st)])
                    st.inputs = None
                act = copy.deepcopy(per_input[id(st)])
            new, info = quantize_linear_mosaic(linear, hessian, config, ctx.seed * 7919 + index, act=act)
            set_module(layer, name, new)
            if "recovered" in info:
                recovered[prefix + name] = round(float(info["recovered"]), 5)

    calibrate_layerwise(model, calib, quantize_layer, batch_size=config.calib_batch,
                        keep_hessian=config.wbits < 16, keep_inputs=config.a_clip_search, log=ctx.log)
    memory = weight_memory(model)
    base_bytes = memory["base_values"] + memory["base_scales"]
    residual_bytes = memory["residual_values"] + memory["residual_scales"] + memory["residual_indices"]
    ctx.info.update(
        wbits=config.wbits, abits=config.abits, kv_bits=config.kvbits, kv_cache=kv,
        exec_path="simulated (fake-quant of the packed W4 + residual format)" if config.wbits == 4
        else "simulated (fake-quant activations, float weights)",
        transform=transform_info,
        online_transforms=online_transforms(model),
        memory_bytes=memory,
        residual_overhead=(residual_bytes / base_bytes) if base_bytes else 0.0,
        weight_bytes_vs_bf16=(memory["total_quantized_linears"] / memory["linear_bf16_equivalent"])
        if memory["linear_bf16_equivalent"] else None,
        distortion_recovered_calib_mean=(sum(recovered.values()) / len(recovered)) if recovered else None,
        distortion_recovered_calib=recovered,
        **({"a_clip_chosen": clips} if clips else {}),
        timing={"transform_s": round(t_transform, 2), "total_s": round(time.perf_counter() - t0, 2)},
    )
    return model
