"""The 2026 leaderboard's training step (§9) by stack and depth: step time, peak memory and MFU.

    python -m cs336_systems.experiments.train_step_benchmark --num-layers 2 4 8 --stacks plain native ours \
        --out results/gpu/train_step/one_gpu.csv

Defaults are the leaderboard's model (d_model 4096, d_ff 11,008, 32 heads, vocabulary 151,936, context 32,768) in
bf16; `--num-layers` sets the depths measured (the leaderboard has 34). Per (stack, depth) one row: a fresh model
(cs336_systems.training.stacks), `triton.testing.do_bench` of the whole step on CUDA (median, after
`--warmup-ms`, over `--rep-ms`; wall-clock median of `--steps` steps on the CPU), the allocator's peak, model
TFLOP and MFU; an out-of-memory cell is an `OOM` row. Then per stack measured at two depths or more, a `fit` row:
per-layer time = the least-squares slope of step time over depth, and the extrapolation to
`--extrapolate-layers` layers = intercept + slope × layers, labelled as such. On one device each cell also gives
`updated_fraction`, the share of the weights one more step changes (an AdamW update of about the learning rate
is lost on a bf16 weight more than ~256x its size; float32 master weights keep it), and `optimizer_ms`,
`optimizer.step()` timed alone, and the memory the model keeps between steps (`weights_mib`, `gradients_mib`,
`optimizer_state_mib`). With `--components`, one more profiled step per cell gives `component` rows: its
kernels' time by component (attention, head + loss, optimizer, matmul, the rest;
train_step_benchmarking.COMPONENTS).

The sharded stacks (`*_fsdp`) run under the launcher, one rank per GPU, each rank on its own `--batch-size`
sequences (the leaderboard: 2 GPUs x 1 sequence):
    python -m cs336_systems.parallel.launch --nproc 2 --backend nccl --out X.csv -- \
        cs336_systems.experiments.train_step_benchmark --num-layers 34 --stacks native_fsdp ours_fsdp
There `do_bench` (whose step count depends on each rank's own estimate) would let the ranks run different
numbers of collectives, so every rank runs `--warmup-steps` then `--steps` steps, synchronised after each; a
step's time is the slowest rank's, the cell's the median. The CUDA allocator uses expandable segments unless
PYTORCH_CUDA_ALLOC_CONF says otherwise. Peak memory is the largest rank's; `world_size` and the
MFU count every rank's tokens over every rank's GPU. Our FSDP also counts, in the timed steps, the compute
stream's wait for all-gathers (`gather_wait_ms`) and at the final synchronisation (`sync_wait_ms`): the median
over steps, the largest rank's.

Every cell also says how long it took to get there (the spec's rule: from an empty PyTorch/Triton cache the whole
benchmarking run ends within 10 minutes): `build_s` (model and optimizer), `first_step_s` (one step before the
timing: where torch.compile compiles and our kernels autotune) and `elapsed_s` (from the CLI's start, imports
included, to the end of the cell's timing; the largest rank's). `--cold-cache` runs everything with
Inductor's and Triton's on-disk caches in a new empty folder (`torch._inductor.utils.fresh_cache`), as on a
fresh machine.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before torch is imported: the run's clock counts the imports

import argparse
import contextlib
import os
import statistics
import sys

import numpy as np
import torch
import torch.distributed as dist

from cs336_systems import cli
from cs336_systems.kernels import triton_interpreter
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import or_oom, resolve_device, sync, time_steps
from cs336_systems.parallel.distributed import BACKENDS, distributed
from cs336_systems.parallel.fsdp import FullyShardedDataParallel
from cs336_systems.training.stacks import (
    DTYPES,
    LEADERBOARD,
    STACKS,
    TrainStep,
    component_times,
    model_flops,
    peak_tflops,
)

# A cell's clock (seconds): building the model and optimizer, the first step, the CLI's start to the timing's end.
CLOCK = ("build_s", "first_step_s", "elapsed_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    for name in ("d_model", "d_ff", "num_heads", "vocab_size", "context_length"):
        p.add_argument(f"--{name.replace('_', '-')}", type=cli.positive_int, default=LEADERBOARD[name])
    p.add_argument("--num-layers", type=cli.positive_int, nargs="+", required=True, help="depths to measure")
    p.add_argument("--batch-size", type=cli.positive_int, default=1, help="sequences per step (on this GPU)")
    p.add_argument("--stacks", nargs="+", choices=list(STACKS), default=["plain", "native", "ours"])
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                   help="weights, gradients, AdamW state (a *_fp32_master stack's compute)")
    p.add_argument("--head-chunk", type=cli.positive_int, default=8192, help="tokens per LM-head chunk")
    p.add_argument("--no-compile", action="store_true", help="run every stack's blocks eagerly")
    p.add_argument("--warmup-ms", type=cli.positive_int, default=3000, help="CUDA: do_bench warm-up")
    p.add_argument("--rep-ms", type=cli.positive_int, default=5000, help="CUDA: do_bench measurement time")
    p.add_argument("--steps", type=cli.positive_int, default=3,
                   help="CPU or several ranks: timed steps (after the warm-up steps)")
    p.add_argument("--warmup-steps", type=cli.positive_int, default=1, help="CPU or several ranks: warm-up steps")
    p.add_argument("--extrapolate-layers", type=cli.positive_int, default=LEADERBOARD["num_layers"])
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="under the launcher: the process group's backend (default: nccl with GPUs, else gloo)")
    p.add_argument("--cold-cache", action="store_true",
                   help="compile and autotune from empty on-disk caches (Inductor's, Triton's), as on a fresh machine")
    p.add_argument("--components", action="store_true",
                   help="also profile one step per cell: time per component (attention, matmul, ...) rows")
    cli.add_device(p)
    args = p.parse_args(argv)
    if args.d_model % args.num_heads or (args.d_model // args.num_heads) % 2:
        p.error(f"--d-model {args.d_model} must split into --num-heads {args.num_heads} heads of even size")
    if len(set(args.stacks)) < len(args.stacks) or len(set(args.num_layers)) < len(args.num_layers):
        p.error("--stacks and --num-layers list each value once")
    sharded = [s for s in args.stacks if STACKS[s].sharding != "none"]
    if sharded and "WORLD_SIZE" not in os.environ:
        p.error(f"--stacks {' '.join(sharded)} shard over ranks: run under python -m cs336_systems.parallel.launch --nproc N")
    if len(sharded) < len(args.stacks) and "WORLD_SIZE" in os.environ:
        p.error(f"--stacks {' '.join(s for s in args.stacks if s not in sharded)} run on one GPU: do not launch "
                "them on several ranks (or list only *_fsdp stacks)")
    return args


def time_step(train: TrainStep, device: torch.device, args: argparse.Namespace) -> float:
    """Milliseconds per step: do_bench's median on one CUDA device; on several ranks the median over steps of
    the slowest rank's time; the median of wall times elsewhere."""
    if dist.is_initialized():
        time_steps(train.step, args.warmup_steps, 0, device)
        per_rank = torch.tensor(time_steps(train.step, 0, args.steps, device), device=device)
        dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
        return statistics.median(per_rank.tolist()) * 1e3
    return one_device_ms(train.step, device, args.warmup_steps, args.steps, warmup=args.warmup_ms, rep=args.rep_ms)


