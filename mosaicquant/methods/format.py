"""The packed 4-bit format of a MosaicQuant linear layer (dense base + sparse residual).

This module is the single definition of the format: the method writes it, the simulated
(fake-quant) layer reads it through :meth:`PackedW4.dequantize`, and the kernels
(:mod:`mosaicquant.kernels`) execute it. Same integers, same FP16 scales everywhere.

Layout, for a weight ``W [N, K]`` (out, in):

Dense base (:class:`PackedW4`)
    ``qweight``: ``uint8 [N, ceil(K / 2)]``: signed 4-bit two's-complement values packed
    along K, element ``k`` in the **low** nibble of byte ``k // 2`` when ``k`` is even and in
    the **high** nibble when odd; an odd K pads the last high nibble with 0.
    ``scales``: ``float16 [N, G]``: symmetric scales, ``G = 1`` (per output channel) or
    ``K // group_size``. Value: ``W[n, k] ≈ q[n, k] * scales[n, k // group_size]``.

Sparse residual (:class:`ResidualBlocks`)
    The weight is tiled into blocks of ``Bn × Bk`` (block row ``i`` covers rows
    ``i*Bn .. min((i+1)*Bn, N)``, block column ``j`` covers ``j*Bk .. min((j+1)*Bk, K)``;
    edge blocks are ragged and zero-padded in storage). Kept blocks are stored in
    block-row-major order (sorted by ``(i, j)``):

    - ``coords``: ``int32 [nb, 2]``: ``(i, j)`` of each kept block.
    - ``row_ptr``: ``int32 [n_block_rows + 1]``: CSR pointer; the blocks of block row ``i``
      are ``row_ptr[i] .. row_ptr[i+1]``.
    - ``values``: ``uint8 [nb, Bn, Bk // 2]``: the block's signed 4-bit values, packed along
      its K like the base (padding nibbles are 0).
    - ``scales``: ``float16 [nb, Bn]``: one symmetric scale per row of a block.

    Value: ``W[n, k] += values[b, n - i*Bn, k - j*Bk] * scales[b, n - i*Bn]`` for the kept
    block ``b = (i, j)`` containing ``(n, k)``.

Power-of-two residual scales (:func:`residual_shifts`)
    Where every kept row's scale is its base row's scale times ``2^-j`` (``j`` in 0..4, MosaicQuant's
    ``rscale=pow2``), ``values · scale = (values · 2^(4 - j)) · s_w / 16`` exactly: the kernels add
    ``values << (4 - j)`` (int8) into the int32 accumulator of the base unpacked as ``16 q``. The
    format is unchanged; the shifts are derived from it.

Activations are quantized per token, symmetric, 4-bit (``mosaicquant.methods.quant``
conventions), once; the base and every residual block multiply the same integers::

    y = s_a ⊙ (Xq · Qwᵀ) ⊙ s_w + Σ_b s_a ⊙ (Xq[:, k∈b] · R_bᵀ) ⊙ s_{r,b}
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import torch

from mosaicquant.errors import UserInputError
from mosaicquant.methods.quant import Quantized

__all__ = ["pack_int4", "unpack_int4", "PackedW4", "ResidualBlocks", "parse_block_shape", "block_shape_text",
           "residual_shifts", "POW2_SHIFT_RANGE"]

# residual scales s_w * 2^-j, j in this range, run in the base's accumulator (see residual_shifts)
POW2_SHIFT_RANGE = (0, 4)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed 4-bit integers ``[..., K]`` (values in [-8, 7]) into ``uint8 [..., ceil(K/2)]``.

    Raises:
        ValueError: a value outside [-8, 7].
    """
    if q.numel():
        low, high = torch.aminmax(q)
        if low < -8 or high > 7:
            raise ValueError(f"pack_int4 takes values in [-8, 7], got [{int(low)}, {int(high)}]")
    k = q.shape[-1]
    # the two's-complement byte of each value; its low nibble is the value's 4-bit code
    nib = q.to(torch.int8).view(torch.uint8) & 0xF
    if k % 2:
        nib = torch.nn.functional.pad(nib, (0, 1))
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


