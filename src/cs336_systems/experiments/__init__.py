"""Experiment entry points: one CLI per deliverable, each writing tidy rows plus provenance.

`failure_reason` reads why one of them failed from what it wrote to stderr (a job's log), in one line: the pipeline
shows it for every failed job. Torch-free, so that Snakemake imports it cheaply."""

from __future__ import annotations

import re

# argparse's last line: "prog: error: message"
_ARGPARSE_ERROR = re.compile(r"^[\w.-]+: error: \S")
# What cs336_systems.parallel.distributed prints before the traceback of a rank that raised
_RANK_FAILED = re.compile(r"^\[rank (\d+)\] failed:")
# A prefix that torchrun may put before each line of a rank's output
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
# torchrun's own traceback when a rank failed: the rank's reason comes before it
_LAUNCHER_FAILED = "ChildFailedError"


def _exceptions(lines: list[str]) -> list[tuple[int, str]]:
    """(position, line) of the exception that ends each traceback (of a chain, the last one), prefixed
    `[rank N]` where cs336_systems.parallel.distributed says which rank raised it."""
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() != _TRACEBACK:
            i += 1
            continue
        rank = _RANK_FAILED.match(lines[i - 1]) if i else None
        while True:  # the frames are indented; the exception's first line is not
            i += 1
            while i < len(lines) and (not lines[i].strip() or lines[i][0].isspace()):
                i += 1
            if i == len(lines):
                break
            end = i
            after = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), len(lines))
            if after < len(lines) and lines[after].strip() in _CHAINED:  # go on to the chain's next traceback
                i = next(
                    (j for j in range(after + 1, len(lines)) if lines[j].strip() == _TRACEBACK), len(lines)
                )
            if i == end or i == len(lines):
                exception = lines[end].strip()
                found.append((end, f"[rank {rank.group(1)}] {exception}" if rank else exception))
                break
        i += 1
    return found


def failure_reason(log: str) -> str | None:
    """Why a CLI failed, in one line, from its stderr: argparse's `prog: error: ...`, or the exception line that
    ends a traceback (under the launcher the failing rank's, `[rank N] ...`, rather than torchrun's report of it),
    the last such line where there are several; else the last line written. None for an empty log."""
    lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in log.splitlines()]
    candidates = [(i, line.strip()) for i, line in enumerate(lines) if _ARGPARSE_ERROR.match(line)]
    candidates = sorted(candidates + _exceptions(lines))
    own = [line for _, line in candidates if _LAUNCHER_FAILED not in line.split(":")[0]]
    if own or candidates:
        return (own or [line for _, line in candidates])[-1]
    written = [line.strip() for line in lines if line.strip()]
    return written[-1] if written else None
