"""What the 2026 leaderboard's training-step benchmark measures (experiments/train_step_benchmark.py): each
(stack, depth) cell timed (do_bench on one GPU; under the launcher a step count every rank shares: fixed, or
do_bench's time budgets turned into counts), its peak memory (PEAKS: the build's, the first step's and the
steps' after it, each from its own reset) and clock, what a device keeps between steps (on several ranks its
shards), and the per-layer least-squares fit extrapolated to the leaderboard's depth (labelled as an
extrapolation). The arguments are the CLI's (`args`)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from cs336_systems.accounting.units import MIB
from cs336_systems.measure.gpu_telemetry import GpuTelemetry
from cs336_systems.measure.timing import or_oom, sync, time_steps
from cs336_systems.parallel.fsdp import FullyShardedDataParallel
from cs336_systems.training.stacks import (
    DTYPES,
    STACKS,
    build_step,
    component_times,
    kernel_times,
    model_flops,
    peak_tflops,
)
from cs336_systems.training.workload import TrainingStep

# A cell's allocator peaks (MiB), each from a reset of the peak statistics at its start: the model's build (model,
# sharding, optimizer), the first step (compilation, autotuning, the optimizer state's creation) and the steps after
# it (the warm-up and timed steps; on one GPU every call of do_bench, its 256 MB L2-flush buffer included): the
# step's own peak. NaN off CUDA.
PEAKS = ("build_peak_mib", "first_step_peak_mib", "peak_mib")


def reset_peak(device: torch.device) -> None:
    """Start a new peak: the allocator's peak statistics from what is allocated now (CUDA; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float:
    """The allocator's peak since the last reset_peak, in MiB; NaN off CUDA, which keeps no such statistics."""
    return torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else float("nan")


def time_step(step, device: torch.device, args: argparse.Namespace) -> tuple[float, dict]:
    """Milliseconds per call of `step` and, on several ranks, the step counts run (`warmup_steps`, `timed_steps`):
    do_bench's median on one CUDA device; on several ranks the median over steps of the slowest rank's time; the
    median of wall times elsewhere."""
    if dist.is_initialized():
        warmup, steps = args.warmup_steps, args.steps
        if args.time_budgets:  # one more step estimates the step, the slowest rank's estimate sets the counts
            estimate = torch.tensor(time_steps(step, 0, 1, device), device=device)
            dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
            warmup, steps = budget_steps(estimate.item() * 1e3, args.warmup_ms, args.rep_ms)
        time_steps(step, warmup, 0, device)
        per_rank = torch.tensor(time_steps(step, 0, steps, device), device=device)
        dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
        return statistics.median(per_rank.tolist()) * 1e3, {"warmup_steps": warmup, "timed_steps": steps}
    ms = one_device_ms(step, device, args.warmup_steps, args.steps, warmup=args.warmup_ms, rep=args.rep_ms)
    return ms, {}


def budget_steps(estimate_ms: float, warmup_ms: float, rep_ms: float) -> tuple[int, int]:
    """do_bench's warm-up and timed step counts for a step of `estimate_ms`: as many as fit in `warmup_ms` and in
    `rep_ms`, at least one each (triton.testing.do_bench rounds the same way)."""
    return max(1, int(warmup_ms / estimate_ms)), max(1, int(rep_ms / estimate_ms))


def one_device_ms(fn, device: torch.device, warmup_steps: int, steps: int, **do_bench_times) -> float:
    """Milliseconds per call of `fn` on one device: do_bench's median on CUDA (over `do_bench_times`, its
    defaults where none are given); elsewhere the median of `steps` wall times after `warmup_steps` calls."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median", **do_bench_times)
    return statistics.median(time_steps(fn, warmup_steps, steps, device)) * 1e3


# The allocator's events that stall a step (CUDA): a failed cudaMalloc retried after freeing the cache (it
# synchronises the device), and memory handed back to the device (with expandable segments, unmapping it).
ALLOCATOR_EVENTS = {"alloc_retries": "num_alloc_retries", "device_frees": "num_device_free"}


def allocator_events(device: torch.device) -> dict[str, float]:
    """The allocator's counters (ALLOCATOR_EVENTS) so far; NaN off CUDA."""
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    return {name: float(stats.get(key, float("nan"))) for name, key in ALLOCATOR_EVENTS.items()}


