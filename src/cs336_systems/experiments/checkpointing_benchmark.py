"""Activation checkpointing benchmark (2026 handout §3.2): memory and time of a train step per policy.

For each depth (`--depths`, default: the size's own num_layers), autocast setting and policy (`--policies`,
default: none, every:1 .. every:N, nested, selective): a fresh seeded model with that `checkpoint`, `--warmup`
train steps (AdamW's state then exists), one train step measured for memory (CUDA), `--steps` timed train steps,
and one forward counted for the bytes it saves for backward. Rows (one per cell and one per depth and autocast):
  record=cell   policy, status (ok, OOM, or skipped after a smaller every:K ran out of memory with
                --skip-after-oom), saved_bytes (one forward, each storage once; any device), median_ms,
                base_mib (weights + AdamW state), forward_backward_peak_mib (peak before the optimizer step),
                step_peak_mib, activation_peak_mib (= forward_backward_peak_mib - base_mib); off CUDA the memory
                columns are empty and memory_reason says why
  record=block  one block's residual_bytes (R, measured), checkpoint_bytes (c) and grad_bytes_per_block (w): the
                inputs of the residual model in cs336_systems.model.checkpointing
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from cs336_systems import cli
from cs336_systems.bench.checkpoint_memory import block_sizes, train_step_memory
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import or_oom, resolve_device, rows_or_oom, summarize, time_steps
from cs336_systems.model import checkpointing
from cs336_systems.model.sizes import MODEL_SIZES
from cs336_systems.model.transformer import ATTENTION, ModelConfig
from cs336_systems.training import workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument(
        "--size", choices=list(MODEL_SIZES), required=True, help="model size (cs336_systems.model.sizes)"
    )
    p.add_argument("--batch-size", type=cli.positive_int, default=4, help="sequences per batch")
    p.add_argument("--context-length", type=cli.positive_int, required=True, help="tokens per sequence")
    p.add_argument(
        "--attention", choices=sorted(ATTENTION), default="naive", help="the attention's implementation"
    )
    p.add_argument(
        "--autocast",
        nargs="+",
        choices=sorted(workload.AUTOCAST),
        default=["none", "bf16"],
        help="torch.autocast dtypes (none: float32) to measure each policy in",
    )
    p.add_argument("--policies", nargs="+", help="default: none, every:1 .. every:N, nested, selective")
    p.add_argument(
        "--depths", type=cli.positive_int, nargs="+", help="num_layers overrides (default: the size's)"
    )
    p.add_argument("--warmup", type=cli.positive_int, default=1, help="train steps before the measured ones")
    p.add_argument("--steps", type=cli.positive_int, default=3, help="timed train steps")
    p.add_argument(
        "--skip-after-oom", action="store_true", help="skip every:K once a smaller K ran out of memory"
    )
    cli.add_device(p)
    args = p.parse_args(argv)
    args.depths = args.depths or [MODEL_SIZES[args.size]["num_layers"]]
    for depth, policy in itertools.product(args.depths, args.policies or []):
        try:
            checkpointing.parse(policy, depth)
        except ValueError as error:
            p.error(f"--policies at depth {depth}: {error}")
    return args


def config(args: argparse.Namespace, depth: int, policy: str = "none") -> ModelConfig:
    """The model of --size with `depth` blocks (the depth study) and checkpoint `policy`."""
    return ModelConfig.from_name(
        args.size,
        num_layers=depth,
        context_length=args.context_length,
        attention=args.attention,
        checkpoint=policy,
    )


def cell_row(args, cfg: ModelConfig, autocast: str, device: torch.device, skip_reason: str | None) -> dict:
    base = {"record": "cell", "num_layers": cfg.num_layers, "autocast": autocast, "policy": cfg.checkpoint}
    if skip_reason:
        return {**base, "status": "skipped", "reason": skip_reason}

    def measure() -> list[dict]:
        training = workload.training_step(
            cfg, args.batch_size, device, workload.AUTOCAST[autocast], seed=args.seed
        )
        time_steps(training.train_step, args.warmup, 0, device)
        if device.type == "cuda":
            memory = train_step_memory(training, device)
        else:
            memory = {"memory_reason": "needs CUDA (torch.cuda.max_memory_allocated)"}
        median_ms = summarize(time_steps(training.train_step, 0, args.steps, device))["median_ms"]
        saved = checkpointing.saved_bytes(training.loss)
        return [{**base, "status": "ok", "saved_bytes": saved, "median_ms": median_ms, **memory}]

    cell = f"layers={cfg.num_layers} autocast={autocast} {cfg.checkpoint}"
    [row] = rows_or_oom("checkpointing", cell, measure, lambda: [{**base, "status": "OOM"}])
    return row


def run(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    rows = []
    for depth, autocast in itertools.product(args.depths, args.autocast):
        dtype = workload.AUTOCAST[autocast]
        sizes = or_oom(functools.partial(block_sizes, config(args, depth), args.batch_size, device, dtype))
        block = sizes if isinstance(sizes, dict) else {"status": "OOM"}
        rows.append({"record": "block", "num_layers": depth, "autocast": autocast, "status": "ok", **block})
        smallest_oom = None
        for policy in args.policies or checkpointing.sweep(depth):
            kind, k = checkpointing.parse(policy, depth)
            skip = f"every:{smallest_oom} ran out of memory" if kind == "every" and smallest_oom else None
            row = cell_row(args, config(args, depth, policy), autocast, device, skip)
            if kind == "every" and row["status"] == "OOM" and args.skip_after_oom:
                smallest_oom = smallest_oom or k
            rows.append(row)
    common = {"size": args.size, "batch_size": args.batch_size, "context_length": args.context_length}
    common |= {"attention": args.attention, "warmup": args.warmup, "steps": args.steps}
    return [{**common, **row} for row in rows]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, cli.params(args))


if __name__ == "__main__":
    main()
