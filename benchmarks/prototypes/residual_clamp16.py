"""Kept: the accuracy bound behind the merged walk's opt-in, rscale_max_shift=3.

SmolLM2-135M accuracy of MosaicQuant (default, j <= 4) with its residual clamped after the fit so that every kept
value's ``16 q + 2^(4-j) r`` is an int8 (an upper bound of what merging in the dense loop's ``s_w / 16`` units would
cost without a refit, Next 3). CPU; prints the perplexity and how many values changed.

    python3 benchmarks/prototypes/residual_clamp16.py OUT_DIR
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import mosaicquant.methods.mosaicquant as mq  # noqa: E402
from mosaicquant.methods.format import ResidualBlocks, pack_int4, residual_shifts, unpack_int4  # noqa: E402
from mosaicquant.methods.qlinear import FakeQuantLinear  # noqa: E402

stats_all = {"values": 0, "clamped": 0}
orig = mq.quantize_linear_mosaic


def clamped(linear, hessian, config, seed):
    layer, stats = orig(linear, hessian, config, seed)
    p = layer.packed
    r = p.residual
    if r is None or r.num_blocks == 0:
        return layer, stats
    sh = residual_shifts(r, p.scales)
    assert sh is not None
    bn, bk = r.block_shape
    n, k = p.shape
    q = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=torch.long)
    q[:n, :k] = unpack_int4(p.qweight, k).long()
    vals = unpack_int4(r.values.reshape(-1, bk // 2), bk).reshape(-1, bn, bk).long()
    out = vals.clone()
    for b, (i, c) in enumerate(r.coords.tolist()):
        base = q[i * bn:(i + 1) * bn, c * bk:(c + 1) * bk]
        step = (2 ** (4 - sh[b].long())).unsqueeze(1)
        lo = torch.div(-128 - 16 * base + step - 1, step, rounding_mode="floor")  # ceil((-128 - 16q) / step)
        hi = torch.div(127 - 16 * base, step, rounding_mode="floor")
        new = torch.maximum(torch.minimum(vals[b], hi), lo).clamp(-8, 7)
        stats_all["values"] += new.numel()
        stats_all["clamped"] += int((new != vals[b]).sum())
        out[b] = new
    values = pack_int4(out.reshape(-1, bk).to(torch.int8)).reshape(r.values.shape)
    p.residual = ResidualBlocks(r.shape, r.block_shape, r.coords, r.row_ptr, values, r.scales)
    new_layer = FakeQuantLinear(p.dequantize(linear.weight.dtype), linear.bias, layer.act, layer.input_transform, p, 4)
    return new_layer.to(linear.weight.device), stats


mq.quantize_linear_mosaic = clamped
from mosaicquant.harness.cli import main  # noqa: E402
rc = main(["run", "--model", "smollm2-135m", "--methods", "mosaicquant", "--suites", "accuracy",
           "--calib-samples", "8", "--calib-seqlen", "1024", "--max-chunks", "8", "--out", sys.argv[1]])
print("clamped", stats_all)
sys.exit(rc)
