"""FlashAttention-2 leaderboard timing (spec §1.3.3), with SDPA's flash and cuDNN backends in the same run.

The spec's test exactly: q, k, v = randn(3, heads, seq, d_head) in bf16 (views of one leaf tensor), causal,
`torch.compile(FlashAttentionTriton.apply)`, forward + backward through `o.sum().backward()`, timed by
`triton.testing.do_bench(rep=..., warmup=...)` (mean, as the spec's test prints; the median is a column too).
Rows:
- `triton_compiled` forward_backward: the leaderboard number;
- `triton` (eager autograd Function) forward, backward and forward_backward: where the time goes;
- `sdpa_flash`, `sdpa_cudnn` forward_backward: `scaled_dot_product_attention` pinned to one backend.
TFLOP/s counts causal attention FLOPs: forward 4 * N^2 * d * heads / 2 (the two matmuls over the unmasked
half), backward 2.5x forward, forward + backward 3.5x forward. Without CUDA every row is `skipped`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cs336_systems.benchmarking import free_memory, is_oom
from cs336_systems.flash_attention import FlashAttentionTriton
from cs336_systems.provenance import write_rows

FLOP_CONVENTION = "causal: forward 4*N^2*d*heads/2; backward 2.5x forward; forward_backward 3.5x forward"
PASS_FLOP_FACTOR = {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5}
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--d-head", type=int, default=64, choices=(16, 32, 64, 128))
    p.add_argument("--warmup-ms", type=int, default=1000, help="do_bench warm-up time (spec: 1000)")
    p.add_argument("--rep-ms", type=int, default=10000, help="do_bench measuring time (spec: 10000)")
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    args = p.parse_args(argv)
    for flag in ("heads", "seq_len", "rep_ms"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup_ms < 0:
        p.error(f"--warmup-ms must be >= 0, got {args.warmup_ms}")
    return args


def forward_flops(args: argparse.Namespace) -> float:
    return 4 * args.seq_len**2 * args.d_head * args.heads / 2


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """SDPA on the spec's (heads, seq, d) tensors: its fused backends need (batch, heads, seq, d), so add batch 1."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=is_causal)[0]


def sdpa_with(backend) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def attend(q, k, v, is_causal):
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal)

    return attend


def attention_fn(impl: str) -> Callable:
    from torch.nn.attention import SDPBackend

    if impl == "triton_compiled":
        return torch.compile(FlashAttentionTriton.apply)
    if impl == "triton":
        return FlashAttentionTriton.apply
    return sdpa_with(
        {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    )


def measure(flash: Callable, pass_name: str, q, k, v, args: argparse.Namespace) -> list[float]:
    """All do_bench times (ms) of one pass, as in the spec's test (no gradient reset between calls)."""
    from triton.testing import do_bench

    if pass_name == "forward":
        fn = lambda: flash(q, k, v, True)
    elif pass_name == "backward":
        loss = flash(q, k, v, True).sum()
        fn = lambda: loss.backward(retain_graph=True)
    else:

        def fn():
            o = flash(q, k, v, True)
            loss = o.sum()
            loss.backward()

    return do_bench(fn, rep=args.rep_ms, warmup=args.warmup_ms, return_mode="all")


def run(args: argparse.Namespace) -> list[dict]:
    base = {
        "heads": args.heads,
        "seq_len": args.seq_len,
        "d_head": args.d_head,
        "dtype": "bfloat16",
        "causal": True,
        "flop_convention": FLOP_CONVENTION,
    }
    if not torch.cuda.is_available():
        return [
            {**base, "impl": impl, "pass": p, "ms": None, "status": "skipped", "reason": "needs CUDA"}
            for impl, p in MEASUREMENTS
        ]
    return measure_all(args, base, torch.device("cuda"))


def measure_all(args: argparse.Namespace, base: dict, device: torch.device) -> list[dict]:
    torch.manual_seed(0)
    # As in the spec: q, k, v are views of one leaf, whose .grad the backward passes accumulate into.
    qkv = torch.randn(
        3, args.heads, args.seq_len, args.d_head, device=device, dtype=torch.bfloat16, requires_grad=True
    )
    q, k, v = qkv
    with torch.no_grad():
        reference = sdpa(q, k, v, True)
        diff = (FlashAttentionTriton.apply(q, k, v, True).float() - reference.float()).abs().max().item()
    rows = []
    for impl, pass_name in MEASUREMENTS:
        print(f"[leaderboard] {impl} {pass_name} ...", file=sys.stderr, flush=True)
        row = {
            **base,
            "impl": impl,
            "pass": pass_name,
            "max_abs_diff_vs_sdpa": diff if impl.startswith("triton") else None,
        }
        try:
            times = measure(attention_fn(impl), pass_name, q, k, v, args)
        except Exception as exc:  # noqa: BLE001 - e.g. a backend this GPU lacks: a row, not a crash
            message = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            rows.append({**row, "ms": None, "status": "OOM" if is_oom(exc) else "error", "error": message})
            print(f"[leaderboard]   {rows[-1]['status']}: {message}", file=sys.stderr, flush=True)
        else:
            ms = statistics.fmean(times)
            flops = forward_flops(args) * PASS_FLOP_FACTOR[pass_name]
            rows.append(
                {
                    **row,
                    "ms": ms,
                    "median_ms": statistics.median(times),
                    "n_timed": len(times),
                    "tflops": flops / (ms * 1e-3) / 1e12,
                    "status": "ok",
                    "error": None,
                }
            )
            print(f"[leaderboard]   {ms:.3f} ms", file=sys.stderr, flush=True)
        finally:
            qkv.grad = None  # grads accumulate within a measurement (as in the spec); start each one fresh
            free_memory()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, {**vars(args), "flop_convention": FLOP_CONVENTION})


if __name__ == "__main__":
    main()
