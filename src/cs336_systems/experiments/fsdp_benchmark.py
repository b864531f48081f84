"""FSDP training-step benchmark (2026 §7, fsdp_accounting): our FSDP beside PyTorch's FSDP2, our DDP and one
rank alone, in the same run.

Run under the launcher (which records a `skipped` row where the machine lacks the GPUs); rank 0 writes one row
per (variant, rank):
    python -m cs336_systems.parallel.launch --nproc 2 --backend nccl --out X.csv --also T.csv -- \\
        cs336_systems.experiments.fsdp_benchmark --size 2.7B --batch-size 2 --context-length 2048 --attention sdpa \\
        --compute-dtype bf16 --trace-dir TRACES --timeline-out T.csv
Variants (cs336_systems.bench.fsdp_variants): `ours`, `ours_exact` (ours in exact mode: bit-equal to one process's
training, what that costs), `fsdp2` (fully_shard per block and root, the same precision policy and prefetch
distance), `ddp` (our bucketed DDP) and `single` (rank 0 alone, the floor). Per variant a
fresh model, `--warmup` steps, then `--steps` timed steps (workload.TrainingStep, AdamW, `--batch-size`
sequences per rank). Columns: `step_ms` (per step the slowest rank's; median, min, max), `peak_mib` (this rank's
allocator peak over the timed steps; empty on the CPU), `gather_wait_ms` / `sync_wait_ms` (ours: the exposed
all-gather wait and the wait in finish_gradient_synchronization, counted by the wrapper in as many more steps run back to back;
FSDP2: not counted, see the timeline), `bytes_*` (bytes one rank receives (all-gathers) or sends per step: counted by ours, computed for
the others; `bytes_source`).
`--trace-dir` (CUDA) gets a Chrome trace of `--trace-steps` steps of ours and FSDP2 from rank 0, each block's
forward annotated; `--timeline-out` the kernels of the last one (stream, kind, start_ms, end_ms, layer), or a
skipped row where there are no CUDA streams.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from cs336_systems import cli
from cs336_systems.bench.data_parallel import (
    add_distributed_model_args,
    gather_measurements,
    log_median,
    setting_columns,
    write_results,
)
from cs336_systems.bench.fsdp_variants import (
    COMPUTE_DTYPES,
    TRACED,
    VARIANTS,
    Settings,
    cell_rows,
    measure,
    timeline_rows,
)
from cs336_systems.parallel.distributed import distributed
from cs336_systems.training import workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    add_distributed_model_args(p)
    p.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="the implementations to time"
    )
    p.add_argument(
        "--compute-dtype",
        choices=list(COMPUTE_DTYPES),
        default="bf16",
        help="weights for compute (ours, FSDP2) and autocast (every variant); fp32: no casts",
    )
    p.add_argument(
        "--prefetch-distance",
        type=cli.positive_int,
        default=2,
        help="units gathered at a time (ours and FSDP2)",
    )
    p.add_argument(
        "--bucket-size-mb", type=cli.positive_float, default=100.0, help="our DDP's bucket cap (MiB)"
    )
    p.add_argument("--warmup", type=cli.nonnegative_int, default=3, help="untimed steps per variant")
    p.add_argument("--steps", type=cli.positive_int, default=10, help="timed steps per variant")
    p.add_argument(
        "--trace-dir", type=Path, help="write a Chrome trace of --trace-steps steps of ours and fsdp2 here"
    )
    p.add_argument("--trace-steps", type=cli.positive_int, default=2, help="steps per trace (--trace-dir)")
    p.add_argument(
        "--timeline-out", type=Path, help="CSV of the last traced step's kernels of ours and fsdp2"
    )
    args = p.parse_args(argv)
    if args.timeline_out is not None and args.trace_dir is None:
        p.error("--timeline-out needs --trace-dir (the timeline is read from the traces)")
    cli.require_launcher(p, __name__)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = cli.model_config(args, args.context_length)
    settings = Settings(args.compute_dtype, args.prefetch_distance, args.bucket_size_mb)
    with distributed(args.backend) as ctx:
        num_params = sum(p.numel() for p in workload.model_parameters(cfg))
        setting = setting_columns(args.size, cfg, args.batch_size, args.warmup, ctx, num_params=num_params)
        setting |= {
            "attention": args.attention,
            "compute_dtype": args.compute_dtype,
            "prefetch_distance": args.prefetch_distance,
        }
        rows, intervals = [], []
        for variant in args.variants:
            traced = args.trace_dir is not None and variant in TRACED
            trace = args.trace_dir / f"{variant}.json" if traced and ctx.device.type == "cuda" else None
            run = partial(
                measure,
                variant,
                cfg,
                args.batch_size,
                settings,
                ctx,
                args.seed,
                args.warmup,
                args.steps,
                trace,
                args.trace_steps,
            )
            per_rank = gather_measurements(run)
            if per_rank is not None:
                rows += cell_rows(variant, setting, per_rank)
                if traced:
                    intervals += timeline_rows(variant, ctx.world_size, per_rank, ctx.device.type)
                log_median(f"[fsdp] {variant}: median step", per_rank, "step_s")
        write_results(args, ctx, rows, intervals)


if __name__ == "__main__":
    main()
