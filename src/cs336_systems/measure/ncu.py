"""Nsight Compute (`ncu`) from Python: the command that profiles a workload's marked units, and its raw page as
one tidy row per kernel.

A workload brackets what it wants profiled with `torch.cuda.profiler.start()` / `stop()` and calls
`mark_unit()` before each unit, so that every profiled kernel is credited to its unit (ours/forward,
cudnn/backward, ...) without knowing how many kernels a library launches for it.
"""

from __future__ import annotations

import csv
import io
import re
import subprocess
from pathlib import Path

import torch
import triton
import triton.language as tl

# Tidy column -> ncu metric. Durations are read in base units (ns); percentages are of the peak.
METRICS = {
    "duration_ms": "gpu__time_duration.sum",
    # Tensor-core pipe busy as a share of active cycles (on Hopper this counter includes wgmma).
    "tensor_pipe_pct": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor_ops": "sm__ops_path_tensor_src_bf16_dst_fp32.sum",  # matmul work executed, bf16 in, fp32 out
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "memory_throughput_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers_per_thread": "launch__registers_per_thread",
    "block_size": "launch__block_size",
    "grid_size": "launch__grid_size",
}
# Warp State Statistics: warp cycles per issued instruction spent stalled, by reason.
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats")
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")
MARKER = "ncu_unit_marker"


@triton.jit
def ncu_unit_marker(flag_ptr):
    tl.store(flag_ptr, 1)


def mark_unit(flag: torch.Tensor) -> None:
    """Launch the marker kernel: the profiled kernels after it, up to the next marker, are the next unit's."""
    ncu_unit_marker[(1,)](flag)


def available_metrics(ncu: str = "ncu") -> set[str] | None:
    """The base metric names this GPU and ncu offer (`ncu --query-metrics`), or None where the query fails."""
    try:
        listing = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = {line.split()[0] for line in listing.stdout.splitlines() if re.match(r"[a-z0-9]+__\w+\s", line)}
    return names or None


def requested_metrics(available: set[str] | None) -> list[str]:
    """METRICS whose base name (before the first '.') is available; all of them where that is unknown."""
    return [m for m in METRICS.values() if available is None or m.split(".")[0] in available]


def command(report: Path, workload: list[str], metrics: list[str], ncu: str = "ncu") -> list[str]:
    """ncu profiling the workload's profiler-started ranges at the clocks the benchmarks run at (not locked to
    base), into `report` (.ncu-rep)."""
    sections = [arg for name in SECTIONS for arg in ("--section", name)]
    return [
        ncu, "--profile-from-start", "off", "--clock-control", "none", "--force-overwrite", "--export", str(report),
        *sections, "--metrics", ",".join(metrics), *workload,
    ]  # fmt: skip


def raw_page(report: Path, ncu: str = "ncu") -> str:
    """The report's raw page as CSV: one row per kernel, every collected metric a column, in base units."""
    cmd = [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout


def number(text: str | None) -> float | None:
    """A raw-page value as a float ('1,234.5' -> 1234.5); None for 'n/a' and the like."""
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def kernels(page: str) -> list[dict[str, str]]:
    """The raw page's kernels in launch order; the units row under the header is dropped."""
    rows = list(csv.DictReader(io.StringIO(page[page.index('"ID"') :])))
    return sorted((r for r in rows if (r.get("ID") or "").strip().isdigit()), key=lambda r: int(r["ID"]))


def kernel_columns(kernel: dict[str, str]) -> dict:
    """One kernel's tidy columns: its name, METRICS, where it is bound and its two largest stall reasons."""
    row = {"kernel": kernel["Kernel Name"][:120]}
    for column, metric in METRICS.items():
        row[column] = number(kernel.get(metric))
    if row["duration_ms"] is not None:
        row["duration_ms"] /= 1e6  # ns
    sm, memory = row["sm_throughput_pct"], row["memory_throughput_pct"]
    row["bound"] = None if sm is None or memory is None else "compute" if sm >= memory else "memory"
    stalls = sorted(
        (
            (STALL.fullmatch(name).group(1), number(value))
            for name, value in kernel.items()
            if STALL.fullmatch(name)
        ),
        key=lambda item: -(item[1] or 0),
    )
    for i, (reason, cycles) in enumerate(stalls[:2], start=1):
        row[f"stall_{i}"], row[f"stall_{i}_cycles"] = reason, cycles
    return row


def credit_to_units(profiled: list[dict[str, str]], units: list[dict]) -> list[dict]:
    """Tidy rows of the profiled kernels, each with the columns of its unit: the i-th marker starts units[i]."""
    markers = sum(MARKER in kernel["Kernel Name"] for kernel in profiled)
    if markers != len(units):
        raise ValueError(f"found {markers} unit markers among the profiled kernels, expected {len(units)}")
    rows, current = [], -1
    for kernel in profiled:
        if MARKER in kernel["Kernel Name"]:
            current += 1
        elif current < 0:
            raise ValueError(
                f"kernel {kernel['Kernel Name'][:60]!r} was profiled before the first unit marker"
            )
        else:
            rows.append({**units[current], **kernel_columns(kernel)})
    return rows
