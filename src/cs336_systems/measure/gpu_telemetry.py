"""The GPU's SM clock, power draw and temperature, sampled in a background thread while a measurement runs.

    with GpuTelemetry(device) as telemetry:
        ...                                   # the timed work
    telemetry.summary()                       # {"sm_clock_mhz": mean, "power_w": mean, "temperature_c": max}

Why: a GPU at its power cap (an H100 or H200 at 700 W) lowers its SM clock as the work draws more power, so the
same kernel runs slower inside a long training step than alone, and a step slower beside collectives; the clock
says how much of a difference between two runs is the clock's. Read through NVML by torch.cuda (`clock_rate`,
`power_draw`, `temperature`; they need nvidia-ml-py). Where that cannot work (no CUDA device, no NVML) the summary
is NaN and nothing runs in the background.
"""

from __future__ import annotations

import math
import statistics
import threading

import torch

INTERVAL_S = 0.1  # NVML's power reading averages over about a second; the clock is sampled as it is
SUMMARY_KEYS = ("sm_clock_mhz", "power_w", "temperature_c")


def read_gpu(device: torch.device) -> tuple[float, float, float]:
    """(SM clock in MHz, power draw in W, temperature in degrees C) of `device` now."""
    return (
        float(torch.cuda.clock_rate(device)),
        torch.cuda.power_draw(device) / 1e3,
        float(torch.cuda.temperature(device)),
    )


def why_unavailable(device: torch.device) -> str | None:
    """Why the telemetry of `device` cannot be read here, or None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    try:
        read_gpu(device)
    except Exception as e:  # no nvidia-ml-py, or NVML without the driver
        return f"NVML unreadable: {type(e).__name__}: {e}"
    return None


class GpuTelemetry:
    """Samples `read(device)` every `interval_s` from entering to leaving the context (once at entry too)."""

    def __init__(self, device: torch.device, interval_s: float = INTERVAL_S, read=read_gpu) -> None:
        self.device, self.interval_s, self.read = device, interval_s, read
        self.samples: list[tuple[float, float, float]] = []
        self.unavailable = why_unavailable(device) if read is read_gpu else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            try:
                self.samples.append(self.read(self.device))
            except Exception:  # NVML gone mid-run: keep what was read
                return
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> GpuTelemetry:
        if self.unavailable is None:
            self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, float]:
        """Mean SM clock and power, highest temperature over the samples (NaN without samples)."""
        if not self.samples:
            return dict.fromkeys(SUMMARY_KEYS, math.nan)
        clocks, powers, temperatures = zip(*self.samples, strict=True)
        return {
            "sm_clock_mhz": statistics.fmean(clocks),
            "power_w": statistics.fmean(powers),
            "temperature_c": max(temperatures),
        }
