"""The 2026 leaderboard's training step (§9) by stack and depth: step time, peak memory and MFU.

    python -m cs336_systems.experiments.train_step_benchmark --num-layers 2 4 8 --stacks plain native ours \
        --out results/gpu/train_step/one_gpu.csv

Defaults are the leaderboard's model (d_model 4096, d_ff 11,008, 32 heads, vocabulary 151,936, context 32,768) in
bf16; `--num-layers` sets the depths measured (the leaderboard has 34). Per (stack, depth) one row: a fresh model
(cs336_systems.train_step_benchmarking), `triton.testing.do_bench` of the whole step on CUDA (median, after
`--warmup-ms`, over `--rep-ms`; wall-clock median of `--steps` steps on the CPU), the allocator's peak, model
TFLOP and MFU; an out-of-memory cell is an `OOM` row. Then per stack measured at two depths or more, a `fit` row:
per-layer time = the least-squares slope of step time over depth, and the extrapolation to
`--extrapolate-layers` layers = intercept + slope × layers, labelled as such. With `--components`, one more
profiled step per cell gives `component` rows: its kernels' time by component (attention, head + loss,
optimizer, matmul, the rest; train_step_benchmarking.COMPONENTS).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

from cs336_systems import cli
from cs336_systems.benchmarking import or_oom, resolve_device, sync
from cs336_systems.provenance import write_rows
from cs336_systems.train_step_benchmarking import (
    LEADERBOARD,
    STACKS,
    TrainStep,
    component_times,
    model_flops,
    peak_tflops,
)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    for name in ("d_model", "d_ff", "num_heads", "vocab_size", "context_length"):
        p.add_argument(f"--{name.replace('_', '-')}", type=cli.positive_int, default=LEADERBOARD[name])
    p.add_argument("--num-layers", type=cli.positive_int, nargs="+", required=True, help="depths to measure")
    p.add_argument("--batch-size", type=cli.positive_int, default=1, help="sequences per step (on this GPU)")
    p.add_argument("--stacks", nargs="+", choices=list(STACKS), default=["plain", "native", "ours"])
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="weights, gradients, AdamW state")
    p.add_argument("--head-chunk", type=cli.positive_int, default=8192, help="tokens per LM-head chunk")
    p.add_argument("--no-compile", action="store_true", help="run every stack's blocks eagerly")
    p.add_argument("--warmup-ms", type=cli.positive_int, default=3000, help="CUDA: do_bench warm-up")
    p.add_argument("--rep-ms", type=cli.positive_int, default=5000, help="CUDA: do_bench measurement time")
    p.add_argument("--steps", type=cli.positive_int, default=3, help="CPU: timed steps (after one warm-up)")
    p.add_argument("--extrapolate-layers", type=cli.positive_int, default=LEADERBOARD["num_layers"])
    p.add_argument("--components", action="store_true",
                   help="also profile one step per cell: time per component (attention, matmul, ...) rows")
    cli.add_device(p)
    args = p.parse_args(argv)
    if args.d_model % args.num_heads or (args.d_model // args.num_heads) % 2:
        p.error(f"--d-model {args.d_model} must split into --num-heads {args.num_heads} heads of even size")
    if len(set(args.stacks)) < len(args.stacks) or len(set(args.num_layers)) < len(args.num_layers):
        p.error("--stacks and --num-layers list each value once")
    return args


def time_step(train: TrainStep, device: torch.device, args: argparse.Namespace) -> float:
    """Milliseconds per step: do_bench's median on CUDA, the median of wall times elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(train.step, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
    train.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        train.step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(stack: str, num_layers: int, args: argparse.Namespace, device: torch.device) -> dict:
    dims = {name: getattr(args, name) for name in ("d_model", "d_ff", "num_heads", "vocab_size", "context_length")}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train = TrainStep(STACKS[stack], {**dims, "num_layers": num_layers}, args.batch_size, device,
                      DTYPES[args.dtype], compile_blocks=not args.no_compile, head_chunk=args.head_chunk, seed=args.seed)
    step_ms = time_step(train, device, args)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    return {"step_ms": step_ms, "peak_mib": peak,
            "components": component_times(train, device) if args.components else {}}


def cell_row(stack: str, num_layers: int, args: argparse.Namespace, device: torch.device, result) -> dict:
    s = STACKS[stack]
    flops = model_flops(vars(args), num_layers, args.context_length, args.batch_size)
    peak = peak_tflops(device)
    row = {"kind": "cell", "stack": stack, "attention": s.attention, "head": s.head, "checkpoint": s.checkpoint,
           "compiled": s.compile_blocks and not args.no_compile, "num_layers": num_layers, "d_model": args.d_model,
           "d_ff": args.d_ff, "num_heads": args.num_heads, "vocab_size": args.vocab_size,
           "context_length": args.context_length, "batch_size": args.batch_size, "dtype": args.dtype,
           "model_tflop": flops / 1e12, "step_ms": float("nan"), "peak_mib": float("nan"), "mfu": float("nan"),
           "status": "ok", "reason": ""}
    if result == "OOM":
        return row | {"status": "OOM", "reason": "out of memory"}
    row |= {key: value for key, value in result.items() if key != "components"}
    if peak is not None:
        row["mfu"] = flops / (result["step_ms"] / 1e3) / (peak * 1e12)
    return row


def fit_rows(cells: list[dict], extrapolate_layers: int, peak: float | None) -> list[dict]:
    """Per stack with two depths or more measured: per-layer time (slope), and the step time and MFU
    extrapolated to `extrapolate_layers` layers."""
    rows = []
    for stack in dict.fromkeys(c["stack"] for c in cells):
        ran = [c for c in cells if c["stack"] == stack and c["status"] == "ok"]
        depths = sorted(c["num_layers"] for c in ran)
        if len(set(depths)) < 2:
            continue
        slope, intercept = np.polyfit([c["num_layers"] for c in ran], [c["step_ms"] for c in ran], 1)
        first = ran[0]
        flops = model_flops(first, extrapolate_layers, first["context_length"], first["batch_size"])
        step_ms = intercept + slope * extrapolate_layers
        rows.append(first | {
            "kind": "fit", "num_layers": extrapolate_layers, "per_layer_ms": slope, "intercept_ms": intercept,
            "step_ms": step_ms, "peak_mib": float("nan"), "model_tflop": flops / 1e12,
            "mfu": flops / (step_ms / 1e3) / (peak * 1e12) if peak else float("nan"), "status": "extrapolated",
            "reason": f"intercept + slope x {extrapolate_layers} layers, least squares over depths {depths}"})
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before our kernels import triton
    cells, parts = [], []
    for stack in args.stacks:
        for num_layers in args.num_layers:
            result = or_oom(lambda s=stack, n=num_layers: measure(s, n, args, device))
            cells.append(cell_row(stack, num_layers, args, device, result))
            if result != "OOM":
                parts += [{"kind": "component", "stack": stack, "num_layers": num_layers, "component": name,
                           "component_ms": ms, "status": "ok"} for name, ms in result["components"].items()]
            shown = "OOM" if result == "OOM" else f"{result['step_ms']:.1f} ms, peak {result['peak_mib']:.0f} MiB"
            print(f"[train_step] {stack} x {num_layers} layers: {shown}", file=sys.stderr, flush=True)
    fits = fit_rows(cells, args.extrapolate_layers, peak_tflops(device))
    write_rows(cells + fits + parts, args.out, cli.params(args))


if __name__ == "__main__":
    main()
