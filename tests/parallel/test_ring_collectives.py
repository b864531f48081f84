"""The §8.1 ring collectives on gloo through the real launcher: each equals torch.distributed's collective, and
the bytes and steps it counts equal parallelism.py's formulas (tests/workers/ring_worker.py asserts on every rank)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sympy as sp

from cs336_systems.accounting import parallelism as p

WORKER = Path(__file__).parents[1].joinpath("workers", "ring_worker.py")


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_ring_collectives_match_torch_distributed_and_the_formulas(world_size: int):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
    ]
    result = subprocess.run([*command, str(WORKER)], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ring collectives OK on rank") == world_size, result.stdout + result.stderr


def test_the_byte_formulas_at_a_hand_computed_point():
    at = {p.S: 120, p.N: 4}
    assert {name: int(p.bytes_sent_per_device(name).subs(at)) for name in p.COLLECTIVE_TIMES} == {
        "all_gather": 90,
        "reduce_scatter": 90,
        "all_reduce": 180,
        "alternate_all_reduce": 360,
    }
    assert sp.simplify(p.COLLECTIVE_STEPS["all_reduce"] - 2 * p.COLLECTIVE_STEPS["all_gather"]) == 0


def test_the_timing_cli_writes_both_algorithms_beside_the_predicted_ratio(tmp_path: Path):
    from cs336_systems.experiments.ring_allreduce_timing import predicted_ratio
    from cs336_systems.measure.provenance import read_rows

    assert [predicted_ratio(n) for n in (2, 4, 6)] == [1.0, 2.0, 3.0]  # N / 2
    out = tmp_path / "timing.csv"
    command = [
        sys.executable,
        "-m",
        "cs336_systems.parallel.launch",
        "--nproc",
        "3",
        "--backend",
        "gloo",
        "--out",
        str(out),
        "--",
        "cs336_systems.experiments.ring_allreduce_timing",
        "--sizes-mb",
        "0.001",
        "0.1",
        "--warmup",
        "0",
        "--iters",
        "2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    rows, _ = read_rows(out)
    assert sorted(zip(rows["size_mb"], rows["algorithm"], strict=True)) == [
        (0.001, "alternate"),
        (0.001, "ring"),
        (0.1, "alternate"),
        (0.1, "ring"),
    ]
    medians = rows.set_index(["size_mb", "algorithm"])["median_ms"]
    for _, row in rows.iterrows():
        assert row["predicted_ratio"] == 1.5 and row["world_size"] == 3
        size = row["size_mb"]
        assert row["measured_ratio"] == pytest.approx(medians[(size, "alternate")] / medians[(size, "ring")])
