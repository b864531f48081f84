"""Optimizer state sharding: memory and time per iteration (ADDENDUM.md §3, sharding accounting a-b).

Run under the launcher (which records a `skipped` row where the machine lacks the GPUs); rank 0 writes every
rank's rows:
    python -m cs336_systems.launch --nproc 2 --backend nccl --out X.csv -- \
        cs336_systems.experiments.sharding_benchmark --d-model 1600 --d-ff 6400 --num-layers 48 \
        --num-heads 25 --batch-size 2 --context-length 512

Variants, in one run: `unsharded` (torch.optim.AdamW), `sharded` (our ShardedOptimizer over AdamW) and `zero`
(torch.distributed.optim.ZeroRedundancyOptimizer over AdamW); gradients are averaged by FlatDDP (one flat
all-reduce). An iteration is zero_grad, forward, backward, gradient all-reduce and the optimizer step on
`--batch-size` sequences per rank.

Memory (CUDA only; CPU has no allocator statistics, so those rows are `skipped`): `memory_allocated` and
`max_memory_allocated` after model initialisation, then, in one steady-state iteration after the warm-up
(the optimizer state exists), after forward + backward (`forward_backward`: its peak holds the activations),
directly before the optimizer step (`before_step`: peak of the gradient all-reduce, which holds a flat copy of
the gradients) and directly after it (`after_step`: peak of the step), resetting the peak between phases.
Beside them the predicted parameters, gradients and optimizer state (accounting.training_state_memory: fp32,
AdamW's two moments; the sharded variant's own partition, the ideal 1/world_size for `zero`), the optimizer
state bytes actually held on the device, and the remainder (peak minus predicted: the activations in
`forward_backward`, the transient buffers of the all-reduce and of the step).

Time: `--steps` iterations after `--warmup`, with a device synchronisation before and after the optimizer
step, so `iteration_ms` and its `optimizer_step_ms` come from the same iterations; one row per rank and step.
Also per variant the predicted bytes each rank sends per step (accounting.data_parallel_communication).
"""

from __future__ import annotations

import argparse
import sys
import timeit

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

from cs336_systems import workload
from cs336_systems.accounting import data_parallel_communication, training_state_memory, values
from cs336_systems.benchmarking import free_memory, or_oom, sync
from cs336_systems.ddp import FlatDDP
from cs336_systems.distributed import BACKENDS, DistContext, distributed, gather_to_rank0
from cs336_systems.model import TransformerLM
from cs336_systems.provenance import write_rows
from cs336_systems.sharded_optimizer import ShardedOptimizer

VARIANTS = ("unsharded", "sharded", "zero")
PHASES = ("after_init", "forward_backward", "before_step", "after_step")
NO_ALLOCATOR_STATS = "no allocator statistics on CPU"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload.add_model_args(p)  # --batch-size is per rank
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--warmup", type=int, default=5, help="untimed iterations per variant (>= 1: creates state)"
    )
    p.add_argument("--steps", type=int, default=10, help="timed iterations per variant")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--backend", choices=BACKENDS, help="default: nccl where there are GPUs, else gloo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    args = p.parse_args(argv)
    for flag in ("batch_size", "context_length", "steps", "warmup"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr}")
    workload.check_model_args(p, args)
    return args


