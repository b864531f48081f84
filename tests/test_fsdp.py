"""Our FSDP (cs336_systems.fsdp) on CPU/gloo through the real launcher: every case of tests/fsdp_worker.py
asserts on every rank against single-process training, under deterministic algorithms with warnings as errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fsdp_worker.py")


def launch(nproc: int, *cases: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return subprocess.run([*command, str(WORKER), *cases], capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])  # 1: nothing is communicated (fsdp.py's own path)
def test_fp32_training_equals_single_process_training(world_size: int):
    result = launch(world_size, "equality", "frozen")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"OK on {world_size} ranks" in result.stdout


def test_compute_dtype_prefetch_rule_our_transformer_tied_weights_and_anomaly_mode():
    result = launch(2, "compute_dtype", "prefetch", "transformer", "tied", "anomaly")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK on 2 ranks" in result.stdout


@pytest.mark.parametrize("world_size", [2, 3])
def test_block_units_and_bf16_weights(world_size: int):
    result = launch(world_size, "units", "bf16")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"OK on {world_size} ranks" in result.stdout
