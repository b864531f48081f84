"""Worker for tests/parallel/test_ring_collectives.py, run by the real launcher:
    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/ring_worker.py

On every rank: cs336_systems.bench.strategy_checks' ring-collective rows (each collective against torch.distributed's
own in float64, its bytes sent and steps against cs336_systems.accounting.parallelism's formulas) must all pass. A failing
row raises, which ends the job with a non-zero status and the row.
"""

from __future__ import annotations

import torch

from cs336_systems.bench.strategy_checks import ring_collective_rows
from cs336_systems.parallel.distributed import distributed

REPEATS = 3  # each check repeated inside one launch, so an ordering race has several chances to show


def main() -> None:
    with distributed("gloo") as ctx:
        generator = torch.Generator().manual_seed(1000 + ctx.rank)  # a different input on every rank
        for _ in range(REPEATS):
            for rows in (ctx.world_size, 3 * ctx.world_size):
                failed = [row for row in ring_collective_rows(rows, generator) if not row["passed"]]
                assert not failed, failed
        print(f"ring collectives OK on rank {ctx.rank} of {ctx.world_size}", flush=True)


if __name__ == "__main__":
    main()