def one_device_ms(fn, device: torch.device, warmup_steps: int, steps: int, **do_bench_times) -> float:
    """Milliseconds per call of `fn` on one device: do_bench's median on CUDA (over `do_bench_times`, its
    defaults where none are given); elsewhere the median of `steps` wall times after `warmup_steps` calls."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median", **do_bench_times)
    return statistics.median(time_steps(fn, warmup_steps, steps, device)) * 1e3


def measure(stack: str, num_layers: int, args: argparse.Namespace, device: torch.device) -> dict:
    dims = {name: getattr(args, name) for name in ("d_model", "d_ff", "num_heads", "vocab_size", "context_length")}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    train = TrainStep(STACKS[stack], {**dims, "num_layers": num_layers}, args.batch_size, device,
                      DTYPES[args.dtype], compile_blocks=not args.no_compile, head_chunk=args.head_chunk, seed=args.seed)
    sync(device)
    built = time.perf_counter()
    train.step()  # the first step compiles and autotunes
    sync(device)
    clock = {"build_s": built - started, "first_step_s": time.perf_counter() - built}
    ours = isinstance(train.model, FullyShardedDataParallel)
    records = []
    if ours:  # its waits, counted in the timed steps (a few CUDA events per unit)
        train.model.measure_communication = True
        finish = train.sync_gradients

        def finish_and_record() -> None:
            finish()
            records.append(train.model.last_communication)

        train.sync_gradients = finish_and_record
    step_ms = time_step(train, device, args)
    sync(device)
    clock["elapsed_s"] = time.perf_counter() - STARTED
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    waits = {}
    alone = {}
    if not dist.is_initialized():  # a step that fit may still find no room for the copy: then no fraction
        alone |= state_mib(train)
        fraction = or_oom(lambda: updated_fraction(train))
        alone["updated_fraction"] = float("nan") if fraction == "OOM" else fraction
        alone["optimizer_ms"] = optimizer_ms(train, device, args)
    if ours:
        stats = [record.stats() for record in records[-args.steps :]]
        waits = {f"{key}_ms": statistics.median(s[f"{key}_s"] for s in stats) * 1e3 for key in ("gather_wait", "sync_wait")}
    largest = {"peak_mib": peak, **clock, **waits}
    if dist.is_initialized():  # the largest rank's
        by_rank = gather_to_all(list(largest.values()))
        largest = dict(zip(largest, map(max, zip(*by_rank, strict=True)), strict=True))
    return {"step_ms": step_ms, **largest, **alone,
            "components": component_times(train, device) if args.components else {}}


def state_mib(train: TrainStep) -> dict[str, float]:
    """MiB of what the model keeps from step to step: its weights, their gradients (still there after a step) and
    the optimizer's state; the rest of the peak is activations and temporaries."""
    mib = lambda tensors: sum(t.numel() * t.element_size() for t in tensors) / 2**20
    params = list(train.model.parameters())
    return {"weights_mib": mib(params), "gradients_mib": mib(p.grad for p in params if p.grad is not None),
            "optimizer_state_mib": mib(v for state in train.optimizer.state.values() for v in state.values()
                                       if torch.is_tensor(v))}


