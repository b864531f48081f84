"""Naive attention, eager and torch.compile'd (spec §1.2.1 pytorch_attention, §1.3.1 torch_compile a).

The attention is the Transformer's own `cs336_systems.model.naive_attention` (causal, materialises the
(seq x seq) score matrix) applied to single-head Q, K, V of shape (batch, seq, d). For each variant, d and
sequence length: `--warmup` untimed passes, then `--passes` timed forward passes (autograd recording, as in
training) and `--passes` timed backward passes (each after an untimed forward), synchronising after each.
Memory (CUDA only): allocated right before `out.backward(dO)`, the peak of the forward and of the backward
pass, and beside them the formulas of `cs336_systems.attention_memory`. One row per timed pass; a cell that
runs out of memory gives one `OOM` row for the phase that failed.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable

import torch

from cs336_systems.attention_memory import mib, naive_attention_memory
from cs336_systems.benchmarking import free_memory, is_oom, resolve_device, sync, time_steps
from cs336_systems.model import naive_attention
from cs336_systems.provenance import write_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VARIANTS = ("eager", "compiled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 64, 128], help="d of Q, K, V")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024, 4096, 8192, 16384])
    p.add_argument(
        "--warmup", type=int, default=10, help="untimed passes (forward and backward) before timing"
    )
    p.add_argument("--passes", type=int, default=100, help="timed forward passes and timed backward passes")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=["eager"],
        help="eager and/or compiled (torch.compile of the attention function)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.passes < 1:
        p.error("--passes must be >= 1")
    for flag in ("batch_size", "head_dims", "seq_lens"):
        values = getattr(args, flag)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            p.error(f"--{flag.replace('_', '-')} must be positive, got {values}")
    return args


def attention_fn(variant: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    if variant == "eager":
        return naive_attention
    # A fresh compile per cell: dynamo's recompile limit (8 shapes per function) would otherwise silently fall
    # back to eager part-way through the grid. dynamic=False: one specialised graph per shape, as benchmarked.
    torch._dynamo.reset()
    return torch.compile(naive_attention, dynamic=False)


def _allocated_mib(device: torch.device, peak: bool = False) -> float | None:
    if device.type != "cuda":
        return None
    return mib(torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device))


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def time_backward(
    attend: Callable,
    inputs: list[torch.Tensor],
    grad_out: torch.Tensor,
    warmup: int,
    passes: int,
    device: torch.device,
) -> tuple[list[float], dict[str, float | None]]:
    """Seconds per backward pass (each after an untimed forward) and the memory seen around the last one."""
    times, memory = [], {}
    for i in range(warmup + passes):
        for x in inputs:
            x.grad = None
        _reset_peak(device)
        out = attend(*inputs)
        sync(device)
        memory = {
            "mem_before_backward_mib": _allocated_mib(device),
            "peak_forward_mib": _allocated_mib(device, True),
        }
        _reset_peak(device)
        start = timeit.default_timer()
        out.backward(grad_out)
        sync(device)
        elapsed = timeit.default_timer() - start
        memory["peak_backward_mib"] = _allocated_mib(device, peak=True)
        del out
        if i >= warmup:
            times.append(elapsed)
    return times, memory


def run_cell(args: argparse.Namespace, variant: str, d: int, seq: int, device: torch.device) -> list[dict]:
    dtype = DTYPES[args.dtype]
    formula = naive_attention_memory(args.batch_size, seq, d, dtype.itemsize)
    base = {
        "variant": variant,
        "batch_size": args.batch_size,
        "d": d,
        "seq_len": seq,
        "dtype": args.dtype,
        "warmup": args.warmup,
        "baseline_mib": _allocated_mib(device),
        "formula_before_backward_mib": mib(formula["before_backward"]),
        "formula_forward_peak_mib": mib(formula["forward_peak"]),
        "formula_backward_peak_mib": mib(formula["backward_peak"]),
    }
    print(f"[attention] {variant} d={d} seq={seq} ...", file=sys.stderr, flush=True)
    torch.manual_seed(args.seed)
    rows, phase = [], "forward"
    try:
        attend = attention_fn(variant)
        inputs = [
            torch.randn(args.batch_size, seq, d, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        ]
        grad_out = torch.randn(args.batch_size, seq, d, device=device, dtype=dtype)
        forward_times = time_steps(lambda: attend(*inputs), args.warmup, args.passes, device)
        rows += [
            {**base, "phase": "forward", "pass": i, "time_ms": t * 1e3, "status": "ok"}
            for i, t in enumerate(forward_times)
        ]
        phase = "backward"
        backward_times, memory = time_backward(attend, inputs, grad_out, args.warmup, args.passes, device)
    except Exception as exc:  # noqa: BLE001 - only OOM is recorded, everything else re-raised
        if not is_oom(exc):
            raise
        print(f"[attention]   OOM in {phase}: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        rows.append(
            {
                **base,
                "phase": phase,
                "pass": None,
                "time_ms": None,
                "status": "OOM",
                "reason": f"out of memory in the {phase} pass",
            }
        )
    else:
        rows = [{**row, **memory} for row in rows]
        rows += [
            {**base, **memory, "phase": "backward", "pass": i, "time_ms": t * 1e3, "status": "ok"}
            for i, t in enumerate(backward_times)
        ]
    finally:
        attend = inputs = grad_out = None
        free_memory()
    return rows


def warm_up_libraries(dtype: torch.dtype, device: torch.device) -> None:
    """One tiny forward/backward first, so library workspaces (cuBLAS) are allocated before any cell's baseline."""
    x = torch.randn(1, 8, 8, device=device, dtype=dtype, requires_grad=True)
    naive_attention(x, x, x).sum().backward()
    sync(device)


def run(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    warm_up_libraries(DTYPES[args.dtype], device)
    return [
        row
        for variant in args.variants
        for d in args.head_dims
        for seq in args.seq_lens
        for row in run_cell(args, variant, d, seq, device)
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, vars(args))


if __name__ == "__main__":
    main()
