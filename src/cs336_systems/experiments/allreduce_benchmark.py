"""All-reduce benchmark (spec §2.1.3): float32 tensors of several sizes, gloo on CPU or NCCL on GPU.

Run under the launcher (which records a `skipped` row where the machine lacks the GPUs); rank 0 writes one row
per size:
    python -m cs336_systems.parallel.launch --nproc 4 --backend nccl --out X.csv -- \\
        cs336_systems.experiments.allreduce_benchmark --sizes-mb 1 10 100 1000
Every timed iteration starts from a barrier and ends with a device synchronisation; an iteration's time is the
slowest rank's, and the row gives median/mean/std over iterations plus bandwidths from the median:
algbw = bytes / time, busbw = algbw * 2 (n - 1) / n (the traffic each link carries in a ring all-reduce).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch
import torch.distributed as dist

from cs336_systems import cli
from cs336_systems.accounting.units import MIB
from cs336_systems.bench.data_parallel import time_collective
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import summarize
from cs336_systems.parallel.distributed import BACKENDS, distributed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, seed=False)
    p.add_argument(
        "--backend", choices=BACKENDS, required=True, help="gloo all-reduces CPU tensors, nccl GPU ones"
    )
    p.add_argument(
        "--sizes-mb", type=cli.positive_float, nargs="+", default=[1, 10, 100, 1000], help="in MiB"
    )
    p.add_argument("--warmup", type=cli.nonnegative_int, default=5, help="untimed iterations per size")
    p.add_argument("--iters", type=cli.positive_int, default=20, help="timed iterations per size")
    args = p.parse_args(argv)
    cli.require_launcher(p, __name__)
    return args


def run(args: argparse.Namespace, device: torch.device) -> list[dict]:
    world_size = dist.get_world_size()
    rows = []
    for size_mb in args.sizes_mb:
        numel = int(size_mb * MIB) // 4
        tensor = torch.rand(numel, dtype=torch.float32, device=device)
        # rescaling keeps the values bounded over iterations
        slowest = time_collective(
            partial(dist.all_reduce, tensor),
            device,
            args.warmup,
            args.iters,
            after=partial(tensor.div_, world_size),
        )
        del tensor
        if slowest is None:
            continue
        median_s = statistics.median(slowest)
        algbw = numel * 4 / median_s / 1e9
        rows.append(
            {
                "backend": args.backend,
                "device": device.type,
                "world_size": world_size,
                "size_mb": size_mb,
                "bytes": numel * 4,
                "warmup": args.warmup,
                "iters": args.iters,
                **summarize(slowest),
                "min_ms": min(slowest) * 1e3,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (world_size - 1) / world_size,
                "status": "ok",
                "reason": "",
            }
        )
        print(
            f"[allreduce] {args.backend} n={world_size} {size_mb} MiB: {rows[-1]['median_ms']:.3f} ms",
            file=sys.stderr,
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with distributed(args.backend) as ctx:
        rows = run(args, ctx.device)
        if ctx.is_main:
            write_rows(rows, args.out, {**vars(args), "world_size": ctx.world_size})


if __name__ == "__main__":
    main()
