"""GPU telemetry through NVML (``nvidia-ml-py``): power, SM clock and energy of a timed window.

Optional: without the package or a GPU, :class:`Telemetry` is inactive and the suites
record no telemetry metrics (and say why in the record). Energy comes from the device's
cumulative energy counter (mJ) over the window; the mean power is that energy over the
window's wall time; the SM clock is sampled at its end. The counter moves in steps of tens of
milliseconds, so windows are held for seconds (see :func:`mosaicquant.harness.timing.time_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Telemetry", "Window"]


@dataclass
class Window:
    """What one timed window measured (``None`` where the device does not report it)."""

    energy_j: float | None
    power_w: float | None
    sm_clock_mhz: float | None
    seconds: float | None = None


class Telemetry:
    """NVML handle for one CUDA device; ``active`` is False (with ``reason``) where unavailable."""

    def __init__(self, device: torch.device):
        self.active = False
        self.reason = ""
        self._nvml = None
        self._handle = None
        if device.type != "cuda" or not torch.cuda.is_available():
            self.reason = "no CUDA device"
            return
        try:
            import pynvml  # the nvidia-ml-py package
        except ImportError:
            self.reason = "nvidia-ml-py is not installed (pip install 'mosaicquant[gpu]')"
            return
        try:
            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = torch.cuda.get_device_properties(index).uuid
            handle = None
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                raw = pynvml.nvmlDeviceGetUUID(h)
                raw = raw.decode() if isinstance(raw, bytes) else raw
                if raw.replace("GPU-", "") == str(uuid):
                    handle = h
                    break
            self._handle = handle if handle is not None else pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # noqa: BLE001 - NVML errors are reported, never fatal
            self.reason = f"NVML unavailable: {exc}"
            return
        self._nvml = pynvml
        self.active = True

    def _energy_mj(self) -> float | None:
        try:
            return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:  # noqa: BLE001 - not every device has the counter
            return None

    def start(self) -> float | None:
        """Mark the start of a window (returns the energy counter, mJ)."""
        return self._energy_mj() if self.active else None

    def stop(self, started: float | None, seconds: float | None = None) -> Window:
        """Close the window opened by :meth:`start`; ``seconds`` is its wall time.

        Power is the mean over the window (energy / ``seconds``) when both are known, else
        NVML's power reading at the end.
        """
        if not self.active:
            return Window(None, None, None, seconds)
        end = self._energy_mj()
        energy = (end - started) / 1e3 if end is not None and started is not None else None
        if energy is not None and seconds:
            power = energy / seconds
        else:
            try:
                power = self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3
            except Exception:  # noqa: BLE001
                power = None
        try:
            clock = float(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))
        except Exception:  # noqa: BLE001
            clock = None
        return Window(energy, power, clock, seconds)