def measure(
    stack: str, num_layers: int, args: argparse.Namespace, device: torch.device, started_run: float
) -> dict:
    """One (stack, depth) cell: build, first step, the timed steps, their peaks (PEAKS: the peak statistics reset
    before the build, before the first step and after it, so the step's peak is not the build's), what the model
    keeps between steps, the allocator's stalls over the steps after the first (ALLOCATOR_EVENTS), and on one
    device the share of weights one more step changes and optimizer.step() alone; on several ranks the largest
    rank's peaks, kept state, stalls, clock and (our FSDP) waits, those of the forward and the backward apart; the
    GPU's SM clock and power over the timed steps, warm-up included (GpuTelemetry: on several ranks their mean).
    `started_run`: the CLI's start (time.perf_counter())."""
    dims = {
        name: getattr(args, name) for name in ("d_model", "d_ff", "num_heads", "vocab_size", "context_length")
    }
    reset_peak(device)
    started = time.perf_counter()
    train = build_step(
        STACKS[stack],
        {**dims, "num_layers": num_layers},
        args.batch_size,
        device,
        DTYPES[args.dtype],
        compile_blocks=not args.no_compile,
        head_chunk=head_chunk_of(stack, args),
        seed=args.seed,
    )
    sync(device)
    built = time.perf_counter()
    peaks = {"build_peak_mib": peak_mib(device)}
    reset_peak(device)
    train.train_step()  # the first step compiles and autotunes
    sync(device)
    clock = {"build_s": built - started, "first_step_s": time.perf_counter() - built}
    peaks["first_step_peak_mib"] = peak_mib(device)
    reset_peak(device)  # from here the steps' own peak
    events_before = allocator_events(device)
    ours = isinstance(train.model, FullyShardedDataParallel)
    records = []
    step = train.train_step
    if ours:  # its waits, counted in the timed steps (a few CUDA events per unit), read after each step
        train.model.measure_communication = True

        def step() -> None:
            train.train_step()
            records.append(train.model.last_communication)

    with GpuTelemetry(device) as telemetry:  # the clock the timed steps ran at (GPUs at a power cap vary it)
        step_ms, counts = time_step(step, device, args)
    sync(device)
    clock["elapsed_s"] = time.perf_counter() - started_run
    peaks["peak_mib"] = peak_mib(device)
    # over the steps after the first, the allocator's stalls (a retry hints that the step runs at the memory's edge)
    events = {name: count - events_before[name] for name, count in allocator_events(device).items()}
    waits = {}
    alone = {}
    kept = state_mib(train)  # on several ranks each rank's own (its shards), the largest rank's recorded
    if not dist.is_initialized():  # a step that fit may still find no room for the copy: then no fraction
        fraction = or_oom(lambda: updated_fraction(train))
        alone["updated_fraction"] = float("nan") if fraction == "OOM" else fraction
        alone["optimizer_ms"] = optimizer_ms(train, device, args)
    if ours:
        stats = [record.stats() for record in records[-counts["timed_steps"] :]]
        waits = {
            f"{key}_ms": statistics.median(s[f"{key}_s"] for s in stats) * 1e3
            for key in ("gather_wait", "gather_wait_forward", "gather_wait_backward", "sync_wait")
        }
    largest = {**peaks, **kept, **events, **clock, **waits}
    gpu = telemetry.summary()
    if dist.is_initialized():
        # the largest rank's; the GPUs' clock and power the ranks' mean, the temperature the hottest rank's
        by_rank = gather_to_all(list(largest.values()))
        largest = dict(zip(largest, map(max, zip(*by_rank, strict=True)), strict=True))
        by_rank = list(zip(*gather_to_all(list(gpu.values())), strict=True))
        gpu = {
            key: float((np.max if key == "temperature_c" else np.mean)(values))
            for key, values in zip(gpu, by_rank, strict=True)
        }
    return {
        "step_ms": step_ms,
        **counts,
        **largest,
        **gpu,
        **alone,
        **profiled_parts(train, device, args),
    }


# --kernels profiles this many steps: a per-layer cost is a slope over depth, which multiplies a single step's
# noise (one H100, depths 2 and 4, one step each: our backward kernel took 45.9 ms a call in one, 41.0 in the other)
KERNEL_STEPS = 3


def profiled_parts(train: TrainingStep, device: torch.device, args: argparse.Namespace) -> dict[str, dict]:
    """With --components, one profiled step's time by component; with --kernels, the mean of KERNEL_STEPS
    profiled steps by kernel (with both, the components come from those steps)."""
    steps = KERNEL_STEPS if args.kernels else 1
    kernels = kernel_times(train, device, steps) if args.components or args.kernels else {}
    return {
        "components": component_times(kernels) if args.components else {},
        "kernels": kernels if args.kernels else {},
    }


