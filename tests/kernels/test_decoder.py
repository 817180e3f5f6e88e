"""The decoder-step kernels (RMSNorm, RoPE + KV write, decode attention, SiLU·mul) against their references."""

import math

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels.decoder import (
    KVFormat,
    KVScales,
    attention_splits,
    decode_attention,
    decode_attention_reference,
    decode_rope_attention,
    decode_rope_attention_reference,
    kv4_dequantize_reference,
    kv4_quantize_reference,
    rmsnorm,
    rmsnorm_quant,
    rmsnorm_quant_reference,
    rmsnorm_reference,
    rope_kv,
    rope_kv_reference,
    silu_mul,
    silu_mul_reference,
)
from mosaicquant.kernels.tile_table import TileTable
from tests.kernels._helpers import DEVICE, needs_triton

pytestmark = needs_triton()
BF16 = torch.bfloat16
# fp32 sums in another order and rsqrt against 1/sqrt move a 16-bit result by at most one ulp, rarely
ULP_FRACTION = 0.02
# attention: bf16 probabilities into the value product (as flash attention) against an fp32 softmax
ATTN_RTOL = 2.0**-6
ATTN_ATOL = 4e-3


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps (both bf16, same sign region)."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return (ia - ib).abs()


def _assert_ulp_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    out, ref = out.cpu(), ref.cpu()
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite entries (unwritten poison?)"
    d = _ulps(out, ref)
    off = (d > 0).float().mean().item()
    assert d.max().item() <= 1 and off <= ULP_FRACTION, (
        f"{what}: max {d.max().item()} ulps, {off:.3%} of entries off (allowed 1 ulp on <= {ULP_FRACTION:.0%})")


