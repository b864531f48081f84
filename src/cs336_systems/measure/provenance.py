"""Provenance: where and how a result was produced, written beside every table of results."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import torch

_REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def collect() -> dict[str, Any]:
    """Machine, software and code version of this process."""
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    # A copy of the tree sent to another machine names its commit in CS336_GIT_COMMIT: a .git there may be stale.
    commit = os.environ.get("CS336_GIT_COMMIT")
    status = None if commit else _git("status", "--porcelain", "--untracked-files=no")
    # which GPU, so which machine: two runs at one commit on two machines of one kind differ by 1-3 %
    gpu_uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "")) if cuda else ""
    return {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "device_uuid": gpu_uuid or None,
        "cpu_threads": torch.get_num_threads(),
        "git_commit": commit or _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "run": os.environ.get("CS336_RUN"),
    }


def write_rows(rows: list[dict[str, Any]] | pd.DataFrame, out: str | Path, params: dict[str, Any]) -> Path:
    """Write tidy rows to `out` (CSV) and their provenance to the JSON sidecar `out` with suffix .json.

    Both files are written to a temporary name first and renamed, so an interrupted job leaves no half-written
    result behind.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    sidecar = sidecar_path(out)
    meta = {"provenance": collect(), "params": _jsonable(params), "rows": len(frame)}
    tmp_json, tmp_csv = sidecar.with_suffix(".json.tmp"), out.with_suffix(out.suffix + ".tmp")
    tmp_json.write_text(json.dumps(meta, indent=2) + "\n")
    frame.to_csv(tmp_csv, index=False)
    tmp_json.replace(sidecar)
    tmp_csv.replace(out)
    return out


def sidecar_path(out: str | Path) -> Path:
    return Path(out).with_suffix(".json")


def read_rows(path: str | Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Read a table written by `write_rows` and its provenance sidecar."""
    path = Path(path)
    meta = json.loads(sidecar_path(path).read_text())
    return pd.read_csv(path), meta


def _jsonable(params: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(params, default=str))
