"""The swapped GEMM's "shared" residual walk: power-of-two residual scales added into the dense accumulator."""

import re

import pytest
import torch

from mosaicquant.errors import UserInputError
from mosaicquant.kernels import _tiles
from mosaicquant.kernels._tl import _ASM_HI_SHIFT16, _ASM_LO_SHIFT16
from mosaicquant.kernels.act_quant import quantize_activations_reference, quantize_activations_triton
from mosaicquant.kernels.quant_linear import QuantLinear
from mosaicquant.kernels.w4a4_gemm import w4a4_gemm_swapped_triton
from mosaicquant.kernels.zipper import zipper_gemm_reference
from mosaicquant.methods.format import residual_shifts

from ._helpers import (
    DEVICE,
    assert_close_bf16,
    assert_residual_matters,
    needs_triton,
    pow2_layers,
    pow2_residual,
    random_activations,
    random_layer,
    random_residual,
    swapped_dense_case,
)


def _case(m, n, k, block, fraction, seed):
    gen = torch.Generator().manual_seed(seed)
    x = random_activations(m, k, gen)
    _, qweight, w_scale = random_layer(n, k, gen)
    residual = pow2_residual(random_residual(n, k, block, fraction, gen), w_scale, gen)
    bias = torch.randn(n, generator=gen)
    packed, scale = quantize_activations_reference(x)
    ref = zipper_gemm_reference(packed, scale, qweight, w_scale, k, residual, bias, out_fp32=True)
    assert_residual_matters(packed, scale, qweight, w_scale, k, bias, ref)
    a8, s8 = quantize_activations_triton(x.to(DEVICE), layout="split8")
    return a8, s8, qweight.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE), residual.to(DEVICE), ref


@needs_triton()
@pytest.mark.parametrize("m,n,k,block,fraction,opts", [
    (13, 200, 300, (128, 128), 0.5, dict(block_n=128, block_m=64)),     # ragged N and K, prefill tiles
    (67, 130, 640, (64, 256), 0.4, dict(block_n=128, block_m=64)),      # block rows of 64: the tile shrinks
    (5, 96, 1000, (32, 128), 1.0, dict(block_n=128, block_m=64)),       # every block kept, K not a multiple of 128
    (29, 130, 1000, (64, 256), 0.5, dict(block_n=64, block_m=32, block_kp=128, split_k=3, num_warps=4)),  # decode tiles
])
def test_shared_walk_matches_zipper_reference(m, n, k, block, fraction, opts):
    a8, s8, qweight, w_scale, bias, residual, ref = _case(m, n, k, block, fraction, seed=m * n)
    shifts = residual_shifts(residual, w_scale)
    assert shifts is not None and int(shifts.min()) >= 0 and int(shifts.max()) <= 4
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, residual=residual, residual_walk="shared",
                             residual_shifts=shifts, out=out, **opts)
    assert_close_bf16(out, ref, f"shared walk M={m} N={n} K={k} blocks {block} {opts}")
    # the shifts derived by the launcher give the same bits
    again = w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, residual=residual, residual_walk="shared",
                                     **opts)
    assert torch.equal(again, out)


@needs_triton()
def test_shared_walk_refuses_free_scales_and_unscaled_weights():
    a8, s8, qweight, w_scale, bias, residual, _ = _case(13, 200, 300, (128, 128), 0.5, seed=7)
    free = random_residual(200, 300, (128, 128), 0.5, torch.Generator().manual_seed(1)).to(DEVICE)
    with pytest.raises(UserInputError, match=r"residual_walk='shared' needs residual scales equal to the base's row "
                                             r"scales times 2\^-j"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 300, residual=free, residual_walk="shared")
    with pytest.raises(UserInputError, match="residual_walk='shared' needs x16=True"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 300, residual=residual, residual_walk="shared", x16=False)
    with pytest.raises(UserInputError, match="residual_shifts"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 300, residual=residual, residual_walk="shared",
                                 residual_shifts=torch.zeros(1, 128, dtype=torch.int8, device=DEVICE))


@needs_triton()
def test_shared_walk_under_graph_capture_asks_for_its_shifts(monkeypatch):
    # deriving the shifts reads a result back from the device, which a CUDA graph capture refuses with an obscure
    # error: the launcher says what to pass instead (the capture is simulated; given shifts still run)
    a8, s8, qweight, w_scale, bias, residual, ref = _case(13, 200, 300, (128, 128), 0.5, seed=7)
    shifts = residual_shifts(residual, w_scale)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(UserInputError, match="under CUDA graph capture needs residual_shifts"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 300, bias, residual=residual, residual_walk="shared")
    monkeypatch.undo()
    out = w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, 300, bias, residual=residual, residual_walk="shared",
                                   residual_shifts=shifts)
    assert_close_bf16(out, ref, "shared walk with the shifts given")


def _run_ptx(text: str, word: int, j: int) -> int:
    """Run the b32 PTX sequence of a shift-unpack string on one register (the few instructions it uses)."""
    regs = {"$1": word, "$2": j * 0x01010101}
    mask = 0xFFFFFFFF

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        a = [val(s) for s in src]
        if op == "shl.b32":
            r = a[0] << a[1]
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "sub.u32":
            r = a[0] - a[1]
        elif op == "mul.lo.u32":
            r = a[0] * a[1]
        else:
            raise AssertionError(f"instruction {op!r} is not emulated")
        regs[dst] = r & mask
    return regs["$0"]


