"""The fit rows of the leaderboard's step benchmark: a least-squares line over the depths measured, carrying none
of the cells' measurements (an extrapolation ran on no GPU)."""

import math

import pytest

from cs336_systems.bench.stack_timing import CONFIG_KEYS, fit_rows

DIMS = {"d_model": 64, "d_ff": 176, "num_heads": 2, "vocab_size": 100, "context_length": 32, "batch_size": 1,
        "world_size": 1, "attention": "flash_triton", "rope": "triton", "head": "fused", "head_chunk": 16,
        "checkpoint": "selective", "compiled": True, "optimizer": "ours", "sharding": "none", "dtype": "bfloat16",
        "weights": "bfloat16"}  # fmt: skip


def cell(layers, step_ms, clock):
    return {**DIMS, "kind": "cell", "stack": "ours", "status": "ok", "num_layers": layers, "step_ms": step_ms,
            "peak_mib": 10.0 * layers, "build_peak_mib": 5.0, "first_step_peak_mib": 8.0, "gather_wait_ms": 1.0,
            "sync_wait_ms": 2.0, "build_s": 3.0, "first_step_s": 4.0, "elapsed_s": 5.0, "sm_clock_mhz": clock,
            "power_w": 690.0, "temperature_c": 60.0, "weights_mib": 3.0 * layers, "updated_fraction": 0.6,
            "optimizer_ms": 0.1 * layers, "alloc_retries": 0.0}  # fmt: skip


def test_a_fit_row_extrapolates_the_step_and_keeps_no_measurement_of_a_cell():
    cells = [cell(2, 400.0, 1634.0), cell(4, 640.0, 1603.0), cell(8, 1120.0, 1587.0), cell(4, math.nan, 0.0)]
    cells[-1]["status"] = "OOM"
    (fit,) = fit_rows(cells, extrapolate_layers=34, peak=None)
    assert fit["kind"] == "fit" and fit["status"] == "extrapolated" and fit["num_layers"] == 34
    assert fit["per_layer_ms"] == pytest.approx(120.0) and fit["intercept_ms"] == pytest.approx(160.0)
    assert fit["step_ms"] == pytest.approx(160.0 + 120.0 * 34)
    # its configuration is its cells'; nothing they measured (peaks, waits, clocks, times, kept state) comes along
    assert {key: fit[key] for key in ("stack", "d_model", "world_size")} == {
        "stack": "ours",
        "d_model": 64,
        "world_size": 1,
    }
    measured = set(cells[0]) - set(CONFIG_KEYS) - {"kind", "num_layers", "step_ms", "status"}
    assert measured and not measured & set(fit), measured & set(fit)


def test_no_fit_from_one_depth():
    assert fit_rows([cell(2, 400.0, 1600.0), cell(2, 410.0, 1600.0)], extrapolate_layers=34, peak=None) == []
