"""Correctness check of the DDP wrappers (spec §2.2.2): DDP training equals single-process training.

Run under the launcher; rank 0 writes one row per wrapper:
    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m cs336_systems.experiments.naive_ddp_check --out X.csv
Every rank starts the toy model (ADDENDUM's fc1 -> ReLU -> LayerNorm -> fc2) from different weights, wraps it
(which installs rank 0's), and trains on its shard of a random batch; a single-process replica of rank 0's
initial model trains on the whole batch. After `--steps` SGD steps each rank compares its parameters with the
replica; a row gives the largest difference over ranks and parameters, and whether all are allclose.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from cs336_systems.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapIndividualDDP
from cs336_systems.distributed import BACKENDS, distributed, gather_to_rank0
from cs336_systems.provenance import write_rows
from cs336_systems.toy_model import ToyModel

IN_FEATURES, OUT_FEATURES = 16, 5
RTOL, ATOL = 1e-5, 1e-6  # float32: only the order of the additions differs from the single-process sum


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, help="default: nccl where there are GPUs, else gloo")
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--batch-per-rank", type=int, default=8, help="examples per rank and step")
    p.add_argument("--bucket-size-mb", type=float, default=0.0005, help="for the bucketed wrapper (MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_per_rank < 1:
        p.error(f"--steps and --batch-per-rank must be >= 1, got {args.steps} and {args.batch_per_rank}")
    if args.bucket_size_mb <= 0:
        p.error(f"--bucket-size-mb must be positive, got {args.bucket_size_mb}")
    return args


def train_and_compare(
    make_ddp, args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> tuple[float, bool]:
    """(largest |DDP - single-process| over parameters, whether every parameter is allclose) on this rank."""
    torch.manual_seed(args.seed)
    reference = ToyModel(IN_FEATURES, OUT_FEATURES).to(device)  # rank 0's initial weights
    torch.manual_seed(args.seed + rank)
    ddp = make_ddp(ToyModel(IN_FEATURES, OUT_FEATURES).to(device))
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
    wrappers = {
        "naive": NaiveDDP,
        "flat": FlatDDP,
        "overlap": OverlapIndividualDDP,
        "bucketed": lambda module: BucketedDDP(module, bucket_size_mb=args.bucket_size_mb),
    }
    with distributed(args.backend) as ctx:
        results = {
            name: train_and_compare(make, args, ctx.rank, ctx.world_size, ctx.device)
            for name, make in wrappers.items()
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
            for name in wrappers
        ]
        write_rows(rows, args.out, {**vars(args), "world_size": ctx.world_size})


if __name__ == "__main__":
    main()
