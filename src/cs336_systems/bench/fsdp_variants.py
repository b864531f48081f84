"""What the FSDP benchmark measures (2026 §7), one variant at a time on the current rank:

- `ours`: our FullyShardedDataParallel (cs336_systems.parallel.fsdp) with `compute_dtype` and `prefetch_distance`, in its
  usual mode (gradients reduce-scattered), the mode every other benchmark and the training step use;
- `ours_exact`: the same in exact mode (training equal to the bit to one process's): every unit's forward and
  backward over the whole batch, activations and output gradients all-gathered, no reduce-scatter: its cost;
- `fsdp2`: PyTorch's `fully_shard` on every Transformer block and on the root, MixedPrecisionPolicy with
  param_dtype = the compute dtype and reduce_dtype = fp32, and explicit prefetching at the same distance;
- `ddp`: our bucketed DDP (cs336_systems.parallel.ddp), every rank holding the whole model;
- `single`: the unwrapped model on rank 0 alone, the floor.

The same model, AdamW, batch per rank and training step (workload.TrainingStep) for all. The same precision
policy: with compute dtype bf16 every variant runs its forward under torch.autocast(bf16), so the same
operators run in bf16 (matmuls) and in fp32 (softmax, norms, the loss); the sharded variants also cast their
weights to bf16 before gathering them (ours: compute_dtype; FSDP2: param_dtype), where DDP and the floor cast
them per operator; every variant keeps fp32 master weights, gradients and optimizer state, and reduces
gradients in fp32. With fp32 nothing is cast.

Prefetch distance d means, as in the handout (d = 2): the gather of a unit starts once the unit d before it
has finished its forward, so d units' weights are gathered at a time. FSDP2 prefetches from a module's
pre-forward (pre-backward), so there each module prefetches the next d - 1 modules of the pass (`prefetch_plan`).
Its units are Transformer blocks (and the root: embedding, final norm, head); ours are the Linear and
Embedding weights.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from cs336_systems.accounting.formulas import collective_bytes, dtype_bytes
from cs336_systems.accounting.units import MIB
from cs336_systems.bench.data_parallel import NO_ALLOCATOR_STATS, OOM_REASON
from cs336_systems.measure.timeline import record_timeline, stream_timeline
from cs336_systems.measure.timing import sync, time_steps
from cs336_systems.model.transformer import ModelConfig, TransformerLM
from cs336_systems.parallel import ddp
from cs336_systems.parallel.distributed import DistContext
from cs336_systems.parallel.fsdp import (
    BYTES_KEYS,
    FullyShardedDataParallel,
    StepCommunication,
    is_sharded_layer,
)
from cs336_systems.training import workload

VARIANTS = ("ours", "ours_exact", "fsdp2", "ddp", "single")
COUNTED = ("ours", "ours_exact")  # the variants that count their own waits and bytes
TRACED = ("ours", "fsdp2")  # the variants whose all-gathers the timeline shows
COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}
LAYER = "fsdp_layer_"  # record_function label of Transformer block i's forward in traced steps, followed by i
STAT_KEYS = ("gather_wait_s", "sync_wait_s", *BYTES_KEYS)
NO_STREAMS = (
    "no CUDA streams on the CPU: gloo's collectives run on its worker threads, not beside compute kernels"
)


@dataclass(frozen=True)
class Settings:
    """What every variant of one run shares besides the model and its batch."""

    compute_dtype: str = "bf16"  # COMPUTE_DTYPES
    prefetch_distance: int = 2
    bucket_size_mb: float = 100.0  # our DDP's bucket cap
    lr: float = 1e-4

    @property
    def dtype(self) -> torch.dtype | None:
        return COMPUTE_DTYPES[self.compute_dtype]


def sharded_units(model: nn.Module) -> tuple[list[int], int]:
    """Sizes of the sharded weights (one unit per Linear and Embedding weight, in module order, as our FSDP
    picks them) and the number of replicated parameters (the norms)."""
    sharded = {id(m.weight): m.weight.numel() for m in model.modules() if is_sharded_layer(m)}
    replicated = sum(p.numel() for p in model.parameters() if id(p) not in sharded)
    return list(sharded.values()), replicated


def model_units(cfg: ModelConfig) -> tuple[list[int], int]:
    """`sharded_units` of the model of `cfg`, built on the meta device (no memory)."""
    with torch.device("meta"):
        return sharded_units(TransformerLM(cfg))


def prefetch_plan(length: int, distance: int) -> list[list[int]]:
    """For each module of a pass of `length` modules, the later modules it prefetches: the next distance - 1,
    so that d modules' weights are gathered at a time."""
    return [list(range(i + 1, min(i + distance, length))) for i in range(length)]


