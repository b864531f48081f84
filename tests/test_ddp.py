"""DDP wrappers and distributed setup, on CPU/gloo through the real launcher (torch.distributed.run).

Each launch runs every case of tests/ddp_worker.py, which asserts on every rank; a failing rank ends the job
with a non-zero status and its message, which these tests show.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cs336_systems.provenance import read_rows

WORKER = Path(__file__).with_name("ddp_worker.py")


def launch(nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_wrapper_matches_single_process_training(world_size: int):
    result = launch(world_size, str(WORKER), "equality")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"DDP equality OK on {world_size} ranks" in result.stdout


def test_a_failing_rank_ends_the_job_quickly_with_its_message():
    start = time.perf_counter()
    result = launch(2, str(WORKER), "fail", timeout=90)
    elapsed = time.perf_counter() - start
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "[rank 1] failed" in output and "deliberate failure on rank 1" in output, output
    # The worker's collective timeout is 600 s: ending well before it means the launcher tore the job down.
    assert elapsed < 45, f"took {elapsed:.0f} s to end the job"


def test_leaving_the_job_stops_every_gloo_thread():
    """A gloo thread still running at interpreter shutdown aborts the process when it frees a tensor
    ("terminate called without an active exception"), at random; here the cause is checked deterministically."""
    result = launch(2, str(WORKER), "teardown")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("no gloo thread left") == 2, result.stdout + result.stderr


# The experiment CLIs, each at toy size under the launcher; rank 0 writes the rows.


def test_allreduce_benchmark_writes_one_row_per_size(tmp_path: Path):
    out = tmp_path / "allreduce.csv"
    result = launch(
        2,
        *"-m cs336_systems.experiments.allreduce_benchmark --backend gloo --sizes-mb 0.01 0.5".split(),
        *"--warmup 1 --iters 3 --out".split(),
        str(out),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows, meta = read_rows(out)
    assert list(rows["size_mb"]) == [0.01, 0.5] and set(rows["status"]) == {"ok"}
    assert (rows["world_size"] == 2).all() and (rows["bytes"] == [10484, 524288]).all()
    assert (rows["median_ms"] > 0).all() and (rows["std_ms"] >= 0).all()
    expected_algbw = rows["bytes"] / (rows["median_ms"] / 1e3) / 1e9
    assert (abs(rows["algbw_gbps"] - expected_algbw) < 1e-9 * expected_algbw).all()
    assert (abs(rows["busbw_gbps"] - rows["algbw_gbps"]) < 1e-12).all()  # 2 (n - 1) / n = 1 for n = 2
    assert meta["params"]["world_size"] == 2


def test_allreduce_benchmark_rejects_bad_sizes(tmp_path: Path):
    from cs336_systems.experiments import allreduce_benchmark

    with pytest.raises(SystemExit):
        allreduce_benchmark.main(["--backend", "gloo", "--sizes-mb", "-1", "--out", str(tmp_path / "x.csv")])


def test_naive_ddp_check_matches_for_every_wrapper(tmp_path: Path):
    out = tmp_path / "check.csv"
    result = launch(2, "-m", "cs336_systems.experiments.naive_ddp_check", "--steps", "3", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    rows, _ = read_rows(out)
    assert list(rows["wrapper"]) == ["naive", "flat", "overlap", "bucketed"]
    assert rows["match"].all() and (rows["max_abs_diff"] < 1e-5).all(), rows


def test_ddp_benchmark_rows_traces_and_timeline(tmp_path: Path):
    out, traces, timeline = tmp_path / "ddp.csv", tmp_path / "traces", tmp_path / "timeline.csv"
    result = launch(
        2,
        *"-m cs336_systems.experiments.ddp_benchmark --d-model 32 --d-ff 64 --num-layers 1 --num-heads 2".split(),
        *"--vocab-size 100 --batch-size 2 --context-length 16 --bucket-sizes-mb 0.001 1".split(),
        *"--warmup 1 --steps 2 --trace-steps 2".split(),
        *["--trace-dir", str(traces), "--timeline-out", str(timeline), "--out", str(out)],
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows, _ = read_rows(out)
    labels = ["naive", "flat", "overlap", "bucketed_0.001mb", "bucketed_1mb"]
    labels += ["torch_ddp_0.001mb", "torch_ddp_1mb", "single"]
    assert len(rows) == len(labels) * 2 and set(rows["status"]) == {"ok"} and (rows["step_ms"] > 0).all()
    # d_model 32, d_ff 64, vocab 100, 1 layer: embedding + output 2*100*32, attention 4*32*32, SwiGLU 3*32*64,
    # two RMSNorms per block and a final one 3*32; fp32.
    assert (rows["param_bytes"] == 4 * (2 * 100 * 32 + 4 * 32 * 32 + 3 * 32 * 64 + 3 * 32)).all()
    assert (rows["num_tensors"] == 3 + 7).all()  # embedding, final norm, head; 7 per block
    by_variant = rows.groupby("variant")
    assert by_variant["comm_ms"].apply(lambda c: c.isna().all())["torch_ddp"]
    assert sorted(by_variant.get_group("torch_ddp")["bucket_size_mb"].unique()) == [0.001, 1.0]
    assert (by_variant.get_group("single")["comm_ms"] == 0).all()
    ours = rows[rows["variant"].isin(["naive", "flat", "overlap", "bucketed"])]
    assert (ours["comm_ms"] >= 0).all() and (ours["comm_ms"] <= ours["step_ms"]).all()
    assert (rows[rows["variant"].isin(["naive", "flat"])]["comm_ms"] > 0).all()
    buckets = by_variant.get_group("bucketed").groupby("bucket_size_mb")["num_buckets"].first()
    assert buckets[0.001] > buckets[1.0] == 1, buckets
    assert sorted(p.stem for p in traces.glob("*.json")) == sorted(labels)

    intervals, _ = read_rows(timeline)
    assert set(intervals["status"]) == {"ok"} and (intervals["end_ms"] >= intervals["start_ms"]).all()
    assert (intervals["start_ms"] >= 0).all()
    comm = intervals.groupby("variant")["communication"].sum()
    # gloo runs a collective on its worker threads: one per parameter (naive), one in all (flat), none alone.
    assert comm["single"] == 0 and comm["flat"] >= 1 and comm["naive"] >= 10
    workers = intervals[intervals["lane"] != "main thread"]
    assert workers["communication"].all() and set(workers["lane"]) <= {"thread 1", "thread 2"}


def test_ddp_timeline_of_a_cuda_trace_keeps_the_last_step_by_stream():
    """The CUDA path of the timeline on a hand-made trace: kernels of the last traced step, NCCL marked."""
    from cs336_systems.experiments.ddp_benchmark import timeline

    def event(cat: str, name: str, ts: float, dur: float, tid: int | str = 1, **args) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}

    trace = {
        "traceEvents": [
            event("user_annotation", "traced_step_0", 0, 100),
            event("kernel", "ampere_sgemm_128x64_tn", 10, 5, tid=7, stream=7),  # the earlier step: dropped
            event("user_annotation", "traced_step_1", 200, 100),
            event("cpu_op", "aten::mm", 201, 3),  # CPU operators are not kernels
            event(
                "kernel",
                "void at::native::(anonymous namespace)::vectorized<4>(int, float*)",
                210,
                20,
                7,
                stream=7,
            ),
            event(
                "kernel",
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                220,
                40,
                tid=13,
                stream=13,
            ),
            event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 265, 2, tid=7, stream=7),
            {"ph": "i", "name": "marker", "ts": 250},
        ]
    }
    rows = timeline(trace, "traced_step_1")
    assert [(r["lane"], r["name"], r["communication"]) for r in rows] == [
        ("stream 7", "at::native::vectorized", False),
        ("stream 13", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", True),
        ("stream 7", "Memcpy DtoD", False),
    ]
    assert [(r["start_ms"], r["end_ms"]) for r in rows] == [(0.01, 0.03), (0.02, 0.06), (0.065, 0.067)]
    with pytest.raises(ValueError, match="traced_step_5"):
        timeline(trace, "traced_step_5")


def test_nccl_without_enough_gpus_is_a_skipped_row_from_the_launcher(tmp_path: Path):
    from cs336_systems import launch
    from cs336_systems.distributed import gpus_available

    out, needed = tmp_path / "ddp.csv", gpus_available() + 1
    launch.main(
        [
            *f"--nproc {needed} --backend nccl --out {out} --".split(),
            "cs336_systems.experiments.ddp_benchmark",
        ]
    )
    rows, _ = read_rows(out)
    assert list(rows["status"]) == ["skipped"]
    assert list(rows["reason"]) == [f"needs {needed} GPUs, found {gpus_available()}"]


def test_ddp_benchmark_rejects_bad_arguments(tmp_path: Path):
    from cs336_systems.experiments import ddp_benchmark

    model = "--d-model 32 --d-ff 64 --num-layers 1 --num-heads 2".split()
    with pytest.raises(SystemExit):
        ddp_benchmark.main([*model, "--steps", "0", "--out", str(tmp_path / "x.csv")])
    with pytest.raises(SystemExit):  # the timeline is read from the traces
        ddp_benchmark.main(
            [*model, "--timeline-out", str(tmp_path / "t.csv"), "--out", str(tmp_path / "x.csv")]
        )
