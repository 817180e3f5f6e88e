"""Pieces the kernel launchers share: the kernel preference and argument checks.

Kernel preference (``kernel=`` argument, else :attr:`mosaicquant.settings.KernelSettings.kernel`
of the settings in force, default ``"auto"``):

- ``"triton"``: run the Triton kernels (a CUDA device, or Triton's CPU interpreter when
  ``TRITON_INTERPRET=1``);
- ``"torch"``: run the plain PyTorch reference of each kernel (any device);
- ``"auto"``: ``"triton"`` when CUDA is available or ``TRITON_INTERPRET=1``, else ``"torch"``.
"""

from __future__ import annotations

import os

import torch

from mosaicquant.errors import UserInputError, unknown_name
from mosaicquant import settings
from mosaicquant.settings import KERNEL_PREFERENCES

__all__ = [
    "KERNEL_PREFERENCES",
    "kernel_preference",
    "resolve_kernel",
    "triton_interpreting",
    "check_tensor",
]

# The kernels' CHAIN constexpr (mosaicquant.kernels._tl.chain_start) for each KernelSettings.pdl_chain.
PDL_CHAINS = {"off": 1, "on": 2}
# The chain is taken by launches of at most this many tokens (rows): it measured 3-5 % faster on
# the Llama-3-8B decode step at batch 4 and 8, 2.5-3.3 % slower at batch 16.
PDL_CHAIN_MAX_M = 8


def triton_interpreting() -> bool:
    """Whether Triton runs on its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch (compiled Triton on sm_90+)."""
    if device.type != "cuda" or triton_interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(device: torch.device, pdl: bool | None = None) -> bool:
    """Whether a GEMM launch on ``device`` uses programmatic dependent launch.

    Args:
        device: the operands' device.
        pdl: the caller's choice; ``None``: :attr:`~mosaicquant.settings.KernelSettings.pdl` of the
            settings in force (default on). Where the device cannot (CPU, interpreter, before
            sm_90) the answer is ``False``.
    """
    if pdl is None:
        pdl = settings.current().pdl
    return bool(pdl) and pdl_supported(device)


def chain_mode(device: torch.device, m: int) -> int:
    """The ``CHAIN`` constexpr of the decode step's non-GEMM kernels on ``device`` (``_tl.chain_start``).

    ``m`` is the launch's tokens (rows). The settings' ``pdl_chain`` picks the mode where
    programmatic dependent launch is on (:func:`use_pdl`; else ``0``, nothing); launches of
    more than :data:`PDL_CHAIN_MAX_M` tokens take ``"off"`` whatever it says:

    - ``"off"`` (``1``): only the activation kernels let the GEMM after them start early
      (they signal as they start; the GEMM is the only kernel launched with PDL);
    - ``"on"`` (``2``, the default): every kernel of the step is launched with PDL, waits for
      the kernel before it as it starts, then lets the next one launch; GEMMs launched with
      PDL signal once they have waited. Each kernel's programs thus become resident while its
      predecessor runs, so the launch gaps between the step's ~11 kernels a layer overlap work
      (:func:`gemm_pdl`).
      Measured on the H200: 3-5 % off the Llama-3-8B batch-4
      step of the W4A4 methods. Signalling *before* waiting, so that a run of small kernels
      and the GEMM after them launch several kernels ahead, was 7-13 % slower.

    Every kernel waits before it reads or writes anything an earlier kernel touches, so the
    results are the same in every mode.
    """
    if not use_pdl(device):
        return 0
    return PDL_CHAINS[settings.current().pdl_chain] if m <= PDL_CHAIN_MAX_M else PDL_CHAINS["off"]


def gemm_pdl(device: torch.device, m: int, pdl: bool) -> int:
    """The ``PDL`` constexpr of a GEMM launch of ``m`` tokens (``_tl.wait_for_inputs``).

    ``0``: launched without PDL; ``1``: with PDL, waiting for the kernel before; ``2``: also
    signalling the kernel after once it has waited (the step's chain, :func:`chain_mode`, is on).
    With the chain ``"off"`` a GEMM never signals, so back-to-back timed GEMMs do not overlap.
    """
    if not pdl:
        return 0
    return 2 if chain_mode(device, m) == PDL_CHAINS["on"] else 1


def chain_launch(chain: int) -> dict:
    """Launch options of a kernel started with ``_tl.chain_start(chain)``."""
    return {"launch_pdl": True} if chain >= 2 else {}


def kernel_preference(kernel: str | None = None) -> str:
    """The preference ``kernel`` names: ``"auto"``, ``"triton"`` or ``"torch"`` (``None``: the
    settings' ``kernel``, default ``"auto"``), before :func:`resolve_kernel` picks the backend.

    Raises:
        UserInputError: an unknown preference.
    """
    pref = kernel if kernel is not None else settings.current().kernel
    pref = str(pref).strip().lower()
    if pref not in KERNEL_PREFERENCES:
        raise unknown_name("kernel preference", pref, KERNEL_PREFERENCES)
    return pref


