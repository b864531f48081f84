"""ShardedOptimizer against the plain optimizer at world sizes 1 (no process group), 2 and 3 (uneven shards).

The cases live in tests/workers/sharded_worker.py (AdamW and SGD with momentum, tied and frozen parameters, two param
groups with their own learning rates, an LR change through param_groups, add_param_group mid-training, the
consolidated state_dict). One launch per world size; the checkpoint written at world size 2 is resumed at
world sizes 3 and 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from cs336_systems.model.transformer import ModelConfig
from cs336_systems.parallel.partition import balanced_partition
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer
from tests.workers import sharded_worker

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parents[1].joinpath("workers", "sharded_worker.py")


def launch(world_size: int, *worker_args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
    ]
    result = subprocess.run(
        [*command, str(WORKER), *worker_args], env=env, capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, (
        f"world size {world_size} failed:\n{result.stdout}\n{result.stderr[-6000:]}"
    )
    assert f"all cases passed at world size {world_size}" in result.stdout


@pytest.fixture(scope="module")
def checkpoint_from_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sharded") / "world2.pt"
    launch(2, "--save", str(path))
    return path


def test_world_size_2_matches_unsharded_and_saves(checkpoint_from_two_ranks: Path) -> None:
    assert checkpoint_from_two_ranks.exists()


def test_world_size_3_uneven_shards_and_resume(checkpoint_from_two_ranks: Path) -> None:
    launch(3, "--load", str(checkpoint_from_two_ranks))


def test_single_process_without_process_group(checkpoint_from_two_ranks: Path) -> None:
    assert not torch.distributed.is_initialized()
    sharded_worker.run_all(load=str(checkpoint_from_two_ranks))


def test_balanced_partition_largest_first_to_least_loaded() -> None:
    # sizes 5, 9, 2, 7, 3 on 2 ranks, largest first, loads (r0, r1): 9 -> r0 (tie at 0: lowest rank) (9, 0);
    # 7 -> r1 (9, 7); 5 -> r1 (9, 12); 3 -> r0 (12, 12); 2 -> r0 (tie: lowest rank) (14, 12).
    owners, loads = balanced_partition([5, 9, 2, 7, 3], 2)
    assert owners == [1, 0, 0, 1, 0]
    assert loads == [14, 12]
    # Items added later balance against the existing loads: 4 -> r1 (14, 16); 1 -> r0 (15, 16).
    assert balanced_partition([4, 1], 2, loads) == ([1, 0], [15, 16])


def test_bad_arguments_are_named() -> None:
    model = sharded_worker.ToyLM()
    with pytest.raises(TypeError, match="optimizer_cls"):
        ShardedOptimizer(model.parameters(), "AdamW", lr=1e-3)
    with pytest.raises(ValueError, match="not contiguous"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(3, 4).t())], torch.optim.SGD, lr=1e-3)
    optimizer = ShardedOptimizer(sharded_worker.param_groups(model), torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match="2 parameter groups, this optimizer has 1"):
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3).load_state_dict(
            optimizer.state_dict()
        )
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        optimizer.load_state_dict({"state": {}})


def test_sharding_benchmark_cli_on_cpu(tmp_path: Path) -> None:
    """The benchmark at toy size under the launcher: every variant times, memory rows say why they are empty."""
    out = tmp_path / "sharding.csv"
    model = ["--size", "tiny"]
    run = ["--batch-size", "1", "--context-length", "8", "--warmup", "1", "--steps", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    result = subprocess.run(
        [*command, "cs336_systems.experiments.sharding_benchmark", *model, *run],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    rows = pd.read_csv(out)
    assert list(rows.columns) == [
        "size", "d_model", "num_layers", "num_params", "batch_size_per_rank", "context_length", "world_size",
        "backend", "device", "warmup", "variant", "rank", "phase", "step", "quantity", "value", "unit", "status",
        "reason",
    ]  # fmt: skip
    assert set(rows["size"]) == {"tiny"} and set(rows["num_params"]) == {
        ModelConfig.from_name("tiny").num_parameters()
    }
    assert set(rows["variant"]) == {"unsharded", "sharded", "zero"} and set(rows["rank"]) == {0, 1}
    times = rows[rows["quantity"] == "iteration_ms"]
    assert len(times) == 3 * 2 * 2 and (times["value"] > 0).all()  # variants x ranks x steps
    step_ms = rows[rows["quantity"] == "optimizer_step_ms"].set_index(["variant", "rank", "step"])["value"]
    assert (step_ms < times.set_index(["variant", "rank", "step"])["value"]).all()  # a part of its iteration
    memory = rows[rows["quantity"] == "max_memory_allocated_bytes"]
    assert (memory["status"] == "skipped").all() and memory["value"].isna().all()
    assert (memory["reason"] == "no allocator statistics on CPU").all()
    # Unsharded and sharded ranks hold the predicted AdamW state (+ 4-byte `step` counters, on the CPU here);
    # `zero` is predicted at the ideal half, its own partition differs by parts of a parameter.
    state = rows[rows["phase"] == "after_step"].pivot_table(
        index=["variant", "rank"], columns="quantity", values="value"
    )
    extra = (state["measured_optimizer_state_bytes"] - state["predicted_optimizer_state_bytes"]).drop("zero")
    assert ((extra >= 0) & (extra < 4 * 20)).all(), state
    sharded = state.loc["sharded", "measured_optimizer_state_bytes"]
    assert sharded.sum() == pytest.approx(
        state.loc["unsharded", "measured_optimizer_state_bytes"].sum() / 2, rel=0.01
    )