@pytest.mark.parametrize("hi", [False, True])
def test_shift_unpack_ptx_gives_each_nibble_times_two_to_the_four_minus_j(hi):
    # every nibble pattern of a byte, in every byte position, at every shift
    text = (_ASM_HI_SHIFT16 if hi else _ASM_LO_SHIFT16).value
    assert re.search(r"mul\.lo\.u32", text)
    gen = torch.Generator().manual_seed(0)
    words = [b * 0x01010101 for b in range(256)] + torch.randint(0, 2**32, (2000,), generator=gen,
                                                                 dtype=torch.int64).tolist()
    for j in range(5):
        for w in words:
            got = _run_ptx(text, w, j)
            for byte in range(4):
                b = (w >> (8 * byte)) & 0xFF
                nib = (b >> 4) if hi else (b & 0xF)
                q = nib - 16 if nib >= 8 else nib
                want = (q * 2 ** (4 - j)) & 0xFF
                assert (got >> (8 * byte)) & 0xFF == want, (hex(w), j, byte)


@needs_triton()
@pytest.mark.parametrize("m,n,k,opts,rem", [
    # 130 rows in 64-row tiles x 67 tokens in 16-token tiles: 15 tiles, 8 programs at once on the
    # interpreter's 4 "SMs": 8 tiles whole, the last 7 split 2 ways (K = 1000: ragged last step)
    (67, 130, 1000, dict(block_n=64, block_m=16, block_kp=64, num_warps=4), 2),
    # 32-token tiles and a 16-token last tile (TAIL_BM): 9 tiles, the last one (a narrow one) split 4 ways
    (67, 130, 1024, dict(block_n=64, block_m=32, block_m_tail=16, block_kp=64, num_warps=4), 4),
])
@pytest.mark.parametrize("walk", [None, "shared", "int8"])
@pytest.mark.parametrize("one_launch", [True, False])  # the whole tiles in the split ones' launch or before it
def test_last_wave_split_over_k_matches_the_unsplit_launch(m, n, k, opts, rem, walk, one_launch, monkeypatch, tile_table):
    monkeypatch.setattr(_tiles, "_sm_count", lambda device: 4)  # the same waves on the GPU as on the interpreter
    tile_table(swap_rem_one_launch=one_launch)

    if walk is None:
        (a8, s8, qweight, w_scale, _, bias), ref = swapped_dense_case(m, n, k, seed=m + k)
        residual = None
    else:
        a8, s8, qweight, w_scale, bias, residual, ref = _case(m, n, k, (64, 256), 0.5, seed=m + k)
    kw = dict(residual=residual, residual_walk=walk or "fp8", **opts)
    whole = w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, rem_split=1, **kw)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, bias, rem_split=rem, out=out, **kw)
    assert_close_bf16(out, ref, f"last wave split {rem} ways, walk {walk}")
    assert_close_bf16(whole, ref, "the unsplit launch")
    assert int(_tiles.lock_buffer(out.device)[:64].abs().sum()) == 0  # every split tile's counter back to zero
    # what ran: the tiles past the last whole wave (8 programs at once on the interpreter's 4 "SMs"), split
    tiles = -(-n // opts["block_n"]) * (3 if "block_m_tail" in opts else -(-m // opts["block_m"]))
    assert _tiles.swapped_rem_plan(tiles, -(-k // 2 // 64), out.device, rem) == (rem, 7 if rem == 2 else 1)
    # the rule: one or two whole waves and a last one under half full split, each split keeping enough K steps;
    # a last wave half full or more, a third whole wave, less than one wave, or too few K steps not
    sms = _tiles._sm_count(out.device)
    slots = _tiles.SWAP_PREFILL_PROGRAMS_PER_SM * sms
    steps = _tiles.SWAP_REM_SPLIT_MIN_STEPS
    assert _tiles.swapped_rem_split(2 * slots + slots // 4, 4 * steps, out.device, most=8) == 4
    assert _tiles.swapped_rem_split(slots + slots // 4, 4 * steps, out.device, most=8) == 4
    assert _tiles.swapped_rem_split(2 * slots + slots // 4, 4 * steps - 1, out.device, most=8) == 2
    assert _tiles.swapped_rem_split(2 * slots + slots // 4, 2 * steps - 1, out.device, most=8) == 1
    assert _tiles.swapped_rem_split(2 * slots + 3 * slots // 8, 8 * steps, out.device, most=8) == 2  # r·4 > S
    assert _tiles.swapped_rem_split(2 * slots + slots // 2, 8 * steps, out.device, most=8) == 1  # half full
    assert _tiles.swapped_rem_split(3 * slots + slots // 4, 8 * steps, out.device, most=8) == 1  # 3 whole waves
    assert _tiles.swapped_rem_split(slots - 1, 8 * steps, out.device, most=8) == 1
    assert _tiles.swapped_rem_split(2 * slots + 1, 8 * steps, out.device, most=1) == 1  # off
    assert _tiles.swapped_rem_split(2 * slots + slots // 4, 4 * steps, out.device) == _tiles.SWAP_REM_SPLIT_MAX
    with pytest.raises(UserInputError, match="rem_split=3 must be None or a power of two"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, rem_split=3)
    with pytest.raises(UserInputError, match="choose one"):
        w4a4_gemm_swapped_triton(a8, s8, qweight, w_scale, k, rem_split=2, split_k=2)
