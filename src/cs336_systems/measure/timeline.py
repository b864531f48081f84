"""The timeline of one training step, read from a Chrome trace (the DDP benchmark's overlap plot, spec §2.3):
which kernels (CUDA) or operators (CPU) ran when, in which lane, and which of them are communication.

`record_timeline` profiles a few steps, writes their Chrome trace and returns the timeline of the last one;
`timeline` reads any one step's intervals from a trace. On CUDA the intervals are the device's kernels by
stream, NCCL's kernels marked as communication; on the CPU, the outermost operators of each thread and gloo's
collectives, which run on gloo's worker threads. `stream_timeline` reads a CUDA step's kernels with their kind
(compute, memcpy or the collective) and the annotated range (a layer) whose CPU code launched them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cs336_systems.measure.timing import sync

TRACED_STEP = "traced_step_"  # record_function label of each profiled step, followed by its number
# Trace events that run on the device; on a CPU-only run there are none and operators stand in for kernels.
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
# NCCL's kernels on CUDA; on the CPU gloo's collectives (`gloo:all_reduce`) and their launches (`c10d::...`).
COMMUNICATION = re.compile(r"nccl|gloo|c10d::", re.IGNORECASE)


def record_timeline(
    step: Callable[[], object],
    steps: int,
    device: torch.device,
    trace_path: Path | None,
    read: Callable[[dict[str, Any], str], list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """Run `step` `steps` times, each ended by a device synchronisation (so a step's kernels lie inside its
    range). With `trace_path`, profile them, write their Chrome trace there and return the timeline of the last
    step as `read` (default `timeline`) gives it; without (a rank whose peer is traced: the collectives need
    both), only run them and return []."""
    if trace_path is None:
        for _ in range(steps):
            step()
            sync(device)
        return []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"{TRACED_STEP}{i}"):
                step()
                sync(device)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    return (read or timeline)(json.loads(trace_path.read_text()), f"{TRACED_STEP}{steps - 1}")


def timeline(trace: dict[str, Any], step_name: str) -> list[dict[str, Any]]:
    """Intervals of the step annotated `step_name` in a Chrome trace, in order of start: lane, short name,
    start/end (ms from the step's start) and whether it is communication. Device kernels by stream where the
    trace has them; otherwise (CPU) the outermost operators of each thread plus the collectives."""
    events, mark = step_events(trace, step_name)
    begin, end, main_thread = mark["ts"], mark["ts"] + mark["dur"], mark["tid"]
    inside = [e for e in events if begin <= e["ts"] < end]
    device = [e for e in inside if e.get("cat") in DEVICE_EVENTS]
    if device:
        lanes = [(f"stream {e.get('args', {}).get('stream', e['tid'])}", e) for e in device]
    else:
        operators = [e for e in inside if e.get("cat") == "cpu_op"]
        collectives = [
            e for e in inside if e.get("cat") == "user_annotation" and COMMUNICATION.search(e["name"])
        ]
        workers = sorted({e["tid"] for e in collectives} - {main_thread}, key=str)
        names = {main_thread: "main thread"} | {tid: f"thread {i + 1}" for i, tid in enumerate(workers)}
        lanes = [(names[e["tid"]], e) for e in outermost(operators) + collectives if e["tid"] in names]
    return [
        {
            "lane": lane,
            "name": short_name(e["name"]),
            # Microsecond timestamps: four decimals of a millisecond keep all of their precision.
            "start_ms": round((e["ts"] - begin) / 1e3, 4),
            "end_ms": round((e["ts"] + e["dur"] - begin) / 1e3, 4),
            "communication": bool(COMMUNICATION.search(e["name"])),
        }
        for lane, e in sorted(lanes, key=lambda pair: pair[1]["ts"])
    ]


def step_events(trace: dict[str, Any], step_name: str) -> tuple[list[dict], dict]:
    """The complete events of a Chrome trace and the one annotation named `step_name` among them."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    marks = [e for e in events if e["name"] == step_name and e.get("cat") == "user_annotation"]
    if len(marks) != 1:
        raise ValueError(f"trace has {len(marks)} annotations named {step_name!r}, expected 1")
    return events, marks[0]


# NCCL's kernels by collective; a kernel of none of them is compute (or a copy, by its trace category).
COLLECTIVES = {"all_gather": "allgather", "reduce_scatter": "reducescatter", "all_reduce": "allreduce"}
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the CPU-side events that launch kernels, by correlation id


def kernel_kind(name: str, category: str) -> str:
    """`all_gather`, `reduce_scatter`, `all_reduce` or `communication` (other NCCL kernels), `memcpy` (copies
    and memsets) or `compute`."""
    if COMMUNICATION.search(name):
        flat = name.lower().replace("_", "")
        return next((kind for kind, key in COLLECTIVES.items() if key in flat), "communication")
    return "memcpy" if category in ("gpu_memcpy", "gpu_memset") else "compute"


def stream_timeline(trace: dict[str, Any], step_name: str, layer_prefix: str = "") -> list[dict[str, Any]]:
    """The device kernels of the step annotated `step_name`, in order of start: stream, kind (`kernel_kind`),
    short name, start/end (ms from the step's start) and `layer`: i where the kernel was launched inside the
    CPU range `<layer_prefix><i>` of the step's thread (found through the launch's correlation id), else None.
    Empty where the trace has no device kernels (a CPU run)."""
    events, mark = step_events(trace, step_name)
    begin, end, main_thread = mark["ts"], mark["ts"] + mark["dur"], mark["tid"]
    inside = [e for e in events if begin <= e["ts"] < end]
    launched_at = {
        e["args"]["correlation"]: e["ts"]
        for e in inside
        if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})
    }
    ranges = []
    if layer_prefix:
        for e in inside:
            label = e["name"].removeprefix(layer_prefix)
            if (
                e.get("cat") == "user_annotation"
                and e["tid"] == main_thread
                and label != e["name"]
                and label.isdigit()
            ):
                ranges.append((e["ts"], e["ts"] + e["dur"], int(label)))

    def layer_of(kernel: dict) -> int | None:
        launch = launched_at.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return None
        return next((layer for start, stop, layer in ranges if start <= launch < stop), None)

    kernels = sorted((e for e in inside if e.get("cat") in DEVICE_EVENTS), key=lambda e: e["ts"])
    return [
        {
            "stream": e.get("args", {}).get("stream", e["tid"]),
            "kind": kernel_kind(e["name"], e["cat"]),
            "name": short_name(e["name"]),
            "start_ms": round((e["ts"] - begin) / 1e3, 4),
            "end_ms": round((e["ts"] + e["dur"] - begin) / 1e3, 4),
            "layer": layer_of(e),
        }
        for e in kernels
    ]


def outermost(events: list[dict]) -> list[dict]:
    """The events not nested inside another event of the same thread (a thread's operators nest as a stack)."""
    kept, open_until = [], {}
    for e in sorted(
        events, key=lambda e: (str(e["tid"]), e["ts"], -e["dur"])
    ):  # thread ids: numbers or names
        if e["ts"] >= open_until.get(e["tid"], float("-inf")):
            kept.append(e)
            open_until[e["tid"]] = e["ts"] + e["dur"]
    return kept


def short_name(name: str) -> str:
    """A kernel's function name without return type, template arguments and parameters."""
    name = re.sub(r"^void |\(anonymous namespace\)::", "", name)
    return re.split(r"[<(]", name, maxsplit=1)[0].strip()[:80] or name[:80]
