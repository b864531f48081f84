"""DDP training-step benchmark (spec §2.2.3, §2.3.1-2.3.3): our four wrappers, PyTorch's DDP and one rank alone.

Run under the launcher (which records a `skipped` row where the machine lacks the GPUs); rank 0 writes one row per
(variant, bucket_size_mb, step):
    python -m cs336_systems.parallel.launch --nproc 2 --backend nccl --out X.csv -- cs336_systems.experiments.ddp_benchmark \\
        --size xl --batch-size 2 --context-length 512 --trace-dir TRACES --timeline-out TIMELINE.csv
The training step (workload.TrainingStep, AdamW) on `--batch-size` sequences per rank, timed between device
synchronisations. `step_ms` is the slowest rank's step; `comm_ms` the slowest rank's time blocked in
finish_gradient_synchronization (all communication for naive/flat, only what backward did not hide for
overlap/bucketed; empty for torch_ddp, where it is not separable). Our bucketed wrapper and PyTorch's DDP
(`bucket_cap_mb`) run at every `--bucket-sizes-mb`; `single` is the step on rank 0 alone, the floor.
`--trace-dir` gets a Chrome trace of `--trace-steps` steps per variant from rank 0; `--timeline-out` the intervals
of the last traced step (cs336_systems.measure.timeline: lane, name, start_ms, end_ms, communication).
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from cs336_systems import cli
from cs336_systems.bench.data_parallel import (
    add_distributed_model_args,
    ddp_rows,
    gather_measurements,
    log_median,
    setting_columns,
    write_results,
)
from cs336_systems.measure.timeline import record_timeline
from cs336_systems.measure.timing import time_steps
from cs336_systems.parallel import ddp
from cs336_systems.parallel.distributed import DistContext, distributed
from cs336_systems.training import workload

VARIANTS = (*ddp.WRAPPERS, "torch_ddp", "single")
BUCKETED = ("bucketed", "torch_ddp")  # the variants run at every bucket size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    add_distributed_model_args(p)
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="the DDP implementations to time",
    )
    p.add_argument(
        "--bucket-sizes-mb",
        type=cli.positive_float,
        nargs="+",
        default=[1, 10, 100, 1000],
        help="bucket caps (MiB) for our bucketed wrapper and PyTorch's DDP (bucket_cap_mb)",
    )
    p.add_argument("--warmup", type=cli.nonnegative_int, default=5, help="untimed steps per variant")
    p.add_argument("--steps", type=cli.positive_int, default=10, help="timed steps per variant")
    p.add_argument(
        "--trace-dir", type=Path, help="write a Chrome trace of --trace-steps steps per variant here"
    )
    p.add_argument("--trace-steps", type=cli.positive_int, default=2, help="steps per trace (--trace-dir)")
    p.add_argument("--timeline-out", type=Path, help="CSV of the last traced step's intervals per variant")
    args = p.parse_args(argv)
    if args.timeline_out is not None and args.trace_dir is None:
        p.error("--timeline-out needs --trace-dir (the timeline is read from the traces)")
    cli.require_launcher(p, __name__)
    return args


def wrap(
    variant: str, bucket_size_mb: float | None, model: torch.nn.Module, ctx: DistContext
) -> torch.nn.Module:
    if variant == "single":
        return model
    if variant == "torch_ddp":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_size_mb)
    wrapped = ddp.wrap(variant, model, bucket_size_mb)
    wrapped.measure_communication = True
    return wrapped


def measure(
    variant: str, bucket_size_mb: float | None, args: argparse.Namespace, ctx: DistContext
) -> dict | None:
    """This rank's step and communication times (seconds) for one cell, its number of buckets and (rank 0, with
    --trace-dir) the timeline of its last traced step; None on the ranks that `single` leaves idle."""
    if variant == "single" and not ctx.is_main:
        return None
    cfg = cli.model_config(args, args.context_length)
    torch.manual_seed(args.seed)
    model, optimizer = workload.build(cfg, ctx.device)
    model = wrap(variant, bucket_size_mb, model, ctx)
    torch.manual_seed(args.seed + 1 + ctx.rank)  # each rank its own shard of the data
    batch = workload.random_batch(cfg, args.batch_size, ctx.device)
    ours, timers = variant in ddp.WRAPPERS, []

    def sync_gradients() -> None:
        model.finish_gradient_synchronization()
        timers.append(model.last_communication)  # read after timing: reading it waits for the GPU

    step = workload.TrainingStep(model, optimizer, batch, sync_gradients=sync_gradients if ours else None)
    step_s = time_steps(step.train_step, args.warmup, args.steps, ctx.device)
    # single has no communication; torch_ddp's cannot be told apart from its backward
    comm_s = (
        [t.seconds for t in timers[-args.steps :]]
        if ours
        else [0.0 if variant == "single" else None] * args.steps
    )
    trace = (
        args.trace_dir / f"{label(variant, bucket_size_mb)}.json" if args.trace_dir and ctx.is_main else None
    )
    intervals = (
        record_timeline(step.train_step, args.trace_steps, ctx.device, trace) if args.trace_dir else []
    )
    buckets = len(model.buckets) if isinstance(model, ddp.BucketedDDP) else None
    return {"step_s": step_s, "comm_s": comm_s, "num_buckets": buckets, "intervals": intervals}


def label(variant: str, bucket_size_mb: float | None) -> str:
    return variant if bucket_size_mb is None else f"{variant}_{bucket_size_mb:g}mb"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = cli.model_config(args, args.context_length)
    params = workload.model_parameters(cfg)
    cells = [(v, b) for v in args.variants for b in (args.bucket_sizes_mb if v in BUCKETED else [None])]
    with distributed(args.backend) as ctx:
        # param_bytes: what is all-reduced per step (the bucket model's s); num_tensors: naive's all-reduces
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        setting = setting_columns(
            args.size,
            cfg,
            args.batch_size,
            args.warmup,
            ctx,
            param_bytes=param_bytes,
            num_tensors=len(params),
        )
        rows, intervals = [], []
        for variant, bucket in cells:
            per_rank = gather_measurements(partial(measure, variant, bucket, args, ctx))
            if per_rank is not None:
                cell_rows, cell_intervals = ddp_rows(
                    {"variant": variant, "bucket_size_mb": bucket}, setting, per_rank
                )
                rows, intervals = rows + cell_rows, intervals + cell_intervals
                log_median(f"[ddp] {label(variant, bucket)}: median step", per_rank, "step_s")
        write_results(args, ctx, rows, intervals)


if __name__ == "__main__":
    main()
