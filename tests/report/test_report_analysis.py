"""The writeup's analysis on made-up numbers whose answers are known: fits, intervals, statistics, trends."""

import math

import numpy as np
import pandas as pd
import pytest

from cs336_systems.report import analysis


def test_latency_bandwidth_fit_recovers_alpha_and_beta():
    n = np.array([1e3, 1e5, 1e7, 1e9])
    alpha, beta = 50e-6, 1 / 200e9  # 50 µs per call, 200 GB/s
    fit = analysis.fit_latency_bandwidth(n, alpha + beta * n)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-9)
    assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-9)
    assert fit["worst_relative_error"] < 1e-9
    assert fit["sizes"] == 4


def test_fit_weights_every_size_by_its_relative_error():
    n = np.array([1e3, 1e9])
    noisy = np.array([2 * 50e-6, 50e-6 + 1e9 / 200e9])  # the small call twice as slow as the model says
    fit = analysis.fit_latency_bandwidth(n, noisy)
    # Two points are fitted exactly, whatever the weights.
    assert fit["alpha_s"] + fit["beta_s_per_byte"] * 1e3 == pytest.approx(noisy[0])


def test_allreduce_fits_one_per_backend_and_process_count_with_two_sizes():
    rows = []
    for backend, world_size, alpha in (("nccl", 2, 20e-6), ("gloo", 2, 1e-3)):
        for size_mb in (1, 10, 100):
            n = size_mb * 2**20
            rows.append(
                {
                    "backend": backend,
                    "world_size": world_size,
                    "size_mb": size_mb,
                    "bytes": n,
                    "median_ms": (alpha + n / 1e10) * 1e3,
                }
            )
    rows.append({"backend": "gloo", "world_size": 4, "size_mb": 1, "bytes": 2**20, "median_ms": 1.0})
    fits = analysis.allreduce_fits(pd.DataFrame(rows)).set_index(["backend", "world_size"])
    assert list(fits.index) == [("gloo", 2), ("nccl", 2)]  # gloo on 4 has a single size
    assert fits.loc[("nccl", 2), "alpha_s"] == pytest.approx(20e-6, rel=1e-6)
    assert 1 / fits.loc[("gloo", 2), "beta_s_per_byte"] == pytest.approx(1e10, rel=1e-6)


def test_union_merges_overlapping_and_touching_intervals():
    assert analysis.union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert analysis.union([]) == []


def test_intersection_length_of_two_unions():
    a = [(0, 4), (6, 10)]
    b = [(2, 7), (9, 12)]
    assert analysis.intersection_length(a, b) == 2 + 1 + 1  # [2,4], [6,7], [9,10]
    assert analysis.intersection_length(a, [(4, 6)]) == 0


def test_concurrency_counts_overlapping_busy_time_once():
    comm = [(0, 4), (2, 6), (10, 12)]  # 8 ms in all once the overlap is merged
    compute = [(3, 11)]
    total, share = analysis.concurrency(comm, compute)
    assert total == 8
    assert share == pytest.approx((3 + 1) / 8)  # [3,6] and [10,11]
    assert analysis.concurrency([], compute) == (0, 0.0)


def steps(cells):
    return pd.DataFrame(
        [
            {"size": size, "mode": "forward", "status": "ok", "time_ms": t}
            for size, times in cells.items()
            for t in times
        ]
        + [{"size": "huge", "mode": "forward", "status": "OOM", "time_ms": None}]
    )


def test_step_stats_per_cell_and_out_of_memory_marker():
    stats = analysis.step_stats(steps({"a": [1, 2, 3, 10], "b": [4, 4]}), ["size", "mode"]).set_index("size")
    assert stats.loc["a", ["mean_ms", "median_ms", "min_ms", "max_ms", "steps"]].tolist() == [
        4,
        2.5,
        1,
        10,
        4,
    ]
    assert stats.loc["b", "std_ms"] == 0
    assert stats.loc["huge", "oom"] is True and math.isnan(stats.loc["huge", "median_ms"])
    assert stats[["oom"]].loc[["a", "b"]].isna().all().all()


