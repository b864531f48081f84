"""Measuring CUDA memory: the allocator's counters, peaks split at the optimizer step, and snapshots of the
allocator's history (`torch.cuda.memory._record_memory_history`) with what they show: the active-memory
timeline and the largest allocations with the code that made them. Counters read None off CUDA."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from cs336_systems.accounting.units import MIB
from cs336_systems.measure.timing import sync


def allocated_mib(device: torch.device, peak: bool = False) -> float | None:
    """Memory allocated by tensors now (or its peak since the last reset), in MiB; None off CUDA."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)) / MIB


def peaks_mib(device: torch.device) -> dict[str, float]:
    """Peak allocated and reserved memory since the last reset, in MiB (CUDA)."""
    return {
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB,
    }


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_index(device: torch.device) -> int:
    """The CUDA device's index in a snapshot's per-device lists (the current device for a bare `cuda`)."""
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()


def record_steps(step: Callable[[], None], steps: int, device: torch.device, snapshot_path: Path) -> None:
    """Run `steps` steps with memory history recording on and dump the snapshot, even when a step fails."""
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")  # python: fast to dump
    try:
        for _ in range(steps):
            step()
            sync(device)
    finally:
        torch.cuda.memory._dump_snapshot(str(snapshot_path))
        torch.cuda.memory._record_memory_history(enabled=None)


def recorded_peaks(
    step: Callable[[], None],
    steps: int,
    device: torch.device,
    snapshot_path: Path,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, float]:
    """Memory at the start and peaks of `steps` recorded steps (`record_steps`), in MiB. With an `optimizer`
    (a train step) the peak is also split at the optimizer step: `forward_backward_peak_mib` before it,
    `optimizer_step_peak_mib` (AdamW's update) during it."""
    # Each hook takes the peaks since the last reset and resets them, so the step's peaks are their maxima.
    phase_peaks: dict[str, dict[str, float]] = {}

    def mark(phase: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            before = phase_peaks.get(phase, {})
            phase_peaks[phase] = {
                key: max(mib, before.get(key, 0.0)) for key, mib in peaks_mib(device).items()
            }
            torch.cuda.reset_peak_memory_stats(device)

        return hook

    hooks = []
    if optimizer is not None:
        hooks.append(optimizer.register_step_pre_hook(mark("forward_backward")))
        hooks.append(optimizer.register_step_post_hook(mark("optimizer_step")))
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    try:
        record_steps(step, steps, device, snapshot_path)
    finally:
        for hook in hooks:
            hook.remove()
    parts = [peaks_mib(device), *phase_peaks.values()]
    peaks = {key: max(part[key] for part in parts) for key in parts[0]}
    peaks.update({f"{phase}_peak_mib": part["peak_allocated_mib"] for phase, part in phase_peaks.items()})
    return {"start_allocated_mib": start / MIB, **peaks}


def read_snapshot(path: Path, device: torch.device, title: str, top: int) -> tuple[float, list[dict]]:
    """What a dumped snapshot shows for `device`: its active-memory timeline, plotted beside it as
    `<name>_timeline.png` under `title`; the timeline's peak in MiB and the `top` largest allocations."""
    snapshot = pickle.loads(path.read_bytes())
    index = device_index(device)
    timeline = active_timeline(snapshot, index)
    plot_timeline(timeline, title, path.with_name(f"{path.stem}_timeline.png"))
    return max(timeline) / MIB, largest_allocations(snapshot, top, index)


def _trace(snapshot: dict, device_index: int) -> list[dict]:
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list) or device_index >= len(traces):
        raise ValueError(f"snapshot has no device_traces for device {device_index}")
    return traces[device_index]


def active_timeline(snapshot: dict, device_index: int = 0) -> list[int]:
    """Bytes held by live tensors after each alloc / free_requested event, starting from what was live before.

    The trace only holds events from after recording began; memory allocated earlier (parameters, optimizer
    state) is the baseline: what is still allocated at the end minus the net change of the trace.
    """
    deltas = []
    for event in _trace(snapshot, device_index):
        if event["action"] == "alloc":
            deltas.append(event["size"])
        elif event["action"] == "free_requested":
            deltas.append(-event["size"])
    live_at_end = sum(
        block["size"]
        for segment in snapshot.get("segments", [])
        if segment.get("device", device_index) == device_index
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )
    total = live_at_end - sum(deltas)
    timeline = [total]
    for delta in deltas:
        total += delta
        timeline.append(total)
    return timeline


def _frame_text(frame: dict) -> str:
    return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"


def largest_allocations(snapshot: dict, top: int, device_index: int = 0, depth: int = 4) -> list[dict]:
    """The `top` largest alloc events: size, position in the trace, and the code that asked for them.

    `stack` lists the first `depth` frames outside torch itself (innermost first); `origin` is the innermost
    frame of this package, the line of model/workload code that asked for the memory.
    """
    allocs = [(i, e) for i, e in enumerate(_trace(snapshot, device_index)) if e["action"] == "alloc"]
    allocs.sort(key=lambda item: item[1]["size"], reverse=True)
    rows = []
    for rank, (index, event) in enumerate(allocs[:top], start=1):
        frames = event.get("frames", [])
        outside_torch = [f for f in frames if "/torch/" not in f["filename"]]
        ours = [f for f in frames if "cs336_systems" in f["filename"]]
        rows.append(
            {
                "rank": rank,
                "size_bytes": event["size"],
                "size_mib": event["size"] / MIB,
                "event_index": index,
                "origin": _frame_text(ours[0]) if ours else None,
                "stack": " <- ".join(_frame_text(f) for f in outside_torch[:depth]),
            }
        )
    return rows


def plot_timeline(timeline: list[int], title: str, path: Path) -> None:
    """The active-memory timeline as a PNG, its peak annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = [b / MIB for b in timeline]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.fill_between(range(len(mib)), mib, step="post", alpha=0.6)
    peak = max(range(len(mib)), key=mib.__getitem__)
    ax.annotate(f"peak {mib[peak]:.0f} MiB", (peak, mib[peak]), textcoords="offset points", xytext=(5, 5))
    ax.set(
        xlabel="allocation event", ylabel="active memory (MiB)", title=title, ylim=(0, max(mib) * 1.1 or 1)
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
