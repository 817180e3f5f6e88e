"""QuaRot: rotations that remove outliers, then GPTQ (or RTN) weights and 4-bit activations and KV (SPEC §3).

Pipeline (the authors' defaults; every piece is the project's shared one):

1. **Rotation** (:func:`mosaicquant.methods.rotation.rotate_model`, function-preserving):
   RMSNorm weights folded into the following linears; a random Hadamard rotation of the
   residual stream (``rotation="hadamard"``, seeded by the run's seed; ``"orthogonal"``
   draws a Haar-random orthogonal matrix instead); a per-head Hadamard folded into v_proj /
   o_proj; online Hadamard transforms on the down_proj input (sizes that are not powers of
   two through Paley factors of order 12, 20, 28, 36, ...) and on the o_proj input.
2. **KV cache** (``kvbits < 16``, :mod:`mosaicquant.methods.kvcache`): the online Hadamard
   over the head dimension on Q and K after RoPE, then K and V fake-quantized per token and
   head (``kv_group_size`` None) — **asymmetric** with clip ``kv_clip`` = 0.95 by default, as
   the QuaRot paper states for its KV cache ("asymmetric, group size 128 = head dim, clip
   0.95"); ``kv_symmetric=true`` switches to the symmetric grid. Installed before
   calibration, so later layers are calibrated on the attention they will run.
3. **Weights**: GPTQ (:func:`mosaicquant.methods.gptq.gptq_quantize`) layer by layer on the
   shared calibration tokens (:func:`mosaicquant.methods.calibration.calibrate_layerwise`,
   inputs from the already-quantized earlier layers), ``percdamp`` 0.01, ``act_order``,
   symmetric per output channel (or per ``w_group_size``) with the RTN clipping search;
   4-bit weights are packed (FP16 scales) like every other 4-bit method. ``w_quant="rtn"`` is the
   paper's other weight quantizer ("QuaRot-RTN"): round-to-nearest on the rotated weights, per output
   channel (or ``w_group_size``) with the same clipping search when ``w_clip_search``; it reads no
   calibration tokens and runs no forward pass (``percdamp``, ``act_order`` and ``calib_batch`` are unused).
4. **Activations**: every linear input but the output head, per token, symmetric,
   ``a_clip`` 0.9 of the range. The output head stays in 16 bits.

``wbits``/``abits``/``kvbits`` = 16 leave that part unquantized, so
``quarot:wbits=16:abits=16:kvbits=16`` is the rotated float model (same function as the
original) and ``quarot:kvbits=16`` is W4A4 with a float KV cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mosaicquant.config import Config, check_choice, check_range
from mosaicquant.methods.calibration import gptq_quantize_model
from mosaicquant.methods.kvcache import KVQuantSpec, enable_kv_quant
from mosaicquant.methods.qlinear import (
    ActQuantSpec, fake_quant_linear_from, quantize_weight, replace_linears, weight_memory,
)
from mosaicquant.methods.rotation import ROTATIONS, TRANSFORM_SUPPORTS, online_transforms, rotate_model
from mosaicquant.methods.speed_form import rotated_speed_form
from mosaicquant.registry import register_method

__all__ = ["QuaRotConfig", "quarot", "WEIGHT_QUANTIZERS"]

#: QuaRot's weight quantizers: GPTQ on calibration Hessians (the paper's main rows) or round-to-nearest
WEIGHT_QUANTIZERS = ("gptq", "rtn")


@dataclass(frozen=True)
class QuaRotConfig(Config):
    """QuaRot options (command line: ``quarot:kvbits=16:w_group_size=128``).

    Attributes:
        wbits: weight bits, 2..8, or 16 (unquantized).
        abits: activation bits, 2..8, or 16.
        kvbits: KV-cache bits, 2..8, or 16 (float cache, no Q/K rotation).
        a_clip: fraction of each token's activation range kept, (0, 1].
        kv_clip: fraction of each K/V group's range kept, (0, 1].
        kv_symmetric: symmetric K/V grid (default asymmetric, as the QuaRot paper).
        kv_group_size: K/V group along the head dim, or None (one group per head and token).
        w_group_size: weight group along the input dim, or None (per output channel).
        w_quant: weight quantizer, "gptq" (default) or "rtn" (QuaRot-RTN: no calibration pass).
        percdamp: GPTQ damping relative to the mean Hessian diagonal.
        act_order: GPTQ quantizes columns by decreasing Hessian diagonal.
        w_clip_search: search each weight scale's clipping ratio (RTN/GPTQ convention).
        rotation: residual rotation, "hadamard" (random Hadamard) or "orthogonal".
        calib_batch: calibration sequences per forward pass.
    """

    description = "QuaRot: Hadamard rotations + GPTQ W4, per-token A4, KV4 with online Q/K rotation"

    wbits: int = 4
    abits: int = 4
    kvbits: int = 4
    a_clip: float = 0.9
    kv_clip: float = 0.95
    kv_symmetric: bool = False
    kv_group_size: int | None = None
    w_group_size: int | None = None
    w_quant: str = "gptq"
    percdamp: float = 0.01
    act_order: bool = True
    w_clip_search: bool = True
    rotation: str = "hadamard"
    calib_batch: int = 4

    def validate(self):
        for name in ("wbits", "abits", "kvbits"):
            check_range(name, getattr(self, name), 2, 8, integer=True, extra=(16,))
        check_range("a_clip", self.a_clip, 0.01, 1.0)
        check_range("kv_clip", self.kv_clip, 0.01, 1.0)
        if self.kv_group_size is not None:
            check_range("kv_group_size", self.kv_group_size, 1, None, integer=True)
        if self.w_group_size is not None:
            check_range("w_group_size", self.w_group_size, 2, None, integer=True)
        check_choice("w_quant", self.w_quant, WEIGHT_QUANTIZERS)
        check_range("percdamp", self.percdamp, 0.0, 1.0)
        check_choice("rotation", self.rotation, ROTATIONS)
        check_range("calib_batch", self.calib_batch, 1, None, integer=True)

    def kv_spec(self) -> KVQuantSpec:
        """The KV-cache spec: Q/K rotation and K/V quantization when ``kvbits < 16``."""
        return KVQuantSpec(bits=self.kvbits, group_size=self.kv_group_size, symmetric=self.kv_symmetric,
                           clip_ratio=self.kv_clip, rotate_qk=self.kvbits < 16)

    def act_spec(self) -> ActQuantSpec:
        """Per-token symmetric activation quantizer."""
        return ActQuantSpec(bits=self.abits, symmetric=True, clip_ratio=self.a_clip)


def _rtn_quantize_rotated(model, config: QuaRotConfig) -> int:
    """QuaRot-RTN's weights: every rotated linear but the output head rounded to nearest; returns the count.

    Each new layer takes over its original's online input transform, as the GPTQ path's layers do.
    """
    act = config.act_spec()

    def make(name, linear):
        qweight = None
        if config.wbits < 16:
            qweight = quantize_weight(linear.weight.data.to(torch.float32), config.wbits, symmetric=True,
                                      group_size=config.w_group_size, clip_search=config.w_clip_search)
        return fake_quant_linear_from(linear, qweight, act, config.wbits)

    return len(replace_linears(model, make))


# o_proj's input gets an online Hadamard, as the method's rotation gives it one
@register_method("quarot", config=QuaRotConfig, description=QuaRotConfig.description,
                 speed_form=rotated_speed_form(lambda config: True), supports=TRANSFORM_SUPPORTS)
def quarot(model, config: QuaRotConfig, ctx):
    """Quantize ``model`` in place with QuaRot; fills ``ctx.info``."""
    t0 = time.perf_counter()
    rotation = rotate_model(model, seed=ctx.seed, rotation=config.rotation, online_down=True, online_o=True)
    kv = enable_kv_quant(model, config.kv_spec())
    t_rotate = time.perf_counter() - t0
    if config.w_quant == "rtn":
        replaced = _rtn_quantize_rotated(model, config)
    else:
        replaced = gptq_quantize_model(
            model, ctx.calib_tokens(), wbits=config.wbits, act=config.act_spec(), w_group_size=config.w_group_size,
            percdamp=config.percdamp, act_order=config.act_order, clip_search=config.w_clip_search,
            batch_size=config.calib_batch, log=ctx.log)
    ctx.info.update(
        wbits=config.wbits, abits=config.abits, kv_bits=config.kvbits,
        kv_cache=kv,
        exec_path="simulated (fake-quant; online Hadamard on down_proj/o_proj inputs and Q/K)",
        weight_quantizer=config.w_quant if config.wbits < 16 else None,
        quantized_linears=replaced,
        transform={k: v for k, v in rotation.items() if k not in ("fused_norms", "per_head", "online")}
        | {"online_linears": len(rotation["online"])},
        online_transforms=online_transforms(model),
        memory_bytes=weight_memory(model),
        timing={"rotate_s": round(t_rotate, 2), "total_s": round(time.perf_counter() - t0, 2)},
    )
    return model
