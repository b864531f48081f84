"""FlashAttention-2 leaderboard timing (spec §1.3.3), with SDPA's flash and cuDNN backends in the same run.

The spec's test exactly: q, k, v = randn(3, heads, seq, d_head) in bf16 (views of one leaf tensor), causal,
`torch.compile(FlashAttentionTriton.apply)`, forward + backward through `o.sum().backward()`, timed by
`triton.testing.do_bench(rep=..., warmup=...)` (mean, as the spec's test prints; the median is a column too).
Rows:
- `triton_compiled` forward_backward: the leaderboard number;
- `triton` (eager autograd Function) forward, backward and forward_backward: where the time goes;
- `sdpa_flash`, `sdpa_cudnn` forward_backward: `scaled_dot_product_attention` pinned to one backend.
Each row's `tier` is the kernel tier ours ran (`flash_tiers`; $CS336_FLASH_TIER forces one), "pytorch" for SDPA's.
TFLOP/s counts causal attention FLOPs: forward 4 * N^2 * d * heads / 2 (the two matmuls over the unmasked
half), backward 2.5x forward, forward + backward 3.5x forward. Without CUDA every row is `skipped`.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from cs336_systems import cli
from cs336_systems.bench import flash_variants as bench
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import free_memory

# (impl, pass) rows in the order they run.
MEASUREMENTS = (
    ("triton_compiled", "forward_backward"),
    ("triton", "forward"),
    ("triton", "backward"),
    ("triton", "forward_backward"),
    ("sdpa_flash", "forward_backward"),
    ("sdpa_cudnn", "forward_backward"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, seed=False)
    p.add_argument("--heads", type=cli.positive_int, default=16, help="attention heads (the batch is 1)")
    p.add_argument("--seq-len", type=cli.positive_int, default=16384, help="tokens per sequence")
    p.add_argument("--d-head", type=cli.head_dim, default=64, help="head dim (1 to 256)")
    bench.add_do_bench_args(p, warmup_ms=1000, rep_ms=10000, note=" (spec: 1000 and 10000)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    base = {
        "heads": args.heads,
        "seq_len": args.seq_len,
        "d_head": args.d_head,
        "dtype": "bfloat16",
        "causal": True,
        "flop_convention": bench.FLOP_CONVENTION,
    }
    if not torch.cuda.is_available():
        skipped = bench.skipped_without_cuda()
        return [{**base, "impl": impl, "tier": None, "pass": p, **skipped} for impl, p in MEASUREMENTS]
    return measure_all(args, base, torch.device("cuda"))


def measure_all(args: argparse.Namespace, base: dict, device: torch.device) -> list[dict]:
    from triton.testing import do_bench

    torch.manual_seed(0)
    # As in the spec: q, k, v are views of one leaf, whose .grad the backward passes accumulate into.
    qkv = torch.randn(
        3, args.heads, args.seq_len, args.d_head, device=device, dtype=torch.bfloat16, requires_grad=True
    )
    q, k, v = qkv
    with torch.no_grad():
        reference = bench.sdpa_attention()(q, k, v)
    diff = bench.max_abs_diff(bench.attention("triton", args.seq_len, device), q, k, v, reference)
    forward_flops = bench.forward_flops(args.seq_len, args.d_head, args.heads)
    rows = []
    for impl, pass_name in MEASUREMENTS:
        bench.log("leaderboard", f"{impl} {pass_name} ...")
        row = {
            **base,
            "impl": impl,
            "tier": None,
            "pass": pass_name,
            "max_abs_diff_vs_sdpa": diff if impl.startswith("triton") else None,
        }
        try:
            row["tier"] = bench.tier(impl, q)
            # As in the spec's test: the gradient of o.sum(), no gradient reset between calls.
            step = bench.pass_step(bench.attention(impl, args.seq_len, device), pass_name, q, k, v, do=None)
            times = do_bench(step, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="all")
        except Exception as exc:  # noqa: BLE001 - e.g. a backend this GPU lacks: a row, not a crash
            rows.append({**row, **bench.failure(exc, "leaderboard")})
        else:
            ms = statistics.fmean(times)
            tflops = forward_flops * bench.PASS_FLOP_FACTOR[pass_name] / (ms * 1e-3) / 1e12
            timing = {
                "ms": ms,
                "median_ms": statistics.median(times),
                "n_timed": len(times),
                "tflops": tflops,
            }
            rows.append({**row, **timing, "status": "ok", "error": None})
            bench.log("leaderboard", f"  {ms:.3f} ms")
        finally:
            step = None
            qkv.grad = None  # grads accumulate within a measurement (as in the spec); start each one fresh
            free_memory()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, {**vars(args), "flop_convention": bench.FLOP_CONVENTION})


if __name__ == "__main__":
    main()
