"""Renders report/<run>/writeup.md from the tidy results of a run: one section per deliverable, in spec order."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from cs336_systems.report.context import Context, NotRun
from cs336_systems.report.formatting import provenance_line

# (heading, module under cs336_systems.report.sections); modules that do not exist yet render a placeholder.
SECTIONS = [
    ("1.1.3 End-to-end benchmarking", "e2e"),
    ("1.1.4 Profiling (nsys_profile)", "profiling"),
    ("1.1.5 Mixed precision", "mixed_precision"),
    ("1.1.6 Memory profiling", "memory"),
    ("3.1 Autograd residuals (2026 §3.1)", "residuals"),
    ("3.2 Activation checkpointing (2026 §3.2)", "checkpointing"),
    ("1.2.1 PyTorch attention", "attention"),
    ("1.3.1 torch.compile", "torch_compile"),
    ("1.3.2–1.3.4 FlashAttention-2", "flash"),
    ("FlashAttention-2 against PyTorch's fastest attention", "flash_peers"),
    ("2.1.3 All-reduce benchmark", "allreduce"),
    ("2.2–2.3 Distributed data parallel training", "ddp"),
    ("2.4 Communication accounting", "communication_accounting"),
    ("3 Optimizer state sharding", "sharding"),
    ("7 Fully-sharded data parallel (2026 §7)", "fsdp"),
    ("8 Parallelism analysis (2026 §8)", "parallelism"),
    ("9 The leaderboard's training step (2026 §9)", "train_step"),
]


def render(run: str, results: Path, out_dir: Path) -> str:
    ctx = Context(run=run, results=results, out_dir=out_dir)
    body = []
    for heading, module in SECTIONS:
        try:
            section = importlib.import_module(f"cs336_systems.report.sections.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"cs336_systems.report.sections.{module}":
                raise
            text = "_This deliverable is not built yet._"
        else:
            try:
                text = section.render(ctx)
            except NotRun as reason:  # the section's own table did not run: its reason is the whole section
                text = str(reason)
        body.append(f"## {heading}\n\n{text.strip()}\n")
    title = [
        f"# CS336 assignment 2 (systems): writeup of run `{run}`",
        "",
        "Every number, table and figure below was produced by `snakemake` from the tidy results in "
        f"`results/{run}/`; sentences that state a finding are computed from those results.",
        "",
        provenance_line(ctx.provenances),
        "",
    ]
    return "\n".join(title) + "\n" + "\n".join(body)


def relink(markdown: str, prefix: str) -> str:
    """Rewrite figure links for a copy of the writeup that lives `prefix` levels above report/<run>/."""
    return re.sub(r"\]\(figures/", f"]({prefix}/figures/", markdown)
