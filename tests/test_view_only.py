"""The published GPU run, seen from this machine without GPUs: newer code never makes its results stale here (so
re-rendering its writeup cannot replace real measurements by 'needs CUDA' rows), while the writeup still follows
the report code."""

from __future__ import annotations

import os
import shutil
import time

from .conftest import REPO
from .pipeline import copy_pipeline, snakemake
from .test_smoke_pipeline import job_counts


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
    set_mtime([work / "src/cs336_systems/benchmarking.py", work / "src/cs336_systems/model.py"], now)

    result = snakemake(work, "-n", "report/gpu/writeup.md", "--config", "run=gpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert job_counts(result.stdout + result.stderr) == {}, result.stdout[-3000:]

    set_mtime([work / "src/cs336_systems/report/context.py"], now)
    result = snakemake(work, "-n", "report/gpu/writeup.md", "--config", "run=gpu")
    assert job_counts(result.stdout + result.stderr) == {"writeup": 1}, result.stdout[-3000:]
