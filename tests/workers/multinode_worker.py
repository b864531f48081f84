"""Run by tests/parallel/test_multinode.py through cs336_systems.parallel.launch: train our FSDP on the toy model of
tests/workers/fsdp_worker.py for a few steps; rank 0 saves the full parameters to --out and every rank says on which node
(torchrun's GROUP_RANK) it ran."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from cs336_systems.parallel.distributed import distributed
from cs336_systems.parallel.fsdp import FullyShardedDataParallel
from tests.workers.fsdp_worker import OPTIMIZERS, ToyLM, batches, loss_fn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with distributed(backend=args.backend, timeout_s=300):
        torch.manual_seed(0)
        fsdp = FullyShardedDataParallel(ToyLM())
        optimizer = OPTIMIZERS["adamw"](fsdp.parameters())
        for _, (ids, targets) in batches(3, dist.get_world_size()):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(fsdp(ids), targets).backward()
            fsdp.finish_gradient_synchronization()
            optimizer.step()
        full = fsdp.gather_full_params()
        print(
            f"rank {dist.get_rank()} of {dist.get_world_size()} on node {os.environ['GROUP_RANK']}",
            flush=True,
        )
        if dist.get_rank() == 0:
            torch.save(full, args.out)


if __name__ == "__main__":
    main()