def test_paired_speedups_divide_medians_and_leave_out_of_memory_cells_empty():
    frame = pd.DataFrame(
        [
            {"size": "s", "context_length": 64, "mode": "forward", "compile": c, "status": "ok", "time_ms": t}
            for c, times in ((False, [10, 12, 100]), (True, [5, 6, 6]))
            for t in times
        ]
        + [
            {"size": "s", "context_length": 128, "mode": "forward", "compile": False, "status": "OOM"},
            {
                "size": "s",
                "context_length": 128,
                "mode": "forward",
                "compile": True,
                "status": "ok",
                "time_ms": 9,
            },
        ]
    )
    compared = analysis.paired_speedups(frame, "compile", "False", "True", ["size", "context_length", "mode"])
    by_context = compared.set_index("context_length")
    assert by_context.loc[64, "speedup"] == 2  # medians 12 / 6: the 100 ms step does not count
    assert by_context.loc[128, "oom_baseline"] is True and math.isnan(by_context.loc[128, "speedup"])


def test_speedups_by_size_in_model_order_with_the_median_over_contexts():
    compared = pd.DataFrame(
        {
            "size": ["big", "big", "small", "small", "small"],
            "mode": ["forward"] * 5,
            "speedup": [1.0, 1.2, 2.0, 3.0, math.nan],
        }
    )
    by_size = analysis.speedups_by_size(compared, ["small", "big"])
    assert list(by_size) == ["forward"]
    assert by_size["forward"].to_dict() == {"small": 2.5, "big": 1.1}


@pytest.mark.parametrize(
    ("values", "direction"),
    [
        ([1.0, 2.0, 3.0, 5.0], "grows"),
        ([5.0, 3.0, 2.0, 1.0], "shrinks"),
        ([1.0, 5.0, 1.0, 5.0], "mixed"),
        ([100.0, 101.0, 99.0], "flat"),
        ([1.0, 2.0], "grows"),
        ([-127.0, 3.0, 67.0], "grows"),  # around zero: never flat
        ([-6.0, -6.1, -6.2], "flat"),  # a negative median spreads as a positive one
    ],
)
def test_trend_both_ways(values, direction):
    assert analysis.trend(pd.Series(values)).direction == direction


def test_share_removed_and_the_fewest_sufficient_warmup():
    assert analysis.share_removed(cold=30, warm=12, reference=10) == pytest.approx(0.9)
    assert analysis.share_removed(cold=30, warm=5, reference=10) == 1.0  # capped
    assert math.isnan(analysis.share_removed(cold=10, warm=10, reference=10))
    means = pd.DataFrame({0: [30.0, 50.0], 1: [25.0, 20.0], 2: [11.0, 21.0], 5: [10.0, 20.0]})
    count, share = analysis.fewest_sufficient(means)
    assert count == 2  # one warm-up step removes only a quarter of the first cell's extra 20 ms
    assert share == pytest.approx(0.95)
    assert analysis.fewest_sufficient(means[[0, 1, 5]]) is None


def test_log_slope_between_the_last_two_points():
    x = pd.Series([256.0, 1024.0, 4096.0])
    assert analysis.log_slope(x, 3 * x + x**2) == pytest.approx(2, abs=2e-3)  # approaches 2 from below
    assert analysis.log_slope(x, 7 * x) == pytest.approx(1)


def test_phase_times_means_and_the_phase_that_ran_out_of_memory():
    frame = pd.DataFrame(
        [
            {"d": 16, "seq_len": 64, "phase": "forward", "status": "ok", "time_ms": 1.0},
            {"d": 16, "seq_len": 64, "phase": "forward", "status": "ok", "time_ms": 3.0},
            {"d": 16, "seq_len": 64, "phase": "backward", "status": "ok", "time_ms": 4.0},
            {"d": 16, "seq_len": 128, "phase": "forward", "status": "ok", "time_ms": 5.0},
            {"d": 16, "seq_len": 128, "phase": "backward", "status": "OOM", "time_ms": None},
        ]
    )
    times = analysis.phase_times(frame, ["d", "seq_len"])
    assert times.loc[(16, 64), ["forward", "backward"]].tolist() == [2.0, 4.0]
    assert pd.isna(times.loc[(16, 64), "oom_phase"])
    assert times.loc[(16, 128), "oom_phase"] == "backward" and math.isnan(times.loc[(16, 128), "backward"])