@pytest.mark.parametrize("t,n", [(1, 576), (13, 100), (67, 256)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(t, n, with_residual):
    g = torch.Generator().manual_seed(t * n)
    x = torch.randn(t, n, generator=g).to(BF16).to(DEVICE)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(BF16).to(DEVICE)
    res = torch.randn(t, n, generator=g).to(BF16).to(DEVICE) if with_residual else None
    res_ref = res.clone() if with_residual else None
    out = torch.full_like(x, float("nan"))
    y = rmsnorm(x, w, 1e-5, residual=res, out=out, kernel="triton")
    ref = rmsnorm_reference(x, w, 1e-5, res_ref)
    assert y is out
    _assert_ulp_close(y, ref, f"rmsnorm t={t} n={n}")
    if with_residual:
        assert torch.equal(res, res_ref), "the residual sum is one rounding of x + residual: bit-exact"


@pytest.mark.parametrize("t,n", [(1, 4100), (13, 100), (5, 576)])
@pytest.mark.parametrize("layout", ["packed", "split8"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_quant_equals_the_norm_then_the_quantizer(t, n, layout, with_residual):
    from mosaicquant.kernels.act_quant import quantize_activations_triton

    g = torch.Generator().manual_seed(t + n)
    x = torch.randn(t, n, generator=g).to(BF16).to(DEVICE)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(BF16).to(DEVICE)
    res = torch.randn(t, n, generator=g).to(BF16).to(DEVICE) if with_residual else None
    res_two = res.clone() if with_residual else None
    res_ref = res.cpu().clone() if with_residual else None
    q, scale = rmsnorm_quant(x, w, 1e-5, res, clip_ratio=0.9, layout=layout, kernel="triton")
    q2, scale2 = quantize_activations_triton(rmsnorm(x, w, 1e-5, res_two, kernel="triton"), 0.9, layout=layout)
    assert torch.equal(q, q2) and torch.equal(scale, scale2), "fused: the same integers and scales as two kernels"
    if with_residual:
        assert torch.equal(res, res_two)
    # the PyTorch reference of the pair agrees up to a norm output one ulp away (which may move an integer)
    qr, sr = rmsnorm_quant_reference(x.cpu(), w.cpu(), 1e-5, res_ref, 0.9, layout)
    assert q.dtype == qr.dtype and q.shape == qr.shape
    assert torch.allclose(scale.cpu(), sr, rtol=2.0**-7)
    assert (q.cpu() != qr).float().mean().item() <= ULP_FRACTION


@pytest.mark.parametrize("layout", ["packed", "split8"])
@pytest.mark.parametrize("kind,k", [("plain", 100), ("plain", 4100), ("hadamard", 256), ("hadamard", 1536)])
def test_gated_quantizers_equal_silu_mul_then_the_quantizer(layout, kind, k):
    # down_proj's quantizer computes silu(gate)·up as it loads: the same integers as silu_mul first
    from mosaicquant.kernels.act_quant import quantize_activations_triton
    from mosaicquant.kernels.hadamard_quant import hadamard_quantize_triton
    from mosaicquant.methods.hadamard import OnlineHadamard, random_signs

    g = torch.Generator().manual_seed(k)
    gate_up = (2 * torch.randn(5, 2 * k, generator=g)).to(BF16).to(DEVICE)
    product = silu_mul(gate_up, kernel="triton")
    if kind == "plain":
        got = quantize_activations_triton(gate_up, 0.9, layout=layout, gated=True)
        want = quantize_activations_triton(product, 0.9, layout=layout)
    else:
        had = OnlineHadamard(k, signs=random_signs(k, seed=k)).to(DEVICE)
        got = hadamard_quantize_triton(gate_up, had, 0.9, layout=layout, gated=True)
        want = hadamard_quantize_triton(product, had, 0.9, layout=layout)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_gated_input_shapes_are_checked():
    from mosaicquant.kernels.act_quant import quantize_activations_triton
    from mosaicquant.kernels.hadamard_quant import hadamard_quantize_triton
    from mosaicquant.methods.hadamard import OnlineHadamard

    with pytest.raises(UserInputError, match="gated input must be BF16/FP16"):
        quantize_activations_triton(torch.randn(2, 7).to(BF16).to(DEVICE), gated=True)
    with pytest.raises(UserInputError, match="gated input holds"):
        hadamard_quantize_triton(torch.randn(2, 256).to(BF16).to(DEVICE), OnlineHadamard(256), gated=True)


def test_rmsnorm_reference_is_transformers_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(96, eps=1e-6).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(96))
    x = torch.randn(5, 96).to(BF16)
    assert torch.equal(rmsnorm_reference(x, norm.weight.data, 1e-6), norm(x))


def _rope_inputs(t_per_seq, batch, heads, kv_heads, d, length, seed):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                      max_position_embeddings=length)
    rot = LlamaRotaryEmbedding(cfg)
    cos, sin = rot(torch.empty(1, dtype=BF16), torch.arange(length)[None])
    t = batch * t_per_seq
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(BF16)
    positions = torch.randint(0, length, (t,), generator=g)
    return qkv, positions, cos[0].contiguous(), sin[0].contiguous()


@pytest.mark.parametrize("heads,kv_heads,d,qk_norm", [(4, 2, 32, False), (6, 2, 64, True), (3, 3, 16, False)])
def test_rope_kv_matches_reference(heads, kv_heads, d, qk_norm):
    batch, per_seq, length = 3, 5, 40
    qkv, pos, cos, sin = _rope_inputs(per_seq, batch, heads, kv_heads, d, length, heads * d)
    # distinct positions within a sequence (a cache slot is written once)
    pos = torch.cat([torch.randperm(length)[:per_seq] for _ in range(batch)])
    qn = (1 + 0.2 * torch.randn(d)).to(BF16) if qk_norm else None
    kn = (1 + 0.2 * torch.randn(d)).to(BF16) if qk_norm else None
    shape = (batch, kv_heads, length, d)
    kc, vc = torch.full(shape, float("nan"), dtype=BF16), torch.full(shape, float("nan"), dtype=BF16)
    kr, vr = kc.clone(), vc.clone()
    dev = [x.to(DEVICE) if x is not None else None for x in (qkv, pos, cos, sin, kc, vc, qn, kn)]
    out = torch.full((qkv.shape[0], heads, d), float("nan"), dtype=BF16, device=DEVICE)
    q = rope_kv(dev[0], dev[1], dev[2], dev[3], dev[4], dev[5], heads, kv_heads, per_seq, dev[6], dev[7], 1e-6,
                out=out, kernel="triton")
    qr = rope_kv_reference(qkv, pos, cos, sin, kr, vr, heads, kv_heads, per_seq, qn, kn, 1e-6)
    _assert_ulp_close(q, qr, "rotated q")
    written = ~torch.isnan(kr.float())
    assert torch.equal(written, ~torch.isnan(dev[4].cpu().float())), "k written exactly at the tokens' slots"
    _assert_ulp_close(dev[4].cpu()[written].reshape(-1, d), kr[written].reshape(-1, d), "rotated k in the cache")
    assert torch.equal(dev[5].cpu()[written], vr[written]), "v is copied as it is"


def test_rope_reference_is_transformers_rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv_heads, d = 4, 2, 32
    qkv, pos, cos, sin = _rope_inputs(6, 1, heads, kv_heads, d, 64, 1)
    pos = torch.arange(6)
    kc = torch.zeros(1, kv_heads, 64, d, dtype=BF16)
    q = rope_kv_reference(qkv, pos, cos, sin, kc, kc.clone(), heads, kv_heads, 6)
    qh = qkv[:, :heads * d].reshape(1, 6, heads, d).transpose(1, 2)
    kh = qkv[:, heads * d:(heads + kv_heads) * d].reshape(1, 6, kv_heads, d).transpose(1, 2)
    q_hf, k_hf = apply_rotary_pos_emb(qh, kh, cos[pos][None], sin[pos][None])
    assert torch.equal(q, q_hf[0].transpose(0, 1))
    assert torch.equal(kc[0, :, :6], k_hf[0])


@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 4, 32), (9, 3, 64)])
@pytest.mark.parametrize("chunk", [None, 64, 128])
def test_decode_attention_matches_reference(heads, kv_heads, d, chunk):
    g = torch.Generator().manual_seed(heads * d)
    b, length = 4, 200
    q = torch.randn(b, heads, d, generator=g).to(BF16)
    kc = torch.randn(b, kv_heads, length, d, generator=g).to(BF16)
    vc = torch.randn(b, kv_heads, length, d, generator=g).to(BF16)
    lengths = torch.tensor([1, 37, 64, 200], dtype=torch.int32)
    ref = decode_attention_reference(q, kc, vc, lengths, d ** -0.5)
    args = (q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), lengths.to(DEVICE), d ** -0.5)
    out = torch.full((b, heads * d), float("nan"), dtype=BF16, device=DEVICE)
    y = decode_attention(*args, chunk=chunk, out=out, kernel="triton").cpu().float()
    assert torch.isfinite(y).all(), "unwritten outputs"
    err = (y - ref.float()).abs()
    bad = err > ATTN_RTOL * ref.float().abs() + ATTN_ATOL
    assert not bad.any(), f"{int(bad.sum())} outputs off, max err {err.max().item():.3g}"
    # a length-1 sequence attends only its first key: the output is that value
    assert torch.allclose(y[0].reshape(heads, d), vc[0, :, 0].float().repeat_interleave(heads // kv_heads, 0),
                          rtol=0, atol=1e-2)


@pytest.mark.parametrize("heads,kv_heads,d,qk_norm", [(8, 2, 64, False), (6, 2, 128, True), (4, 4, 32, False)])
@pytest.mark.parametrize("chunk,direct", [(None, True), (64, True), (128, True), (256, True), (256, False)])
def test_decode_rope_attention_is_rope_kv_then_attention(heads, kv_heads, d, qk_norm, chunk, direct, monkeypatch, tile_table):
    # RoPE inside the attention: the cache as rope_kv leaves it, the output as rope_kv + decode_attention give it;
    # a one-chunk cache (256 keys, and the default chunk here) written by the programs themselves or combined
    tile_table(attn_direct_one_chunk=direct)
    g = torch.Generator().manual_seed(heads * d + (chunk or 0))
    b, length = 4, 200
    qkv, _, cos, sin = _rope_inputs(1, b, heads, kv_heads, d, length, heads + d)
    pos = torch.tensor([0, 36, 63, 199])  # first key only, ragged, a chunk's last slot, the cache's last
    qn = (1 + 0.2 * torch.randn(d, generator=g)).to(BF16) if qk_norm else None
    kn = (1 + 0.2 * torch.randn(d, generator=g)).to(BF16) if qk_norm else None
    shape = (b, kv_heads, length, d)
    kc, vc = torch.randn(shape, generator=g).to(BF16), torch.randn(shape, generator=g).to(BF16)
    kr, vr = kc.clone(), vc.clone()
    ref = decode_rope_attention_reference(qkv, pos, cos, sin, kr, vr, heads, kv_heads, d ** -0.5, qn, kn, 1e-6)
    dev = [x.to(DEVICE) if x is not None else None for x in (qkv, pos, cos, sin, qn, kn)]
    caches = {name: (kc.clone().to(DEVICE), vc.clone().to(DEVICE)) for name in ("fused", "two ops")}
    out = torch.full((b, heads * d), float("nan"), dtype=BF16, device=DEVICE)
    y = decode_rope_attention(dev[0], dev[1], dev[2], dev[3], *caches["fused"], heads, kv_heads, d ** -0.5,
                              dev[4], dev[5], 1e-6, chunk=chunk, out=out, kernel="triton")
    assert y is out
    y = y.cpu().float()
    assert torch.isfinite(y).all(), "unwritten outputs"
    q = rope_kv(dev[0], dev[1], dev[2], dev[3], *caches["two ops"], heads, kv_heads, 1, dev[4], dev[5], 1e-6,
                kernel="triton")
    y2 = decode_attention(q, *caches["two ops"], (dev[1] + 1).to(torch.int32), d ** -0.5, chunk=chunk,
                          kernel="triton").cpu().float()
    if qk_norm:  # the per-head norm's fp32 sum may round its last bit otherwise in another kernel
        _assert_ulp_close(caches["fused"][0], caches["two ops"][0], "the new keys against rope_kv's")
    else:
        assert torch.equal(caches["fused"][0], caches["two ops"][0]), "the new keys are rope_kv's"
    assert torch.equal(caches["fused"][1], caches["two ops"][1]), "the new values are rope_kv's"
    _assert_ulp_close(caches["fused"][0].cpu(), kr, "the rotated keys in the cache")
    assert torch.equal(caches["fused"][1].cpu(), vr)
    for what, want in (("the two ops", y2), ("the reference", ref.float())):
        err = (y - want).abs()
        bad = err > ATTN_RTOL * want.abs() + ATTN_ATOL
        assert not bad.any(), f"against {what}: {int(bad.sum())} outputs off, max err {err.max().item():.3g}"
    # a position-0 token attends only its own key: the output is its value, whatever the cache held
    assert torch.allclose(y[0].reshape(heads, d), vr[0, :, 0].float().repeat_interleave(heads // kv_heads, 0),
                          rtol=0, atol=1e-2)


@pytest.mark.parametrize("heads,kv_heads,d,qk_norm,chunk", [(8, 2, 64, False, None), (6, 2, 128, True, 64)])
def test_new_token_from_registers_over_the_16bit_cache(heads, kv_heads, d, qk_norm, chunk, monkeypatch, tile_table):
    # the form before ATTN_NEW_CACHED: the new key and value added to the softmax from registers after the loop
    tile_table(attn_new_cached=False)
    test_decode_rope_attention_is_rope_kv_then_attention(heads, kv_heads, d, qk_norm, chunk, True, monkeypatch,
                                                         tile_table)


def _kv4_cache(b, kv_heads, length, d, g):
    """Random packed caches and scales (every slot holds something: a slot the kernel must write shows)."""
    kc = torch.randint(0, 256, (b, kv_heads, length, d // 2), dtype=torch.uint8, generator=g)
    vc = torch.randint(0, 256, (b, kv_heads, length, d // 2), dtype=torch.uint8, generator=g)
    shape = (b, kv_heads, length)
    # grids about zero, as for unit-scale keys and values (zero points 6-10, steps 0.02-0.17)
    scales = KVScales(0.02 + 0.15 * torch.rand(shape, generator=g), torch.randint(6, 11, shape, generator=g).float(),
                      0.02 + 0.15 * torch.rand(shape, generator=g), torch.randint(6, 11, shape, generator=g).float())
    return kc, vc, scales


def _copy(kc, vc, scales, device):
    return (kc.clone().to(device), vc.clone().to(device),
            KVScales(*(t.clone().to(device) for t in (scales.k_scale, scales.k_zero, scales.v_scale, scales.v_zero))))


@pytest.mark.parametrize("symmetric,clip", [(True, 1.0), (False, 0.95), (True, 0.9)])
def test_kv4_quantizer_is_the_methods_fake_quantizer(symmetric, clip):
    from mosaicquant.methods.quant import fake_quantize

    g = torch.Generator().manual_seed(int(clip * 100))
    x = (torch.randn(6, 3, 64, generator=g) * torch.rand(6, 3, 1, generator=g) * 4).to(BF16)
    x[0, 0] = 0  # an all-zero group: scale 1
    packed, scale, zero = kv4_quantize_reference(x, symmetric, clip)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 3, 32) and scale.shape == zero.shape == (6, 3)
    deq = kv4_dequantize_reference(packed, scale, zero, BF16)
    assert torch.equal(deq, fake_quantize(x, 4, symmetric=symmetric, clip_ratio=clip))
    # channel j in the low nibble of byte j, channel j + D/2 in its high nibble
    u = torch.round(x.float() / scale[..., None]) + zero[..., None]
    u = u.clamp(0, 15).to(torch.uint8)
    assert torch.equal(packed & 0xF, u[..., :32]) and torch.equal(packed >> 4, u[..., 32:])
    assert scale[0, 0] == 1 and (zero == 8).all() == symmetric


@pytest.mark.parametrize("heads,kv_heads,d,qk_norm", [(8, 2, 64, False), (6, 2, 32, True)])
@pytest.mark.parametrize("symmetric,rotate", [(False, True), (True, False)])
def test_rope_kv_writes_the_4bit_cache(heads, kv_heads, d, qk_norm, symmetric, rotate):
    # the kernel's queries, packed integers, scales, zeros and dequantized prompt equal the reference's
    batch, per_seq, length = 2, 9, 24
    qkv, pos, cos, sin = _rope_inputs(per_seq, batch, heads, kv_heads, d, length, heads * d + 1)
    pos = torch.cat([torch.randperm(length)[:per_seq] for _ in range(batch)])
    g = torch.Generator().manual_seed(d)
    qn = (1 + 0.2 * torch.randn(d, generator=g)).to(BF16) if qk_norm else None
    kn = (1 + 0.2 * torch.randn(d, generator=g)).to(BF16) if qk_norm else None
    kv = KVFormat(4, symmetric, 0.95, rotate)
    cache = _kv4_cache(batch, kv_heads, length, d, g)
    kr, vr, sr = _copy(*cache, "cpu")
    dq_shape = (batch, kv_heads, length, d)
    dr = (torch.zeros(dq_shape, dtype=BF16), torch.zeros(dq_shape, dtype=BF16))
    qref = rope_kv_reference(qkv, pos, cos, sin, kr, vr, heads, kv_heads, per_seq, qn, kn, 1e-6, kv, sr, dr)
    kc, vc, sc = _copy(*cache, DEVICE)
    dq = tuple(torch.full(dq_shape, float("nan"), dtype=BF16, device=DEVICE) for _ in range(2))
    dev = [x.to(DEVICE) if x is not None else None for x in (qkv, pos, cos, sin, qn, kn)]
    q = rope_kv(*dev[:4], kc, vc, heads, kv_heads, per_seq, dev[4], dev[5], 1e-6, kernel="triton",
                kv=kv, scales=sc, dequant=dq).cpu()
    if rotate or qk_norm:  # fp32 sums in another order: one ulp before a quantizer can move its integer
        # (values next to zero may land on either side of it: an absolute floor)
        assert torch.allclose(q.float(), qref.float(), rtol=2.0**-8, atol=1e-3 * qref.float().abs().max().item())
        slots = (torch.arange(batch).repeat_interleave(per_seq), pos)  # [T, kv_heads, D] after the permute
        got = kv4_dequantize_reference(kc.cpu(), sc.k_scale.cpu(), sc.k_zero.cpu(), BF16).transpose(1, 2)[slots]
        want = kv4_dequantize_reference(kr, sr.k_scale, sr.k_zero, BF16).transpose(1, 2)[slots]
        step = sr.k_scale.transpose(1, 2)[slots][..., None]
        diff = (got.float() - want.float()).abs()
        assert (diff <= 1.01 * step).all() and (diff > 0).float().mean() < 0.02
    else:
        assert torch.equal(q, qref)
        assert torch.equal(kc.cpu(), kr) and torch.equal(sc.k_scale.cpu(), sr.k_scale)
        assert torch.equal(sc.k_zero.cpu(), sr.k_zero)
    assert torch.equal(vc.cpu(), vr) and torch.equal(sc.v_scale.cpu(), sr.v_scale)
    assert torch.equal(sc.v_zero.cpu(), sr.v_zero)
    for i in range(batch):  # the dequantized prompt: written at every token's slot, the simulation's values
        at = pos[i * per_seq:(i + 1) * per_seq]
        assert torch.equal(dq[1].cpu()[i, :, at], dr[1][i, :, at])
        got_k = dq[0].cpu()[i, :, at]
        assert torch.isfinite(got_k.float()).all()
        if not (rotate or qk_norm):
            assert torch.equal(got_k, dr[0][i, :, at])


@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 4, 32)])
@pytest.mark.parametrize("symmetric,rotate", [(False, True), (True, False)])
@pytest.mark.parametrize("chunk,direct", [(None, True), (128, True), (256, True), (256, False)])
def test_decode_rope_attention_over_the_4bit_cache(heads, kv_heads, d, symmetric, rotate, chunk, direct,
                                                   monkeypatch, tile_table):
    # the integers into the dots, scales and zeros outside: attention over the dequantized cache to bf16 accuracy
    tile_table(attn_direct_one_chunk=direct)
    _check_4bit_attention(heads, kv_heads, d, symmetric, rotate, chunk)


@pytest.mark.parametrize("biased,block_n", [(True, 64), (False, 64), (True, 128)])
@pytest.mark.parametrize("chunk", [None, 128])
def test_4bit_attention_loop_variants(biased, block_n, chunk, monkeypatch, tile_table):
    # the integers into the dots as they are or biased by 128 (zero points too), and the loop's step
    tile_table(attn_kv4_biased=biased)
    tile_table(attn_kv4_block_n=block_n)
    _check_4bit_attention(8, 2, 64, False, True, chunk)


@pytest.mark.parametrize("new_cached", [False, True])
@pytest.mark.parametrize("heads,kv_heads,symmetric", [(8, 2, False), (4, 4, True)])
def test_4bit_attention_prologue_forms(new_cached, heads, kv_heads, symmetric, monkeypatch, tile_table):
    # the new key and value from registers or read back by the loop: the same attention, and the same cache
    # (_check_4bit_attention checks both)
    tile_table(attn_new_cached=new_cached)
    _check_4bit_attention(heads, kv_heads, 64, symmetric, True, None)


@pytest.mark.parametrize("rotate", [True, False])
def test_4bit_attention_in_fp16(rotate):
    # an FP16 model: the biased integers converted by the compiler (the byte permutes are BF16's)
    _check_4bit_attention(8, 2, 64, False, rotate, None, torch.float16)


def _check_4bit_attention(heads, kv_heads, d, symmetric, rotate, chunk, dtype=BF16):
    b, length = 4, 200
    qkv, _, cos, sin = (x.to(dtype) if x.is_floating_point() else x
                        for x in _rope_inputs(1, b, heads, kv_heads, d, length, heads + d))
    pos = torch.tensor([0, 36, 63, 199])
    g = torch.Generator().manual_seed(heads * d + (chunk or 0))
    kv = KVFormat(4, symmetric, 0.95 if not symmetric else 1.0, rotate)
    cache = _kv4_cache(b, kv_heads, length, d, g)
    kr, vr, sr = _copy(*cache, "cpu")
    ref = decode_rope_attention_reference(qkv, pos, cos, sin, kr, vr, heads, kv_heads, d ** -0.5, kv=kv, scales=sr)
    kc, vc, sc = _copy(*cache, DEVICE)
    dev = [x.to(DEVICE) for x in (qkv, pos, cos, sin)]
    out = torch.full((b, heads * d), float("nan"), dtype=dtype, device=DEVICE)
    y = decode_rope_attention(*dev, kc, vc, heads, kv_heads, d ** -0.5, chunk=chunk, out=out, kernel="triton",
                              kv=kv, scales=sc)
    assert y is out
    y = y.cpu().float()
    assert torch.isfinite(y).all(), "unwritten outputs"
    at = (torch.arange(b), slice(None), pos)
    if rotate:
        # the rotation's fp32 sums may round a new key one ulp apart, moving an integer one step: attention is
        # checked over the kernel's own cache (queries as the reference rotates them), the cache against the
        # reference's to within a step
        ks = sr.k_scale[at][..., None]
        got = kv4_dequantize_reference(kc.cpu()[at], sc.k_scale.cpu()[at], sc.k_zero.cpu()[at], torch.float32)
        want = kv4_dequantize_reference(kr[at], sr.k_scale[at], sr.k_zero[at], torch.float32)
        assert ((got - want).abs() <= 1.01 * ks).all() and ((got - want).abs() > 0).float().mean() < 0.02
        q = rope_kv_reference(qkv, pos, cos, sin, kr.clone(), vr.clone(), heads, kv_heads, 1, kv=kv,
                              scales=KVScales(*(t.clone() for t in (sr.k_scale, sr.k_zero, sr.v_scale, sr.v_zero))))
        ref = decode_attention_reference(
            q, kv4_dequantize_reference(kc.cpu(), sc.k_scale.cpu(), sc.k_zero.cpu(), dtype),
            kv4_dequantize_reference(vc.cpu(), sc.v_scale.cpu(), sc.v_zero.cpu(), dtype), (pos + 1).to(torch.int32),
            d ** -0.5)
    else:
        assert torch.equal(kc.cpu(), kr) and torch.equal(sc.k_scale.cpu(), sr.k_scale)
    err = (y - ref.float()).abs()
    bad = err > ATTN_RTOL * ref.float().abs() + ATTN_ATOL
    assert not bad.any(), f"{int(bad.sum())} outputs off, max err {err.max().item():.3g}"
    # the new token's value and scales: the reference's (no rotation touches v)
    assert torch.equal(vc.cpu()[at], vr[at]) and torch.equal(sc.v_scale.cpu()[at], sr.v_scale[at])
    others = torch.ones(length, dtype=torch.bool)
    others[pos[1]] = False
    assert torch.equal(kc.cpu()[1][:, others], kr[1][:, others]), "only the new token's slot is written"
    # a position-0 token attends only its own value, dequantized (to attention's accuracy: the loop rounds p·scale
    # to the 16-bit dtype for its dot, and the new token is one of the loop's keys)
    own = kv4_dequantize_reference(vr[0, :, 0], sr.v_scale[0, :, 0], sr.v_zero[0, :, 0], torch.float32)
    assert torch.allclose(y[0].reshape(heads, d), own.repeat_interleave(heads // kv_heads, 0), rtol=ATTN_RTOL,
                          atol=ATTN_ATOL)


@pytest.mark.parametrize("chunk", [None, 64])
def test_decode_rope_attention_rotates_a_16bit_cache(chunk):
    # the Q/K Hadamard alone (a spec rotating without quantizing): rotated keys in a 16-bit cache
    heads, kv_heads, d, b, length = 8, 2, 64, 4, 200
    qkv, _, cos, sin = _rope_inputs(1, b, heads, kv_heads, d, length, 5)
    pos = torch.tensor([0, 36, 63, 199])
    g = torch.Generator().manual_seed(5)
    shape = (b, kv_heads, length, d)
    kc, vc = torch.randn(shape, generator=g).to(BF16), torch.randn(shape, generator=g).to(BF16)
    kv = KVFormat(16, rotate=True)
    kr, vr = kc.clone(), vc.clone()
    ref = decode_rope_attention_reference(qkv, pos, cos, sin, kr, vr, heads, kv_heads, d ** -0.5, kv=kv)
    kd, vd = kc.clone().to(DEVICE), vc.clone().to(DEVICE)
    y = decode_rope_attention(*(x.to(DEVICE) for x in (qkv, pos, cos, sin)), kd, vd, heads, kv_heads, d ** -0.5,
                              chunk=chunk, kernel="triton", kv=kv).cpu().float()
    _assert_ulp_close(kd.cpu(), kr, "the rotated keys in the cache")
    err = (y - ref.float()).abs()
    assert not (err > ATTN_RTOL * ref.float().abs() + ATTN_ATOL).any(), f"max err {err.max().item():.3g}"
    kp = kc.clone()
    plain = decode_rope_attention_reference(qkv, pos, cos, sin, kp, vc.clone(), heads, kv_heads, d ** -0.5)
    at = (torch.arange(b), slice(None), pos)
    assert (kr[at].float() - kp[at].float()).abs().max() > 0.1, "the rotation changed the new keys"
    assert (y - plain.float()).abs().max() > 0.1, "the queries were rotated (the cached keys here were not)"


def test_kv_format_inputs_are_named():
    heads, kv_heads, d, b, length = 4, 2, 32, 2, 16
    qkv, _, cos, sin = _rope_inputs(1, b, heads, kv_heads, d, length, 3)
    pos = torch.tensor([1, 2])
    g = torch.Generator().manual_seed(0)
    kc, vc, sc = _kv4_cache(b, kv_heads, length, d, g)
    kv = KVFormat(4)
    with pytest.raises(UserInputError, match="kv bits=8: the decode kernels keep K/V in 4 or 16 bits"):
        KVFormat(8)
    with pytest.raises(UserInputError, match="clip_ratio=0 is out of range"):
        KVFormat(4, clip_ratio=0)
    with pytest.raises(UserInputError, match="a 4-bit cache needs its KVScales"):
        rope_kv(qkv, pos, cos, sin, kc, vc, heads, kv_heads, 1, kv=kv)
    with pytest.raises(UserInputError, match="k_cache.*uint8"):
        rope_kv(qkv, pos, cos, sin, kc.to(BF16), vc.to(BF16), heads, kv_heads, 1, kv=kv, scales=sc)
    bad = KVScales(sc.k_scale[:, :, :8], sc.k_zero, sc.v_scale, sc.v_zero)
    with pytest.raises(UserInputError, match=r"scales.k_scale"):
        rope_kv(qkv, pos, cos, sin, kc, vc, heads, kv_heads, 1, kv=kv, scales=bad)
    kb, vb = torch.zeros(b, kv_heads, length, d, dtype=BF16), torch.zeros(b, kv_heads, length, d, dtype=BF16)
    with pytest.raises(UserInputError, match="dequant is given for a 16-bit cache"):
        rope_kv(qkv, pos, cos, sin, kb, vb, heads, kv_heads, 1, dequant=(kb, vb))
    with pytest.raises(UserInputError, match="scales are given without a kv format"):
        decode_rope_attention(qkv, pos, cos, sin, kb, vb, heads, kv_heads, d ** -0.5, scales=sc)


def test_devices_and_host_positions_are_checked_before_launch():
    # tensors on two devices (the meta device stands in for a GPU here) are named before any kernel runs; positions
    # and lengths on the host must lie in the cache and the tables (the Triton kernel would write and read past them)
    heads, kv_heads, d, b, length = 4, 2, 32, 2, 16
    qkv, _, cos, sin = _rope_inputs(1, b, heads, kv_heads, d, length, 3)
    kb, vb = torch.zeros(b, kv_heads, length, d, dtype=BF16), torch.zeros(b, kv_heads, length, d, dtype=BF16)
    pos = torch.tensor([1, 2])
    for kernel in ("torch", "triton"):
        with pytest.raises(UserInputError, match="tensors must be on one device, .*cos on meta"):
            rope_kv(qkv, pos, cos.to("meta"), sin, kb, vb, heads, kv_heads, 1, kernel=kernel)
        with pytest.raises(UserInputError, match="tensors must be on one device, .*k_cache on meta"):
            decode_rope_attention(qkv, pos, cos, sin, kb.to("meta"), vb.to("meta"), heads, kv_heads, d ** -0.5,
                                  kernel=kernel)
        with pytest.raises(UserInputError, match=r"positions span 1\.\.16; allowed 0\.\.15 \(the cache holds 16 slots"):
            rope_kv(qkv, torch.tensor([1, length]), cos, sin, kb, vb, heads, kv_heads, 1, kernel=kernel)
        with pytest.raises(UserInputError, match=r"positions span -1\.\.2"):
            decode_rope_attention(qkv, torch.tensor([-1, 2]), cos, sin, kb, vb, heads, kv_heads, d ** -0.5,
                                  kernel=kernel)
        with pytest.raises(UserInputError, match=r"positions span 0\.\.9; allowed 0\.\.7 \(.*tables 8 positions"):
            rope_kv(qkv, torch.tensor([0, 9]), cos[:8], sin[:8], kb, vb, heads, kv_heads, 1, kernel=kernel)
        q = qkv[:, :heads * d].reshape(b, heads, d)
        with pytest.raises(UserInputError, match=r"lengths span 0\.\.3; allowed 1\.\.16"):
            decode_attention(q, kb, vb, torch.tensor([0, 3], dtype=torch.int32), d ** -0.5, kernel=kernel)
        with pytest.raises(UserInputError, match="tensors must be on one device, .*lengths on meta"):
            decode_attention(q, kb, vb, torch.tensor([1, 3], dtype=torch.int32, device="meta"), d ** -0.5,
                             kernel=kernel)
        with pytest.raises(UserInputError, match="tensors must be on one device, .*weight on meta"):
            rmsnorm(qkv, torch.ones(qkv.shape[1], dtype=BF16, device="meta"), 1e-6, kernel=kernel)


def test_4bit_attention_chunk_is_a_multiple_of_its_step():
    heads, kv_heads, d, b, length = 4, 2, 32, 2, 256
    qkv, _, cos, sin = _rope_inputs(1, b, heads, kv_heads, d, length, 3)
    g = torch.Generator().manual_seed(0)
    kc, vc, sc = _copy(*_kv4_cache(b, kv_heads, length, d, g), DEVICE)
    dev = [x.to(DEVICE) for x in (qkv, torch.tensor([1, 2]), cos, sin)]
    with pytest.raises(UserInputError, match=f"chunk=64 must be a positive multiple of {TileTable().attn_kv4_block_n}"):
        decode_rope_attention(*dev, kc, vc, heads, kv_heads, d ** -0.5, chunk=64, kernel="triton", kv=KVFormat(4),
                              scales=sc)


def test_attention_splits_fill_the_gpu():
    # two programs an SM below 64 (sequence, KV head) pairs, one from there
    assert attention_splits(4, 8, 520, 132) == 64  # 9 chunks of 32 pairs: 288 programs
    assert attention_splits(8, 8, 520, 132) == 192  # 3 chunks of 64 pairs: 192 programs
    chunk = attention_splits(32, 8, 520, 132)
    assert chunk % 64 == 0 and 32 * 8 * math.ceil(520 / chunk) >= 132
    assert attention_splits(8, 8, 520, 132, per_sm=2) == 128
    assert attention_splits(1, 1, 10, 132) == 64
    # from 0.95 pairs an SM one chunk a head (128 pairs on 132 SMs), unless programs an SM are given
    assert attention_splits(16, 8, 520, 132) == 576 and attention_splits(15, 8, 520, 132) == 320
    assert attention_splits(16, 8, 520, 132, per_sm=1) == 320


@pytest.mark.parametrize("t,i", [(1, 96), (13, 4100), (67, 33)])
def test_silu_mul_matches_reference(t, i):
    g = torch.Generator().manual_seed(i)
    gu = (2 * torch.randn(t, 2 * i, generator=g)).to(BF16).to(DEVICE)
    out = torch.full((t, i), float("nan"), dtype=BF16, device=DEVICE)
    y = silu_mul(gu, out=out, kernel="triton")
    _assert_ulp_close(y, silu_mul_reference(gu), f"silu*mul t={t} I={i}")


def test_bad_inputs_are_named():
    x = torch.randn(2, 8).to(BF16)
    with pytest.raises(UserInputError, match="weight must have shape"):
        rmsnorm(x, torch.ones(7, dtype=BF16), 1e-6)
    with pytest.raises(UserInputError, match="odd width"):
        silu_mul(torch.randn(2, 7).to(BF16))
    with pytest.raises(UserInputError, match="head size 48"):
        decode_attention(torch.randn(1, 2, 48).to(BF16), torch.randn(1, 1, 8, 48).to(BF16),
                         torch.randn(1, 1, 8, 48).to(BF16), torch.ones(1, dtype=torch.int32), 0.1)
    with pytest.raises(UserInputError, match="lengths has dtype int64"):
        decode_attention(torch.randn(1, 2, 32).to(BF16), torch.randn(1, 1, 8, 32).to(BF16),
                         torch.randn(1, 1, 8, 32).to(BF16), torch.ones(1, dtype=torch.int64), 0.1)
    kc = torch.zeros(2, 2, 8, 32, dtype=BF16)
    with pytest.raises(UserInputError, match="expected batch 2 × tokens_per_seq 2"):
        rope_kv(torch.randn(3, 8 * 32).to(BF16), torch.zeros(3, dtype=torch.int64), torch.ones(8, 32, dtype=BF16),
                torch.ones(8, 32, dtype=BF16), kc, kc.clone(), 4, 2, 2)
    with pytest.raises(UserInputError, match="expected batch 2 × tokens_per_seq 1"):
        decode_rope_attention(torch.randn(3, 8 * 32).to(BF16), torch.zeros(3, dtype=torch.int64),
                              torch.ones(8, 32, dtype=BF16), torch.ones(8, 32, dtype=BF16), kc, kc.clone(), 4, 2, 0.1)
    with pytest.raises(UserInputError, match="chunk=96"):
        decode_attention(torch.randn(1, 2, 32).to(BF16).to(DEVICE), torch.randn(1, 1, 8, 32).to(BF16).to(DEVICE),
                         torch.randn(1, 1, 8, 32).to(BF16).to(DEVICE), torch.ones(1, dtype=torch.int32).to(DEVICE),
                         0.1, chunk=96, kernel="triton")
