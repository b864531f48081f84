"""Test modules whose kernels must run in Triton's interpreter set TRITON_INTERPRET=1 before importing triton; where
another module imported triton first (compiled), they rerun themselves in a fresh process instead."""

from __future__ import annotations

import os
import subprocess
import sys


def triton_imported_compiled() -> bool:
    """Whether an earlier test module imported triton without the interpreter: its choice is fixed for this
    process, so a module that needs the interpreter must run its kernel tests in a fresh process."""
    return "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"


def assert_passes_in_fresh_process(test_file: str) -> None:
    """pytest over `test_file` (all but its fresh-process test) in a new process with TRITON_INTERPRET=1."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            test_file,
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "not fresh_process",
        ],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
