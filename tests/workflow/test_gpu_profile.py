"""profiles/gpu and rules/pin_gpus.sh, on a CPU machine: the plan a GPU box would run, and how concurrent jobs
share the GPUs (stand-in GPU ids: pin_gpus only reads CUDA_VISIBLE_DEVICES and takes locks)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

from ..conftest import REPO
from ..pipeline import SNAKEMAKE, announced_jobs, copy_pipeline


def pinned(gpus_needed: int, visible: str, **env: str) -> subprocess.Popen:
    """A job that pins its GPUs, prints CUDA_VISIBLE_DEVICES and holds them until its stdin closes."""
    script = (
        f'source {REPO}/rules/pin_gpus.sh; pin_gpus {gpus_needed}; echo "${{CUDA_VISIBLE_DEVICES:-}}"; cat'
    )
    return subprocess.Popen(
        ["bash", "-c", f"set -euo pipefail; {script}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": visible, **env},
    )


def test_pin_gpus_gives_each_job_gpus_no_other_job_holds():
    ids = [f"cs336-test-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    visible = ",".join(ids)
    jobs = []
    try:
        first = pinned(1, visible)
        jobs.append(first)
        assert first.stdout.readline().strip() == ids[0]
        second = pinned(2, visible)
        jobs.append(second)
        assert second.stdout.readline().strip() == f"{ids[1]},{ids[2]}"
        # No GPU left: the job keeps what it was given rather than wait (a lock may outlive its job).
        third = pinned(1, visible)
        jobs.append(third)
        assert third.stdout.readline().strip() == visible
        # A job that needs no GPU, or runs under SLURM, is left alone.
        for job in (pinned(0, visible), pinned(1, visible, SLURM_JOB_ID="7")):
            jobs.append(job)
            assert job.stdout.readline().strip() == visible
        first.stdin.close()
        first.wait(timeout=10)
        fourth = pinned(1, visible)  # the first job's GPU is free again
        jobs.append(fourth)
        assert fourth.stdout.readline().strip() == ids[0]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.stdin.close()
                job.wait(timeout=10)
        for gpu in ids:
            Path(f"/tmp/cs336-gpu-{gpu}.lock").unlink(missing_ok=True)


def test_gpu_profile_plans_every_gpu_job_with_the_gpus_it_needs(tmp_path):
    workdir = copy_pipeline(tmp_path)
    cmd = [*SNAKEMAKE, "--profile", "profiles/gpu", "-n", "report/writeup.md"]
    dry = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    jobs = {job["rule_name"]: job for job in announced_jobs(dry.stderr)}
    gpu = {rule: job["resources"]["gpu"] for rule, job in jobs.items() if rule != "all"}
    # The profile's gpu=1 caps each job's share of the box: one GPU job at a time.
    assert gpu["e2e_benchmark"] == gpu["flash_benchmark"] == gpu["naive_ddp_check"] == 1
    assert gpu["communication_accounting"] == gpu["writeup"] == gpu["mixed_precision_accumulation"] == 0
    # ...but an NCCL job still pins all the GPUs it needs, and a single-GPU job one.
    assert (
        "pin_gpus 2; python -m cs336_systems.parallel.launch --nproc 2 --backend nccl"
        in jobs["naive_ddp_check"]["shellcmd"]
    )
    assert (
        "pin_gpus 1; python -m cs336_systems.experiments.e2e_benchmark" in jobs["e2e_benchmark"]["shellcmd"]
    )
