"""2026 §8 checked by running it (gloo): the rows of cs336_systems.bench.strategy_checks on every rank (the ring
collectives against torch.distributed's, the FFN strategies against the single-device FFN, counted bytes, steps and
FLOPs against parallelism.py's expressions), gathered on rank 0 with the rank that produced them.

    python -m cs336_systems.parallel.launch --nproc 4 --backend gloo --out X.csv -- cs336_systems.experiments.parallelism_checks
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from cs336_systems import cli
from cs336_systems.bench.strategy_checks import FFN_SHAPES, MESHES, ffn_rows, ring_collective_rows
from cs336_systems.measure.provenance import write_rows
from cs336_systems.parallel.distributed import BACKENDS, distributed, gather_to_rank0


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__, seed=False)
    parser.add_argument(
        "--backend", choices=BACKENDS, required=True, help="the process group's (the launcher passes it)"
    )
    args = parser.parse_args(argv)
    cli.require_launcher(parser, __name__)
    with distributed(args.backend) as ctx:
        generator = torch.Generator().manual_seed(1000 + ctx.rank)  # a different input on every rank
        rows = [r for n in (ctx.world_size, 3 * ctx.world_size) for r in ring_collective_rows(n, generator)]
        shape = MESHES.get(ctx.world_size)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("fsdp", "tp")) if shape else None
        rows += [r for ffn in FFN_SHAPES for r in ffn_rows(ffn, mesh)]
        everyone = gather_to_rank0([{**row, "rank": ctx.rank} for row in rows])
        if everyone is not None:
            write_rows(
                [row for rank_rows in everyone for row in rank_rows],
                args.out,
                {**vars(args), "world_size": ctx.world_size},
            )


if __name__ == "__main__":
    main()