#: the two signed values (low nibble, high nibble) of every byte, ``int8 [256, 2]``
_NIBBLE_PAIRS = torch.stack([(torch.arange(256) & 0xF ^ 8) - 8, (torch.arange(256) >> 4 ^ 8) - 8], dim=1).to(torch.int8)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``uint8 [..., ceil(K/2)]`` → ``int8 [..., K]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4 takes uint8, got {packed.dtype}")
    # one table lookup a byte: three times faster on a CPU than masking, shifting and sign-extending
    both = _NIBBLE_PAIRS.to(packed.device)[packed.to(torch.int32)]
    both = both.reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return both if both.shape[-1] == k else both[..., :k].contiguous()


def parse_block_shape(block: int | str | tuple[int, int]) -> tuple[int, int]:
    """Parse a block shape: ``128`` → (128, 128); ``"64x128"`` → (64, 128) (rows × cols).

    Raises:
        ValueError: not positive, or an odd column count (blocks are packed two per byte).
    """
    if isinstance(block, tuple):
        bn, bk = block
    elif isinstance(block, int):
        bn = bk = block
    else:
        text = str(block).lower().strip()
        try:
            parts = [int(p) for p in text.split("x")]
        except ValueError:
            raise ValueError(f"block={block!r}: expected 'B' or 'BNxBK', e.g. 128 or 64x128") from None
        if len(parts) == 1:
            bn = bk = parts[0]
        elif len(parts) == 2:
            bn, bk = parts
        else:
            raise ValueError(f"block={block!r}: expected 'B' or 'BNxBK', e.g. 128 or 64x128")
    if bn < 1 or bk < 2 or bk % 2:
        raise ValueError(
            f"block={block!r}: rows must be >= 1 and columns an even number >= 2, got {bn}x{bk}"
        )
    return int(bn), int(bk)


def block_shape_text(block: int | str | tuple[int, int]) -> str:
    """The one text of a block shape: ``"B"`` for a square block, else ``"BNxBK"`` (``"16x16"`` → ``"16"``,
    ``"64X128"`` → ``"64x128"``), so one shape written two ways is one config.

    Raises:
        ValueError: as :func:`parse_block_shape`.
    """
    bn, bk = parse_block_shape(block)
    return str(bn) if bn == bk else f"{bn}x{bk}"


