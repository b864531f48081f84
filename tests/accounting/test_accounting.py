"""The accounting module against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest

from cs336_systems.accounting.formulas import (
    FFNStack,
    collective_bytes,
    data_parallel_communication,
    dtype_bytes,
    fsdp_memory,
    fsdp_tp_compute_bound_batch,
    sharding_prediction,
    training_state_memory,
    values,
    xxl_fsdp_memory,
    xxl_memory,
)

XXL = FFNStack(d_model=16384, d_ff=53248, num_blocks=126)


def test_xxl_memory_on_h100s() -> None:
    got = values(xxl_memory(XXL, batch_size=4, seq_len=1024, device_memory_bytes=80e9))
    # N = 2 * 126 * 16384 * 53248 = 252 * 872,415,232 = 219,848,638,464 parameters
    assert got["num_params"] == 219_848_638_464
    # fp32 master weights and accumulated gradients: 4 N = 879,394,553,856 bytes (~879 GB) each
    assert got["master_weights_bytes"] == 879_394_553_856
    assert got["accumulated_gradients_bytes"] == 879_394_553_856
    # AdamW, two fp32 moments: 8 N = 1,758,789,107,712 bytes
    assert got["optimizer_state_bytes"] == 1_758_789_107_712
    # 16 N = 3,517,578,215,424 bytes = 43.97 x 80 GB -> 44 H100s
    assert got["states_bytes"] == 3_517_578_215_424
    assert got["states_devices"] == pytest.approx(43.9697, abs=1e-4)
    assert got["states_devices_needed"] == 44
    # bf16 inputs of both linears: 126 * (16384 + 53248) * 2 = 126 * 69,632 * 2 = 17,547,264 bytes per token
    assert got["activation_bytes_per_token"] == 17_547_264
    # 4 x 1024 = 4096 tokens: 71,873,593,344 bytes; with the states 3,589.45 GB / 80 GB = 44.87 -> 45
    assert got["activation_bytes"] == 71_873_593_344
    assert got["total_devices_needed"] == 45


def test_xxl_fsdp_memory_on_v5p() -> None:
    got = values(xxl_fsdp_memory(XXL, batch_size=4, seq_len=1024, device_memory_bytes=95e9, n_fsdp=64))
    # states only: 3,517.58 GB / 95 GB = 37.03 -> 38 devices
    assert got["n_fsdp_states_only"] == 38
    # A/2 = 35,936,796,672; n >= (S + A/2) / (M - A/2) = 3,553,515,012,096 / 59,063,203,328 = 60.16 -> 61
    assert got["n_fsdp_needed"] == 61
    # at 61: 3,517,578,215,424/61 + 35,936,796,672 + 35,936,796,672/61 = 57,665,216,646 + 35,936,796,672
    #        + 589,127,814 = 94,191,141,132 bytes <= 95 GB (and 60 would need 95.2 GB)
    assert got["per_device_bytes_at_n_fsdp_needed"] == pytest.approx(94_191_141_132.6, rel=1e-12)
    # at 64: 54,962,159,616 + 35,936,796,672 + 561,512,448 = 91,460,468,736
    assert got["per_device_bytes"] == pytest.approx(91_460_468_736, rel=1e-12)
    # activations alone past the device (A/2 >= M): no N_FSDP fits
    huge = values(xxl_fsdp_memory(XXL, batch_size=64, seq_len=1024, device_memory_bytes=95e9))
    assert math.isinf(huge["n_fsdp_needed"])


def test_fsdp_tp_compute_bound_batch_scaling_book() -> None:
    got = values(fsdp_tp_compute_bound_batch(XXL, 4.6e14, 2 * 9e10, fsdp=16, tp=4, fsdp_axes=2, tp_axes=1))
    # alpha = 4.6e14 / 1.8e11 = 2555.56; N = 16 * 4 = 64
    assert got["alpha"] == pytest.approx(2555.5556, abs=1e-4)
    assert got["num_devices"] == 64
    # B F/N >= alpha F/(Y M_X) + alpha B/(X M_Y): F/N = 53248/64 = 832, alpha/(16*1) = 159.72,
    # alpha * 53248 / (4*2) = 17,009,777.8 -> B >= 17,009,777.8 / (832 - 159.72) = 25,301.7 tokens
    assert got["min_global_batch"] == pytest.approx(25_301.71, abs=0.01)
    # per device 25,301.7 / 64 = 395.34 -> 396 tokens; overall 396 * 64 = 25,344 tokens
    assert got["min_per_device_batch"] == pytest.approx(395.339, abs=1e-3)
    assert got["per_device_batch"] == 396
    assert got["global_batch"] == 25_344
    # scaling book's best-split bound: 4 alpha^2 / (F M_X M_Y) = 4 * 6,530,864 / 106,496 = 245.3
    assert got["optimal_split_min_per_device_batch"] == pytest.approx(245.30, abs=0.01)
    # at that batch compute time equals communication time (each in units of 4D/C)
    b = got["min_global_batch"]
    assert b * got["t_math_per_token"] == pytest.approx(got["t_fsdp"] + b * got["t_tp_per_token"])
    # too much tensor parallelism for F: F/N <= alpha/(X M_Y) never becomes compute bound
    never = values(fsdp_tp_compute_bound_batch(XXL, 4.6e14, 1.8e11, fsdp=1, tp=64))
    assert math.isinf(never["min_global_batch"])


def test_training_state_memory_sharded_per_rank() -> None:
    got = values(training_state_memory([10, 7, 7, 3], world_size=3))
    # Psi = 27: fp32 parameters and gradients 108 bytes each, AdamW state 2 * 4 * 27 = 216 bytes
    assert (got["num_params"], got["parameters_bytes"], got["gradients_bytes"]) == (27, 108, 108)
    assert got["optimizer_state_bytes"] == 216
    # 10 -> r0, 7 -> r1, 7 -> r2, 3 -> r1 (loads 10, 7, 7): loads 10, 10, 7 elements x 8 bytes
    assert [got[f"sharded_optimizer_state_bytes_rank{r}"] for r in range(3)] == [80, 80, 56]
    assert got["sharded_optimizer_state_bytes_max_rank"] == 80
    assert got["sharded_optimizer_state_bytes_ideal"] == 72  # 216 / 3


def test_data_parallel_communication_zero1_vs_ours() -> None:
    got = values(data_parallel_communication(num_params=100, world_size=2))
    # ring factor (n-1)/n = 1/2; DDP all-reduce 2 * 1/2 * 100 * 4 bytes = 400
    assert got["ddp_bytes_per_rank"] == 400
    # ZeRO-1: reduce-scatter 1/2 * 100 * 4 + all-gather 1/2 * 100 * 4 = 400, same as DDP
    assert got["zero1_bytes_per_rank"] == 400
    # ours: all-reduce 400 + parameter all-gather 200 = 600 (3 Psi vs 2 Psi)
    assert got["sharded_bytes_per_rank"] == 600
    assert (got["ddp_psi_units"], got["zero1_psi_units"], got["sharded_psi_units"]) == (2, 2, 3)


def test_sharding_prediction_per_variant_and_rank() -> None:
    # Psi = 5 + 9 + 2 + 7 + 3 = 26 fp32 parameters: 104 bytes of parameters and of gradients, AdamW state 8 Psi
    # = 208. balanced_partition on 2 ranks gives loads (14, 12): our shards hold 112 and 96 bytes of state.
    numels = [5, 9, 2, 7, 3]
    unsharded = sharding_prediction("unsharded", numels, rank=1, world_size=2)
    # Ring all-reduce of the gradients: 2 (n-1)/n Psi * 4 = 104 bytes sent per rank.
    assert unsharded == {"parameters": 104, "gradients": 104, "optimizer_state": 208, "communication": 104}
    # Sharded: the all-reduce plus the exchange of updated parameters, (n-1)/n Psi * 4 = 52: 156.
    assert sharding_prediction("sharded", numels, rank=0, world_size=2)["optimizer_state"] == 112
    assert sharding_prediction("sharded", numels, rank=1, world_size=2) == {
        "parameters": 104, "gradients": 104, "optimizer_state": 96, "communication": 156,
    }  # fmt: skip
    assert (
        sharding_prediction("zero", numels, rank=1, world_size=2)["optimizer_state"] == 104
    )  # the ideal half
    assert (
        sharding_prediction("sharded", numels, rank=0, world_size=1)["communication"] == 0
    )  # nothing to send


def test_fsdp_memory_per_rank_and_the_expected_saving() -> None:
    # Units of 10, 30, 20 parameters (Psi_s = 60, largest 30) and 4 replicated: Psi = 64.
    got = values(fsdp_memory([10, 30, 20], 4, world_size=2, compute_dtype="bf16", prefetch_distance=2))
    assert (got["sharded_params"], got["replicated_params"], got["largest_unit_params"]) == (60, 4, 30)
    assert got["ddp_state_bytes"] == 16 * 64 == 1024
    assert got["ddp_bucket_bytes"] == 4 * 64 == 256
    assert got["fsdp_state_bytes"] == 16 * (60 / 2 + 4) == 544
    # two units' bf16 weights (2 x 30 x 2) and one unit's fp32 gradient (30 x 4)
    assert got["fsdp_gathered_bytes"] == 120 + 120
    assert got["saving_handout_bytes"] == 1024 - 544 == 480
    assert got["saving_vs_our_ddp_bytes"] == 1024 + 256 - 544 - 240 == 496
    # One rank shards nothing: FSDP keeps the whole state and only adds its buffers.
    alone = values(fsdp_memory([10, 30, 20], 4, world_size=1, prefetch_distance=3))
    assert alone["saving_handout_bytes"] == 0 and alone["fsdp_gathered_bytes"] == 3 * 30 * 4 + 30 * 4
    with pytest.raises(ValueError, match="unit_numels"):
        fsdp_memory([], 4, world_size=2)


def test_collective_bytes_of_a_ring() -> None:
    assert collective_bytes("all_gather", 100, world_size=4) == 75  # (n-1)/n of the full tensor
    assert collective_bytes("reduce_scatter", 100, world_size=4) == 75
    assert collective_bytes("all_reduce", 100, world_size=4) == 150  # a reduce-scatter, then an all-gather
    assert collective_bytes("all_gather", 100, world_size=1) == 0
    with pytest.raises(ValueError, match="broadcast"):
        collective_bytes("broadcast", 100, world_size=2)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="d_model"):
        FFNStack(d_model=0)
    with pytest.raises(ValueError, match="int4"):
        dtype_bytes("int4")
    with pytest.raises(ValueError, match="batch_size"):
        xxl_memory(XXL, batch_size=0, seq_len=1)
    with pytest.raises(ValueError, match="world_size"):
        training_state_memory([1], world_size=0)


def test_communication_accounting_cli(tmp_path, capsys) -> None:
    from cs336_systems.experiments import communication_accounting_analysis as communication_accounting
    from cs336_systems.measure.provenance import read_rows

    out = tmp_path / "accounting.csv"
    communication_accounting.main(["--out", str(out)])  # the ADDENDUM's numbers are the defaults
    rows, meta = read_rows(out)
    assert list(rows.columns) == ["part", "quantity", "value", "unit", "formula"]
    assert set(rows["part"]) == {"a", "b", "c"}
    value = rows.set_index(["part", "quantity"])["value"]
    assert value["a", "states_devices_needed"] == 44
    assert value["c", "global_batch"] == 25_344
    assert meta["params"]["x"] == 16 and meta["params"]["y"] == 4
    with pytest.raises(SystemExit):
        communication_accounting.main(["--out", str(out), "--y", "0"])
    assert "argument --y: must be >= 1, got 0" in capsys.readouterr().err
