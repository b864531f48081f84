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


def test_allreduce_benchmark_skips_without_the_launcher(tmp_path: Path):
    from cs336_systems.experiments import allreduce_benchmark

    out = tmp_path / "skipped.csv"
    allreduce_benchmark.main(
        [*"--backend nccl --world-size 4 --sizes-mb 1 10".split(), "--skip-reason", "needs 4 GPUs, found 0"]
        + ["--out", str(out)]
    )
    rows, _ = read_rows(out)
    assert list(rows["status"]) == ["skipped"] * 2 and set(rows["reason"]) == {"needs 4 GPUs, found 0"}
    assert list(rows["world_size"]) == [4, 4] and list(rows["size_mb"]) == [1, 10]
    with pytest.raises(SystemExit):
        allreduce_benchmark.main(["--backend", "gloo", "--sizes-mb", "-1", "--out", str(out)])


def test_naive_ddp_check_matches_for_every_wrapper(tmp_path: Path):
    out = tmp_path / "check.csv"
    result = launch(2, "-m", "cs336_systems.experiments.naive_ddp_check", "--steps", "3", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    rows, _ = read_rows(out)
    assert list(rows["wrapper"]) == ["naive", "flat", "overlap", "bucketed"]
    assert rows["match"].all() and (rows["max_abs_diff"] < 1e-5).all(), rows


def test_ddp_benchmark_rows_and_traces(tmp_path: Path):
    out, traces = tmp_path / "ddp.csv", tmp_path / "traces"
    result = launch(
        2,
        *"-m cs336_systems.experiments.ddp_benchmark --d-model 32 --d-ff 64 --num-layers 1 --num-heads 2".split(),
        *"--vocab-size 100 --batch-size 2 --context-length 16 --bucket-sizes-mb 0.001 1".split(),
        *"--warmup 1 --steps 2 --trace-steps 1".split(),
        *["--trace-dir", str(traces), "--out", str(out)],
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows, _ = read_rows(out)
    labels = ["naive", "flat", "overlap", "bucketed_0.001mb", "bucketed_1mb", "torch_ddp", "single"]
    assert len(rows) == len(labels) * 2 and set(rows["status"]) == {"ok"} and (rows["step_ms"] > 0).all()
    by_variant = rows.groupby("variant")
    assert by_variant["comm_ms"].apply(lambda c: c.isna().all())["torch_ddp"]
    assert (by_variant.get_group("single")["comm_ms"] == 0).all()
    ours = rows[rows["variant"].isin(["naive", "flat", "overlap", "bucketed"])]
    assert (ours["comm_ms"] >= 0).all() and (ours["comm_ms"] <= ours["step_ms"]).all()
    assert (rows[rows["variant"].isin(["naive", "flat"])]["comm_ms"] > 0).all()
    buckets = by_variant.get_group("bucketed").groupby("bucket_size_mb")["num_buckets"].first()
    assert buckets[0.001] > buckets[1.0] == 1, buckets
    assert sorted(p.stem for p in traces.glob("*.json")) == sorted(labels)


def test_ddp_benchmark_skips_without_the_launcher(tmp_path: Path):
    from cs336_systems.experiments import ddp_benchmark

    out = tmp_path / "skipped.csv"
    model = (
        "--d-model 32 --d-ff 64 --num-layers 1 --num-heads 2 --variants naive bucketed --bucket-sizes-mb 1 10"
    )
    ddp_benchmark.main([*model.split(), "--skip-reason", "needs 2 GPUs, found 1", "--out", str(out)])
    rows, _ = read_rows(out)
    assert list(rows["variant"]) == ["naive", "bucketed", "bucketed"] and set(rows["status"]) == {"skipped"}
    assert rows["bucket_size_mb"].isna()[0] and list(rows["bucket_size_mb"][1:]) == [1, 10]
    with pytest.raises(SystemExit):
        ddp_benchmark.main([*model.split(), "--steps", "0", "--out", str(out)])