def resolve_kernel(kernel: str | None = None, device: torch.device | None = None) -> str:
    """Resolve a kernel preference to the backend that will run: ``"triton"`` or ``"torch"``.

    Args:
        kernel: ``"auto"``, ``"triton"``, ``"torch"`` or ``None`` (the settings' ``kernel``,
            default ``"auto"``).
        device: where the operands are; CPU tensors run Triton only in its interpreter, so
            ``"auto"`` picks the PyTorch reference for them on a machine with a GPU.

    Returns:
        ``"triton"`` or ``"torch"``.

    Raises:
        UserInputError: an unknown preference, or ``"triton"`` where neither CUDA nor the
            interpreter is available.
    """
    pref = kernel_preference(kernel)
    on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    can_triton = on_gpu or triton_interpreting()
    if pref == "auto":
        return "triton" if can_triton else "torch"
    if pref == "triton" and not can_triton:
        raise UserInputError(
            "kernel='triton' needs a CUDA device or TRITON_INTERPRET=1 (Triton's CPU interpreter); "
            "use kernel='torch' or 'auto' on this machine"
        )
    return pref


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    dtypes: tuple[torch.dtype, ...],
    dim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous_last: bool = True,
) -> None:
    """Check one launcher argument and raise a message that names what is wrong.

    Args:
        name: argument name used in the message.
        tensor: the tensor to check.
        dtypes: allowed dtypes.
        dim: required number of dimensions.
        shape: required sizes, ``None`` entries are free.
        contiguous_last: require unit stride along the last dimension (coalesced loads).

    Raises:
        UserInputError: not a tensor, wrong dtype, rank, shape or stride.
    """
    if not isinstance(tensor, torch.Tensor):
        raise UserInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise UserInputError(f"{name} has dtype {str(tensor.dtype).replace('torch.', '')}; allowed: {allowed}")
    if dim is not None and tensor.dim() != dim:
        raise UserInputError(f"{name} must be {dim}-D, got shape {tuple(tensor.shape)}")
    if shape is not None:
        want = tuple(shape)
        got = tuple(tensor.shape)
        if len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got)):
            shown = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
            raise UserInputError(f"{name} must have shape {shown}, got {list(got)}")
    if contiguous_last and tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise UserInputError(f"{name} must have unit stride along its last dimension, got strides {tensor.stride()}")


def check_input_features(x: torch.Tensor, features: int) -> None:
    """A layer's input ``[..., features]``: a tensor of at least one dimension, the last ``features``.

    Raises:
        UserInputError: not a tensor, a 0-d tensor, or another last dimension.
    """
    if not isinstance(x, torch.Tensor):
        raise UserInputError(f"input must be a torch.Tensor [..., {features}], got {type(x).__name__}")
    if x.dim() == 0:
        raise UserInputError(f"input has shape [] (a 0-d tensor): the layer takes [..., {features}]")
    if x.shape[-1] != features:
        raise UserInputError(f"input has {x.shape[-1]} features, the layer takes {features}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device; returns it.

    Raises:
        UserInputError: naming the tensors and their devices.
    """
    devs = {k: t.device for k, t in tensors.items() if t is not None}
    if len({str(d) for d in devs.values()}) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in devs.items())
        raise UserInputError(f"tensors must be on one device, got {listing}")
    return next(iter(devs.values()))


def check_triton_device(device: torch.device) -> None:
    """The Triton path runs on CUDA tensors, or on CPU tensors under the interpreter.

    Raises:
        UserInputError: CPU tensors without ``TRITON_INTERPRET=1`` (or CUDA tensors under it).
    """
    if device.type == "cuda" and not triton_interpreting():
        return
    if device.type == "cpu" and triton_interpreting():
        return
    raise UserInputError(
        f"the Triton kernels take CUDA tensors (or CPU tensors with TRITON_INTERPRET=1); got a tensor on "
        f"{device} with TRITON_INTERPRET={'1' if triton_interpreting() else '0'}; use kernel='torch' instead"
    )


def output_buffer(out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A launcher's output: the caller's ``out`` once checked, else a new empty tensor.

    Raises:
        UserInputError: ``out`` of another dtype or shape, not contiguous, or on another device.
    """
    if out is None:
        return torch.empty(*shape, dtype=dtype, device=device)
    check_tensor("out", out, dtypes=(dtype,), shape=shape)
    if not out.is_contiguous() or out.device != device:
        raise UserInputError("out must be contiguous and on the operands' device")
    return out
