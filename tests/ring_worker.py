"""Worker for tests/test_ring_collectives.py, run by the real launcher:
    python -m torch.distributed.run --standalone --nproc-per-node N tests/ring_worker.py

On every rank: each ring collective of cs336_systems.ring_collectives against torch.distributed's own (float64),
and the bytes sent and steps taken against the formulas of cs336_systems.parallelism. A mismatch raises, which
ends the job with a non-zero status and the message.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cs336_systems import parallelism as p
from cs336_systems.distributed import distributed
from cs336_systems.ring_collectives import (
    Traffic,
    alternate_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)

REPEATS = 3  # each check repeated inside one launch, so an ordering race has several chances to show


def expect_traffic(collective: str, size_bytes: int, world: int, traffic: Traffic) -> None:
    at = {p.S: size_bytes, p.N: world}
    expected = (int(p.bytes_sent_per_device(collective).subs(at)), int(p.COLLECTIVE_STEPS[collective].subs(at)))
    assert (traffic.bytes_sent, traffic.steps) == expected, (collective, traffic, expected)


def check(rank: int, world: int, rows: int, generator: torch.Generator) -> None:
    x = torch.randn(rows, 5, generator=generator, dtype=torch.float64) * (rank + 1)
    size = x.numel() * x.element_size()

    reference = x.clone()
    dist.all_reduce(reference)
    for name, algorithm in [("all_reduce", ring_all_reduce), ("alternate_all_reduce", alternate_all_reduce)]:
        traffic, before = Traffic(), x.clone()
        torch.testing.assert_close(algorithm(x, traffic), reference, rtol=1e-12, atol=1e-12)
        assert torch.equal(x, before), f"{name} changed its input"
        expect_traffic(name, size, world, traffic)

    traffic = Traffic()
    reference = torch.empty(rows // world, 5, dtype=x.dtype)
    dist.reduce_scatter_tensor(reference, x)
    torch.testing.assert_close(ring_reduce_scatter(x, traffic), reference, rtol=1e-12, atol=1e-12)
    expect_traffic("reduce_scatter", size, world, traffic)

    traffic, chunk = Traffic(), x[: rows // world].clone()
    reference = torch.empty_like(x)
    dist.all_gather_into_tensor(reference, chunk)
    assert torch.equal(ring_all_gather(chunk, traffic), reference)  # a copy, so exactly equal
    expect_traffic("all_gather", size, world, traffic)


def main() -> None:
    with distributed("gloo") as ctx:
        generator = torch.Generator().manual_seed(1000 + ctx.rank)  # a different input on every rank
        for _ in range(REPEATS):
            for rows in (ctx.world_size, 3 * ctx.world_size):
                check(ctx.rank, ctx.world_size, rows, generator)
        print(f"ring collectives OK on rank {ctx.rank} of {ctx.world_size}", flush=True)


if __name__ == "__main__":
    main()
