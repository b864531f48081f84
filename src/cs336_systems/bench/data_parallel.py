"""What the multi-process benchmarks of the Transformer (DDP, optimizer state sharding) share beyond
`benchmarking`: their model flags, every rank's measurement gathered on rank 0 (an out-of-memory on any rank as
one outcome), the columns that say what ran, and the tidy rows built from the ranks' measurements: the DDP
benchmark's steps (the slowest rank's), the sharding benchmark's memory by phase (PhaseMemory) beside the
accounting's predictions."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from cs336_systems import cli
from cs336_systems.accounting.formulas import sharding_prediction
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import or_oom, sync, time_phases
from cs336_systems.model.transformer import ModelConfig
from cs336_systems.parallel.distributed import BACKENDS, DistContext, gather_to_rank0

T = TypeVar("T")
OOM_REASON = "out of memory on a rank"
NO_ALLOCATOR_STATS = "no allocator statistics on CPU"
# The phases at whose end the sharding benchmark records memory (PhaseMemory), in order.
SHARDING_PHASES = ("after_init", "forward_backward", "before_step", "after_step")


def add_distributed_model_args(p: argparse.ArgumentParser) -> None:
    """The flags of a multi-process benchmark of the Transformer: the model (`--batch-size` is per rank), its
    context length and the backend."""
    cli.add_model_args(p)
    p.add_argument("--context-length", type=cli.positive_int, default=512)
    p.add_argument("--backend", choices=BACKENDS, help="default: nccl where there are GPUs, else gloo")


def gather_measurements(measure: Callable[[], T]) -> list[T] | str | None:
    """`measure()` on every rank, gathered on rank 0: the results by rank, or "OOM" where any rank ran out of
    memory (each rank frees its memory either way, so the next cell starts clean); None on the other ranks."""
    per_rank = gather_to_rank0(or_oom(measure))
    if per_rank is None:
        return None
    return "OOM" if any(isinstance(result, str) and result == "OOM" for result in per_rank) else per_rank


def time_collective(
    collective: Callable[[], Any],
    device: torch.device,
    warmup: int,
    iters: int,
    after: Callable[[], Any] | None = None,
) -> list[float] | None:
    """Seconds of each timed `collective()`, the slowest rank's per iteration, on rank 0 (None on the others).

    Every iteration starts from a barrier, so a rank's time is the collective's, not its wait for late peers;
    `after` (e.g. rescaling an all-reduced tensor) runs after each call, outside the timed phase.
    """
    phases = {"barrier": dist.barrier, "collective": collective} | ({"after": after} if after else {})
    per_rank = gather_to_rank0([step["collective"] for step in time_phases(phases, warmup, iters, device)])
    return None if per_rank is None else [max(times) for times in zip(*per_rank, strict=True)]


def log_median(prefix: str, per_rank: list[dict | None] | str, key: str) -> None:
    """Log a cell's median over steps of the slowest rank's `key` (seconds per step), or that it ran out of
    memory."""
    if per_rank == "OOM":
        text = "OOM"
    else:
        slowest = map(max, zip(*(result[key] for result in per_rank if result is not None), strict=True))
        text = f"{statistics.median(slowest) * 1e3:.1f} ms"
    print(f"{prefix} {text}", file=sys.stderr, flush=True)


def write_results(
    args: argparse.Namespace, ctx: DistContext, rows: list[dict], intervals: list[dict]
) -> None:
    """On rank 0: the benchmark's rows to `args.out` and, where `--timeline-out` was given, its traced kernel
    intervals there, both with the run's parameters and world size as provenance."""
    if not ctx.is_main:
        return
    recorded = {**cli.params(args), "world_size": ctx.world_size}
    write_rows(rows, args.out, recorded)
    if args.timeline_out is not None:
        write_rows(intervals, args.timeline_out, recorded)


def setting_columns(
    size: str, cfg: ModelConfig, batch_size: int, warmup: int, ctx: DistContext, **model_columns: Any
) -> dict[str, Any]:
    """The columns that say what ran: the model (its size, shape and `model_columns`), the batch per rank, the
    processes and the warm-up."""
    return {
        "size": size,
        "d_model": cfg.d_model,
        "num_layers": cfg.num_layers,
        **model_columns,
        "batch_size_per_rank": batch_size,
        "context_length": cfg.context_length,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "warmup": warmup,
    }


