"""DDP training-step benchmark (spec §2.2.3, §2.3.1-2.3.3): our four wrappers, PyTorch's DDP and one rank alone.

Run under the launcher (which records a `skipped` row where the machine lacks the GPUs); rank 0 writes one row per
(variant, bucket_size_mb, step):
    python -m cs336_systems.launch --nproc 2 --backend nccl --out X.csv -- cs336_systems.experiments.ddp_benchmark \
        --d-model 1600 --d-ff 6400 --num-layers 48 --num-heads 25 --batch-size 2 --context-length 512 \
        --variants naive flat overlap bucketed torch_ddp single --bucket-sizes-mb 1 10 100 1000 \
        --trace-dir TRACES --timeline-out TIMELINE.csv
A step is zero_grad, forward, backward, gradient synchronisation and AdamW on `--batch-size` sequences per rank,
timed between device synchronisations. `step_ms` is the slowest rank's step; `comm_ms` the slowest rank's time
blocked in finish_gradient_synchronization (all communication for naive/flat, only the part backward did not hide
for overlap/bucketed; empty for torch_ddp, where it is not separable). Our bucketed wrapper and PyTorch's DDP
(`bucket_cap_mb`) run at every `--bucket-sizes-mb`. `single` runs the same step on rank 0 alone, without
communication: the floor.

`--trace-dir` writes a Chrome trace of `--trace-steps` steps per variant from rank 0; `--timeline-out` also writes
the intervals of the last traced step (one row per interval: lane, name, start_ms, end_ms, communication): on
CUDA every kernel by stream, with NCCL's kernels marked as communication; on the CPU the outermost operators of
each thread and gloo's collectives, which run on gloo's worker threads.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

from cs336_systems import workload
from cs336_systems.benchmarking import or_oom, sync, time_steps
from cs336_systems.ddp import BucketedDDP, CommunicationTimer, FlatDDP, NaiveDDP, OverlapIndividualDDP
from cs336_systems.distributed import BACKENDS, DistContext, distributed, gather_to_rank0
from cs336_systems.model import TransformerLM
from cs336_systems.provenance import write_rows

VARIANTS = ("naive", "flat", "overlap", "bucketed", "torch_ddp", "single")
OURS = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapIndividualDDP, "bucketed": BucketedDDP}
BUCKETED = ("bucketed", "torch_ddp")  # the variants run at every bucket size
TRACED_STEP = "traced_step_"  # record_function label of each profiled step
# Trace events that run on the device; on a CPU-only run there are none and operators stand in for kernels.
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
# NCCL's kernels on CUDA; on the CPU gloo's collectives (`gloo:all_reduce`) and their launches (`c10d::...`).
COMMUNICATION = re.compile(r"nccl|gloo|c10d::", re.IGNORECASE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload.add_model_args(p)  # --batch-size is per rank
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--bucket-sizes-mb",
        type=float,
        nargs="+",
        default=[1, 10, 100, 1000],
        help="bucket caps (MiB) for our bucketed wrapper and PyTorch's DDP (bucket_cap_mb)",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--backend", choices=BACKENDS, help="default: nccl where there are GPUs, else gloo")
    p.add_argument(
        "--trace-dir", type=Path, help="write a Chrome trace of --trace-steps steps per variant here"
    )
    p.add_argument("--trace-steps", type=int, default=3)
    p.add_argument(
        "--timeline-out",
        type=Path,
        help="CSV of the last traced step's intervals per variant (needs --trace-dir)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    args = p.parse_args(argv)
    for flag in ("batch_size", "context_length", "steps", "trace_steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if any(b <= 0 for b in args.bucket_sizes_mb):
        p.error(f"--bucket-sizes-mb must be positive, got {args.bucket_sizes_mb}")
    if args.timeline_out is not None and args.trace_dir is None:
        p.error("--timeline-out needs --trace-dir (the timeline is read from the traces)")
    workload.check_model_args(p, args)
    return args


def cells(args: argparse.Namespace) -> list[tuple[str, float | None]]:
    """(variant, bucket_size_mb) pairs in the order they run; bucket_size_mb only for the bucketed variants."""
    return [
        (variant, bucket)
        for variant in args.variants
        for bucket in (args.bucket_sizes_mb if variant in BUCKETED else [None])
    ]


def cell_label(variant: str, bucket_size_mb: float | None) -> str:
    return variant if bucket_size_mb is None else f"{variant}_{bucket_size_mb:g}mb"


def wrap(variant: str, bucket_size_mb: float | None, model: nn.Module, ctx: DistContext) -> nn.Module:
    if variant == "single":
        return model
    if variant == "torch_ddp":
        return DistributedDataParallel(
            model,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            bucket_cap_mb=bucket_size_mb,
        )
    if variant == "bucketed":
        ddp = BucketedDDP(model, bucket_size_mb=bucket_size_mb)
    else:
        ddp = OURS[variant](model)
    ddp.measure_communication = True
    return ddp


def measure(
    variant: str, bucket_size_mb: float | None, args: argparse.Namespace, ctx: DistContext
) -> tuple[dict, list[dict]]:
    """This rank's step and communication times (seconds) for one cell and the number of buckets; and the
    timeline of its last traced step (rank 0, with --trace-dir)."""
    cfg = workload.model_config(args, args.context_length)
    torch.manual_seed(args.seed)
    with ctx.device:  # initialise on the device: an XL model initialised on the CPU takes long
        model = wrap(variant, bucket_size_mb, TransformerLM(cfg), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(args.seed + 1 + ctx.rank)  # each rank its own shard of the data
    inputs, targets = workload.random_batch(cfg, args.batch_size, ctx.device)
    finish = getattr(model, "finish_gradient_synchronization", None)
    comm_timers: list[CommunicationTimer] = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        if finish is not None:
            finish()
            comm_timers.append(model.last_communication)  # read after timing: reading it waits for the GPU
        optimizer.step()

    step_s = time_steps(step, args.warmup, args.steps, ctx.device)
    if finish is not None:
        measured_comm_s = [timer.seconds for timer in comm_timers[-args.steps :]]
    else:  # single has no communication; torch_ddp's cannot be told apart from its backward
        measured_comm_s = [0.0 if variant == "single" else None] * args.steps
    buckets = len(model.buckets) if isinstance(model, BucketedDDP) else None
    result = {"step_s": step_s, "comm_s": measured_comm_s, "num_buckets": buckets}
    intervals = []
    if args.trace_dir is not None:
        intervals = trace(step, args, ctx, cell_label(variant, bucket_size_mb))
    return result, intervals


def trace(step, args: argparse.Namespace, ctx: DistContext, label: str) -> list[dict]:
    """Profile a few steps on rank 0 (the other ranks run them unprofiled, as their peers must); return the
    intervals of the last one. Each step ends with a device synchronisation, so its kernels lie inside its
    `record_function` range."""
    if not ctx.is_main:
        for _ in range(args.trace_steps):
            step()
            sync(ctx.device)
        return []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(args.trace_steps):
            with record_function(f"{TRACED_STEP}{i}"):
                step()
                sync(ctx.device)
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    path = args.trace_dir / f"{label}.json"
    prof.export_chrome_trace(str(path))
    return timeline(json.loads(path.read_text()), f"{TRACED_STEP}{args.trace_steps - 1}")


def timeline(trace_json: dict[str, Any], step_name: str) -> list[dict]:
    """Intervals of one step of a Chrome trace: lane, short name, start/end (ms from the step's start) and
    whether it is communication. Device kernels by stream where the trace has them; otherwise (CPU) the
    outermost operators of each thread plus the collectives (gloo's run on its own threads)."""
    events = [e for e in trace_json["traceEvents"] if e.get("ph") == "X" and "dur" in e]
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


def outermost(events: list[dict]) -> list[dict]:
    """The events not nested inside another event of the same thread (a thread's operators nest as a stack)."""
    kept, open_until = [], {}
    for e in sorted(events, key=lambda e: (e["tid"], e["ts"], -e["dur"])):
        if e["ts"] >= open_until.get(e["tid"], float("-inf")):
            kept.append(e)
            open_until[e["tid"]] = e["ts"] + e["dur"]
    return kept


def short_name(name: str) -> str:
    """A kernel's function name without return type, template arguments and parameters."""
    name = re.sub(r"^void |\(anonymous namespace\)::", "", name)
    return re.split(r"[<(]", name, maxsplit=1)[0].strip()[:80] or name[:80]


def run_cell(
    variant: str, bucket_size_mb: float | None, args: argparse.Namespace, ctx: DistContext
) -> tuple[list[dict], list[dict]]:
    """Rows and timeline rows for one cell on rank 0 (empty on the others); an out-of-memory on any rank gives
    one OOM row in each."""
    result: dict | str
    intervals: list[dict] = []
    if variant == "single" and not ctx.is_main:
        result = "idle"
    else:
        outcome = or_oom(lambda: measure(variant, bucket_size_mb, args, ctx))
        result, intervals = ("OOM", []) if outcome == "OOM" else outcome
    per_rank = gather_to_rank0(result)
    if per_rank is None:
        return [], []
    cell = {"variant": variant, "bucket_size_mb": bucket_size_mb}
    if "OOM" in per_rank:
        oom = {**cell, "status": "OOM", "reason": "out of memory on a rank"}
        return [{**base_row(args, ctx, cell), "step": None, **oom}], [oom]
    base = base_row(args, ctx, cell)
    measured = [r for r in per_rank if r != "idle"]
    rows = []
    for i in range(args.steps):
        comm = [r["comm_s"][i] for r in measured]
        rows.append(
            {
                **base,
                "step": i,
                "step_ms": max(r["step_s"][i] for r in measured) * 1e3,
                "comm_ms": None if None in comm else max(comm) * 1e3,
                "num_buckets": measured[0]["num_buckets"],
                "status": "ok",
            }
        )
    median_ms = statistics.median(row["step_ms"] for row in rows)
    print(
        f"[ddp] {cell_label(variant, bucket_size_mb)}: median step {median_ms:.1f} ms",
        file=sys.stderr,
        flush=True,
    )
    return rows, [{**cell, **interval, "status": "ok"} for interval in intervals]


def base_row(args: argparse.Namespace, ctx: DistContext, cell: dict) -> dict:
    with torch.device("meta"):  # parameter sizes without allocating them
        model = TransformerLM(workload.model_config(args, args.context_length))
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {
        **cell,
        "size": args.size,
        "d_model": args.d_model,
        "num_layers": args.num_layers,
        # s of the bucket model (bytes of gradients all-reduced per step) and naive's number of all-reduces
        "param_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "num_tensors": len(trainable),
        "batch_size_per_rank": args.batch_size,
        "context_length": args.context_length,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "warmup": args.warmup,
        "reason": "",
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with distributed(args.backend) as ctx:
        rows, intervals = [], []
        for variant, bucket in cells(args):
            cell_rows, cell_intervals = run_cell(variant, bucket, args, ctx)
            rows += cell_rows
            intervals += cell_intervals
        if ctx.is_main:
            params = {**vars(args), "world_size": ctx.world_size}
            write_rows(rows, args.out, params)
            if args.timeline_out is not None:
                write_rows(intervals, args.timeline_out, params)


if __name__ == "__main__":
    main()
