"""Naive attention, eager and torch.compile'd (spec §1.2.1 pytorch_attention, §1.3.1 torch_compile a).

The attention is the Transformer's own `cs336_systems.model.transformer.naive_attention` (causal, materialises the
(seq x seq) score matrix) applied to single-head Q, K, V of shape (batch, seq, d). For each variant, d and
sequence length: `--warmup` untimed passes, then `--passes` timed forward passes (autograd recording, as in
training) and `--passes` timed backward passes (each after an untimed forward), synchronising after each.
Memory (CUDA only): allocated right before `out.backward(dO)`, the peak of the forward and of the backward
pass, and beside them the formulas of `cs336_systems.accounting.attention_memory`. One row per timed pass; a cell that
runs out of memory gives one `OOM` row for the phase that failed. `tier` is "pytorch" in every row: the kernel
tier column of the FlashAttention benchmarks, for PyTorch's attention.
"""

from __future__ import annotations

import argparse

import torch

from cs336_systems import cli
from cs336_systems.accounting.attention_memory import mib, naive_attention_memory
from cs336_systems.bench import attention_timing
from cs336_systems.measure.cuda_memory import allocated_mib
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import resolve_device, rows_or_oom, time_steps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    cli.add_device(p)
    p.add_argument("--batch-size", type=cli.positive_int, default=8, help="sequences per batch")
    p.add_argument(
        "--head-dims", type=cli.positive_int, nargs="+", default=[16, 32, 64, 128], help="d of Q, K, V"
    )
    p.add_argument(
        "--seq-lens",
        type=cli.positive_int,
        nargs="+",
        default=[256, 1024, 4096, 8192, 16384],
        help="sequence lengths",
    )
    p.add_argument(
        "--warmup", type=cli.nonnegative_int, default=10, help="untimed passes (forward and backward)"
    )
    p.add_argument(
        "--passes", type=cli.positive_int, default=100, help="timed forward and timed backward passes"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=attention_timing.VARIANTS,
        default=["eager"],
        help="eager, and/or compiled with torch.compile",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of Q, K, V")
    return p.parse_args(argv)


def cell_rows(args: argparse.Namespace, variant: str, d: int, seq: int, device: torch.device) -> list[dict]:
    """One variant, d and sequence length: a row per timed pass, or the forward rows and one `OOM` row."""
    dtype = DTYPES[args.dtype]
    formula = naive_attention_memory(args.batch_size, seq, d, dtype.itemsize)
    base = {
        "variant": variant,
        "tier": "pytorch",
        "batch_size": args.batch_size,
        "d": d,
        "seq_len": seq,
        "dtype": args.dtype,
        "warmup": args.warmup,
        "baseline_mib": allocated_mib(device),
        "formula_before_backward_mib": mib(formula["before_backward"]),
        "formula_forward_peak_mib": mib(formula["forward_peak"]),
        "formula_backward_peak_mib": mib(formula["backward_peak"]),
    }
    forward: list[float] = []  # seconds per forward pass, once they are all timed

    def pass_rows(phase: str, times: list[float], memory: dict) -> list[dict]:
        return [
            {**base, "phase": phase, "pass": i, "time_ms": t * 1e3, "status": "ok", **memory}
            for i, t in enumerate(times)
        ]

    def measure() -> list[dict]:
        torch.manual_seed(args.seed)
        attend = attention_timing.attention_variant(variant)
        inputs, grad_out = attention_timing.random_inputs(args.batch_size, seq, d, dtype, device)
        forward.extend(time_steps(lambda: attend(*inputs), args.warmup, args.passes, device))
        backward, memory = attention_timing.time_backward(
            attend, inputs, grad_out, args.warmup, args.passes, device
        )
        return pass_rows("forward", forward, memory) + pass_rows("backward", backward, memory)

    def out_of_memory() -> list[dict]:
        phase = "backward" if forward else "forward"
        oom = {"phase": phase, "pass": None, "time_ms": None, "status": "OOM"}
        return pass_rows("forward", forward, {}) + [
            {**base, **oom, "reason": f"out of memory in the {phase} pass"}
        ]

    return rows_or_oom("attention", f"{variant} d={d} seq={seq}", measure, out_of_memory)


def run(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    attention_timing.warm_up_libraries(DTYPES[args.dtype], device)
    return [
        row
        for variant in args.variants
        for d in args.head_dims
        for seq in args.seq_lens
        for row in cell_rows(args, variant, d, seq, device)
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, vars(args))


if __name__ == "__main__":
    main()
