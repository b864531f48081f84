"""The timeline of one training step, read from a Chrome trace (the DDP benchmark's overlap plot, spec §2.3):
which kernels (CUDA) or operators (CPU) ran when, in which lane, and which of them are communication.

`record_timeline` profiles a few steps, writes their Chrome trace and returns the timeline of the last one;
`timeline` reads any one step's intervals from a trace. On CUDA the intervals are the device's kernels by
stream, NCCL's kernels marked as communication; on the CPU, the outermost operators of each thread and gloo's
collectives, which run on gloo's worker threads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cs336_systems.benchmarking import sync

TRACED_STEP = "traced_step_"  # record_function label of each profiled step, followed by its number
# Trace events that run on the device; on a CPU-only run there are none and operators stand in for kernels.
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
# NCCL's kernels on CUDA; on the CPU gloo's collectives (`gloo:all_reduce`) and their launches (`c10d::...`).
COMMUNICATION = re.compile(r"nccl|gloo|c10d::", re.IGNORECASE)


def record_timeline(
    step: Callable[[], object], steps: int, device: torch.device, trace_path: Path | None
) -> list[dict[str, Any]]:
    """Run `step` `steps` times, each ended by a device synchronisation (so a step's kernels lie inside its
    range). With `trace_path`, profile them, write their Chrome trace there and return the timeline of the last
    step; without (a rank whose peer is traced: the collectives need both), only run them and return []."""
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
    return timeline(json.loads(trace_path.read_text()), f"{TRACED_STEP}{steps - 1}")


def timeline(trace: dict[str, Any], step_name: str) -> list[dict[str, Any]]:
    """Intervals of the step annotated `step_name` in a Chrome trace, in order of start: lane, short name,
    start/end (ms from the step's start) and whether it is communication. Device kernels by stream where the
    trace has them; otherwise (CPU) the outermost operators of each thread plus the collectives."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    marks = [e for e in events if e["name"] == step_name and e.get("cat") == "user_annotation"]
    if len(marks) != 1:
        raise ValueError(f"trace has {len(marks)} annotations named {step_name!r}, expected 1")
    begin, end, main_thread = marks[0]["ts"], marks[0]["ts"] + marks[0]["dur"], marks[0]["tid"]
    inside = [e for e in events if begin <= e["ts"] < end]
    device = [e for e in inside if e.get("cat") in DEVICE_EVENTS]
    if device:
        lanes = [(f"stream {e.get('args', {}).get('stream', e['tid'])}", e) for e in device]
    else:
        operators = [e for e in inside if e.get("cat") == "cpu_op"]
        collectives = [e for e in inside if e.get("cat") == "user_annotation" and COMMUNICATION.search(e["name"])]
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


def outermost(events: list[dict]) -> list[dict]:
    """The events not nested inside another event of the same thread (a thread's operators nest as a stack)."""
    kept, open_until = [], {}
    for e in sorted(events, key=lambda e: (str(e["tid"]), e["ts"], -e["dur"])):  # thread ids: numbers or names
        if e["ts"] >= open_until.get(e["tid"], float("-inf")):
            kept.append(e)
            open_until[e["tid"]] = e["ts"] + e["dur"]
    return kept


def short_name(name: str) -> str:
    """A kernel's function name without return type, template arguments and parameters."""
    name = re.sub(r"^void |\(anonymous namespace\)::", "", name)
    return re.split(r"[<(]", name, maxsplit=1)[0].strip()[:80] or name[:80]