def updated_fraction(train: TrainStep) -> float:
    """The share of the weights that one more step changes (after the peak is read: it holds a copy of them)."""
    before = [p.detach().clone() for p in train.model.parameters()]
    train.step()
    changed = sum(int((p.detach() != old).sum()) for p, old in zip(train.model.parameters(), before, strict=True))
    return changed / sum(old.numel() for old in before)


def optimizer_ms(train: TrainStep, device: torch.device, args: argparse.Namespace) -> float:
    """Milliseconds of `optimizer.step()` alone, on the last step's gradients (no warm-up steps off CUDA)."""
    return one_device_ms(train.optimizer.step, device, 0, args.steps)


def gather_to_all(values: list[float]) -> list[list[float]]:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return gathered


def cell_row(stack: str, num_layers: int, args: argparse.Namespace, device: torch.device, result) -> dict:
    s = STACKS[stack]
    world = dist.get_world_size() if dist.is_initialized() else 1
    flops = model_flops(vars(args), num_layers, args.context_length, args.batch_size * world)
    peak = peak_tflops(device)
    row = {"kind": "cell", "stack": stack, "attention": s.attention, "head": s.head, "checkpoint": s.checkpoint,
           "compiled": s.compile_blocks and not args.no_compile, "optimizer": s.optimizer, "sharding": s.sharding,
           "world_size": world, "num_layers": num_layers, "d_model": args.d_model,
           "d_ff": args.d_ff, "num_heads": args.num_heads, "vocab_size": args.vocab_size,
           "context_length": args.context_length, "batch_size": args.batch_size, "dtype": args.dtype,
           "weights": "float32" if s.fp32_master else args.dtype, "model_tflop": flops / 1e12,
           "step_ms": float("nan"), "peak_mib": float("nan"), "mfu": float("nan"),
           "status": "ok", "reason": ""}
    if result == "OOM":
        return row | {"status": "OOM", "reason": "out of memory"}
    row |= {key: value for key, value in result.items() if key != "components"}
    if peak is not None:
        row["mfu"] = flops / (result["step_ms"] / 1e3) / (world * peak * 1e12)
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
        world = first["world_size"]
        flops = model_flops(first, extrapolate_layers, first["context_length"], first["batch_size"] * world)
        step_ms = intercept + slope * extrapolate_layers
        rows.append(first | {
            "kind": "fit", "num_layers": extrapolate_layers, "per_layer_ms": slope, "intercept_ms": intercept,
            "step_ms": step_ms, "peak_mib": float("nan"), "gather_wait_ms": float("nan"),
            "sync_wait_ms": float("nan"), **dict.fromkeys(CLOCK, float("nan")), "model_tflop": flops / 1e12,
            "mfu": flops / (step_ms / 1e3) / (world * peak * 1e12) if peak else float("nan"), "status": "extrapolated",
            "reason": f"intercept + slope x {extrapolate_layers} layers, least squares over depths {depths}"})
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Before CUDA starts: expandable segments (as torchtitan sets them). At 34 layers on 2x H200 the default
    # allocator left 10-16 GiB reserved but unusable, and both sharded stacks ran out of memory in their second
    # step (ours at 121.8 GiB allocated); with them ours peaked at 129.5 GiB.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if "WORLD_SIZE" not in os.environ:
        run(args, resolve_device(args.device))
        return
    with distributed(args.backend) as ctx:
        run(args, ctx.device)


