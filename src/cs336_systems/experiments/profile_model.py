"""Profile the Transformer LM with torch.profiler (spec §1.1.4 nsys_profile a-e).

For each context length and mode: build the model, run `--warmup` steps outside the profiled window, then
profile `--steps` steps (CPU + CUDA activity) while timing each with the Python timer. One CSV of rows by
`record` (cs336_systems.measure.profiling says what each column holds):
  python_timer  the Python timer around the profiled steps (synchronised after each)               (a)
  range         a `record_function` range of the model/workload (forward, backward, optimizer_step,
                attention, attention/scores, attention/softmax, attention/output, feed_forward)      (a, e)
  kernel        every CUDA kernel (on CPU: every aten op, by self time), with `is_matmul`       (b, c, d)
The attention ranges carry their forward FLOPs per step (`flops_per_step`).

`--trace-dir` keeps a Chrome/Perfetto trace per mode at the first context length, `trace_<size>_<ctx>_<mode>.json`
(a trace of every cell of the large models would be gigabytes of JSON and minutes of export). `--nsys`: when `nsys`
is on the PATH, the same command is re-run under `nsys profile` (report `nsys_<size>` in the trace folder), where
the profiled steps also run as NVTX ranges.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from cs336_systems import cli
from cs336_systems.measure import profiling
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import resolve_device, rows_or_oom
from cs336_systems.model.transformer import ModelConfig
from cs336_systems.training import workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    cli.add_step_sweep_args(p, warmup=3, steps=3, measured="profiled")
    p.add_argument("--trace-dir", help="folder for Chrome/Perfetto traces (and the nsys report)")
    p.add_argument("--nsys", action="store_true", help="re-run under `nsys profile` when nsys is on the PATH")
    return p.parse_args(argv)


def cell_rows(
    args: argparse.Namespace, cfg: ModelConfig, mode: str, device: torch.device, trace: Path | None
) -> list[dict]:
    """One context length and mode: its python_timer, range and kernel rows, or one `OOM` row."""
    base = {
        "size": args.size,
        "context_length": cfg.context_length,
        "batch_size": args.batch_size,
        "mode": mode,
        "autocast": args.autocast,
        "attention": args.attention,
        "warmup": args.warmup,
        "steps": args.steps,
        "device": device.type,
    }

    def measure() -> list[dict]:
        autocast = workload.AUTOCAST[args.autocast]
        step = workload.training_step(cfg, args.batch_size, device, autocast, seed=args.seed).mode(mode)
        label = trace.stem if trace else mode
        rows = profiling.profile_step(step, args.warmup, args.steps, device, trace, label)
        return [
            {**base, **row, "status": "ok"}
            for row in profiling.with_attention_flops(rows, cfg, args.batch_size)
        ]

    oom = [{**base, "record": "status", "status": "OOM"}]
    return rows_or_oom("profile", f"{args.size} ctx={cfg.context_length} {mode}", measure, lambda: oom)


def run(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    trace_dir = Path(args.trace_dir) if args.trace_dir else None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for context_length in args.context_lengths:
        cfg = cli.model_config(args, context_length)
        for mode in args.modes:
            # Traces of the first context length only: those of every cell would be gigabytes.
            traced = trace_dir is not None and context_length == args.context_lengths[0]
            trace = trace_dir / f"trace_{args.size}_{context_length}_{mode}.json" if traced else None
            rows += cell_rows(args, cfg, mode, device, trace)
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.nsys and not profiling.under_nsys():
        report = Path(args.trace_dir or Path(args.out).parent) / f"nsys_{args.size}"
        if profiling.rerun_under_nsys("cs336_systems.experiments.profile_model", argv, report):
            return
    write_rows(run(args), args.out, {**cli.params(args), "under_nsys": profiling.under_nsys()})


if __name__ == "__main__":
    main()
