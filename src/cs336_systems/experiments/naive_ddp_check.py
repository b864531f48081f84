"""Correctness check of the DDP wrappers (spec §2.2.2): DDP training equals single-process training.

Run under the launcher; rank 0 writes one row per wrapper:
    python -m cs336_systems.parallel.launch --nproc 2 --backend gloo --out X.csv -- cs336_systems.experiments.naive_ddp_check
Every rank starts the toy model (ADDENDUM's fc1 -> ReLU -> LayerNorm -> fc2) from different weights, wraps it
(which installs rank 0's), and trains on its shard of a random batch; a single-process replica of rank 0's
initial model trains on the whole batch. After `--steps` SGD steps each rank compares its parameters with the
replica; a row gives the largest difference over ranks and parameters, and whether all are allclose.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from cs336_systems import cli
from cs336_systems.measure.provenance import write_rows
from cs336_systems.model.toy import ToyModel
from cs336_systems.parallel.ddp import WRAPPERS, wrap
from cs336_systems.parallel.distributed import BACKENDS, distributed, gather_to_rank0

IN_FEATURES, OUT_FEATURES = 16, 5
RTOL, ATOL = 1e-5, 1e-6  # float32: only the order of the additions differs from the single-process sum


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--backend", choices=BACKENDS, help="default: nccl where there are GPUs, else gloo")
    p.add_argument("--steps", type=cli.positive_int, default=10, help="training steps")
    p.add_argument("--batch-per-rank", type=cli.positive_int, default=8, help="examples per rank and step")
    p.add_argument(
        "--bucket-size-mb", type=cli.positive_float, default=0.0005, help="for the bucketed wrapper (MiB)"
    )
    args = p.parse_args(argv)
    cli.require_launcher(p, __name__)
    return args


def train_and_compare(
    wrapper: str, args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> tuple[float, bool]:
    """(largest |DDP - single-process| over parameters, whether every parameter is allclose) on this rank."""
    torch.manual_seed(args.seed)
    reference = ToyModel(IN_FEATURES, OUT_FEATURES).to(device)  # rank 0's initial weights
    torch.manual_seed(args.seed + rank)
    ddp = wrap(wrapper, ToyModel(IN_FEATURES, OUT_FEATURES).to(device), bucket_size_mb=args.bucket_size_mb)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(args.seed + 12345)  # the same batches on every rank
    mine = slice(rank * args.batch_per_rank, (rank + 1) * args.batch_per_rank)
    for _ in range(args.steps):
        x = torch.randn(args.batch_per_rank * world_size, IN_FEATURES, generator=generator).to(device)
        y = torch.randn(args.batch_per_rank * world_size, OUT_FEATURES, generator=generator).to(device)

        reference_optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()

        ddp_optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        ddp.finish_gradient_synchronization()
        ddp_optimizer.step()
    pairs = list(zip(ddp.module.parameters(), reference.parameters(), strict=True))
    max_abs_diff = max((a - b).abs().max().item() for a, b in pairs)
    return max_abs_diff, all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in pairs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with distributed(args.backend) as ctx:
        results = {
            name: train_and_compare(name, args, ctx.rank, ctx.world_size, ctx.device) for name in WRAPPERS
        }
        per_rank = gather_to_rank0(results)
        if per_rank is None:
            return
        rows = [
            {
                "wrapper": name,
                "backend": ctx.backend,
                "device": ctx.device.type,
                "world_size": ctx.world_size,
                "steps": args.steps,
                "batch_per_rank": args.batch_per_rank,
                "max_abs_diff": max(rank_results[name][0] for rank_results in per_rank),
                "match": all(rank_results[name][1] for rank_results in per_rank),
                "rtol": RTOL,
                "atol": ATOL,
                "status": "ok",
            }
            for name in WRAPPERS
        ]
        write_rows(rows, args.out, {**vars(args), "world_size": ctx.world_size})


if __name__ == "__main__":
    main()
