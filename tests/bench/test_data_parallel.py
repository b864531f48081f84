"""The rows of the multi-process benchmarks from hand-made per-rank measurements (cs336_systems.
bench.data_parallel), without processes: the distributed runs are in test_ddp and test_sharded_optimizer."""

from __future__ import annotations

import pytest
import torch

from cs336_systems.bench.data_parallel import (
    OOM_REASON,
    PhaseMemory,
    ddp_rows,
    log_median,
    optimizer_state_bytes,
    setting_columns,
    sharding_rows,
)
from cs336_systems.model.transformer import ModelConfig
from cs336_systems.parallel.distributed import DistContext
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer

CTX = DistContext(rank=0, world_size=2, local_rank=0, backend="gloo", device=torch.device("cpu"))
CELL = {"variant": "bucketed", "bucket_size_mb": 10.0}


def test_setting_columns_name_the_model_and_put_its_own_columns_after_its_shape():
    cfg = ModelConfig.from_name("tiny", context_length=32)
    setting = setting_columns("tiny", cfg, 2, 5, CTX, num_params=123)
    assert setting == {
        "size": "tiny", "d_model": 64, "num_layers": 2, "num_params": 123, "batch_size_per_rank": 2,
        "context_length": 32, "world_size": 2, "backend": "gloo", "device": "cpu", "warmup": 5,
    }  # fmt: skip
    assert list(setting)[3] == "num_params"


def test_ddp_rows_take_the_slowest_rank_per_step_and_leave_idle_ranks_out():
    per_rank = [
        {"step_s": [0.010, 0.030], "comm_s": [0.002, 0.001], "num_buckets": 3, "intervals": [{"lane": "x"}]},
        {"step_s": [0.020, 0.025], "comm_s": [0.001, 0.004], "num_buckets": 3, "intervals": []},
        None,  # a rank that took no part
    ]
    rows, intervals = ddp_rows(CELL, {"size": "tiny"}, per_rank)
    assert [(r["step"], r["step_ms"], r["comm_ms"]) for r in rows] == [
        (0, pytest.approx(20.0), pytest.approx(2.0)),
        (1, pytest.approx(30.0), pytest.approx(4.0)),
    ]
    assert list(rows[0]) == [
        "variant", "bucket_size_mb", "size", "reason", "step", "step_ms", "comm_ms", "num_buckets", "status",
    ]  # fmt: skip
    assert {(r["status"], r["reason"], r["num_buckets"]) for r in rows} == {("ok", "", 3)}
    assert intervals == [{**CELL, "lane": "x", "status": "ok"}]  # rank 0's timeline


def test_ddp_rows_have_no_communication_time_where_one_rank_cannot_tell_it():
    per_rank = [{"step_s": [0.01], "comm_s": [None], "num_buckets": None, "intervals": []}] * 2
    rows, _ = ddp_rows(CELL, {}, per_rank)
    assert rows[0]["comm_ms"] is None


def test_a_cell_out_of_memory_is_one_row_in_each_table():
    rows, intervals = ddp_rows(CELL, {"size": "tiny"}, "OOM")
    assert rows == [{**CELL, "size": "tiny", "reason": OOM_REASON, "step": None, "status": "OOM"}]
    assert intervals == [{**CELL, "status": "OOM", "reason": OOM_REASON}]
    assert sharding_rows("zero", "OOM", {"size": "tiny"}, [1]) == [
        {"size": "tiny", "variant": "zero", "status": "OOM", "reason": OOM_REASON}
    ]


def test_sharding_rows_set_measured_memory_beside_the_prediction():
    # Psi = 26 fp32 parameters (104 bytes, gradients the same), AdamW state 208 bytes unsharded.
    numels = [5, 9, 2, 7, 3]
    measured = {
        "memory": {"after_init": (104, 150), "forward_backward": (300, 1000)},  # no record for the others
        "state_bytes": 216,
        "iteration_s": [0.5, 0.25],
        "step_s": [0.125, 0.0625],
    }
    rows = sharding_rows("unsharded", [measured], {"world_size": 1}, numels)
    value = {(r["phase"], r["quantity"], r["step"]): r for r in rows}
    assert value["after_init", "predicted_total_bytes", None]["value"] == 104  # parameters only
    assert value["after_init", "remainder_bytes", None]["value"] == 150 - 104
    assert value["forward_backward", "predicted_total_bytes", None]["value"] == 104 + 104 + 208
    assert value["forward_backward", "remainder_bytes", None]["value"] == 1000 - 416
    skipped = value["after_step", "max_memory_allocated_bytes", None]
    assert (skipped["value"], skipped["status"], skipped["reason"]) == (
        None,
        "skipped",
        "no allocator statistics on CPU",
    )
    assert value["after_step", "measured_optimizer_state_bytes", None]["value"] == 216
    assert value["iteration", "predicted_communication_bytes", None]["value"] == 0  # one rank sends nothing
    assert [value["iteration", "iteration_ms", s]["value"] for s in (0, 1)] == [500, 250]
    assert [value["iteration", "optimizer_step_ms", s]["unit"] for s in (0, 1)] == ["ms", "ms"]
    # 4 phases x 7 quantities, the state held, the communication, 2 steps x 2 times; every row names its rank.
    assert len(rows) == 4 * 7 + 1 + 1 + 2 * 2 and {r["rank"] for r in rows} == {0}


def test_phase_memory_records_nothing_on_the_cpu():
    memory = PhaseMemory(torch.device("cpu"))
    memory.record("after_init")
    assert memory.by_phase == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA's allocator statistics")
def test_phase_memory_gives_each_phase_its_own_peak():
    device = torch.device("cuda")
    memory = PhaseMemory(device)
    big = torch.empty(2**20, device=device)  # 4 MiB
    del big
    memory.record("big")
    small = torch.empty(2**10, device=device)
    memory.record("small")
    assert memory.by_phase["big"][1] - memory.by_phase["small"][1] >= 4 * 2**20 - 4 * 2**10
    del small


def test_optimizer_state_bytes_counts_the_state_inside_a_sharding_wrapper():
    params = [torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(3, 2))]
    for optimizer in (torch.optim.AdamW(params), ShardedOptimizer(params, torch.optim.AdamW)):
        assert (
            optimizer_state_bytes(optimizer, torch.device("cpu")) == 0
        )  # AdamW's state comes with its first step
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        # two fp32 moments of 16 elements, and a 4-byte fp32 `step` counter per parameter (on the CPU here)
        assert optimizer_state_bytes(optimizer, torch.device("cpu")) == 2 * 16 * 4 + 2 * 4


def test_log_median_is_the_median_over_steps_of_the_slowest_rank(capsys):
    log_median("[x] cell:", [{"s": [0.001, 0.003, 0.010]}, None, {"s": [0.002, 0.001, 0.001]}], "s")
    log_median("[x] other:", "OOM", "s")
    assert capsys.readouterr().err == "[x] cell: 3.0 ms\n[x] other: OOM\n"  # slowest per step: 2, 3, 10 ms
