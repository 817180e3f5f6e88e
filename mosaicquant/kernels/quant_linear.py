"""``QuantLinear``: an ``nn.Module`` that runs a packed MosaicQuant layer on the 4-bit kernels.

It holds the shared format (:class:`mosaicquant.methods.format.PackedW4`, optionally with
:class:`~mosaicquant.methods.format.ResidualBlocks`) as buffers, unchanged, plus one
kernel-side index built at construction (:func:`mosaicquant.kernels.zipper.residual_block_map`).
A forward pass quantizes the activations per token (4-bit symmetric, ``act_clip_ratio``),
then runs the dense W4A4 GEMM, or ZipperEngine (fused) or the unfused pipeline when the
layer has residual blocks. Input any float dtype ``[..., K]``, output BF16 ``[..., N]``.

Prefill-sized calls (``M >= swap_min_m`` tokens on the Triton path, when the GEMM's 128 x 128
output tiles fill the GPU: :func:`mosaicquant.kernels._tiles.swapped_prefill`) quantize the
activations to the ``"split8"`` int8 layout instead and run the operand-swapped GEMM
(:func:`mosaicquant.kernels.w4a4_gemm.w4a4_gemm_swapped_triton`; the residual blocks, if any,
fused in its tail: the ``"shared"`` walk into the dense accumulator where the residual's scales are
the base's times powers of two, :func:`mosaicquant.methods.format.residual_shifts`, the ``"merged"`` walk
where those powers are at most ``2^-3`` (a kept unit's base and residual one int8 operand, built once here;
:attr:`~mosaicquant.kernels.tile_table.TileTable.merged_walk`), else the FP8 walk): the same integers and scales, the same result up to float rounding
. The unfused pipeline always keeps the packed path.
Layers without residual blocks also run decode calls of ``swap_decode`` tokens (16-32) that way,
at decode tiles, but for those of ``TileTable.wide_k_decode_min_m`` to 16 tokens; layers
with them keep ZipperEngine's packed kernels at those sizes (the swapped GEMM with the kept blocks in
its tail, on each of its walks, measured slower). Calls of at most
``gemv_max_m`` tokens run the decode GEMV on CUDA-core ``dp4a`` instead
(:mod:`mosaicquant.kernels.gemv`, dense and with the residual).

It computes the function of the simulated layer
``fake_quantize(x, 4, clip_ratio) @ packed.dequantize().T (+ bias)`` up to float
accumulation order and the final BF16 rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from mosaicquant.errors import UserInputError
from mosaicquant.kernels._common import check_input_features, resolve_kernel
from mosaicquant.kernels._residual_check import check_residual
from mosaicquant.kernels import _tiles
from mosaicquant.kernels._tiles import (
    GEMV_ROUTE_MAX_M,
    SWAP_DECODE_M,
    SWAP_MIN_M,
    TileConfig,
    parallel_mode,
    parallel_residual,
    pick_config,
    swapped_decode_config,
    swapped_mid_config,
    swapped_prefill,
)
from mosaicquant.kernels.act_quant import quantize_activations, quantize_activations_triton
from mosaicquant.kernels.gemv import GEMV_MAX_M, gemv_reason, gemv_triton
from mosaicquant.kernels.tile_table import table_for
from mosaicquant.kernels.residual_gemm import residual_add
from mosaicquant.kernels.w4a4_gemm import (
    MERGED_MAX_SHIFT,
    check_weight_args,
    dense_step_table,
    gated_shape_reason,
    merged_residual_operand,
    row_tile_order,
    swapped_residual_reason,
    w4a4_gemm,
    w4a4_gemm_reference,
    w4a4_gemm_swapped_triton,
    w4a4_gemm_triton,
)
from mosaicquant.kernels.zipper import (
    FUSE_MODES,
    gated_reason,
    residual_block_map,
    zipper_gemm,
)
from mosaicquant.methods.format import PackedW4, ResidualBlocks, residual_shifts

__all__ = ["QuantLinear"]


class QuantLinear(nn.Module):
    """A W4A4 linear layer (dense 4-bit base + optional sparse 4-bit residual) on the kernels.

    Args:
        packed: the layer in the shared packed format; per-output-channel base scales
            (``group_size`` ``None`` or ``K``).
        act_clip_ratio: activation clip ratio in (0, 1].
        kernel: ``"auto"`` / ``"triton"`` / ``"torch"``, or ``None`` for the ``kernel`` of the
            settings in force at each call (:mod:`mosaicquant.settings`; default ``"auto"``).
        fused: run the residual fused into the GEMM (ZipperEngine) or as the unfused
            pipeline (dense GEMM to fp32, separate residual kernel, add).
        mode: ZipperEngine fusion mode, ``"auto"``, ``"inline"`` or ``"tail"``.
        swap_min_m: calls of at least this many tokens on the Triton path run the
            operand-swapped prefill GEMM (default :data:`mosaicquant.kernels._tiles.SWAP_MIN_M`)
            when its output tiles fill the GPU (``swap_min_tiles_per_sm``); ``None`` never. Layers
            whose residual blocks that GEMM cannot take (block columns not a multiple of 128), and
            the unfused pipeline, keep the packed path.
        swap_min_tiles_per_sm: 128 x 128 output tiles per SM a call needs for the swapped prefill
            GEMM (``None``: the measured defaults,
            :data:`mosaicquant.kernels._tiles.SWAP_MIN_TILES_PER_SM`; ``0``: every call of
            ``swap_min_m`` tokens or more).
        swap_decode: ``(lo, hi)``: a layer without residual blocks runs calls of ``lo`` to ``hi``
            tokens on the swapped GEMM too, at decode tiles (default
            :data:`mosaicquant.kernels._tiles.SWAP_DECODE_M`), but for calls of
            :attr:`~mosaicquant.kernels.tile_table.TileTable.wide_k_decode_min_m` to 16 tokens (the packed kernel's wide
            K steps, read at each call); ``None`` never. Layers with residual blocks never do.
        gemv_max_m: calls of up to this many tokens on the Triton path run the decode GEMV where it
            takes them (:func:`mosaicquant.kernels.gemv.gemv_reason`; the fused residual only);
            default :data:`mosaicquant.kernels._tiles.GEMV_ROUTE_MAX_M`, ``0`` never.
        swap_mid: mid-sized calls (from :attr:`~mosaicquant.kernels.tile_table.TileTable.swap_mid_min_m` tokens, or
            :attr:`~mosaicquant.kernels.tile_table.TileTable.swap_mid_residual_min_m` with residual blocks of power-of-two
            scales; read at each call) run the swapped GEMM on the tiles of
            :func:`mosaicquant.kernels._tiles.swapped_mid_config` where it gives them (layers short of output
            tiles): a dense layer's ahead of the prefill tiles, a residual layer's where neither the prefill nor
            the decode tiles take them. ``False`` keeps those calls on the other routes.
        swap_tail: calls on the swapped GEMM's prefill or mid tiles whose tokens leave a small remainder over a
            whole number of token tiles run the last token tile narrower
            (:func:`mosaicquant.kernels._tiles.swapped_tail`, read at each call); ``False``: every token tile full
            size.

    Raises:
        UserInputError: group-wise base scales, a bad clip ratio, mode, kernel
            preference or ``swap_min_m``, or a residual of another shape.

    Example:
        >>> from mosaicquant.methods.quant import quantize
        >>> w = torch.randn(8, 6)
        >>> layer = QuantLinear(PackedW4.from_quantized(quantize(w, 4, scale_dtype=torch.float16)), kernel="torch")
        >>> layer(torch.randn(2, 6)).shape
        torch.Size([2, 8])
    """

    def __init__(
        self,
        packed: PackedW4,
        act_clip_ratio: float = 1.0,
        kernel: str | None = None,
        fused: bool = True,
        mode: str = "auto",
        swap_min_m: int | None = SWAP_MIN_M,
        swap_decode: tuple[int, int] | None = SWAP_DECODE_M,
        swap_min_tiles_per_sm: float | None = None,
        gemv_max_m: int = GEMV_ROUTE_MAX_M,
        swap_mid: bool = True,
        swap_tail: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(packed, PackedW4):
            raise UserInputError(f"packed must be a PackedW4, got {type(packed).__name__}")
        n, k = packed.shape
        if packed.group_size not in (None, k):
            raise UserInputError(
                f"group_size={packed.group_size}: the W4A4 kernels support per-output-channel base "
                f"scales only (group_size=None)"
            )
        if not 0.0 < float(act_clip_ratio) <= 1.0:
            raise UserInputError(f"act_clip_ratio={act_clip_ratio!r} is out of range: allowed (0, 1]")
        if mode not in FUSE_MODES:
            raise UserInputError(f"mode={mode!r} is not allowed: choose one of {', '.join(FUSE_MODES)}")
        if kernel is not None:
            resolve_kernel(kernel)
        if swap_min_m is not None and (not isinstance(swap_min_m, int) or swap_min_m < 1):
            raise UserInputError(f"swap_min_m={swap_min_m!r} must be a positive int or None")
        if swap_min_tiles_per_sm is not None and not (isinstance(swap_min_tiles_per_sm, (int, float))
                                                      and 0 <= swap_min_tiles_per_sm < float("inf")):
            raise UserInputError(f"swap_min_tiles_per_sm={swap_min_tiles_per_sm!r} must be None or a number >= 0")
        if not isinstance(gemv_max_m, int) or not 0 <= gemv_max_m <= GEMV_MAX_M:
            raise UserInputError(f"gemv_max_m={gemv_max_m!r} must be an int in [0, {GEMV_MAX_M}]")
        if swap_decode is not None:
            if not (isinstance(swap_decode, (tuple, list)) and len(swap_decode) == 2
                    and all(isinstance(v, int) for v in swap_decode) and 1 <= swap_decode[0] <= swap_decode[1]):
                raise UserInputError(f"swap_decode={swap_decode!r} must be None or (lo, hi) ints with 1 <= lo <= hi")
            swap_decode = tuple(swap_decode)
        self.in_features = k
        self.out_features = n
        self.act_clip_ratio = float(act_clip_ratio)
        self.kernel = kernel
        self.fused = bool(fused)
        self.mode = mode
        self.swap_min_m = swap_min_m
        self.swap_decode = swap_decode
        self.swap_min_tiles_per_sm = swap_min_tiles_per_sm
        self.gemv_max_m = gemv_max_m
        self.swap_mid = bool(swap_mid)
        self.swap_tail = bool(swap_tail)
        self.register_buffer("qweight", packed.qweight.contiguous())
        self.register_buffer("w_scale", packed.scales.reshape(n).to(torch.float16).contiguous())
        self.register_buffer("bias", None if packed.bias is None else packed.bias.to(torch.float32).reshape(n).contiguous())
        # the launchers' weight checks, once here too (an odd K's padding nibbles are read once per weight tensor)
        check_weight_args(self.qweight, self.w_scale, self.bias, k)
        residual = packed.residual
        if residual is not None and residual.num_blocks == 0:
            residual = None
        self.block_shape = None
        if residual is not None:
            check_residual(residual, n, k)
            residual.validate()  # the indices' values, once (built blocks are checked; fields set since are not)
            self.block_shape = tuple(residual.block_shape)
            self.register_buffer("res_coords", residual.coords.contiguous())
            self.register_buffer("res_row_ptr", residual.row_ptr.contiguous())
            self.register_buffer("res_values", residual.values.contiguous())
            self.register_buffer("res_scales", residual.scales.contiguous())
            self.register_buffer("res_block_map", residual_block_map(residual))
            # power-of-two residual scales (MosaicQuant's rscale=pow2): the swapped GEMM adds the kept
            # blocks into its dense accumulator (residual_walk="shared")
            self.register_buffer("res_shifts", residual_shifts(residual, self.w_scale))
        self.swap_ok = residual is None or (self.fused and swapped_residual_reason(self.block_shape) is None)
        # shifts of at most 3 (MosaicQuant's rscale_max_shift=3): each kept unit's base and residual as one int8
        # operand, and the dense steps the kept blocks leave, for the swapped GEMM's "merged" walk (its calls at
        # 64-byte K steps; kept alongside the packed residual, which the decode kernels read)
        self.register_buffer("res_merged", None)
        self.register_buffer("res_steps", None)
        if (residual is not None and self.swap_ok and self.res_shifts is not None
                and int(self.res_shifts.max()) <= MERGED_MAX_SHIFT):
            self.res_merged = merged_residual_operand(self.qweight, k, residual, self.res_shifts)
            self.res_steps = dense_step_table(residual, k)
        # the swapped GEMM's block-row tiles, those that keep the most blocks first (its row_order at prefill tiles
        # of a block row's height: TileTable.swap_row_order); an index of the block rows, like res_block_map not
        # counted by weight_nbytes
        self.register_buffer("res_row_order", None)
        if residual is not None and self.swap_ok:
            self.res_row_order = row_tile_order(residual, self.block_shape[0])
        # the layer's side of gemv_reason (K, block shape) is fixed: decided once; the route then checks M only
        self.gemv_ok = (residual is None or self.fused) and gemv_reason(1, k, residual) is None

    @property
    def residual(self) -> ResidualBlocks | None:
        """The residual blocks (views of this module's buffers), or ``None``."""
        if self.block_shape is None:
            return None
        return ResidualBlocks(
            shape=(self.out_features, self.in_features), block_shape=self.block_shape,
            coords=self.res_coords, row_ptr=self.res_row_ptr, values=self.res_values, scales=self.res_scales,
            check=False,  # checked at construction: no device synchronisation per call
        )

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``, as the weight's shape."""
        return self.out_features, self.in_features

    def weight_nbytes(self) -> dict[str, int]:
        """Bytes of the stored format by part, as :meth:`PackedW4.nbytes` counts them."""
        def size(*names):
            return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)
        out = {"base_values": size("qweight"), "base_scales": size("w_scale"), "residual_values": 0,
               "residual_scales": 0, "residual_indices": 0, "exec_operands": 0}
        if self.block_shape is not None:
            out.update(residual_values=size("res_values"), residual_scales=size("res_scales"),
                       residual_indices=size("res_coords", "res_row_ptr"))
        if self.res_merged is not None:  # the merged walk's copies, resident beside the format
            out["exec_operands"] = size("res_merged", "res_steps")
        return out

    def extra_repr(self) -> str:
        blocks = 0 if self.block_shape is None else int(self.res_coords.shape[0])
        return (f"in_features={self.in_features}, out_features={self.out_features}, residual_blocks={blocks}, "
                f"act_clip_ratio={self.act_clip_ratio}, fused={self.fused}, kernel={self.kernel or 'env/auto'}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., K]`` float → ``[..., N]`` BF16.

        Raises:
            UserInputError: a 0-d input, or a last dimension that is not ``in_features``.
        """
        check_input_features(x, self.in_features)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        backend = resolve_kernel(self.kernel, x2.device)
        if self.uses_swapped(x2.shape[0], backend):
            a_split, a_scale = quantize_activations_triton(x2, self.act_clip_ratio, layout="split8")
            y = self.forward_split8(a_split, a_scale)
        else:
            a_packed, a_scale = quantize_activations(x2, self.act_clip_ratio, kernel=backend)
            y = self.forward_quantized(a_packed, a_scale, backend)
        return y.reshape(*lead, self.out_features)

    def uses_gemv(self, m: int) -> bool:
        """Whether a Triton call of ``m`` packed tokens runs the decode GEMV."""
        return self.gemv_ok and 1 <= m <= self.gemv_max_m

    def uses_parallel_residual(self, m: int) -> bool:
        """Whether a Triton call of ``m`` packed tokens runs ZipperEngine's parallel mode (kept blocks in
        programs of their own; :func:`mosaicquant.kernels._tiles.parallel_residual`)."""
        return self._parallel_call(m) is not None

    def _parallel_call(self, m: int) -> tuple[str, TileConfig] | None:
        """``(mode, tiles)`` of a Triton call of ``m`` packed tokens in a parallel mode, else ``None``."""
        if not self.fused or self.residual is None or self.uses_gemv(m) or self.swap_route(m) is not None:
            return None
        if self.mode not in ("auto", "parallel", "parallel_rows"):
            return None
        # the launcher's tiles (pick_config nests them in the residual blocks)
        cfg = pick_config(m, self.out_features, self.qweight.shape[1], self.qweight.device, self.block_shape)
        if self.mode != "auto":
            return self.mode, cfg
        if not parallel_residual(m, cfg, self.residual.num_blocks / max(1, self.residual.grid[0]),
                                 device=self.qweight.device):
            return None
        return parallel_mode(cfg, device=self.qweight.device), cfg

    def parallel_mode(self, m: int) -> str | None:
        """ZipperEngine's parallel mode (``"parallel"``, ``"parallel_rows"``) a call of ``m`` tokens runs, or ``None``."""
        call = self._parallel_call(m)
        return None if call is None else call[0]

    def writes_gated(self, m: int) -> bool:
        """Whether a Triton call of ``m`` packed tokens can write SiLU·mul of this stacked ``[gate | up]``
        layer itself (``forward_quantized(..., gated=True)``): ZipperEngine's parallel modes sum each gate
        tile with its up tile (:func:`mosaicquant.kernels.zipper.gated_reason`), and so does the dense
        GEMM of a layer without residual blocks at 2 to :attr:`~mosaicquant.kernels.tile_table.TileTable.dense_gated_max_m`
        tokens (:func:`mosaicquant.kernels.w4a4_gemm.gated_shape_reason`), on the packed kernel even where
        a plain call would run the swapped GEMM at decode tiles."""
        if self.block_shape is None:  # the dense GEMM's counted fix-up
            if not 1 <= m <= table_for(self.qweight.device).dense_gated_max_m or self.uses_gemv(m) or self.swap_route(m) == "prefill":
                return False
            cfg = pick_config(m, self.out_features, self.qweight.shape[1], self.qweight.device)
            return gated_shape_reason(m, self.out_features, cfg) is None
        call = self._parallel_call(m)
        return call is not None and gated_reason(m, self.out_features, call[1], self.block_shape, call[0]) is None

    def uses_swapped(self, m: int, backend: str) -> bool:
        """Whether a call of ``m`` tokens on ``backend`` runs the operand-swapped GEMM (prefill, mid or decode tiles)."""
        return backend == "triton" and self.swap_route(m) is not None

    def swap_route(self, m: int) -> str | None:
        """``"prefill"``, ``"decode"`` (the swapped GEMM at decode tiles), ``"mid"`` (at :meth:`mid_tiles`) or ``None``
        (the packed kernels) for a call of ``m`` tokens."""
        return self._swap_call(m)[0]

    def swap_tiles(self, m: int) -> dict:
        """The swapped GEMM's tile arguments for a call of ``m`` tokens (``{}``: its prefill defaults, or a call
        that does not run it)."""
        return self._swap_call(m)[1]

    def _swap_call(self, m: int) -> tuple[str | None, dict]:
        """:meth:`swap_route` of a call of ``m`` tokens and the swapped GEMM's tile arguments for it (``{}``: its
        prefill defaults), with the narrower last token tile where :func:`mosaicquant.kernels._tiles.swapped_tail`
        gives one (prefill and mid routes)."""
        route, tiles = self._swap_route_tiles(m)
        if self.swap_tail and route in ("prefill", "mid"):
            tail = _tiles.swapped_tail(m, tiles.get("block_m", 128), device=self.qweight.device)  # 128: the launcher's default
            if tail is not None:
                tiles = {**tiles, "block_m_tail": tail}
        return route, tiles

    def _swap_route_tiles(self, m: int) -> tuple[str | None, dict]:
        if not self.swap_ok:
            return None, {}
        mid = self.mid_tiles(m)
        if mid is not None and self.block_shape is None:  # dense layers: ahead of the prefill tiles
            return "mid", mid
        if self.swap_min_m is not None and swapped_prefill(
                m, self.out_features, self.qweight.device, self.block_shape is not None, self.swap_min_m,
                self.swap_min_tiles_per_sm):
            return "prefill", {}
        if self.swap_decode is not None and self.swap_decode[0] <= m <= self.swap_decode[1]:
            decode = (self.block_shape is None and not 0 < table_for(self.qweight.device).wide_k_decode_min_m <= m <= 16
                      and not (m > 16 and _tiles.wide_decode(m, self.out_features, self.qweight.device, False)))
            if decode:  # layers with residual blocks keep ZipperEngine's packed kernels at decode sizes
                return "decode", swapped_decode_config(m, self.out_features, (self.in_features + 1) // 2,
                                                       self.qweight.device)
            return None, {}
        if mid is not None:
            return "mid", mid
        return None, {}

    def mid_tiles(self, m: int) -> dict | None:
        """Tiles of the swapped GEMM for a mid-sized call of ``m`` tokens
        (:func:`mosaicquant.kernels._tiles.swapped_mid_config`: dense layers, and residual blocks with
        power-of-two scales on the shared walk), or ``None`` where the call takes another route."""
        if not self.swap_mid:
            return None
        if self.block_shape is not None and self.res_shifts is None:
            return None
        return swapped_mid_config(m, self.out_features, (self.in_features + 1) // 2, self.qweight.device,
                                  residual=self.block_shape is not None)

    def forward_split8(self, a_split: torch.Tensor, a_scale: torch.Tensor) -> torch.Tensor:
        """The swapped GEMM on ``"split8"`` activations ``int8 [M, split8_width(K)]`` + ``[M]`` scales → BF16 ``[M, N]``."""
        _, tiles = self._swap_call(a_split.shape[0])
        walk = {}
        if self.block_shape is not None and self.res_shifts is not None:
            walk = {"residual_walk": "shared", "residual_shifts": self.res_shifts}
            if self.res_merged is not None and table_for(self.qweight.device).merged_walk and tiles.get("block_kp", 64) == 64:
                walk.update(residual_walk="merged", residual_operand=self.res_merged, dense_steps=self.res_steps)
        if self.res_row_order is not None and _tiles.swapped_row_order(tiles, self.block_shape[0], device=self.qweight.device):
            walk["row_order"] = self.res_row_order
        return w4a4_gemm_swapped_triton(a_split, a_scale, self.qweight, self.w_scale, self.in_features, self.bias,
                                        residual=self.residual, **tiles, **walk)

    def forward_quantized(self, a_packed: torch.Tensor, a_scale: torch.Tensor, backend: str,
                          gated: bool = False) -> torch.Tensor:
        """The GEMM part on already quantized activations: ``[M, ceil(K/2)]`` packed + ``[M]`` scales → ``[M, N]`` BF16.

        For callers that quantize the activations themselves (e.g. fused with an online
        Hadamard, :mod:`mosaicquant.kernels.hadamard_quant`); ``backend`` is ``"triton"`` or
        ``"torch"`` (:func:`mosaicquant.kernels.resolve_kernel`). ``gated``: this layer is stacked
        ``[gate | up]``; return ``bf16(silu(gate)) · up``, ``[M, N / 2]``, written by the GEMM where
        :meth:`writes_gated` says so (else :class:`UserInputError`).
        """
        k = self.in_features
        residual = self.residual
        if gated:  # the Triton launchers name what they cannot take
            if residual is None:
                return w4a4_gemm(a_packed, a_scale, self.qweight, self.w_scale, k, self.bias, kernel=backend,
                                 gated=True)
            if not self.fused:
                raise UserInputError(f"the unfused pipeline cannot write SiLU·mul in its GEMM "
                                     f"(M={a_packed.shape[0]}; see writes_gated)")
            return zipper_gemm(a_packed, a_scale, self.qweight, self.w_scale, k, residual, self.bias,
                               kernel=backend, block_map=self.res_block_map, mode=self.mode, gated=True)
        if backend == "triton" and self.uses_gemv(a_packed.shape[0]):
            return gemv_triton(a_packed, a_scale, self.qweight, self.w_scale, k, self.bias, residual=residual)
        if residual is None:
            return w4a4_gemm(a_packed, a_scale, self.qweight, self.w_scale, k, self.bias, kernel=backend)
        if self.fused:
            return zipper_gemm(a_packed, a_scale, self.qweight, self.w_scale, k, residual, self.bias,
                               kernel=backend, block_map=self.res_block_map, mode=self.mode)
        if backend == "triton":
            dense = w4a4_gemm_triton(a_packed, a_scale, self.qweight, self.w_scale, k, self.bias, out_fp32=True)
        else:
            dense = w4a4_gemm_reference(a_packed, a_scale, self.qweight, self.w_scale, k, self.bias, out_fp32=True)
        return residual_add(a_packed, a_scale, dense, residual, k, kernel=backend)