def state_mib(train: TrainingStep) -> dict[str, float]:
    """MiB of what the model keeps from step to step: its weights, their gradients (still there after a step) and
    the optimizer's state; the rest of the peak is activations and temporaries. Sharded, this rank's: its shards
    (a DTensor of FSDP2 counts its local part)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    mib = lambda tensors: sum(local(t).numel() * t.element_size() for t in tensors) / MIB
    params = list(train.model.parameters())
    return {
        "weights_mib": mib(params),
        "gradients_mib": mib(p.grad for p in params if p.grad is not None),
        "optimizer_state_mib": mib(
            v for state in train.optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        ),
    }


def updated_fraction(train: TrainingStep) -> float:
    """The share of the weights that one more step changes (after the peak is read: it holds a copy of them)."""
    before = [p.detach().clone() for p in train.model.parameters()]
    train.train_step()
    changed = sum(
        int((p.detach() != old).sum()) for p, old in zip(train.model.parameters(), before, strict=True)
    )
    return changed / sum(old.numel() for old in before)


def optimizer_ms(train: TrainingStep, device: torch.device, args: argparse.Namespace) -> float:
    """Milliseconds of `optimizer.step()` alone, on the last step's gradients (no warm-up steps off CUDA)."""
    return one_device_ms(train.optimizer.step, device, 0, args.steps)


def gather_to_all(values: list[float]) -> list[list[float]]:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return gathered


def head_chunk_of(stack: str, args: argparse.Namespace) -> int | None:
    """Tokens per chunk of the stack's LM head (the CLI's `--head-chunk` by head); None for an unchunked head."""
    return args.head_chunk.get(STACKS[stack].head)


# What a cell's row says of its configuration; the rest of it is measured. A fit row keeps only these of its cells'.
CONFIG_KEYS = ("stack", "attention", "rope", "head", "head_chunk", "checkpoint", "compiled", "optimizer", "sharding",
               "world_size", "d_model", "d_ff", "num_heads", "vocab_size", "context_length", "batch_size", "dtype",
               "weights")  # fmt: skip


def cell_row(stack: str, num_layers: int, args: argparse.Namespace, device: torch.device, result) -> dict:
    s = STACKS[stack]
    world = dist.get_world_size() if dist.is_initialized() else 1
    flops = model_flops(vars(args), num_layers, args.context_length, args.batch_size * world)
    peak = peak_tflops(device)
    row = {
        "kind": "cell",
        "stack": stack,
        "attention": s.attention,
        "rope": s.rope,
        "head": s.head,
        "head_chunk": head_chunk_of(stack, args),
        "checkpoint": s.checkpoint,
        "compiled": s.compile_blocks and not args.no_compile,
        "optimizer": s.optimizer,
        "sharding": s.sharding,
        "world_size": world,
        "num_layers": num_layers,
        "d_model": args.d_model,
        "d_ff": args.d_ff,
        "num_heads": args.num_heads,
        "vocab_size": args.vocab_size,
        "context_length": args.context_length,
        "batch_size": args.batch_size,
        "dtype": args.dtype,
        "weights": "float32" if s.fp32_master else args.dtype,
        "model_tflop": flops / 1e12,
        "step_ms": float("nan"),
        **dict.fromkeys(PEAKS, float("nan")),
        "mfu": float("nan"),
        "status": "ok",
        "reason": "",
    }
    if result == "OOM":
        return row | {"status": "OOM", "reason": "out of memory"}
    row |= {key: value for key, value in result.items() if key not in ("components", "kernels")}
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
        rows.append(
            {key: first[key] for key in CONFIG_KEYS}  # none of the cells' measurements: no GPU ran this
            | {
                "kind": "fit",
                "num_layers": extrapolate_layers,
                "per_layer_ms": slope,
                "intercept_ms": intercept,
                "step_ms": step_ms,
                "model_tflop": flops / 1e12,
                "mfu": flops / (step_ms / 1e3) / (world * peak * 1e12) if peak else float("nan"),
                "status": "extrapolated",
                "reason": f"intercept + slope x {extrapolate_layers} layers, least squares over depths {depths}",
            }
        )
    return rows


def compile_caches(cold: bool):
    """Inductor's and Triton's on-disk caches in a new empty folder, removed after (PyTorch's own helper), or the
    usual ones."""
    if not cold:
        return contextlib.nullcontext()
    from torch._inductor.utils import fresh_cache  # imports triton: only once TRITON_INTERPRET is settled

    return fresh_cache()