@dataclass
class ResidualBlocks:
    """Kept residual blocks of one layer in the packed format (see module docstring).

    The block indices are checked as the object is built (:meth:`validate`; ``check=False`` skips
    that, for views of blocks already checked): the kernels follow ``coords`` and ``row_ptr`` without
    bounds checks.
    """

    shape: tuple[int, int]
    block_shape: tuple[int, int]
    coords: torch.Tensor
    row_ptr: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor
    check: InitVar[bool] = True

    def __post_init__(self, check: bool) -> None:
        if check:
            self.validate()

    def validate(self) -> None:
        """Check that ``coords`` and ``row_ptr`` index the block grid as the format says.

        Every kept block inside the :attr:`grid`, the blocks in block-row-major order without repeats
        (sorted by ``(i, j)``), and ``row_ptr`` the CSR pointer of their block rows (``0`` first,
        :attr:`num_blocks` last). The kernels take these indices as they are: a block outside the grid
        reads activations past ``K``, a ``row_ptr`` past the kept blocks reads blocks that are not there.

        It reads the indices (one copy to the host: a device synchronisation on CUDA), so it runs where
        blocks are built or a layer is constructed (:class:`~mosaicquant.kernels.quant_linear.QuantLinear`),
        not per call. Tensors on the ``meta`` device (no data) are checked for shape only.

        Raises:
            UserInputError: (a ``ValueError``) naming the block shape, index tensor, block or pointer
                that is out of place.
        """
        bn, bk = self.block_shape
        if not (isinstance(bn, int) and isinstance(bk, int) and bn >= 1 and bk >= 2 and bk % 2 == 0):
            raise UserInputError(f"residual block_shape={tuple(self.block_shape)!r}: rows must be an int >= 1 and "
                                 f"columns an even int >= 2")
        nbr, nbc = self.grid
        for name, t, want in (("coords", self.coords, "[num_blocks, 2]"), ("row_ptr", self.row_ptr, f"[{nbr + 1}]")):
            if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex \
                    or t.dtype == torch.bool:
                what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise UserInputError(f"residual.{name} must be an integer tensor, got {what}")
        if self.coords.dim() != 2 or self.coords.shape[1] != 2:
            raise UserInputError(f"residual.coords must have shape [num_blocks, 2], got {list(self.coords.shape)}")
        if tuple(self.row_ptr.shape) != (nbr + 1,):
            raise UserInputError(f"residual.row_ptr must have shape [{nbr + 1}] (block rows + 1 of a "
                                 f"{tuple(self.shape)} layer in {bn}x{bk} blocks), got {list(self.row_ptr.shape)}")
        if self.coords.is_meta or self.row_ptr.is_meta:
            return
        coords = self.coords.detach().to("cpu", torch.int64)
        row_ptr = self.row_ptr.detach().to("cpu", torch.int64)
        nb = coords.shape[0]
        outside = (coords[:, 0] < 0) | (coords[:, 0] >= nbr) | (coords[:, 1] < 0) | (coords[:, 1] >= nbc)
        if outside.any():
            b = int(outside.nonzero()[0])
            raise UserInputError(f"residual block {b} at (i, j) = {tuple(coords[b].tolist())} is outside the "
                                 f"{nbr}x{nbc} block grid of a {tuple(self.shape)} layer in {bn}x{bk} blocks")
        key = coords[:, 0] * nbc + coords[:, 1]
        unordered = key[1:] <= key[:-1]
        if unordered.any():
            b = int(unordered.nonzero()[0]) + 1
            raise UserInputError(f"residual blocks must be in block-row-major order without repeats (sorted by "
                                 f"(i, j)): block {b} at {tuple(coords[b].tolist())} follows "
                                 f"{tuple(coords[b - 1].tolist())}")
        want = torch.zeros(nbr + 1, dtype=torch.int64)
        want[1:] = torch.cumsum(torch.bincount(coords[:, 0], minlength=nbr), 0)
        wrong = row_ptr != want
        if wrong.any():
            i = int(wrong.nonzero()[0])
            raise UserInputError(f"residual.row_ptr[{i}] = {int(row_ptr[i])}, but the {nb} kept blocks' rows give "
                                 f"{int(want[i])}: row_ptr must be the CSR pointer of coords' block rows "
                                 f"(0 .. {nb})")

    @property
    def num_blocks(self) -> int:
        return int(self.coords.shape[0])

    @property
    def grid(self) -> tuple[int, int]:
        """Number of block rows and block columns of the tiling."""
        n, k = self.shape
        bn, bk = self.block_shape
        return -(-n // bn), -(-k // bk)

    @classmethod
    def empty(cls, shape: tuple[int, int], block_shape: tuple[int, int], device=None) -> "ResidualBlocks":
        bn, bk = block_shape
        nbr = -(-shape[0] // bn)
        return cls(
            shape=tuple(shape),
            block_shape=tuple(block_shape),
            coords=torch.zeros(0, 2, dtype=torch.int32, device=device),
            row_ptr=torch.zeros(nbr + 1, dtype=torch.int32, device=device),
            values=torch.zeros(0, bn, bk // 2, dtype=torch.uint8, device=device),
            scales=torch.zeros(0, bn, dtype=torch.float16, device=device),
        )

    @classmethod
    def from_blocks(
        cls,
        shape: tuple[int, int],
        block_shape: tuple[int, int],
        coords: torch.Tensor,
        q: torch.Tensor,
        scales: torch.Tensor,
    ) -> "ResidualBlocks":
        """Build from unsorted kept blocks.

        Args:
            shape: ``(N, K)`` of the layer.
            block_shape: ``(Bn, Bk)``.
            coords: ``[nb, 2]`` block coordinates ``(i, j)``.
            q: ``int8 [nb, Bn, Bk]`` 4-bit values, zero outside the layer's edge.
            scales: ``[nb, Bn]`` per-row scales (stored as FP16).
        """
        bn, bk = block_shape
        nbr, nbc = -(-shape[0] // bn), -(-shape[1] // bk)
        coords = coords.to(torch.int64).reshape(-1, 2)
        if coords.numel():
            if (coords[:, 0] < 0).any() or (coords[:, 0] >= nbr).any() or (coords[:, 1] < 0).any() or (coords[:, 1] >= nbc).any():
                raise ValueError(f"block coordinates outside the {nbr}x{nbc} block grid")
            key = coords[:, 0] * nbc + coords[:, 1]
            if key.unique().numel() != key.numel():
                raise ValueError("duplicate residual block coordinates")
            order = torch.argsort(key)
        else:
            order = torch.zeros(0, dtype=torch.int64, device=coords.device)
        coords = coords[order]
        counts = torch.bincount(coords[:, 0], minlength=nbr) if coords.numel() else torch.zeros(nbr, dtype=torch.int64, device=coords.device)
        row_ptr = torch.zeros(nbr + 1, dtype=torch.int64, device=coords.device)
        row_ptr[1:] = torch.cumsum(counts, 0)
        return cls(
            shape=tuple(int(s) for s in shape),
            block_shape=(bn, bk),
            coords=coords.to(torch.int32),
            row_ptr=row_ptr.to(torch.int32),
            values=pack_int4(q[order].reshape(-1, bn, bk)),
            scales=scales[order].reshape(-1, bn).to(torch.float16),
        )

    def to_dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The residual as a dense ``[N, K]`` tensor (zero outside kept blocks)."""
        n, k = self.shape
        bn, bk = self.block_shape
        nbr, nbc = self.grid
        out = torch.zeros(nbr * bn, nbc * bk, dtype=torch.float32, device=self.values.device)
        if self.num_blocks:
            vals = unpack_int4(self.values, bk).to(torch.float32) * self.scales.to(torch.float32).unsqueeze(-1)
            view = out.view(nbr, bn, nbc, bk).permute(0, 2, 1, 3)
            view[self.coords[:, 0].long(), self.coords[:, 1].long()] = vals
        return out[:n, :k].to(dtype)

    def nbytes(self) -> dict[str, int]:
        """Bytes of residual values, scales and indices (coords + row pointer)."""
        return {
            "residual_values": self.values.numel() * self.values.element_size(),
            "residual_scales": self.scales.numel() * self.scales.element_size(),
            "residual_indices": self.coords.numel() * self.coords.element_size()
            + self.row_ptr.numel() * self.row_ptr.element_size(),
        }

    def to(self, device) -> "ResidualBlocks":
        """The same blocks on ``device`` (a move does not change the indices: not checked again, which would
        copy them back from the device)."""
        return ResidualBlocks(
            self.shape, self.block_shape, self.coords.to(device), self.row_ptr.to(device),
            self.values.to(device), self.scales.to(device), check=False,
        )


def residual_shifts(residual: "ResidualBlocks", base_scales: torch.Tensor) -> torch.Tensor | None:
    """``int8 [nb, Bn]`` shifts ``j`` with ``scales == base_scales[row] · 2^-j`` exactly, or ``None``.

    ``None`` unless every row of every kept block inside the layer has such a ``j`` in
    :data:`POW2_SHIFT_RANGE` (a zero scale qualifies only with zero values, shift 0); rows in the
    padding of a ragged last block row get 0 (their values are zero). The kernels then add the
    block's integers shifted left by ``4 - j`` into the int32 accumulator of the base unpacked as
    ``16 q`` (:mod:`mosaicquant.kernels.w4a4_gemm`, ``residual_walk="shared"``).

    Args:
        residual: the layer's kept blocks.
        base_scales: the base's per-output-channel scales (``[N]`` or ``[N, 1]``).
    """
    n = residual.shape[0]
    if base_scales.numel() != n:
        return None  # group-wise base scales: no single row scale to share
    bn, _ = residual.block_shape
    nb = residual.num_blocks
    if nb == 0:
        return torch.zeros(0, bn, dtype=torch.int8, device=residual.scales.device)
    rows = residual.coords[:, 0].long().unsqueeze(1) * bn + torch.arange(bn, device=residual.coords.device)
    inside = rows < n
    base = base_scales.reshape(-1).to(torch.float32)[rows.clamp(max=n - 1)]
    scale = residual.scales.to(torch.float32)
    shifts = torch.zeros(nb, bn, dtype=torch.int8, device=scale.device)
    found = ~inside | ((scale == 0) & (residual.values == 0).all(-1))
    lo, hi = POW2_SHIFT_RANGE
    for j in range(lo, hi + 1):
        hit = ~found & (scale > 0) & (scale * 2.0 ** j == base)
        shifts[hit] = j
        found |= hit
    return shifts if bool(found.all()) else None


@dataclass
class PackedW4:
    """A 4-bit symmetric weight (dense base) with an optional sparse 4-bit residual."""

    shape: tuple[int, int]
    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int | None = None
    residual: ResidualBlocks | None = None
    bias: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_quantized(
        cls,
        qt: Quantized,
        residual: ResidualBlocks | None = None,
        bias: torch.Tensor | None = None,
    ) -> "PackedW4":
        """Pack a symmetric 4-bit :class:`Quantized` weight ``[N, K]``.

        Raises:
            ValueError: not 4-bit symmetric, or not 2-D.
        """
        if qt.bits != 4 or qt.zero is not None:
            raise ValueError(f"PackedW4 holds 4-bit symmetric weights, got bits={qt.bits}, "
                             f"{'asymmetric' if qt.zero is not None else 'symmetric'}")
        if qt.q.dim() != 2:
            raise ValueError(f"PackedW4 takes a 2-D weight, got shape {tuple(qt.q.shape)}")
        return cls(
            shape=(int(qt.q.shape[0]), int(qt.q.shape[1])),
            qweight=pack_int4(qt.q),
            scales=qt.scale.reshape(qt.q.shape[0], -1).to(torch.float16),
            group_size=qt.group_size,
            residual=residual,
            bias=bias,
        )

    def int_weight(self) -> torch.Tensor:
        """The base's integers, ``int8 [N, K]``."""
        return unpack_int4(self.qweight, self.shape[1])

    def dequantize_base(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        g = self.group_size or k
        q = self.int_weight().to(torch.float32).view(n, k // g, g)
        return (q * self.scales.to(torch.float32).unsqueeze(-1)).view(n, k).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Base plus residual as a float ``[N, K]`` weight (what the simulated layer multiplies)."""
        w = self.dequantize_base(torch.float32)
        if self.residual is not None and self.residual.num_blocks:
            w = w + self.residual.to_dense(torch.float32)
        return w.to(dtype)

    def nbytes(self) -> dict[str, int]:
        """Bytes of base values, base scales, residual values/scales/indices (bias excluded)."""
        out = {
            "base_values": self.qweight.numel() * self.qweight.element_size(),
            "base_scales": self.scales.numel() * self.scales.element_size(),
            "residual_values": 0,
            "residual_scales": 0,
            "residual_indices": 0,
        }
        if self.residual is not None:
            out.update(self.residual.nbytes())
        return out

    @staticmethod
    def concat_outputs(parts: list["PackedW4"]) -> "PackedW4":
        """Stack layers that share an input along ``N``: ``[N_1 + N_2 + ..., K]``.

        Base values, scales and biases are concatenated; residual blocks keep their columns and
        move down by the rows above them, so every part's ``N`` except the last must be a
        multiple of the block height (blocks never straddle two parts).

        Raises:
            ValueError: no parts, different ``K``, group sizes or block shapes, a part with
                a residual next to one without, or an ``N`` that is not a block multiple.
        """
        if not parts:
            raise ValueError("concat_outputs needs at least one layer")
        k = parts[0].shape[1]
        for p in parts:
            if p.shape[1] != k or p.group_size != parts[0].group_size:
                raise ValueError(f"layers of shapes/groups {[(q.shape, q.group_size) for q in parts]} do not share K")
        n_total = sum(p.shape[0] for p in parts)
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([p.bias.float() if p.bias is not None
                              else torch.zeros(p.shape[0], device=p.qweight.device) for p in parts])
        residual = None
        res = [p.residual for p in parts]
        if any(r is not None for r in res):
            if any(r is None for r in res) or len({tuple(r.block_shape) for r in res}) != 1:
                raise ValueError("concat_outputs: every layer needs a residual of one block shape, or none")
            bn, bk = res[0].block_shape
            coords, row_ptr, values, scales = [], [res[0].row_ptr[:1]], [], []
            row_off = nnz = 0
            for i, (p, r) in enumerate(zip(parts, res)):
                if i < len(parts) - 1 and p.shape[0] % bn:
                    raise ValueError(f"N={p.shape[0]} is not a multiple of the block height {bn}")
                c = r.coords.clone()
                c[:, 0] += row_off
                coords.append(c)
                row_ptr.append(r.row_ptr[1:] + nnz)
                values.append(r.values)
                scales.append(r.scales)
                row_off += r.grid[0]
                nnz += r.num_blocks
            residual = ResidualBlocks((n_total, k), (bn, bk), torch.cat(coords), torch.cat(row_ptr),
                                      torch.cat(values), torch.cat(scales))
        return PackedW4((n_total, k), torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                        parts[0].group_size, residual, bias, {})

    def to(self, device) -> "PackedW4":
        return PackedW4(
            self.shape, self.qweight.to(device), self.scales.to(device), self.group_size,
            self.residual.to(device) if self.residual is not None else None,
            self.bias.to(device) if self.bias is not None else None, dict(self.meta),
        )
