"""The §8 FFN under DP, FSDP, TP (world 2, 3, 4 and 6) and 2D FSDP x TP (2 x 2 and 2 x 3 DeviceMesh) on gloo, through the real
launcher: equal to the single-device FFN, with counted FLOPs and bytes equal to parallelism.py's expressions
(tests/workers/ffn_parallel_worker.py asserts on every rank)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parents[1].joinpath("workers", "ffn_parallel_worker.py")


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_every_strategy_matches_the_single_device_ffn_and_the_formulas(world_size: int):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
    ]
    result = subprocess.run([*command, str(WORKER)], capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("FFN parallel OK on rank") == world_size, result.stdout + result.stderr
