"""RTN: round-to-nearest weights and activations (SPEC §3).

Weights: per output channel (or per group of ``w_group_size``), symmetric by default, with
the clipping search of the RTN/GPTQ reference code (grid 100, max shrink 0.8, error norm
2.4). Activations: per token, symmetric, ``a_clip`` of the range. Bits are config, so
W8A8 (``rtn:wbits=8:abits=8``), W4A16 (``rtn:abits=16``) and W4A4 (default) are one method.
The output head stays in 16 bits. The KV cache is not quantized (16 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

from mosaicquant.config import Config, check_range
from mosaicquant.errors import Unavailable
from mosaicquant.methods.qlinear import ActQuantSpec, fake_quant_linear_from, quantize_weight, replace_linears
from mosaicquant.methods.speed_form import check_w4a4, dense_w4
from mosaicquant.registry import register_method


@dataclass(frozen=True)
class RTNConfig(Config):
    """RTN options.

    Attributes:
        wbits: weight bits, 2..8, or 16 for unquantized weights.
        abits: activation bits, 2..8, or 16 for unquantized activations.
        w_group_size: group along the input dim, or None for per output channel.
        w_clip_search: search a per-channel clipping ratio for the weights.
        w_symmetric / a_symmetric: symmetric grids (True) or asymmetric with zero points.
        a_clip: fraction of each token's activation range kept, (0, 1].
    """

    description = "round-to-nearest W/A quantization (per-channel weights with clip search, per-token activations)"

    wbits: int = 4
    abits: int = 4
    w_group_size: int | None = None
    w_clip_search: bool = True
    w_symmetric: bool = True
    a_symmetric: bool = True
    a_clip: float = 1.0

    def validate(self):
        check_range("wbits", self.wbits, 2, 8, integer=True, extra=(16,))
        check_range("abits", self.abits, 2, 8, integer=True, extra=(16,))
        if self.w_group_size is not None:
            check_range("w_group_size", self.w_group_size, 1, None, integer=True)
        check_range("a_clip", self.a_clip, 0.01, 1.0)


def _speed_form(model, config: RTNConfig, ctx):
    """RTN's format is its method: round-to-nearest W4 layers, per-token activations (symmetric weights only)."""
    check_w4a4("rtn", config.wbits, config.abits)
    act = ActQuantSpec(bits=config.abits, symmetric=config.a_symmetric, clip_ratio=config.a_clip)
    if not config.w_symmetric:
        raise Unavailable("no fast path: asymmetric weights; the W4A4 kernels take symmetric 4-bit weights")
    return dense_w4(model, act, config.wbits, config.w_group_size), {}


@register_method("rtn", config=RTNConfig, description=RTNConfig.description, speed_form=_speed_form,
                 seeded=False)
def rtn(model, config: RTNConfig, ctx):
    """Quantize every linear but the output head by round-to-nearest."""
    act = ActQuantSpec(bits=config.abits, symmetric=config.a_symmetric, clip_ratio=config.a_clip)

    def make(name, linear):
        qweight = None
        if config.wbits < 16:
            qweight = quantize_weight(linear.weight.data, config.wbits, symmetric=config.w_symmetric,
                                      group_size=config.w_group_size, clip_search=config.w_clip_search)
        return fake_quant_linear_from(linear, qweight, act, config.wbits)

    replaced = replace_linears(model, make)
    ctx.info.update(wbits=config.wbits, abits=config.abits, kv_bits=16, quantized_linears=len(replaced),
                    exec_path="simulated (fake-quant)")
    return model