def fully_shard_model(model: TransformerLM, device: torch.device, settings: Settings) -> TransformerLM:
    """FSDP2 on every block and the root, with our precision policy and prefetch distance (module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = settings.dtype
    policy = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    blocks = list(model.blocks)
    # The root's pre-forward runs first (the embedding) and its pre-backward first (the head).
    for chain, prefetch in (
        (blocks, "set_modules_to_forward_prefetch"),
        (blocks[::-1], "set_modules_to_backward_prefetch"),
    ):
        chain = [model, *chain]
        for module, targets in zip(chain, prefetch_plan(len(chain), settings.prefetch_distance), strict=True):
            getattr(module, prefetch)([chain[t] for t in targets])
    return model


def wrap(variant: str, model: TransformerLM, ctx: DistContext, settings: Settings) -> nn.Module:
    if variant == "single":
        return model
    if variant == "ddp":
        return ddp.wrap("bucketed", model, settings.bucket_size_mb)
    if variant == "fsdp2":
        return fully_shard_model(model, ctx.device, settings)
    if variant in COUNTED:
        return FullyShardedDataParallel(
            model,
            compute_dtype=settings.dtype,
            prefetch_distance=settings.prefetch_distance,
            exact=variant == "ours_exact",
        )
    raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")


def computed_bytes(
    variant: str, model: TransformerLM, world_size: int, settings: Settings
) -> dict[str, float]:
    """Bytes one rank sends per step (accounting.collective_bytes), computed from the unwrapped model's
    parameters for the variants that do not count them. FSDP2 gathers each block's parameters (in the compute
    dtype) for forward and again for backward, the root's once (it keeps them from forward to backward), and
    reduce-scatters every gradient in fp32; DDP all-reduces every fp32 gradient; the floor sends nothing."""
    compute = dtype_bytes(settings.compute_dtype)
    moved = dict.fromkeys(BYTES_KEYS, 0.0)
    for name, p in model.named_parameters():
        full = p.numel()
        if variant == "fsdp2":
            gathers = 2 if name.startswith("blocks.") else 1
            moved["bytes_all_gathered"] += gathers * collective_bytes(
                "all_gather", full * compute, world_size
            )
            moved["bytes_reduce_scattered"] += collective_bytes("reduce_scatter", full * 4, world_size)
        elif variant == "ddp":
            moved["bytes_all_reduced"] += collective_bytes("all_reduce", full * 4, world_size)
    return moved


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The Transformer blocks inside a wrapper (ours and DDP keep the model as `.module`; FSDP2 is the model)."""
    return getattr(model, "module", model).blocks