def test_analysis_picks_the_best_k_and_its_neighbours():
    cells = pd.DataFrame(
        {
            "policy": ["selective", "every:2", "none", "every:1", "every:3", "nested"],
            "status": ["ok", "ok", "OOM", "ok", "OOM", "ok"],
            "forward_backward_peak_mib": [30.0, 12.0, None, 14.0, None, 11.0],
            "median_ms": [5.0, 6.0, None, 6.5, None, 8.0],
            "saved_bytes": [1, 1, 1, 1, 1, 1],
        }
    )
    block = pd.Series(
        {"num_layers": 3, "residual_bytes": 10 * 2**20, "checkpoint_bytes": 2**20, "grad_bytes_per_block": 0}
    )
    table = analysis.checkpointing_cells(cells, block)
    assert list(table["policy"]) == ["none", "every:1", "every:2", "every:3", "nested", "selective"]
    assert list(table["predicted_mib"][:3]) == [30.0, 12.0, 20.0]  # N R; (N-1) c + R; c + 2R... max(20, 11)
    best = analysis.best_one_level(table, "forward_backward_peak_mib")
    assert best["k"] == 2 and best["smaller"]["value"] == 14.0 and best["larger"]["status"] == "OOM"
    assert analysis.time_baseline(table) == ("selective", 5.0)  # none ran out of memory: the fastest instead
    assert analysis.ratio_of(table, "selective", "every:1", "median_ms") == pytest.approx(5.0 / 6.5)
    assert analysis.analytic_optimum(block)["k"] == 1
    model = analysis.nested_asymptotics([4, 32], block)
    assert list(model["nested_checkpoints"]) == [2, 5] and list(model["nested_forwards"]) == [10, 128]


def _residual_rows(mode, shapes_bytes, module="block", attention="naive", heads=3):
    """Measured residual rows: (storage_bytes, counted, is_parameter_object) per saved tensor, batch 2, context 4,
    d_model 8, d_ff 16."""
    return [
        {
            "module": module,
            "attention": attention,
            "heads": heads,
            "mode": mode,
            "source": "measured",
            "status": "ok",
            "batch_size": 2,
            "context_length": 4,
            "d_model": 8,
            "d_ff": 16,
            "dtype": "float32",
            "bytes": size,
            "storage_bytes": size,
            "counted": counted,
            "counted_bytes": size if counted else 0,
            "is_parameter_object": parameter,
        }
        for size, counted, parameter in shapes_bytes
    ]


def test_residual_totals_count_storages_once_and_the_handout_way_counts_every_save():
    btd = 2 * 4 * 8 * 4
    frame = pd.DataFrame(
        _residual_rows("eager", [(btd, True, False), (btd, False, False), (32, False, True)])
    )
    [row] = analysis.residual_totals(frame).to_dict("records")
    assert row["counted_mib"] * 2**20 == btd and row["handout_mib"] * 2**20 == 2 * btd
    assert (row["tensors"], row["storages"], row["status"]) == (3, 1, "ok")


def test_residual_size_class_names_formulas_and_joins_equal_ones():
    dims = {"batch_size": 2, "context_length": 4, "d_model": 8, "d_ff": 16, "heads": 2, "dtype": "float32"}

    def size_class(**row):
        return analysis.residual_size_class(pd.Series({**dims, **row}))

    assert size_class(storage_bytes=2 * 4 * 16 * 4) == "B·T·d_ff"
    assert size_class(storage_bytes=2 * 2 * 4 * 4 * 4) == "B·T·d = B·h·T²"  # 2·4·8 = 2·2·4² = 64 elements
    assert size_class(storage_bytes=4 * 4, dtype="bool") == "T² = B·h·T"  # bool: 1 byte per element
    assert size_class(storage_bytes=7 * 4) == "other"


def test_fusion_changes_pair_eager_and_compiled_by_size():
    btd, btf = 2 * 4 * 8 * 4, 2 * 4 * 16 * 4
    frame = pd.DataFrame(
        _residual_rows("eager", [(btd, True, False), (btd, True, False), (btf, True, False)])
        + _residual_rows("compiled", [(btd, True, False), (btf, True, False)])
        + _residual_rows("eager", [(btd, True, False)], attention="flash")
    )  # no compiled pair
    changes = analysis.fusion_changes(analysis.residuals_by_size(frame)).set_index("size_class")
    assert set(changes["attention"]) == {"naive"}
    assert changes.loc["B·T·d", ["eager_tensors", "compiled_tensors"]].tolist() == [2, 1]
    assert changes.loc["B·T·d", "change_mib"] * 2**20 == -btd
    assert changes.loc["B·T·d_ff", "change_mib"] == 0


