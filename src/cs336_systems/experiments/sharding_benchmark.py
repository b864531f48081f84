"""Optimizer state sharding: memory and time per iteration (ADDENDUM.md §3, sharding accounting a-b).

Run under the launcher (which records a `skipped` row where the machine lacks the GPUs); rank 0 writes every
rank's rows:
    python -m cs336_systems.parallel.launch --nproc 2 --backend nccl --out X.csv -- \\
        cs336_systems.experiments.sharding_benchmark --size xl --batch-size 2 --context-length 512
Variants: `unsharded` (torch.optim.AdamW), `sharded` (our ShardedOptimizer over AdamW) and `zero` (PyTorch's
ZeroRedundancyOptimizer over AdamW); FlatDDP averages the gradients (one flat all-reduce). An iteration is the
training step (workload.TrainingStep) on `--batch-size` sequences per rank.

Memory (CUDA only; the CPU has no allocator statistics, so those rows are `skipped`): `memory_allocated` and
`max_memory_allocated` after model initialisation, then in one steady-state iteration after the warm-up: after
forward + backward (`forward_backward`: its peak holds the activations), directly before the optimizer step
(`before_step`: the gradient all-reduce and its flat copy) and after it (`after_step`), the peak reset between
phases. Beside them the accounting's predictions (accounting.sharding_prediction: parameters, gradients, AdamW
state; ours by its own partition, `zero` at the ideal 1/world_size; bytes sent per step), the optimizer state
held on the device, and the remainder (peak minus predicted: activations, transient buffers).
Time: `--steps` iterations after `--warmup`, synchronised before and after the optimizer step, so
`iteration_ms` and its `optimizer_step_ms` come from the same iterations; one row per rank and step.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from cs336_systems import cli
from cs336_systems.bench.data_parallel import (
    PhaseMemory,
    add_distributed_model_args,
    gather_measurements,
    log_median,
    optimizer_state_bytes,
    setting_columns,
    sharding_rows,
)
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import free_memory, time_phases
from cs336_systems.model.transformer import TransformerLM
from cs336_systems.parallel.ddp import FlatDDP
from cs336_systems.parallel.distributed import DistContext, distributed
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer
from cs336_systems.training import workload

VARIANTS = ("unsharded", "sharded", "zero")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    add_distributed_model_args(p)
    p.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="the optimizers to measure"
    )
    p.add_argument(
        "--warmup", type=cli.positive_int, default=5, help="untimed iterations per variant (create state)"
    )
    p.add_argument("--steps", type=cli.positive_int, default=10, help="timed iterations per variant")
    p.add_argument("--lr", type=cli.positive_float, default=1e-4, help="AdamW's learning rate")
    args = p.parse_args(argv)
    cli.require_launcher(p, __name__)
    return args


def make_optimizer(variant: str, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if variant == "sharded":
        return ShardedOptimizer(params, torch.optim.AdamW, lr=lr)
    if variant == "zero":
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


def measure(variant: str, args: argparse.Namespace, ctx: DistContext) -> dict:
    """This rank's memory per phase (CUDA), optimizer state bytes and iteration / optimizer step times (s)."""
    cfg = cli.model_config(args, args.context_length)
    free_memory()
    memory = PhaseMemory(ctx.device)
    torch.manual_seed(args.seed)
    with ctx.device:  # initialise on the device: an XL model initialised on the CPU takes long
        model = FlatDDP(TransformerLM(cfg))
    optimizer = make_optimizer(variant, list(model.parameters()), args.lr)
    memory.record("after_init")
    torch.manual_seed(args.seed + 1 + ctx.rank)  # each rank its own shard of the data
    batch = workload.random_batch(cfg, args.batch_size, ctx.device)
    step = workload.TrainingStep(
        model, optimizer, batch, sync_gradients=model.finish_gradient_synchronization
    )
    for _ in range(args.warmup):
        step.train_step()
    memory.reset()  # one steady-state iteration, phase by phase
    step.gradients()
    memory.record("forward_backward")  # the all-reduce's flat gradient copy comes after this
    step.sync_gradients()
    memory.record("before_step")
    step.optimizer_step()
    memory.record("after_step")

    def gradients() -> None:
        step.gradients()
        step.sync_gradients()

    times = time_phases({"gradients": gradients, "step": step.optimizer_step}, 0, args.steps, ctx.device)
    return {
        "memory": memory.by_phase,
        "state_bytes": optimizer_state_bytes(optimizer, ctx.device),
        "iteration_s": [phases["gradients"] + phases["step"] for phases in times],
        "step_s": [phases["step"] for phases in times],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = cli.model_config(args, args.context_length)
    param_numels = [p.numel() for p in workload.model_parameters(cfg)]
    with distributed(args.backend) as ctx:
        setting = setting_columns(
            args.size, cfg, args.batch_size, args.warmup, ctx, num_params=sum(param_numels)
        )
        rows = []
        for variant in args.variants:
            per_rank = gather_measurements(partial(measure, variant, args, ctx))
            if per_rank is not None:
                rows += sharding_rows(variant, per_rank, setting, param_numels)
                log_median(f"[sharding] {variant}: median iteration", per_rank, "iteration_s")
        if ctx.is_main:
            write_rows(rows, args.out, {**cli.params(args), "world_size": ctx.world_size})


if __name__ == "__main__":
    main()
