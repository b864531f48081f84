"""The two all-reduce algorithms of 2026 §8.1, timed: the ring all-reduce (reduce-scatter + all-gather) against
the alternate one (every device sends its whole input at each of N - 1 steps), both on point-to-point messages
(cs336_systems.parallel.ring_collectives), beside the ratio their bandwidth-only times predict (cs336_systems.accounting.parallelism:
alternate / ring = N / 2).

    python -m cs336_systems.parallel.launch --nproc 4 --backend gloo --out X.csv -- \\
        cs336_systems.experiments.ring_allreduce_timing --sizes-mb 0.01 1 16

Every timed iteration starts from a barrier; its time is the slowest rank's. Rows (rank 0), one per size and
algorithm: median_ms over iterations; and `measured_ratio` (alternate / ring medians) and `predicted_ratio` on
both rows of a size. Small messages are latency-bound (each of the 2 (N - 1) ring steps costs a round trip),
which the bandwidth-only model leaves out.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import torch.distributed as dist

from cs336_systems import cli
from cs336_systems.accounting import parallelism as p
from cs336_systems.accounting.units import MIB
from cs336_systems.bench.data_parallel import time_collective
from cs336_systems.measure.provenance import write_rows
from cs336_systems.parallel.distributed import BACKENDS, distributed
from cs336_systems.parallel.ring_collectives import alternate_all_reduce, ring_all_reduce

ALGORITHMS = {"ring": ring_all_reduce, "alternate": alternate_all_reduce}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, seed=False)
    parser.add_argument(
        "--backend", choices=BACKENDS, required=True, help="the process group's (the launcher passes it)"
    )
    parser.add_argument(
        "--sizes-mb", type=cli.positive_float, nargs="+", default=[0.01, 1, 16], help="in MiB"
    )
    parser.add_argument("--warmup", type=cli.nonnegative_int, default=2, help="untimed iterations per cell")
    parser.add_argument("--iters", type=cli.positive_int, default=10, help="timed iterations per cell")
    args = parser.parse_args(argv)
    cli.require_launcher(parser, __name__)
    return args


def predicted_ratio(world_size: int) -> float:
    """alternate / ring all-reduce time in the bandwidth-only model, at `world_size` devices."""
    ratio = p.alternate_all_reduce_time(p.S, p.N) / p.ring_all_reduce_time(p.S, p.N)
    return float(p.sp.simplify(ratio).subs(p.N, world_size))


def run(args: argparse.Namespace, device: torch.device) -> list[dict]:
    world = dist.get_world_size()
    rows = []
    for size_mb in args.sizes_mb:
        # float32, a multiple of world elements (the ring splits the tensor into world chunks)
        numel = max(world, int(size_mb * MIB) // 4 // world * world)
        x = torch.rand(numel, dtype=torch.float32, device=device)
        medians = {}
        for name, algorithm in ALGORITHMS.items():
            slowest = time_collective(partial(algorithm, x), device, args.warmup, args.iters)
            if slowest is not None:
                medians[name] = statistics.median(slowest)
        if not medians:
            continue
        for name, median_s in medians.items():
            rows.append(
                {
                    "backend": args.backend,
                    "world_size": world,
                    "size_mb": size_mb,
                    "bytes": numel * 4,
                    "algorithm": name,
                    "median_ms": median_s * 1e3,
                    "iters": args.iters,
                    "measured_ratio": medians["alternate"] / medians["ring"],
                    "predicted_ratio": predicted_ratio(world),
                    "status": "ok",
                }
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
