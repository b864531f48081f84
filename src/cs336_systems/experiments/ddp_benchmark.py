"""DDP training-step benchmark (spec §2.2.3, §2.3.1-2.3.3): our four wrappers, PyTorch's DDP and one rank alone.

Run under the launcher; rank 0 writes one row per (variant, bucket_size_mb, step):
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m cs336_systems.experiments.ddp_benchmark \
        --d-model 1600 --d-ff 6400 --num-layers 48 --num-heads 25 --batch-size 2 --context-length 512 \
        --variants naive flat overlap bucketed torch_ddp single --bucket-sizes-mb 1 10 100 1000 --out X.csv
A step is zero_grad, forward, backward, gradient synchronisation and AdamW on `--batch-size` sequences per rank,
timed between device synchronisations. `step_ms` is the slowest rank's step; `comm_ms` the slowest rank's time
blocked in finish_gradient_synchronization (all communication for naive/flat, only the part backward did not hide
for overlap/bucketed; empty for torch_ddp, where it is not separable). `single` runs the same step on rank 0 alone,
without communication: the floor. `--trace-dir` writes a Chrome trace of a few steps per variant from rank 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from cs336_systems import workload
from cs336_systems.benchmarking import free_memory, is_oom, time_steps
from cs336_systems.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapIndividualDDP
from cs336_systems.distributed import BACKENDS, DistContext, distributed, gather_to_rank0
from cs336_systems.model import TransformerLM
from cs336_systems.provenance import write_rows

VARIANTS = ("naive", "flat", "overlap", "bucketed", "torch_ddp", "single")
OURS = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapIndividualDDP, "bucketed": BucketedDDP}


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
        help="bucket caps (MiB) for the bucketed variant",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--backend", choices=BACKENDS, help="default: nccl where there are GPUs, else gloo")
    p.add_argument(
        "--trace-dir", type=Path, help="write a Chrome trace of --trace-steps steps per variant here"
    )
    p.add_argument("--trace-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skip-reason", help="write status=skipped rows with this reason and exit (no launcher needed)"
    )
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    args = p.parse_args(argv)
    for flag in ("batch_size", "context_length", "steps", "trace_steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if any(b <= 0 for b in args.bucket_sizes_mb):
        p.error(f"--bucket-sizes-mb must be positive, got {args.bucket_sizes_mb}")
    workload.model_config(args, args.context_length)  # raises ValueError naming a bad model dimension
    return args


def cells(args: argparse.Namespace) -> list[tuple[str, float | None]]:
    """(variant, bucket_size_mb) pairs in the order they run; bucket_size_mb only for the bucketed variant."""
    return [
        (variant, bucket)
        for variant in args.variants
        for bucket in (args.bucket_sizes_mb if variant == "bucketed" else [None])
    ]


def cell_label(variant: str, bucket_size_mb: float | None) -> str:
    return variant if bucket_size_mb is None else f"{variant}_{bucket_size_mb:g}mb"


def wrap(variant: str, bucket_size_mb: float | None, model: nn.Module, ctx: DistContext) -> nn.Module:
    if variant == "single":
        return model
    if variant == "torch_ddp":
        return DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
        )
    if variant == "bucketed":
        ddp = BucketedDDP(model, bucket_size_mb=bucket_size_mb)
    else:
        ddp = OURS[variant](model)
    ddp.measure_communication = True
    return ddp


def measure(variant: str, bucket_size_mb: float | None, args: argparse.Namespace, ctx: DistContext) -> dict:
    """This rank's step and communication times (seconds) for one cell, and the number of buckets."""
    cfg = workload.model_config(args, args.context_length)
    torch.manual_seed(args.seed)
    with ctx.device:  # initialise on the device: an XL model initialised on the CPU takes long
        model = wrap(variant, bucket_size_mb, TransformerLM(cfg), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(args.seed + 1 + ctx.rank)  # each rank its own shard of the data
    inputs, targets = workload.random_batch(cfg, args.batch_size, ctx.device)
    finish = getattr(model, "finish_gradient_synchronization", None)
    comm_s: list[float] = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        if finish is not None:
            finish()
            comm_s.append(model.last_communication_s)
        optimizer.step()

    step_s = time_steps(step, args.warmup, args.steps, ctx.device)
    if finish is not None:
        measured_comm_s = comm_s[-args.steps :]
    else:  # single has no communication; torch_ddp's cannot be told apart from its backward
        measured_comm_s = [0.0 if variant == "single" else None] * args.steps
    buckets = len(model.buckets) if isinstance(model, BucketedDDP) else None
    result = {"step_s": step_s, "comm_s": measured_comm_s, "num_buckets": buckets}
    if args.trace_dir is not None:
        trace(step, args, ctx, cell_label(variant, bucket_size_mb))
    return result


def trace(step, args: argparse.Namespace, ctx: DistContext, label: str) -> None:
    """Profile a few steps on rank 0 (the other ranks run them unprofiled, as their peers must)."""
    if not ctx.is_main:
        for _ in range(args.trace_steps):
            step()
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.trace_steps):
            step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.trace_dir / f"{label}.json"))


def run_cell(
    variant: str, bucket_size_mb: float | None, args: argparse.Namespace, ctx: DistContext
) -> list[dict]:
    """Rows for one cell on rank 0 (empty on the others); an out-of-memory on any rank gives one OOM row."""
    result: dict | str
    if variant == "single" and not ctx.is_main:
        result = "idle"
    else:
        try:
            result = measure(variant, bucket_size_mb, args, ctx)
        except Exception as exc:  # noqa: BLE001 - only OOM is recorded, everything else re-raised
            if not is_oom(exc):
                raise
            result = "OOM"
        finally:
            free_memory()
    per_rank = gather_to_rank0(result)
    if per_rank is None:
        return []
    base = {
        "variant": variant,
        "bucket_size_mb": bucket_size_mb,
        "size": args.size,
        "d_model": args.d_model,
        "num_layers": args.num_layers,
        "batch_size_per_rank": args.batch_size,
        "context_length": args.context_length,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "warmup": args.warmup,
        "reason": "",
    }
    if "OOM" in per_rank:
        return [{**base, "step": None, "status": "OOM"}]
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
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.skip_reason is not None:
        rows = [
            {
                "variant": v,
                "bucket_size_mb": b,
                "size": args.size,
                "status": "skipped",
                "reason": args.skip_reason,
            }
            for v, b in cells(args)
        ]
        write_rows(rows, args.out, vars(args))
        return
    with distributed(args.backend) as ctx:
        rows = [row for variant, bucket in cells(args) for row in run_cell(variant, bucket, args, ctx)]
        if ctx.is_main:
            write_rows(rows, args.out, {**vars(args), "world_size": ctx.world_size})


if __name__ == "__main__":
    main()
