"""Worker for tests/parallel/test_ffn_parallel.py, run by the real launcher:
    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/ffn_parallel_worker.py

On every rank, for several (B, D, D_FF): cs336_systems.bench.strategy_checks' FFN rows (DP, FSDP and TP over all
ranks and, at 4 and 6 ranks, 2D FSDP x TP on a 2 x 2 or 2 x 3 DeviceMesh: outputs and gradients against the
single-device FFN in float64, counted FLOPs and ring bytes against cs336_systems.accounting.parallelism's expressions) must
all pass. A failing row raises, ending the job.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from cs336_systems.bench.strategy_checks import FFN_SHAPES, MESHES, ffn_rows
from cs336_systems.parallel.distributed import distributed


def main() -> None:
    with distributed("gloo") as ctx:
        shape = MESHES.get(ctx.world_size)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("fsdp", "tp")) if shape else None
        for ffn in FFN_SHAPES:
            rows = ffn_rows(ffn, mesh)
            assert {row["check"] for row in rows} >= {"FFN DP", "FFN FSDP", "FFN TP"}, rows
            assert mesh is None or any(row["check"].startswith("FFN 2D") for row in rows), rows
            failed = [row for row in rows if not row["passed"]]
            assert not failed, failed
        print(f"FFN parallel OK on rank {ctx.rank} of {ctx.world_size}", flush=True)


if __name__ == "__main__":
    main()
