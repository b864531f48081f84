"""DDP wrappers and distributed setup, on CPU/gloo through the real launcher (torch.distributed.run).

Each launch runs every case of tests/ddp_worker.py, which asserts on every rank; a failing rank ends the job
with a non-zero status and its message, which these tests show.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ddp_worker.py")
SRC = Path(__file__).resolve().parents[1] / "src"


def launch(nproc: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return subprocess.run(
        [*command, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_wrapper_matches_single_process_training(world_size: int):
    result = launch(world_size, str(WORKER), "equality")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"DDP equality OK on {world_size} ranks" in result.stdout


def test_a_failing_rank_ends_the_job_quickly_with_its_message():
    start = time.perf_counter()
    result = launch(2, str(WORKER), "fail", timeout=60)
    elapsed = time.perf_counter() - start
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "[rank 1] failed" in output and "deliberate failure on rank 1" in output, output
    assert elapsed < 30, f"took {elapsed:.0f} s to end the job"