def make_optimizer(variant: str, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if variant == "sharded":
        return ShardedOptimizer(params, torch.optim.AdamW, lr=lr)
    if variant == "zero":
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes of optimizer state this rank holds on `device` (AdamW's `step` counters stay on the CPU)."""
    local = getattr(optimizer, "local_optimizer", None) or getattr(optimizer, "optim", None) or optimizer
    return sum(
        t.numel() * t.element_size()
        for state in local.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.device.type == device.type
    )


def measure(variant: str, args: argparse.Namespace, ctx: DistContext) -> dict:
    """This rank's memory per phase (CUDA), optimizer state bytes and iteration / step times (seconds)."""
    cfg = workload.model_config(args, args.context_length)
    cuda = ctx.device.type == "cuda"
    memory: dict[str, tuple[int, int]] = {}

    def snapshot(phase: str) -> None:
        if cuda:
            sync(ctx.device)
            memory[phase] = (
                torch.cuda.memory_allocated(ctx.device),
                torch.cuda.max_memory_allocated(ctx.device),
            )
            torch.cuda.reset_peak_memory_stats(ctx.device)

    free_memory()
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    torch.manual_seed(args.seed)
    with ctx.device:  # initialise on the device: an XL model initialised on the CPU takes long
        model = FlatDDP(TransformerLM(cfg))
    optimizer = make_optimizer(variant, list(model.parameters()), args.lr)
    snapshot("after_init")
    torch.manual_seed(args.seed + 1 + ctx.rank)  # each rank its own shard of the data
    inputs, targets = workload.random_batch(cfg, args.batch_size, ctx.device)

    def forward_backward(instrumented: bool = False) -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        if instrumented:
            snapshot("forward_backward")  # the all-reduce's flat gradient copy comes after this
        model.finish_gradient_synchronization()

    for _ in range(args.warmup):
        forward_backward()
        optimizer.step()
    snapshot("warmup")  # only resets the peak
    forward_backward(instrumented=True)
    snapshot("before_step")
    optimizer.step()
    snapshot("after_step")

    iteration_s, step_s = [], []
    for _ in range(args.steps):
        sync(ctx.device)
        start = timeit.default_timer()
        forward_backward()
        sync(ctx.device)
        before_step = timeit.default_timer()
        optimizer.step()
        sync(ctx.device)
        end = timeit.default_timer()
        iteration_s.append(end - start)
        step_s.append(end - before_step)
    return {
        "memory": {phase: memory[phase] for phase in PHASES if phase in memory},
        "state_bytes": optimizer_state_bytes(optimizer, ctx.device),
        "iteration_s": iteration_s,
        "step_s": step_s,
    }


def predicted(variant: str, param_numels: list[int], rank: int, world_size: int) -> dict[str, float]:
    """Predicted bytes of parameters, gradients and optimizer state on `rank`, and communication per step."""
    memory = values(training_state_memory(param_numels, world_size))
    state = {
        "unsharded": memory["optimizer_state_bytes"],
        "sharded": memory.get(f"sharded_optimizer_state_bytes_rank{rank}", 0.0),
        "zero": memory["sharded_optimizer_state_bytes_ideal"],
    }[variant]
    comm = values(data_parallel_communication(sum(param_numels), world_size)) if world_size > 1 else {}
    comm_key = "ddp_bytes_per_rank" if variant == "unsharded" else "sharded_bytes_per_rank"
    return {
        "parameters": memory["parameters_bytes"],
        "gradients": memory["gradients_bytes"],
        "optimizer_state": state,
        "communication": comm.get(comm_key, 0.0),
    }


def rows_for_rank(variant: str, rank: int, result: dict, base: dict, param_numels: list[int]) -> list[dict]:
    world_size = base["world_size"]
    guess = predicted(variant, param_numels, rank, world_size)
    rows = []

    def add(
        phase: str, quantity: str, value: float | None, unit: str = "bytes", step: int | None = None
    ) -> None:
        skipped = value is None  # memory statistics that this device does not have
        rows.append(
            {
                **base,
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

    for phase in PHASES:
        # After initialisation there are only parameters; gradients and state exist from the first step on.
        steady = phase != "after_init"
        parts = {
            "predicted_parameters": guess["parameters"],
            "predicted_gradients": guess["gradients"] if steady else 0.0,
            "predicted_optimizer_state": guess["optimizer_state"] if steady else 0.0,
        }
        for name, value in parts.items():
            add(phase, f"{name}_bytes", value)
        total = sum(parts.values())
        add(phase, "predicted_total_bytes", total)
        if phase in result["memory"]:
            allocated, peak = result["memory"][phase]
            add(phase, "memory_allocated_bytes", allocated)
            add(phase, "max_memory_allocated_bytes", peak)
            add(phase, "remainder_bytes", peak - total)  # activations before the step
        else:
            for name in ("memory_allocated_bytes", "max_memory_allocated_bytes", "remainder_bytes"):
                add(phase, name, None)
    add("after_step", "measured_optimizer_state_bytes", result["state_bytes"])
    add("iteration", "predicted_communication_bytes", guess["communication"])
    for step, (iteration, opt_step) in enumerate(zip(result["iteration_s"], result["step_s"], strict=True)):
        add("iteration", "iteration_ms", iteration * 1e3, unit="ms", step=step)
        add("iteration", "optimizer_step_ms", opt_step * 1e3, unit="ms", step=step)
    return rows


def run_variant(variant: str, args: argparse.Namespace, ctx: DistContext) -> list[dict]:
    """Rows for one variant on rank 0 (empty on the others); out of memory on any rank gives one OOM row."""
    result: dict | str
    result = or_oom(lambda: measure(variant, args, ctx))
    per_rank = gather_to_rank0(result)
    if per_rank is None:
        return []
    cfg = workload.model_config(args, args.context_length)
    with torch.device("meta"):  # parameter shapes without allocating them
        param_numels = [p.numel() for p in TransformerLM(cfg).parameters()]
    base = {
        "size": args.size,
        "d_model": args.d_model,
        "num_layers": args.num_layers,
        "num_params": sum(param_numels),
        "batch_size_per_rank": args.batch_size,
        "context_length": args.context_length,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "warmup": args.warmup,
    }
    if "OOM" in per_rank:
        return [{**base, "variant": variant, "status": "OOM", "reason": "out of memory on a rank"}]
    median_ms = sorted(max(times) for times in zip(*(r["iteration_s"] for r in per_rank), strict=True))
    print(
        f"[sharding] {variant}: median iteration {median_ms[len(median_ms) // 2] * 1e3:.1f} ms",
        file=sys.stderr,
    )
    return [
        row
        for rank, result in enumerate(per_rank)
        for row in rows_for_rank(variant, rank, result, base, param_numels)
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with distributed(args.backend) as ctx:
        rows = [row for variant in args.variants for row in run_variant(variant, args, ctx)]
        if ctx.is_main:
            write_rows(rows, args.out, {**vars(args), "world_size": ctx.world_size})


if __name__ == "__main__":
    main()
