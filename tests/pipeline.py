"""Helpers for tests that run the Snakemake pipeline in a throw-away copy of the repository."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

PIPELINE_FILES = ["Snakefile", "config.yaml", "rules", "src", "profiles", "tests"]


def copy_pipeline(dest: Path) -> Path:
    """A copy of the pipeline's own files (no results, no .snakemake) under `dest`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in PIPELINE_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


# `python -m snakemake` that also prints each job it announces as one line "JOB {json}" on stderr. The rules have
# messages, so the console shows a job's message in place of its rule block (rule, wildcards, resources, threads,
# reason); the tests read those from here instead.
_RECORD_JOBS = """
import json, logging, sys
from snakemake.cli import main
from snakemake.logging import LogEvent, get_event

class RecordJobs(logging.Handler):
    def emit(self, record):
        if get_event(record) == LogEvent.JOB_INFO:
            job = {key: getattr(record, key) for key in ("rule_name", "rule_msg", "wildcards", "threads", "reason", "shellcmd")}
            job["resources"] = dict(record.resources.items())
            print("JOB " + json.dumps(job, default=str), file=sys.stderr, flush=True)

logging.getLogger().addHandler(RecordJobs())  # Snakemake's logger propagates to the root's handlers
main()
"""
SNAKEMAKE = [sys.executable, "-c", _RECORD_JOBS]


def announced_jobs(output: str) -> list[dict]:
    """The jobs a run of SNAKEMAKE announced (in a dry run: planned), in order: dicts of rule_name, rule_msg (its
    message), wildcards, threads, reason, shellcmd and resources."""
    return [json.loads(line[4:]) for line in output.splitlines() if line.startswith("JOB {")]


def snakemake(workdir: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [*SNAKEMAKE, "--cores", "2", *args]
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout)
