"""DDP wrappers and distributed setup, on CPU/gloo through the real launcher (torch.distributed.run).

Each launch runs every case of tests/workers/ddp_worker.py, which asserts on every rank; a failing rank ends the job
with a non-zero status and its message, which these tests show.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cs336_systems.measure.provenance import read_rows

WORKER = Path(__file__).parents[1].joinpath("workers", "ddp_worker.py")


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


def test_allreduce_benchmark_rejects_bad_sizes(tmp_path: Path, capsys: pytest.CaptureFixture):
    from cs336_systems.experiments import allreduce_benchmark

    with pytest.raises(SystemExit):
        allreduce_benchmark.main(["--backend", "gloo", "--sizes-mb", "-1", "--out", str(tmp_path / "x.csv")])
    assert "argument --sizes-mb: must be > 0, got -1" in capsys.readouterr().err


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
        *"-m cs336_systems.experiments.ddp_benchmark --size tiny --batch-size 2 --context-length 16".split(),
        *"--bucket-sizes-mb 0.001 100 --warmup 1 --steps 2 --trace-steps 2".split(),
        *["--trace-dir", str(traces), "--timeline-out", str(timeline), "--out", str(out)],
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows, _ = read_rows(out)
    labels = ["naive", "flat", "overlap", "bucketed_0.001mb", "bucketed_100mb"]
    labels += ["torch_ddp_0.001mb", "torch_ddp_100mb", "single"]
    assert len(rows) == len(labels) * 2 and set(rows["status"]) == {"ok"} and (rows["step_ms"] > 0).all()
    assert list(rows.columns) == [
        "variant", "bucket_size_mb", "size", "d_model", "num_layers", "param_bytes", "num_tensors",
        "batch_size_per_rank", "context_length", "world_size", "backend", "device", "warmup", "reason",
        "step", "step_ms", "comm_ms", "num_buckets", "status",
    ]  # fmt: skip
    # tiny: d_model 64, d_ff 256, 2 layers, vocab 10,000. Embedding + output 2*10000*64, per layer attention
    # 4*64*64, SwiGLU 3*64*256 and two RMSNorms 2*64, a final RMSNorm 64; fp32.
    assert (
        rows["param_bytes"] == 4 * (2 * 10000 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64)
    ).all()
    assert (rows["num_tensors"] == 3 + 2 * 7).all()  # embedding, final norm, head; 7 per block
    assert set(rows["size"]) == {"tiny"} and set(rows["d_model"]) == {64} and set(rows["num_layers"]) == {2}
    by_variant = rows.groupby("variant")
    assert by_variant["comm_ms"].apply(lambda c: c.isna().all())["torch_ddp"]
    assert sorted(by_variant.get_group("torch_ddp")["bucket_size_mb"].unique()) == [0.001, 100.0]
    assert (by_variant.get_group("single")["comm_ms"] == 0).all()
    ours = rows[rows["variant"].isin(["naive", "flat", "overlap", "bucketed"])]
    assert (ours["comm_ms"] >= 0).all() and (ours["comm_ms"] <= ours["step_ms"]).all()
    assert (rows[rows["variant"].isin(["naive", "flat"])]["comm_ms"] > 0).all()
    buckets = by_variant.get_group("bucketed").groupby("bucket_size_mb")["num_buckets"].first()
    assert buckets[0.001] > buckets[100.0] == 1, buckets
    assert sorted(p.stem for p in traces.glob("*.json")) == sorted(labels)

    intervals, _ = read_rows(timeline)
    assert set(intervals["status"]) == {"ok"} and (intervals["end_ms"] >= intervals["start_ms"]).all()
    assert (intervals["start_ms"] >= 0).all()
    comm = intervals.groupby("variant")["communication"].sum()
    # gloo runs a collective on its worker threads: one per parameter (naive), one in all (flat), none alone.
    assert comm["single"] == 0 and comm["flat"] >= 1 and comm["naive"] >= 17
    workers = intervals[intervals["lane"] != "main thread"]
    assert workers["communication"].all() and set(workers["lane"]) <= {"thread 1", "thread 2"}


def test_nccl_without_enough_gpus_is_a_skipped_row_from_the_launcher(tmp_path: Path):
    from cs336_systems.parallel import launch
    from cs336_systems.parallel.distributed import gpus_available

    out, timeline, needed = tmp_path / "ddp.csv", tmp_path / "timeline.csv", gpus_available() + 1
    launch.main(
        [
            *f"--nproc {needed} --backend nccl --out {out} --also {timeline} --".split(),
            "cs336_systems.experiments.ddp_benchmark",
        ]
    )
    for table in (out, timeline):  # --also: the experiment's other output says the same
        rows, meta = read_rows(table)
        assert list(rows["status"]) == ["skipped"]
        assert list(rows["reason"]) == [f"needs {needed} GPUs, found {gpus_available()}"]
        assert meta["params"]["module"] == "cs336_systems.experiments.ddp_benchmark"


def test_ddp_benchmark_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture):
    from cs336_systems.experiments import ddp_benchmark

    model = "--size tiny".split()
    with pytest.raises(SystemExit):
        ddp_benchmark.main([*model, "--steps", "0", "--out", str(tmp_path / "x.csv")])
    assert "argument --steps: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ddp_benchmark.main([*model, "--bucket-sizes-mb", "1", "0", "--out", str(tmp_path / "x.csv")])
    assert "argument --bucket-sizes-mb: must be > 0, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the timeline is read from the traces
        ddp_benchmark.main(
            [*model, "--timeline-out", str(tmp_path / "t.csv"), "--out", str(tmp_path / "x.csv")]
        )
    assert "--timeline-out needs --trace-dir" in capsys.readouterr().err