@contextmanager
def layer_annotations(blocks: nn.ModuleList) -> Iterator[None]:
    """Each block's forward (its hooks included) inside a profiler range `fsdp_layer_<i>`, so a trace tells which
    block launched a kernel."""
    open_ranges: dict[int, record_function] = {}

    def enter(i: int, *_: object) -> None:
        open_ranges[i] = record_function(f"{LAYER}{i}").__enter__()

    def leave(i: int, *_: object) -> None:
        open_ranges.pop(i).__exit__(None, None, None)

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(partial(enter, i), prepend=True))
        handles.append(block.register_forward_hook(partial(leave, i)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float | None:
    """The allocator's peak since the last reset_peak (CUDA); None on the CPU, which has no such statistics."""
    if device.type != "cuda":
        return None
    sync(device)
    return torch.cuda.max_memory_allocated(device) / MIB


def measure(
    variant: str,
    cfg: ModelConfig,
    batch_size: int,
    settings: Settings,
    ctx: DistContext,
    seed: int,
    warmup: int,
    steps: int,
    trace: Path | None = None,
    trace_steps: int = 2,
) -> dict[str, Any] | None:
    """One variant on this rank: seconds per timed step, the allocator's peak over them (MiB), the counted
    statistics of as many more steps run back to back (ours, with measure_communication on, whose events add
    CPU work the timed steps should not carry; read after those steps) or the computed bytes, and with `trace` (CUDA) the timeline of one profiled
    step (rank 0 writes the trace; the others run the same steps). None on the ranks that `single` leaves idle."""
    if variant == "single" and not ctx.is_main:
        return None
    torch.manual_seed(seed)
    with torch.device(ctx.device):
        model = TransformerLM(cfg)
    bytes_moved = computed_bytes(variant, model, ctx.world_size, settings)
    model = wrap(variant, model, ctx, settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    torch.manual_seed(seed + 1 + ctx.rank)  # each rank its own shard of the data
    batch = workload.random_batch(cfg, batch_size, ctx.device)
    counted: list[StepCommunication] = []

    def sync_gradients() -> None:
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
        if getattr(model, "measure_communication", False):
            counted.append(model.last_communication)

    step = workload.TrainingStep(model, optimizer, batch, settings.dtype, sync_gradients)
    time_steps(step.train_step, warmup, 0, ctx.device)
    reset_peak(ctx.device)
    step_s = time_steps(step.train_step, 0, steps, ctx.device)
    peak = peak_mib(ctx.device)
    if variant in COUNTED:
        # Back to back, as in training: with a sync after every step (time_steps) each rank starts the next one
        # when its own CPU gets there, and the first all-gather then measures that start skew between ranks
        # (2x H200: 18.6 ms median per step on one rank, against 1.5 ms on both run back to back).
        model.measure_communication = True
        for _ in range(steps):
            step.train_step()
        sync(ctx.device)
        model.measure_communication = False
    intervals = None
    if trace is not None:
        with layer_annotations(blocks_of(model)):
            read = partial(stream_timeline, layer_prefix=LAYER)
            intervals = record_timeline(
                step.train_step, trace_steps, ctx.device, trace if ctx.is_main else None, read
            )
    return {
        "step_s": step_s,
        "peak_mib": peak,
        "counted": [record.stats() for record in counted],
        "bytes": bytes_moved,
        "intervals": intervals,
    }


def cell_rows(
    variant: str, setting: dict[str, Any], per_rank: list[dict | None] | str
) -> list[dict[str, Any]]:
    """One row per rank that took part: the cell's step time (per step the slowest rank's; median, min, max in
    ms), this rank's peak (MiB), its exposed all-gather and synchronisation waits (ms, median over the counted
    steps) and bytes sent per step, and where those come from. An out-of-memory cell is one OOM row."""
    base = {"variant": variant, **setting}
    if per_rank == "OOM":
        return [{**base, "status": "OOM", "reason": OOM_REASON}]
    ranks = [(rank, result) for rank, result in enumerate(per_rank) if result is not None]
    slowest = [max(steps) for steps in zip(*(result["step_s"] for _, result in ranks), strict=True)]
    rows = []
    for rank, result in ranks:
        waits, moved, source = waits_and_bytes(variant, result)
        peak = result["peak_mib"]
        rows.append(
            {
                **base,
                "rank": rank,
                "steps": len(slowest),
                "step_ms": statistics.median(slowest) * 1e3,
                "step_min_ms": min(slowest) * 1e3,
                "step_max_ms": max(slowest) * 1e3,
                "peak_mib": peak,
                **waits,
                **moved,
                "bytes_source": source,
                "status": "ok",
                "reason": NO_ALLOCATOR_STATS if peak is None else "",
            }
        )
    return rows


def waits_and_bytes(variant: str, result: dict[str, Any]) -> tuple[dict, dict, str]:
    """Ours (either mode): the medians of its counted statistics. The others: no counted waits (FSDP2 hides its
    all-gather waits inside its hooks: None, read the timeline instead; DDP and the floor gather nothing: 0),
    computed bytes."""
    if variant in COUNTED:
        median = {key: statistics.median(stats[key] for stats in result["counted"]) for key in STAT_KEYS}
        waits = {"gather_wait_ms": median["gather_wait_s"] * 1e3, "sync_wait_ms": median["sync_wait_s"] * 1e3}
        return waits, {key: median[key] for key in STAT_KEYS if key.startswith("bytes")}, "counted"
    wait = None if variant == "fsdp2" else 0.0
    return {"gather_wait_ms": wait, "sync_wait_ms": None}, result["bytes"], "computed"


def timeline_rows(
    variant: str, world_size: int, per_rank: list[dict | None] | str, device: str
) -> list[dict[str, Any]]:
    """Rank 0's timeline of a traced variant; a skipped row on the CPU, an OOM row where it ran out of memory."""
    cell = {"variant": variant, "world_size": world_size}
    if per_rank == "OOM":
        return [{**cell, "status": "OOM", "reason": OOM_REASON}]
    if device != "cuda":
        return [{**cell, "status": "skipped", "reason": NO_STREAMS}]
    return [{**cell, **interval, "status": "ok"} for interval in per_rank[0]["intervals"]]
