"""Memory profile of the Transformer LM with CUDA memory snapshots (spec §1.1.6 memory_profiling a-e).

For each context length, mode (forward, train_step) and autocast setting: build the model, run `--warmup`
untimed steps (so a train step's AdamW state already exists), then record `--steps` steps with
`torch.cuda.memory._record_memory_history(max_entries=1_000_000)` and dump the snapshot. Outputs:
  --out              rows `peak` (peak allocated/reserved memory of the recorded steps, b and c) and
                     `residual_activation` (batch x context x d_model x 4 bytes in MiB, from the flags, d)
  --snapshot-dir     memory_<size>_<ctx>_<mode>_<autocast>.pickle (open with pytorch.org/memory_viz) and
                     a PNG "active memory timeline" of each, rebuilt from the snapshot's alloc/free events (a)
  --allocations-out  the `--top` largest allocations of each forward snapshot, with their size and the first
                     frames of the Python stack that made them (e)
Without CUDA the peak rows have status "skipped" and reason "needs CUDA"; the residual rows are still written.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from cs336_systems import cli
from cs336_systems.accounting.units import MIB
from cs336_systems.measure import cuda_memory
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import resolve_device, rows_or_oom, time_steps
from cs336_systems.model.transformer import ModelConfig
from cs336_systems.training import workload

MODES = ("forward", "train_step")
LARGEST = "largest_allocation"  # the record of the --allocations-out rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    cli.add_model_args(p)
    cli.add_device(p)
    p.add_argument(
        "--context-lengths", type=cli.positive_int, nargs="+", required=True, help="tokens per sequence"
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what a recorded step runs")
    p.add_argument(
        "--autocast",
        nargs="+",
        choices=sorted(workload.AUTOCAST),
        default=["none", "bf16"],
        help="torch.autocast dtypes (none: float32)",
    )
    p.add_argument("--warmup", type=cli.nonnegative_int, default=1, help="steps before the recorded ones")
    p.add_argument("--steps", type=cli.positive_int, default=1, help="recorded steps")
    p.add_argument("--top", type=cli.positive_int, default=20, help="allocations listed per snapshot")
    p.add_argument("--snapshot-dir", required=True, help="folder for the snapshot pickles and timeline PNGs")
    p.add_argument("--allocations-out", help="CSV of the largest allocations (default: beside --out)")
    args = p.parse_args(argv)
    if args.allocations_out is None:
        out = Path(args.out)
        args.allocations_out = str(out.with_name(f"{out.stem}_largest_allocations.csv"))
    return args


def residual_row(args: argparse.Namespace, cfg: ModelConfig) -> dict:
    """(d) One float32 residual-stream activation of the batch: batch x context x d_model x 4 bytes."""
    row = {"record": "residual_activation", "size": args.size, "context_length": cfg.context_length}
    row |= {"batch_size": args.batch_size, "d_model": cfg.d_model}
    size_bytes = args.batch_size * cfg.context_length * cfg.d_model * 4
    return {**row, "bytes": size_bytes, "mib": size_bytes / MIB, "status": "ok"}


def cell_rows(
    args: argparse.Namespace, cfg: ModelConfig, mode: str, autocast: str, device: torch.device
) -> list[dict]:
    """One context length, mode and precision: its `peak` row, then a forward pass's largest allocations."""
    base = {
        "record": "peak",
        "size": args.size,
        "context_length": cfg.context_length,
        "batch_size": args.batch_size,
        "mode": mode,
        "autocast": autocast,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    if device.type != "cuda":
        return [{**base, "status": "skipped", "reason": "needs CUDA"}]
    name = f"memory_{args.size}_{cfg.context_length}_{mode}_{autocast}"
    snapshot = Path(args.snapshot_dir) / f"{name}.pickle"
    snapshot.unlink(missing_ok=True)  # a stale one would be mistaken for this cell's

    def measure() -> list[dict]:
        autocast_dtype = workload.AUTOCAST[autocast]
        training = workload.training_step(cfg, args.batch_size, device, autocast_dtype, seed=args.seed)
        step = training.mode(mode)
        time_steps(step, args.warmup, 0, device)  # untimed, unrecorded: AdamW's state exists from here on
        optimizer = training.optimizer if mode == "train_step" else None  # to split the peak at its step
        peaks = cuda_memory.recorded_peaks(step, args.steps, device, snapshot, optimizer)
        return [{**base, **peaks, "status": "ok"}]

    def out_of_memory() -> list[dict]:
        return [{**base, **cuda_memory.peaks_mib(device), "status": "OOM"}]

    [row] = rows_or_oom("memory", name, measure, out_of_memory)
    if not snapshot.exists():
        return [row]
    title = f"{args.size} ctx={cfg.context_length} {mode} autocast={autocast}"
    row["snapshot"] = snapshot.name
    row["timeline_peak_mib"], largest = cuda_memory.read_snapshot(snapshot, device, title, args.top)
    return [row, *({**base, "record": LARGEST, **a} for a in largest if mode == "forward")]


def run(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    Path(args.snapshot_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for context_length in args.context_lengths:
        cfg = cli.model_config(args, context_length)
        rows.append(residual_row(args, cfg))
        for mode, autocast in itertools.product(args.modes, args.autocast):
            rows += cell_rows(args, cfg, mode, autocast, device)
    if device.type != "cuda":
        rows.append({"record": LARGEST, "status": "skipped", "reason": "needs CUDA"})
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run(args)
    write_rows([row for row in rows if row["record"] == LARGEST], args.allocations_out, cli.params(args))
    write_rows([row for row in rows if row["record"] != LARGEST], args.out, cli.params(args))


if __name__ == "__main__":
    main()
