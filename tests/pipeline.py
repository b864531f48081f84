"""Helpers for tests that run the Snakemake pipeline in a throw-away copy of the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

PIPELINE_FILES = ["Snakefile", "config.yaml", "rules", "src", "profiles"]


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


def snakemake(workdir: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", *args]
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout)
