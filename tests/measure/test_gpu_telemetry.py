"""The GPU telemetry sampler: what it summarises, that its thread stops, and that it stays out of the way where
NVML cannot be read."""

import math
import threading

import torch

from cs336_systems.measure.gpu_telemetry import SUMMARY_KEYS, GpuTelemetry, why_unavailable


def test_no_thread_and_nan_off_a_gpu():
    device = torch.device("cpu")
    assert why_unavailable(device) == "not a CUDA device"
    before = threading.active_count()
    with GpuTelemetry(device) as telemetry:
        assert threading.active_count() == before
    assert telemetry.samples == []
    assert all(math.isnan(telemetry.summary()[key]) for key in SUMMARY_KEYS)


def test_mean_clock_and_power_and_the_highest_temperature():
    readings = iter([(1500.0, 690.0, 55.0), (1700.0, 700.0, 61.0), (1600.0, 650.0, 58.0)])
    seen = threading.Event()

    def read(_device):
        try:
            return next(readings)
        except StopIteration:  # all three read: let the context end
            seen.set()
            raise

    with GpuTelemetry(torch.device("cpu"), interval_s=0.001, read=read) as telemetry:
        assert seen.wait(10)
    assert telemetry.samples == [(1500.0, 690.0, 55.0), (1700.0, 700.0, 61.0), (1600.0, 650.0, 58.0)]
    assert telemetry.summary() == {"sm_clock_mhz": 1600.0, "power_w": 680.0, "temperature_c": 61.0}
    assert telemetry._thread is not None and not telemetry._thread.is_alive()


def test_the_thread_stops_when_the_context_ends():
    calls = []
    with GpuTelemetry(
        torch.device("cpu"), interval_s=0.001, read=lambda d: calls.append(1) or (1.0, 2.0, 3.0)
    ) as t:
        while len(calls) < 3:
            pass
    stopped_at = len(calls)
    assert not t._thread.is_alive()
    assert len(t.samples) == stopped_at >= 3
