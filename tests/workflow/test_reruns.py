"""Stale-only reruns: after a complete smoke run, a change makes Snakemake rerun exactly the jobs it affects,
and an interrupted run resumes without leaving a half-written result behind. Works on a private copy of the
smoke run."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from ..pipeline import snakemake
from .test_smoke_pipeline import SMOKE_TIMEOUT_S, copy_of_smoke_run, job_counts

# Under pytest-xdist every test that starts from the smoke run goes to one worker, which runs the smoke run once;
# the first to ask for it builds it in its setup, which on a loaded machine may take longer than pytest-timeout's
# default 600 s.
pytestmark = [pytest.mark.xdist_group("smoke_run"), pytest.mark.timeout(SMOKE_TIMEOUT_S)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_of_smoke_run(tmp_path_factory, "reruns")


def dry_run(workdir: Path) -> dict[str, int]:
    result = snakemake(workdir, "-n", "report/writeup.md", "--config", "run=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    return job_counts(result.stdout + result.stderr)


def test_smoke_run_is_up_to_date(workdir):
    assert dry_run(workdir) == {}


# (config keys, new value from the old, jobs that must rerun): one deliverable's parameter each.
CONFIG_CHANGES = [
    (["runs", "cpu", "attention", "passes"], lambda v: v + 1, {"attention_benchmark": 1}),
    (["runs", "cpu", "e2e", "warmup_study", "steps"], lambda v: v + 1, {"e2e_warmup_study": 3}),
    (["runs", "cpu", "flash", "rep_ms"], lambda v: v + 10, {"flash_benchmark": 1}),
    (["runs", "cpu", "flash_host", "calls"], lambda v: v + 1, {"flash_host": 1}),
    (["runs", "cpu", "allreduce", "iters"], lambda v: v + 1, {"allreduce_benchmark": 2}),
    (["runs", "cpu", "ddp", "bucket_sizes_mb"], lambda v: v + [10], {"ddp_benchmark": 1}),
    (["runs", "cpu", "ddp", "steps"], lambda v: v + 1, {"ddp_benchmark": 1}),
    (["runs", "cpu", "sharding", "steps"], lambda v: v + 1, {"sharding_benchmark": 1}),
    (["runs", "cpu", "fsdp", "steps"], lambda v: v + 1, {"fsdp_benchmark": 2}),  # one job per world size
    (["communication_accounting", "batch_size"], lambda v: v + 1, {"communication_accounting": 1}),
]


@pytest.mark.parametrize(
    ("keys", "change", "expected"), CONFIG_CHANGES, ids=[".".join(k) for k, _, _ in CONFIG_CHANGES]
)
def test_changing_one_parameter_reruns_its_deliverable_and_the_writeup(workdir, keys, change, expected):
    path = workdir / "config.yaml"
    original = path.read_text()
    config = yaml.safe_load(original)
    parent = config
    for key in keys[:-1]:
        parent = parent[key]
    parent[keys[-1]] = change(parent[keys[-1]])
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        jobs = dry_run(workdir)
    finally:
        path.write_text(original)
    assert jobs == {**expected, "writeup": 1}


# (source file under src/cs336_systems, jobs that must rerun): editing one experiment's code, or shared code.
CODE_EDITS = [
    ("experiments/allreduce_benchmark.py", {"allreduce_benchmark": 2}),
    ("experiments/memory_profile.py", {"memory_profile": 1}),
    ("experiments/communication_accounting_analysis.py", {"communication_accounting": 1}),
    # the residuals study (2026 §3.1) and the leaderboard's training step (§9) also run our FlashAttention
    (
        "kernels/flash_triton.py",
        {
            "flash_benchmark": 1,
            "flash_leaderboard": 1,
            "flash_peers": 2,
            "flash_goals": 1,
            "flash_host": 1,
            "flash_ncu": 1,
            "gpu_tests": 1,
            "residuals": 1,
            "train_step": 3,
            "train_step_components": 1,
            "train_step_kernels": 1,
            "train_step_sharded": 1,
            "train_step_check": 1,
            "train_step_cold": 1,
        },
    ),
    ("measure/ncu.py", {"flash_ncu": 1}),
    (
        "experiments/train_step_benchmark.py",
        {
            "train_step": 3,
            "train_step_components": 1,
            "train_step_kernels": 1,
            "train_step_sharded": 1,
            "train_step_cold": 1,
        },
    ),
    ("experiments/train_step_check.py", {"train_step_check": 1}),
    ("report/sections/e2e.py", {}),
]


@pytest.mark.parametrize(("module", "expected"), CODE_EDITS, ids=[m for m, _ in CODE_EDITS])
def test_editing_one_experiments_code_reruns_its_deliverable_and_the_writeup(workdir, module, expected):
    path = workdir / "src/cs336_systems" / module
    original, stat = path.read_bytes(), path.stat()
    path.write_bytes(original + b"\n# an edit\n")
    try:
        jobs = dry_run(workdir)
    finally:
        path.write_bytes(original)
        os.utime(
            path, ns=(stat.st_atime_ns, stat.st_mtime_ns)
        )  # and as old as before, so nothing stays stale
    assert jobs == {**expected, "writeup": 1}


# Snakemake in a process whose torch sees two GPUs: the DAG as it is planned on a machine that has them.
ON_TWO_GPUS = (
    "import sys, torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 2; "
    "from snakemake.cli import main; main()"
)


def test_a_job_skipped_for_lack_of_gpus_reruns_where_they_exist(workdir):
    """The GPU preset's 2-rank NCCL check on this CPU machine records why it did not run; nothing is stale here,
    and on a machine with the GPUs the same command reruns it (its gpus_ok param changes), no --forceall."""
    target = "results/gpu/naive_ddp/check.csv"
    first = snakemake(workdir, target, "--config", "run=gpu")
    assert first.returncode == 0, first.stderr[-3000:]
    rows = list(csv.DictReader((workdir / target).open()))
    assert [(row["status"], row["reason"]) for row in rows] == [("skipped", "needs 2 GPUs, found 0")]
    again = snakemake(workdir, "-n", target, "--config", "run=gpu")
    assert job_counts(again.stdout + again.stderr) == {}, again.stderr[-3000:]

    cmd = [sys.executable, "-c", ON_TWO_GPUS, "--cores", "2", "-n", target, "--config", "run=gpu"]
    elsewhere = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300)
    assert elsewhere.returncode == 0, elsewhere.stderr[-3000:]
    assert job_counts(elsewhere.stdout + elsewhere.stderr) == {"naive_ddp_check": 1}
    assert "Params have changed" in elsewhere.stdout + elsewhere.stderr


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_interrupted_run_leaves_no_half_written_result_and_resumes(workdir, stop):
    """A parameter of e2e_benchmark changes and the run starts; Ctrl-C (SIGINT to Snakemake's process group), or
    SIGKILL as from the OOM killer after a second run in the same directory was refused, stops it once
    e2e_benchmark's first cell has started. The next run finishes the job: after a kill, once `--unlock` has
    cleared the lock Snakemake could not release, and without --rerun-incomplete (profiles/default sets it)."""
    path = workdir / "config.yaml"
    config = yaml.safe_load(path.read_text())
    e2e = config["runs"]["cpu"]["e2e"]
    # Reversed (only e2e_benchmark reads these), so that its params change in each case.
    contexts = e2e["context_lengths"] = e2e["context_lengths"][::-1]
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    last_cell = f"ctx={contexts[-1]} train_step"  # the CLI logs "[e2e] <size> ctx=<n> <mode> ..." per cell
    csv, sidecar = workdir / "results/cpu/e2e/tiny.csv", workdir / "results/cpu/e2e/tiny.json"
    log = workdir / "results/cpu/logs/e2e/tiny.log"
    log.unlink()

    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "report/writeup.md", "--config", "run=cpu"]
    with open(workdir / "interrupted.log", "w") as out:
        # SIGINT at its default in Snakemake, so that Ctrl-C stops it even where pytest runs with SIGINT ignored
        # (started with nohup or `&`), which children would inherit.
        run = subprocess.Popen(
            cmd,
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 120
            while not (log.exists() and "[e2e]" in log.read_text()):
                assert run.poll() is None and time.monotonic() < deadline, "e2e_benchmark never started"
                time.sleep(0.05)
            # Snakemake and its job frozen as soon as the first cell started, so that the signal lands mid-job
            # however busy the machine is: a stopped process takes it as it continues, before another step.
            frozen = [run.pid, *(child.pid for child in psutil.Process(run.pid).children(recursive=True))]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            try:
                if stop == signal.SIGKILL:
                    # The lock held while a second run tries (however slowly); checked once, in one of the cases.
                    second = snakemake(workdir, "report/writeup.md", "--config", "run=cpu")
                    refused = second.returncode != 0 and "cannot be locked" in second.stderr
                    assert refused, second.stderr[-3000:]
                    assert run.poll() is None, "the second run disturbed the first"
                os.killpg(run.pid, stop)
            finally:
                for pid in frozen:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            # Not asserted: its exit status. On a loaded machine Snakemake has exited 0 on SIGINT with the job cut
            # short; what matters is checked below (nothing half-written, the job still to do, then done).
            run.wait(timeout=60)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    interrupted = (workdir / "interrupted.log").read_text()
    assert job_counts(interrupted) == {"e2e_benchmark": 1, "writeup": 1}, interrupted[-3000:]
    assert last_cell not in log.read_text(), (
        "the job finished before it was interrupted; the job's log ends:\n"
        + log.read_text()[-2000:]
        + "\nSnakemake's output ends:\n"
        + interrupted[-2000:]
    )
    # After Ctrl-C Snakemake removed the job's output; a killed job wrote none either, not even a temporary
    # file (write_rows renames complete files into place), and the result from before the change was removed
    # when the job started.
    assert not csv.exists() and not sidecar.exists()
    assert not list((workdir / "results").rglob("*.tmp")), "a half-written result was left behind"

    # The job alone: the writeup that reads its result is no part of the interrupt.
    target = "results/cpu/e2e/tiny.csv"
    resumed = snakemake(workdir, target, "--config", "run=cpu")
    if stop == signal.SIGKILL:
        assert resumed.returncode != 0 and "--unlock" in resumed.stderr, resumed.stderr[-3000:]
        assert snakemake(workdir, "--unlock", "--config", "run=cpu").returncode == 0
        resumed = snakemake(workdir, target, "--config", "run=cpu")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The job was still to do, and now it is done: of the whole run only the writeup is left.
    assert job_counts(resumed.stdout + resumed.stderr) == {"e2e_benchmark": 1}, resumed.stderr[-3000:]
    assert last_cell in log.read_text() and csv.exists() and sidecar.exists()
    assert dry_run(workdir) == {"writeup": 1}
