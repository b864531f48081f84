"""The 2026 leaderboard's training step (§9) by stack and depth: step time, peak memory and MFU.

    python -m cs336_systems.experiments.train_step_benchmark --num-layers 2 4 8 --stacks plain native ours \\
        --out results/gpu/train_step/one_gpu.csv

Defaults are the leaderboard's model (d_model 4096, d_ff 11,008, 32 heads, vocabulary 151,936, context 32,768) in
bf16; `--num-layers` sets the depths measured (the leaderboard has 34), `--head-chunk` the LM head's tokens per
chunk, for every chunked head or per head (`chunked=2048 fused=8192`). Per (stack, depth) one row: a fresh model
(cs336_systems.training.stacks; `head_chunk`: its head's), `triton.testing.do_bench` of the whole step on CUDA
(median, after `--warmup-ms`, over `--rep-ms`; wall-clock median of `--steps` steps on the CPU), the allocator's peaks, each
from its own reset of the peak statistics (`peak_mib`: over the steps after the first, the step's own;
`build_peak_mib`: the model's build; `first_step_peak_mib`: the first step, where compilation and autotuning
run), model TFLOP and MFU; an out-of-memory cell is an `OOM` row. Then per stack measured at two depths or more, a `fit` row:
per-layer time = the least-squares slope of step time over depth, and the extrapolation to
`--extrapolate-layers` layers = intercept + slope × layers, labelled as such. On one device each cell also gives
`updated_fraction`, the share of the weights one more step changes (an AdamW update of about the learning rate
is lost on a bf16 weight more than ~256x its size; float32 master weights keep it), and `optimizer_ms`,
`optimizer.step()` timed alone, and the memory the model keeps between steps (`weights_mib`, `gradients_mib`,
`optimizer_state_mib`). With `--components`, one more profiled step per cell gives `component` rows: its
kernels' time by component (attention, head + loss, optimizer, matmul, the rest;
cs336_systems.training.stacks.COMPONENTS); with `--kernels`, the mean of a few profiled steps gives `kernel` rows,
each kernel's time and calls per step (at two depths or more, what a layer costs kernel by kernel is their slope),
and with both flags the component rows come from those same steps.

The sharded stacks (`*_fsdp`) run under the launcher, one rank per GPU, each rank on its own `--batch-size`
sequences (the leaderboard: 2 GPUs x 1 sequence):
    python -m cs336_systems.parallel.launch --nproc 2 --backend nccl --out X.csv -- \\
        cs336_systems.experiments.train_step_benchmark --num-layers 34 --stacks native_fsdp ours_fsdp
There `do_bench` (whose step count depends on each rank's own estimate) would let the ranks run different
numbers of collectives, so every rank runs `--warmup-steps` then `--steps` steps, synchronised after each; a
step's time is the slowest rank's, the cell's the median. With `--time-budgets` the counts are do_bench's instead:
one more step estimates a step (the slowest rank's), then as many warm-up steps as fit in `--warmup-ms` and timed
steps as fit in `--rep-ms` (the spec's leaderboard test: 10,000 and 30,000), the same on every rank; the cell
records them (`warmup_steps`, `timed_steps`). The CUDA allocator uses expandable segments unless
PYTORCH_CUDA_ALLOC_CONF says otherwise. A sharded stack's model is built on the meta device and each rank
initialises only its shards, one layer at a time, as the plain model would be (training.stacks.build_sharded).
Peak memory is the largest rank's; `world_size` and the
MFU count every rank's tokens over every rank's GPU. Our FSDP also counts, in the timed steps, the compute
stream's wait for all-gathers (`gather_wait_ms`) and at the final synchronisation (`sync_wait_ms`): the median
over steps, the largest rank's. On a GPU every cell also records the SM clock and power the timed steps ran
at (`sm_clock_mhz`, `power_w`: means of samples every 0.1 s, warm-up included; `temperature_c`: the highest; on
several ranks the ranks' mean and the hottest; NaN where NVML cannot be read): a GPU at its power cap runs the
same kernels slower in a long, hot, power-hungry run (cs336_systems.measure.gpu_telemetry).

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
import os
import sys

import torch
import torch.distributed as dist

from cs336_systems import cli
from cs336_systems.bench.stack_timing import cell_row, compile_caches, fit_rows, measure
from cs336_systems.kernels import triton_interpreter
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import or_oom, resolve_device
from cs336_systems.parallel.distributed import BACKENDS, distributed, how_to_launch
from cs336_systems.training.stacks import (
    CHUNKED_HEADS,
    DEFAULT_HEAD_CHUNK,
    DTYPES,
    LEADERBOARD,
    STACKS,
    component_of,
    peak_tflops,
)

# The model's dimensions (flags of the same names), the leaderboard's by default
DIMENSIONS = {
    "d_model": "the model width",
    "d_ff": "the FFN's hidden width",
    "num_heads": "attention heads (d_model / num_heads: an even head dim)",
    "vocab_size": "vocabulary size",
    "context_length": "tokens per sequence",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    for name, meaning in DIMENSIONS.items():
        p.add_argument(
            f"--{name.replace('_', '-')}", type=cli.positive_int, default=LEADERBOARD[name], help=meaning
        )
    p.add_argument("--num-layers", type=cli.positive_int, nargs="+", required=True, help="depths to measure")
    p.add_argument("--batch-size", type=cli.positive_int, default=1, help="sequences per step (on this GPU)")
    p.add_argument(
        "--stacks",
        nargs="+",
        choices=list(STACKS),
        default=["plain", "native", "ours"],
        help="the stacks to measure (cs336_systems.training.stacks; *_fsdp: under the launcher)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="bfloat16",
        help="weights, gradients, AdamW state (a *_fp32_master stack's compute)",
    )
    p.add_argument(
        "--head-chunk",
        type=head_chunk,
        nargs="+",
        default=[],
        metavar="[HEAD=]TOKENS",
        help=f"tokens per LM-head chunk, for every chunked head or per head ({', '.join(CHUNKED_HEADS)}=TOKENS; "
        f"default {DEFAULT_HEAD_CHUNK})",
    )
    p.add_argument("--no-compile", action="store_true", help="run every stack's blocks eagerly")
    p.add_argument(
        "--warmup-ms", type=cli.positive_int, default=3000, help="CUDA (or --time-budgets): do_bench warm-up"
    )
    p.add_argument(
        "--rep-ms",
        type=cli.positive_int,
        default=5000,
        help="CUDA (or --time-budgets): do_bench measurement time",
    )
    p.add_argument(
        "--steps",
        type=cli.positive_int,
        default=3,
        help="CPU or several ranks: timed steps (after the warm-up steps)",
    )
    p.add_argument(
        "--warmup-steps", type=cli.positive_int, default=1, help="CPU or several ranks: warm-up steps"
    )
    p.add_argument(
        "--extrapolate-layers",
        type=cli.positive_int,
        default=LEADERBOARD["num_layers"],
        help="depth the fit extrapolates to (the leaderboard's)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="under the launcher: the process group's backend (default: nccl with GPUs, else gloo)",
    )
    p.add_argument(
        "--time-budgets",
        action="store_true",
        help="several ranks: warm up for --warmup-ms and time for --rep-ms as do_bench does, the step counts set "
        "by the slowest rank's step (in place of --warmup-steps, --steps)",
    )
    p.add_argument(
        "--cold-cache",
        action="store_true",
        help="compile and autotune from empty on-disk caches (Inductor's, Triton's), as on a fresh machine",
    )
    p.add_argument(
        "--components",
        action="store_true",
        help="also profile one step per cell: time per component (attention, matmul, ...) rows",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="also profile a few steps per cell: time and calls per kernel (kernel rows)",
    )
    cli.add_device(p)
    args = p.parse_args(argv)
    args.head_chunk = head_chunks(p, args.head_chunk)
    if args.d_model % args.num_heads or (args.d_model // args.num_heads) % 2:
        p.error(f"--d-model {args.d_model} must split into --num-heads {args.num_heads} heads of even size")
    if len(set(args.stacks)) < len(args.stacks) or len(set(args.num_layers)) < len(args.num_layers):
        p.error("--stacks and --num-layers list each value once")
    sharded = [s for s in args.stacks if STACKS[s].sharding != "none"]
    if sharded and "WORLD_SIZE" not in os.environ:
        p.error(f"--stacks {' '.join(sharded)} shard over ranks: {how_to_launch(__name__)}")
    if args.time_budgets and "WORLD_SIZE" not in os.environ:
        p.error("--time-budgets sets the step counts of several ranks: on one device do_bench's --warmup-ms and "
                "--rep-ms apply already (or --warmup-steps and --steps on the CPU)")  # fmt: skip
    if len(sharded) < len(args.stacks) and "WORLD_SIZE" in os.environ:
        p.error(
            f"--stacks {' '.join(s for s in args.stacks if s not in sharded)} run on one GPU: do not launch "
            "them on several ranks (or list only *_fsdp stacks)"
        )
    return args


def head_chunk(text: str) -> tuple[str | None, int]:
    """One `--head-chunk` value: TOKENS (every chunked head) or HEAD=TOKENS."""
    head, _, tokens = text.rpartition("=")
    if head and head not in CHUNKED_HEADS:
        raise argparse.ArgumentTypeError(
            f"{head!r} is not a chunked head (one of {', '.join(CHUNKED_HEADS)})"
        )
    return head or None, cli.positive_int(tokens)


def head_chunks(p: argparse.ArgumentParser, values: list[tuple[str | None, int]]) -> dict[str, int]:
    """Tokens per LM-head chunk by head (CHUNKED_HEADS): a bare value sets every head, HEAD=TOKENS one (over a bare
    value); each once."""
    named = [head or "TOKENS" for head, _ in values]
    if len(set(named)) < len(named):
        p.error(f"--head-chunk sets each head once: got {' '.join(named)}")
    every = next((tokens for head, tokens in values if head is None), DEFAULT_HEAD_CHUNK)
    return dict.fromkeys(CHUNKED_HEADS, every) | {head: tokens for head, tokens in values if head}


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


def run(args: argparse.Namespace, device: torch.device) -> None:
    """Every (stack, depth) cell, the fits; rank 0 (or the only process) writes them."""
    triton_interpreter.use_off_cuda(device)
    main_rank = not dist.is_initialized() or dist.get_rank() == 0
    cells, parts = [], []
    with compile_caches(args.cold_cache):
        for stack in args.stacks:
            for num_layers in args.num_layers:
                result = or_oom(lambda s=stack, n=num_layers: measure(s, n, args, device, STARTED))
                cells.append(cell_row(stack, num_layers, args, device, result))
                if result != "OOM":
                    parts += [
                        {
                            "kind": "component",
                            "stack": stack,
                            "num_layers": num_layers,
                            "component": name,
                            "component_ms": ms,
                            "status": "ok",
                        }
                        for name, ms in result["components"].items()
                    ]
                    parts += [
                        {
                            "kind": "kernel",
                            "stack": stack,
                            "num_layers": num_layers,
                            "kernel": name,
                            "component": component_of(name),
                            "kernel_ms": ms,
                            "calls": calls,
                            "status": "ok",
                        }
                        for name, (ms, calls) in result["kernels"].items()
                    ]
                shown = (
                    "OOM"
                    if result == "OOM"
                    else f"{result['step_ms']:.1f} ms, peak {result['peak_mib']:.0f} MiB "
                    f"(build {result['build_peak_mib']:.0f} MiB)"
                )
                if main_rank:
                    print(f"[train_step] {stack} x {num_layers} layers: {shown}", file=sys.stderr, flush=True)
    if main_rank:
        fits = fit_rows(cells, args.extrapolate_layers, peak_tflops(device))
        write_rows(cells + fits + parts, args.out, cli.params(args))


if __name__ == "__main__":
    main()
