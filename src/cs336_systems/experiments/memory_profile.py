"""Memory profile of the Transformer LM with CUDA memory snapshots (spec §1.1.6 memory_profiling a-e).

For each context length, mode (forward, train_step) and autocast setting: build the model, run `--warmup`
untimed steps (so a train step's AdamW state already exists), then record `--steps` steps with
`torch.cuda.memory._record_memory_history(max_entries=1_000_000)` and dump the snapshot. Outputs:
  --out              rows `peak` (peak allocated/reserved memory of the recorded steps, b and c) and
                     `residual_activation` (batch x context x d_model x 4 bytes in MiB, from the flags, d)
  --snapshot-dir     memory_<size>_<ctx>_<mode>_<autocast>.pickle (open with pytorch.org/memory_viz) and
                     a PNG "active memory timeline" of each, rebuilt from the snapshot's alloc/free events (a)
  --allocations-out  the `--top` largest allocations of each forward snapshot, with their size and the first
                     frames of the Python stack that made them (e)
Without CUDA the peak rows have status "skipped" and reason "needs CUDA"; the residual rows are still written.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from cs336_systems import workload
from cs336_systems.benchmarking import free_memory, is_oom, resolve_device, sync, time_steps
from cs336_systems.model import ModelConfig
from cs336_systems.provenance import write_rows

MODES = ("forward", "train_step")
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload.add_model_args(p)
    p.add_argument("--context-lengths", type=int, nargs="+", required=True)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--autocast",
        nargs="+",
        choices=sorted(workload.AUTOCAST),
        default=["none", "bf16"],
        help="precisions to profile: none (fp32) and/or bf16 / fp16 autocast",
    )
    p.add_argument("--warmup", type=int, default=1, help="unrecorded steps before the recorded ones")
    p.add_argument("--steps", type=int, default=1, help="recorded steps")
    p.add_argument("--top", type=int, default=20, help="largest allocations listed per forward snapshot")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--snapshot-dir", required=True, help="folder for the snapshot pickles and timeline PNGs")
    p.add_argument("--allocations-out", help="CSV of the largest allocations (default: beside --out)")
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    for flag in ("steps", "top", "batch_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if any(c < 1 for c in args.context_lengths):
        p.error("--context-lengths must be positive")
    if args.allocations_out is None:
        out = Path(args.out)
        args.allocations_out = str(out.with_name(f"{out.stem}_largest_allocations.csv"))
    workload.check_model_args(p, args)
    return args


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


def profile_cell(
    args: argparse.Namespace, cfg: ModelConfig, mode: str, autocast: str, device: torch.device, snapshot: Path
) -> dict:
    """Peak memory of the recorded steps of one cell; the snapshot is written to `snapshot`."""
    torch.manual_seed(args.seed)
    model, optimizer = workload.build(cfg, device)
    batch = workload.random_batch(cfg, args.batch_size, device)
    step = workload.make_step(model, optimizer, batch, mode, workload.AUTOCAST[autocast])
    time_steps(step, args.warmup, 0, device)
    # A train step's peak, split at the optimizer step: forward + backward before it, AdamW's update during it.
    # Each hook takes the peaks since the last reset and resets them, so the step's peaks are their maxima.
    phase_peaks: dict[str, dict[str, float]] = {}

    def mark(phase: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            before = phase_peaks.get(phase, {})
            phase_peaks[phase] = {key: max(mib, before.get(key, 0.0)) for key, mib in _peaks(device).items()}
            torch.cuda.reset_peak_memory_stats(device)

        return hook

    if mode == "train_step":
        optimizer.register_step_pre_hook(mark("forward_backward"))
        optimizer.register_step_post_hook(mark("optimizer_step"))
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    record_steps(step, args.steps, device, snapshot)
    parts = [_peaks(device), *phase_peaks.values()]
    peaks = {key: max(part[key] for part in parts) for key in parts[0]}
    peaks.update({f"{phase}_peak_mib": part["peak_allocated_mib"] for phase, part in phase_peaks.items()})
    return {"start_allocated_mib": start / MIB, **peaks}


def _peaks(device: torch.device) -> dict:
    return {
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB,
    }


def run(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    device = resolve_device(args.device)
    snapshot_dir = Path(args.snapshot_dir)
    snapshot_dir.mkdir(parents=True, exist_ok=True)
    rows, allocations = [], []
    index = (
        (device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else 0
    )
    for context_length in args.context_lengths:
        rows.append(
            {
                "record": "residual_activation",
                "size": args.size,
                "context_length": context_length,
                "batch_size": args.batch_size,
                "d_model": args.d_model,
                "bytes": args.batch_size * context_length * args.d_model * 4,
                "mib": args.batch_size * context_length * args.d_model * 4 / MIB,
                "status": "ok",
            }
        )
        cfg = workload.model_config(args, context_length)
        for mode in args.modes:
            for autocast in args.autocast:
                base = {
                    "record": "peak",
                    "size": args.size,
                    "context_length": context_length,
                    "batch_size": args.batch_size,
                    "mode": mode,
                    "autocast": autocast,
                    "warmup": args.warmup,
                    "steps": args.steps,
                }
                if device.type != "cuda":
                    rows.append({**base, "status": "skipped", "reason": "needs CUDA"})
                    continue
                name = f"memory_{args.size}_{context_length}_{mode}_{autocast}"
                snapshot = snapshot_dir / f"{name}.pickle"
                snapshot.unlink(missing_ok=True)  # a stale one would be mistaken for this cell's
                print(f"[memory] {name} ...", file=sys.stderr, flush=True)
                try:
                    rows.append(
                        {**base, **profile_cell(args, cfg, mode, autocast, device, snapshot), "status": "ok"}
                    )
                except Exception as exc:  # noqa: BLE001 - only OOM is recorded, everything else re-raised
                    if not is_oom(exc):
                        raise
                    rows.append({**base, **_peaks(device), "status": "OOM"})
                    print(f"[memory]   OOM: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
                finally:
                    free_memory()
                if not snapshot.exists():
                    continue
                rows[-1]["snapshot"] = snapshot.name
                data = pickle.loads(snapshot.read_bytes())
                timeline = active_timeline(data, index)
                rows[-1]["timeline_peak_mib"] = max(timeline) / MIB
                plot_timeline(
                    timeline,
                    f"{args.size} ctx={context_length} {mode} autocast={autocast}",
                    snapshot_dir / f"{name}_timeline.png",
                )
                if mode == "forward":
                    allocations += [
                        {**base, "record": "largest_allocation", **row}
                        for row in largest_allocations(data, args.top, index)
                    ]
    if device.type != "cuda":
        allocations.append({"record": "largest_allocation", "status": "skipped", "reason": "needs CUDA"})
    return rows, allocations


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows, allocations = run(args)
    write_rows(allocations, args.allocations_out, vars(args))
    write_rows(rows, args.out, vars(args))


if __name__ == "__main__":
    main()