def test_difference_keeps_the_time_of_a_outside_b():
    assert analysis.difference([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert analysis.difference([(0, 2), (1, 4)], [(3, 8), (-1, 0.5)]) == [(0.5, 3)]  # a's union, b unsorted
    assert analysis.difference([(0, 1)], [(0, 1)]) == [] and analysis.difference([(0, 1)], []) == [(0, 1)]


def test_gather_exposure_per_forward_layer_and_over_the_step():
    kernels = pd.DataFrame(
        [
            ("compute", 0.1, 1.0, 0), ("compute", 1.0, 2.0, 0),
            ("all_gather", 0.0, 0.3, None),  # 0.0-0.1 before the first compute kernel: layer 0's window
            ("all_gather", 1.8, 2.6, 0),  # 2.0-2.5 while layer 1 waits
            ("compute", 2.5, 4.0, 1),
            ("all_gather", 3.0, 3.9, 1),  # hidden behind layer 1
            ("compute", 4.0, 5.0, 2),
            ("memcpy", 5.0, 5.1, None), ("reduce_scatter", 5.5, 7.0, None),
            ("all_gather", 6.0, 6.5, None),  # backward: exposed, outside the forward's layers
        ],
        columns=["kind", "start_ms", "end_ms", "layer"],
    )  # fmt: skip
    kernels["stream"] = [7 if kind in ("compute", "memcpy") else 20 for kind in kernels["kind"]]
    # a copy on the communication stream (FSDP2's copy-in) hides nothing
    kernels.loc[len(kernels)] = ("memcpy", 6.0, 6.5, None, 20)
    layers, summary = analysis.gather_exposure(kernels)
    assert list(layers["layer"]) == [0, 1, 2]
    assert list(zip(layers["window_start_ms"], layers["window_end_ms"], strict=True)) == [
        (0, 2),
        (2, 4),
        (4, 5),
    ]
    assert list(layers["exposed_ms"]) == pytest.approx([0.1, 0.5, 0.0])
    assert list(layers["in_time"]) == [False, False, True]
    assert (summary["layers"], summary["layers_in_time"], summary["worst_layer"]) == (3, 1, 1)
    assert summary["worst_exposed_ms"] == pytest.approx(0.5)
    assert summary["forward_exposed_ms"] == pytest.approx(0.6)
    assert summary["step_exposed_ms"] == pytest.approx(1.1) and summary["step_ms"] == 7.0
    # a synchronous all-reduce runs on the compute stream (torch puts it on the current stream): still compute's
    kernels.loc[len(kernels)] = ("all_reduce", 7.0, 7.2, None, 7)
    with_sync, synced = analysis.gather_exposure(kernels)
    assert with_sync.equals(layers) and synced["step_exposed_ms"] == pytest.approx(1.1)
    _, none = analysis.gather_exposure(kernels.assign(layer=None))  # no layer annotations: the step only
    assert (
        none["layers"] == 0 and none["worst_layer"] is None and none["step_exposed_ms"] == pytest.approx(1.1)
    )


def test_fsdp_goals_pass_fail_and_not_measured():
    cells = pd.DataFrame(
        {
            "variant": ["ours", "fsdp2", "single"],
            "world_size": [2, 2, 2],
            "step_ms": [100.0, 110.0, 90.0],
            "peak_mib": [1000.0, 960.0, 2000.0],
            "gather_wait_ms": [4.0, math.nan, 0.0],
        }
    )
    goals = analysis.fsdp_goals(cells).set_index("goal")
    assert list(goals["passed"]) == [True, True, True]  # 100 <= 110; 1000 <= 1008; 4 < 5
    assert goals.loc["peak memory ≤ FSDP2's + 5 %", "bound"] == pytest.approx(1008)
    one = analysis.fsdp_goals(cells.assign(world_size=1, peak_mib=math.nan, gather_wait_ms=5.0)).set_index(
        "goal"
    )
    # on one rank also the overhead over the floor: 100 >= 1.05 * 90; no peaks (CPU): not measured
    assert one.loc["overhead over the unwrapped model < 5 %", "passed"] is False
    assert one.loc["peak memory ≤ FSDP2's + 5 %", "passed"] is None
    assert one.loc["exposed all-gather < 5 % of the step", "passed"] is False  # 5 is not < 5
    alone = analysis.fsdp_goals(cells[cells["variant"] == "ours"])  # no FSDP2 in the run
    assert list(alone["passed"]) == [None, None, True]