def ddp_rows(
    cell: dict[str, Any], setting: dict[str, Any], per_rank: list[dict | None] | str
) -> tuple[list, list]:
    """Rows and timeline rows of one DDP benchmark cell (`cell`: variant and bucket size). Rows: one per timed
    step, the slowest rank's step (`step_s`) and time blocked in gradient synchronisation (`comm_s`; None where
    it cannot be told apart from backward, as in PyTorch's DDP), ranks that took no part (None) left out.
    Timeline rows: rank 0's `intervals`. A cell that ran out of memory ("OOM") gives one OOM row in each."""
    base = {**cell, **setting, "reason": ""}
    if per_rank == "OOM":
        oom = {"status": "OOM", "reason": OOM_REASON}
        return [{**base, "step": None, **oom}], [{**cell, **oom}]
    measured = [result for result in per_rank if result is not None]
    rows = []
    for i in range(len(measured[0]["step_s"])):
        comm = [result["comm_s"][i] for result in measured]
        rows.append(
            {
                **base,
                "step": i,
                "step_ms": max(result["step_s"][i] for result in measured) * 1e3,
                "comm_ms": None if None in comm else max(comm) * 1e3,
                "num_buckets": measured[0]["num_buckets"],
                "status": "ok",
            }
        )
    return rows, [{**cell, **interval, "status": "ok"} for interval in per_rank[0]["intervals"]]


class PhaseMemory:
    """CUDA memory at the end of each phase of a step, `by_phase[phase] = (memory_allocated,
    max_memory_allocated)`, the peak reset between phases (so a phase's peak is its own). Records nothing on the
    CPU, which has no allocator statistics."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.by_phase: dict[str, tuple[int, int]] = {}
        self.reset()

    def reset(self) -> None:
        """Start a new phase without recording the one before."""
        if self.cuda:
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def record(self, phase: str) -> None:
        if self.cuda:
            sync(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.by_phase[phase] = (torch.cuda.memory_allocated(self.device), peak)
        self.reset()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes of optimizer state this rank holds on `device` (AdamW's `step` counters stay on the CPU), inside a
    sharding wrapper (ours: `local_optimizer`; ZeroRedundancyOptimizer: `optim`) where there is one."""
    local = getattr(optimizer, "local_optimizer", None) or getattr(optimizer, "optim", None) or optimizer
    return sum(
        t.numel() * t.element_size()
        for state in local.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.device.type == device.type
    )


def sharding_rows(
    variant: str, per_rank: list[dict] | str, setting: dict[str, Any], param_numels: list[int]
) -> list[dict[str, Any]]:
    """Every rank's rows of one sharding benchmark variant: per phase the predicted parameters, gradients and
    optimizer state and the measured memory (`skipped` where the device has no allocator statistics) with the
    remainder (peak minus predicted); the optimizer state held; the predicted communication; the step times.
    A variant that ran out of memory ("OOM") gives one OOM row."""
    if per_rank == "OOM":
        return [{**setting, "variant": variant, "status": "OOM", "reason": OOM_REASON}]
    return [
        row
        for rank, result in enumerate(per_rank)
        for row in _sharding_rank_rows(variant, rank, result, setting, param_numels)
    ]


def _sharding_rank_rows(
    variant: str, rank: int, result: dict, setting: dict[str, Any], param_numels: list[int]
) -> list[dict[str, Any]]:
    predicted = sharding_prediction(variant, param_numels, rank, setting["world_size"])
    rows = []

    def add(
        phase: str, quantity: str, value: float | None, unit: str = "bytes", step: int | None = None
    ) -> None:
        skipped = value is None  # memory statistics that this device does not have
        rows.append(
            {
                **setting,
                "variant": variant,
                "rank": rank,
                "phase": phase,
                "step": step,
                "quantity": quantity,
                "value": value,
                "unit": unit,
                "status": "skipped" if skipped else "ok",
                "reason": NO_ALLOCATOR_STATS if skipped else "",
            }
        )

    for phase in SHARDING_PHASES:
        # After initialisation there are only parameters; gradients and state exist from the first step on.
        steady = phase != "after_init"
        parts = {
            "predicted_parameters": predicted["parameters"],
            "predicted_gradients": predicted["gradients"] if steady else 0.0,
            "predicted_optimizer_state": predicted["optimizer_state"] if steady else 0.0,
        }
        for name, value in parts.items():
            add(phase, f"{name}_bytes", value)
        total = sum(parts.values())
        add(phase, "predicted_total_bytes", total)
        allocated, peak = result["memory"].get(phase, (None, None))
        add(phase, "memory_allocated_bytes", allocated)
        add(phase, "max_memory_allocated_bytes", peak)
        add(phase, "remainder_bytes", None if peak is None else peak - total)  # activations before the step
    add("after_step", "measured_optimizer_state_bytes", result["state_bytes"])
    add("iteration", "predicted_communication_bytes", predicted["communication"])
    for step, (iteration, opt_step) in enumerate(zip(result["iteration_s"], result["step_s"], strict=True)):
        add("iteration", "iteration_ms", iteration * 1e3, unit="ms", step=step)
        add("iteration", "optimizer_step_ms", opt_step * 1e3, unit="ms", step=step)
    return rows