def compile_caches(cold: bool):
    """Inductor's and Triton's on-disk caches in a new empty folder, removed after (PyTorch's own helper), or the
    usual ones."""
    if not cold:
        return contextlib.nullcontext()
    from torch._inductor.utils import fresh_cache  # imports triton: only once TRITON_INTERPRET is settled

    return fresh_cache()


def run(args: argparse.Namespace, device: torch.device) -> None:
    """Every (stack, depth) cell, the fits; rank 0 (or the only process) writes them."""
    triton_interpreter.use_off_cuda(device)
    main_rank = not dist.is_initialized() or dist.get_rank() == 0
    cells, parts = [], []
    with compile_caches(args.cold_cache):
        for stack in args.stacks:
            for num_layers in args.num_layers:
                result = or_oom(lambda s=stack, n=num_layers: measure(s, n, args, device))
                cells.append(cell_row(stack, num_layers, args, device, result))
                if result != "OOM":
                    parts += [{"kind": "component", "stack": stack, "num_layers": num_layers, "component": name,
                               "component_ms": ms, "status": "ok"} for name, ms in result["components"].items()]
                shown = "OOM" if result == "OOM" else f"{result['step_ms']:.1f} ms, peak {result['peak_mib']:.0f} MiB"
                if main_rank:
                    print(f"[train_step] {stack} x {num_layers} layers: {shown}", file=sys.stderr, flush=True)
    if main_rank:
        fits = fit_rows(cells, args.extrapolate_layers, peak_tflops(device))
        write_rows(cells + fits + parts, args.out, cli.params(args))


if __name__ == "__main__":
    main()
