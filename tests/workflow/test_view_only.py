"""The published GPU run, seen from this machine without GPUs: newer code never makes its results stale here (so
re-rendering its writeup cannot replace real measurements by 'needs CUDA' rows), while the writeup still follows
the report code."""

from __future__ import annotations

import os
import shutil
import time

from ..conftest import REPO
from ..pipeline import announced_jobs, copy_pipeline, snakemake
from .test_smoke_pipeline import job_counts


def job_reasons(output: str) -> dict[str, str]:
    """Rule name -> the reason a `snakemake -n` run gives for its job(s)."""
    return {job["rule_name"]: job["reason"] for job in announced_jobs(output)}


def set_mtime(paths, when: float) -> None:
    for path in paths:
        os.utime(path, (when, when))


def test_gpu_results_are_kept_where_they_cannot_be_remade(tmp_path):
    work = copy_pipeline(tmp_path)
    for folder in ("results/gpu", "report/gpu"):
        shutil.copytree(REPO / folder, work / folder)
    (work / "report/writeup.md").write_text("the copy of the last writeup rendered\n")
    now = time.time()
    set_mtime((p for p in work.rglob("*") if p.is_file()), now - 100)
    set_mtime(
        [work / "src/cs336_systems/measure/timing.py", work / "src/cs336_systems/model/transformer.py"], now
    )

    result = snakemake(work, "-n", "report/gpu/writeup.md", "--config", "run=gpu")
    assert result.returncode == 0, result.stderr[-3000:]
    # Only results not published yet run (they record that they need CUDA), and the writeup after them; nothing
    # that exists is stale.
    reasons = job_reasons(result.stdout + result.stderr)
    assert set(reasons) == set(job_counts(result.stdout + result.stderr)), result.stdout[-3000:]
    for rule, reason in reasons.items():
        allowed = "Input files updated by another job" if rule == "writeup" else "Missing output files"
        assert reason.startswith(allowed) and ";" not in reason, (rule, reason)

    set_mtime([work / "src/cs336_systems/report/context.py"], now)
    result = snakemake(work, "-n", "report/gpu/writeup.md", "--config", "run=gpu")
    reasons = job_reasons(result.stdout + result.stderr)
    assert "Updated input files: src/cs336_systems/report/context.py" in reasons["writeup"], reasons
