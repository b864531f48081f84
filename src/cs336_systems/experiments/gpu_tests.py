"""Tests run on the GPUs whose timings the writeup shows (the kernels', our FSDP's): one row per test with its
outcome, so that the writeup can say that the code it timed passed its tests at this commit on these GPUs.

Each `--tests` file runs whole, or only its tests that `--marker` selects, in a pytest process of its own (a kernel
test file fixes at import whether Triton runs compiled or interpreted, so two files must not share a process), its
results read from pytest's JUnit XML. One row per test: `file`, `test` (JUnit's class name :: test name),
`outcome` (passed, failed, error or skipped), `seconds` and `message` (a failure's or skip's first line), `status`
ok. Without CUDA nothing runs: one row per file, `status` skipped and its `reason`.

Example:
  python -m cs336_systems.experiments.gpu_tests \\
      --tests tests/kernels/test_flash_hopper.py tests/kernels/test_flash_compile.py \\
      --out results/gpu/gpu_tests/kernels.csv
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from cs336_systems import cli
from cs336_systems.measure.provenance import write_rows

OUTCOMES = ("passed", "failed", "error", "skipped")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, seed=False)
    p.add_argument("--tests", nargs="+", required=True, help="pytest files, each run in its own process")
    p.add_argument(
        "--marker", help="run only the tests this pytest marker expression selects (pytest -m), e.g. gpu"
    )
    p.add_argument(
        "--timeout-s", type=cli.positive_int, default=1200, help="the most one file's pytest run may take"
    )
    args = p.parse_args(argv)
    missing = [path for path in args.tests if not Path(path).is_file()]
    if missing:
        p.error(f"--tests: no such file: {', '.join(missing)}")
    return args


def junit_rows(xml_text: str, file: str) -> list[dict]:
    """One row per <testcase> of pytest's JUnit XML."""
    rows = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                lines = (found.get("message") or found.text or "").strip().splitlines()
                message = lines[0][:300] if lines else ""
                break
        rows.append(
            {
                "file": file,
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time", "nan")),
                "message": message,
            }
        )
    return rows


def run_file(path: str, timeout_s: int, marker: str | None = None) -> list[dict]:
    """pytest over one file in a process of its own (only the tests `marker` selects, if given): its tests' rows,
    or one error row saying why there are none."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", path]
        if marker:
            cmd += ["-m", marker]
        print(f"gpu_tests: {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return [
                {"file": path, "test": "", "outcome": "error", "message": f"timed out after {timeout_s} s"}
            ]
        if not xml.is_file():
            return [
                {"file": path, "test": "", "outcome": "error", "message": f"pytest exited {done.returncode}"}
            ]
        return junit_rows(xml.read_text(), path) or [
            {"file": path, "test": "", "outcome": "error", "message": "no test collected"}
        ]


def run(args: argparse.Namespace) -> list[dict]:
    if not torch.cuda.is_available():
        return [{"file": path, "status": "skipped", "reason": "needs CUDA"} for path in args.tests]
    rows = [
        {**row, "status": "ok"} for path in args.tests for row in run_file(path, args.timeout_s, args.marker)
    ]
    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    print(f"gpu_tests: {counts}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_rows(run(args), args.out, {**vars(args), "device": device})


if __name__ == "__main__":
    main()
