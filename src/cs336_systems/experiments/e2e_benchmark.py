"""End-to-end benchmark of the Transformer LM (spec §1.1.3, reused by §1.1.5 c and §1.3.1 b).

For each context length and mode, build the model, run `--warmup` untimed steps and `--steps` timed steps,
synchronising after each, and write one row per timed step (or one `OOM` row for a cell that does not fit).
The first warm-up step is timed on its own (`first_step_ms` on every row of the cell): it holds the one-off
costs, torch.compile's compilation above all.
"""

from __future__ import annotations

import argparse

import torch

from cs336_systems import cli
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import resolve_device, rows_or_oom, time_steps
from cs336_systems.model.transformer import ModelConfig
from cs336_systems.training import workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    cli.add_step_sweep_args(p, warmup=5, steps=10, measured="timed")
    p.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    return p.parse_args(argv)


def cell_rows(args: argparse.Namespace, cfg: ModelConfig, mode: str, device: torch.device) -> list[dict]:
    """One context length and mode: a row per timed step, or one `OOM` row."""
    base = {
        "size": args.size,
        "context_length": cfg.context_length,
        "batch_size": args.batch_size,
        "mode": mode,
        "warmup": args.warmup,
        "autocast": args.autocast,
        "compile": args.compile,
        "attention": args.attention,
    }

    def measure() -> list[dict]:
        autocast = workload.AUTOCAST[args.autocast]
        training = workload.training_step(cfg, args.batch_size, device, autocast, args.compile, args.seed)
        step = training.mode(mode)
        # With no warm-up, the first step is the first timed one (the warm-up study wants exactly that).
        first_ms = time_steps(step, 0, 1, device)[0] * 1e3 if args.warmup else None
        times = time_steps(step, max(args.warmup - 1, 0), args.steps, device)
        return [
            {**base, "first_step_ms": first_ms, "step": i, "time_ms": t * 1e3, "status": "ok"}
            for i, t in enumerate(times)
        ]

    oom = [{**base, "step": None, "time_ms": None, "status": "OOM"}]
    return rows_or_oom("e2e", f"{args.size} ctx={cfg.context_length} {mode}", measure, lambda: oom)


def run(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    return [
        row
        for context_length in args.context_lengths
        for mode in args.modes
        for row in cell_rows(args, cli.model_config(args, context_length), mode, device)
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, cli.params(args))


if __name__ == "__main__":
    main()
