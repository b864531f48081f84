"""Profiling a step with torch.profiler (and nsys), summarised as tidy rows per step.

`profile_step` warms a step up, profiles `steps` steps (CPU + CUDA activity) while timing each with the Python
timer and returns rows (long format), by `record`:
  python_timer  the Python timer around the profiled steps (synchronised after each)
  range         a `record_function` range of the model/workload (RANGES)
  kernel        every CUDA kernel (on CPU: every aten op, by self time), with `is_matmul`
Columns per step (divided by the number of profiled steps): `count_per_step` and `time_ms_per_step`, which is
  python_timer: mean of the timed steps;
  range:  CUDA: the range's device span (first to last kernel launched from inside the CPU range);
          CPU: the range's CPU duration;
  kernel: CUDA: total kernel time; CPU: the op's self CPU time.
`share` is a kernel's fraction of all kernel (op) time; `cpu_ms_per_step` and `device_busy_ms_per_step` (sum of
kernel durations) are given for ranges too. `with_attention_flops` adds `flops_per_step` to the attention ranges.

Under nsys (`rerun_under_nsys` re-runs a command there), the profiled steps are run once more inside
`torch.autograd.profiler.emit_nvtx()`, so the ranges become NVTX ranges; warm-up and profiled steps get NVTX ranges
of their own.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cs336_systems.measure.timing import summarize, time_steps
from cs336_systems.model.transformer import ModelConfig

RANGES = (
    "forward",
    "backward",
    "optimizer_step",
    "attention",
    "attention/scores",
    "attention/softmax",
    "attention/output",
    "feed_forward",
)
MATMUL = re.compile(r"gemm|matmul|xmma|cutlass|nvjet|^aten::(mm|addmm|bmm|baddbmm|addbmm)$", re.IGNORECASE)
UNDER_NSYS = "CS336_UNDER_NSYS"  # set in the re-executed child so it does not re-exec again


def profile_step(
    step: Callable[[], object],
    warmup: int,
    steps: int,
    device: torch.device,
    trace: Path | None = None,
    label: str = "steps",
) -> list[dict]:
    """Run `warmup` steps outside the profiled window, profile `steps` steps and return their rows (module
    docstring); `trace` keeps the Chrome/Perfetto trace. Under nsys the profiled steps run once more, as the NVTX
    range `profiled <label>`."""
    on_cuda = device.type == "cuda"
    nvtx = on_cuda and under_nsys()
    with nvtx_range("warmup", nvtx):
        time_steps(step, warmup, 0, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        times = time_steps(step, 0, steps, device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    if nvtx:
        with torch.autograd.profiler.emit_nvtx(), nvtx_range(f"profiled {label}"):
            time_steps(step, 0, steps, device)
    events = kineto_events(prof) if on_cuda else prof.events()
    return [timer_row(times), *range_rows(events, steps, on_cuda), *kernel_rows(events, steps, on_cuda)]


def nvtx_range(name: str, enabled: bool = True) -> contextlib.AbstractContextManager:
    return torch.cuda.nvtx.range(name) if enabled else contextlib.nullcontext()


def timer_row(times_s: list[float]) -> dict:
    timer = summarize(times_s)
    return {
        "record": "python_timer",
        "name": "step",
        "count_per_step": 1.0,
        "time_ms_per_step": timer["mean_ms"],
        "std_ms": timer["std_ms"],
        "median_ms": timer["median_ms"],
        "time_basis": "python timer",
    }


def attention_flops(cfg: ModelConfig, batch_size: int) -> dict[str, int]:
    """FLOPs of one call of each naive-attention range, with B batch, H heads, S context, d = d_head:
    attention/scores 2·B·H·S²·d (the Q Kᵀ matmul; scaling and masking not counted), attention/output
    2·B·H·S²·d (P V), attention/softmax 5·B·H·S² (max, subtract, exp, sum, divide per score)."""
    d_head = cfg.d_model // cfg.num_heads
    squares = batch_size * cfg.num_heads * cfg.context_length**2
    return {
        "attention/scores": 2 * squares * d_head,
        "attention/softmax": 5 * squares,
        "attention/output": 2 * squares * d_head,
    }


def with_attention_flops(rows: list[dict], cfg: ModelConfig, batch_size: int) -> list[dict]:
    """`rows` with `flops_per_step` (forward only, all layers: per call times calls per step) on the attention
    ranges."""
    flops = attention_flops(cfg, batch_size)
    return [
        {**row, "flops_per_step": flops[row["name"]] * row["count_per_step"]}
        if row["record"] == "range" and row["name"] in flops
        else row
        for row in rows
    ]


def _is_kernel(event) -> bool:
    return (
        event.device_type == DeviceType.CUDA
        and not event.is_user_annotation
        and event.name not in RANGES
        and not event.name.startswith("ProfilerStep")
    )


def kineto_events(prof: profile) -> list[SimpleNamespace]:
    """The profiler's raw events with the CPU-op -> kernel link (`linked_correlation_id`).

    FunctionEvent carries that link only from torch 2.12 on; the raw Kineto events carry it in every 2.x release,
    so the CUDA path reads those (times in microseconds on one clock, like FunctionEvent's).
    """
    events = []
    for e in prof.profiler.kineto_results.events():
        start, end = e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3
        interval = SimpleNamespace(start=start, end=end, elapsed_us=lambda s=start, t=end: t - s)
        events.append(
            SimpleNamespace(
                name=e.name(),
                time_range=interval,
                device_type=e.device_type(),
                id=e.correlation_id(),
                linked_correlation_id=e.linked_correlation_id(),
                is_user_annotation=getattr(e, "is_user_annotation", lambda: False)(),
            )
        )
    return events


def range_rows(events: Iterable, steps: int, on_cuda: bool) -> list[dict]:
    """Per record_function range: calls, CPU time and (CUDA) the kernels launched from inside it, per step.

    Kernels are attributed by *launch* time (the CPU start of the op that launched them), not by run time:
    the GPU lags the CPU, and the backward pass runs on the autograd engine's own thread, so neither the
    device time window nor the CPU call tree of the `backward` range would find them.
    """
    events = list(events)
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]
    launched = _kernels_by_launch(events, cpu_ops) if on_cuda else []  # (launch, start, end, duration) in us
    launch_times = [k[0] for k in launched]

    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in cpu_ops:
        if r.name not in RANGES:
            continue
        t = totals[r.name]
        t["count"] += 1
        t["cpu_us"] += r.time_range.elapsed_us()
        first = bisect.bisect_left(launch_times, r.time_range.start)
        inside = launched[first : bisect.bisect_right(launch_times, r.time_range.end)]
        if inside:
            t["busy_us"] += sum(k[3] for k in inside)
            t["span_us"] += max(k[2] for k in inside) - min(k[1] for k in inside)
    rows = []
    for name, t in totals.items():
        cpu_ms = t["cpu_us"] / 1e3 / steps
        span_ms = t["span_us"] / 1e3 / steps if on_cuda else None
        rows.append(
            {
                "record": "range",
                "name": name,
                "count_per_step": t["count"] / steps,
                "time_ms_per_step": span_ms if on_cuda else cpu_ms,
                "cpu_ms_per_step": cpu_ms,
                "device_busy_ms_per_step": t["busy_us"] / 1e3 / steps if on_cuda else None,
                "device_span_ms_per_step": span_ms,
                "time_basis": "device span" if on_cuda else "cpu",
            }
        )
    return rows


def _kernels_by_launch(events: list, cpu_ops: list) -> list[tuple[float, float, float, float]]:
    """(launch, start, end, duration) of every kernel, sorted by the CPU start of the op that launched it."""
    launch_of: dict[int, float] = {}
    for e in cpu_ops:
        if e.linked_correlation_id == 0:
            launch_of[e.id] = min(e.time_range.start, launch_of.get(e.id, float("inf")))
    launched = []
    for k in filter(_is_kernel, events):
        start, end = k.time_range.start, k.time_range.end
        launched.append((launch_of.get(k.linked_correlation_id, start), start, end, end - start))
    return sorted(launched)


def kernel_rows(events: Iterable, steps: int, on_cuda: bool) -> list[dict]:
    """Per CUDA kernel name (total device time); on CPU per aten op (self CPU time: nothing counts twice)."""
    count: dict[str, int] = defaultdict(int)
    total_us: dict[str, float] = defaultdict(float)
    for e in events:
        if on_cuda and _is_kernel(e):
            us = e.time_range.elapsed_us()
        elif not on_cuda and e.device_type == DeviceType.CPU and e.name.startswith("aten::"):
            us = e.self_cpu_time_total
        else:
            continue
        count[e.name] += 1
        total_us[e.name] += us
    grand_total = sum(total_us.values()) or 1.0
    return [
        {
            "record": "kernel",
            "name": name,
            "count_per_step": count[name] / steps,
            "time_ms_per_step": total_us[name] / 1e3 / steps,
            "share": total_us[name] / grand_total,
            "is_matmul": bool(MATMUL.search(name)),
            "time_basis": "device" if on_cuda else "cpu self",
        }
        for name in sorted(total_us, key=total_us.get, reverse=True)
    ]


def under_nsys() -> bool:
    """Whether this process is the one `rerun_under_nsys` started."""
    return bool(os.environ.get(UNDER_NSYS))


def nsys_command(nsys: str, report: Path, module: str, argv: list[str]) -> list[str]:
    return [
        nsys,
        "profile",
        "--trace=cuda,nvtx,osrt",
        "--force-overwrite=true",
        f"--output={report}",
        sys.executable,
        "-m",
        module,
        *argv,
    ]


def rerun_under_nsys(module: str, argv: list[str], report: Path) -> bool:
    """Run `python -m module argv` under `nsys profile` (report written to `report`.nsys-rep) and return True;
    False, with a note on stderr, when nsys is not on the PATH. A failed run is a SystemExit."""
    nsys = shutil.which("nsys")
    if nsys is None:
        print(
            "[profile] --nsys: nsys is not on the PATH; profiling with torch.profiler only", file=sys.stderr
        )
        return False
    report.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(nsys_command(nsys, report, module, argv), env={**os.environ, UNDER_NSYS: "1"})
    if done.returncode != 0:
        raise SystemExit(f"nsys profile failed with exit status {done.returncode}")
    return True
