"""FlashAttention-2 benchmark grid (spec §1.3.2 e): our Triton kernels against PyTorch attention.

Batch 1, one head, causal; for every dtype x head dim x sequence length, each implementation is timed with
`triton.testing.do_bench` (median) on the forward, the backward and forward + backward, all in one run:
- `triton`: `FlashAttentionTriton` (Triton forward and backward);
- `pytorch_naive`: softmax(Q K^T / sqrt(d) + causal mask) V, materialising the scores;
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` with PyTorch's own backend choice.
One row per (impl, dtype, seq_len, d_head, pass) with `ms` and `status` (ok / OOM / error), plus
`max_abs_diff_vs_sdpa`: the largest difference of the implementation's output from SDPA's in that cell.
Without CUDA every row is `skipped` with reason "needs CUDA".
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cs336_systems.benchmarking import free_memory, is_oom
from cs336_systems.flash_attention import FlashAttentionTriton
from cs336_systems.provenance import write_rows

IMPLS = ("triton", "pytorch_naive", "sdpa")
PASSES = ("forward", "backward", "forward_backward")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
HEAD_DIMS = (16, 32, 64, 128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", required=True, help="e.g. 128 256 ... 65536")
    p.add_argument("--d-heads", type=int, nargs="+", required=True, choices=HEAD_DIMS)
    p.add_argument("--dtypes", nargs="+", required=True, choices=sorted(DTYPES))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up time per measurement")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.seq_lens):
        p.error(f"--seq-lens must be positive, got {args.seq_lens}")
    if args.warmup_ms < 0 or args.rep_ms < 1:
        p.error(f"--warmup-ms must be >= 0 and --rep-ms >= 1, got {args.warmup_ms} and {args.rep_ms}")
    return args


def naive_causal_attention(mask: torch.Tensor) -> Callable:
    """Attention that materialises the (seq x seq) scores; `mask` (True above the diagonal) is built once."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v

    return attend


def implementation(name: str, seq_len: int, device: torch.device) -> Callable:
    if name == "triton":
        return lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True)
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)
    return naive_causal_attention(mask)


def time_pass(attend: Callable, q, k, v, do, pass_name: str, warmup_ms: int, rep_ms: int) -> float:
    """Median milliseconds of one pass, by triton.testing.do_bench."""
    from triton.testing import do_bench

    inputs = [q, k, v]
    if pass_name == "forward":
        return do_bench(lambda: attend(q, k, v), warmup=warmup_ms, rep=rep_ms, return_mode="median")
    if pass_name == "backward":
        o = attend(q, k, v)
        return do_bench(
            lambda: o.backward(do, retain_graph=True),
            warmup=warmup_ms,
            rep=rep_ms,
            grad_to_none=inputs,
            return_mode="median",
        )
    return do_bench(
        lambda: attend(q, k, v).backward(do),
        warmup=warmup_ms,
        rep=rep_ms,
        grad_to_none=inputs,
        return_mode="median",
    )


def run_cell(args, dtype_name: str, d_head: int, seq_len: int, device: torch.device) -> list[dict]:
    dtype = DTYPES[dtype_name]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    # Batch 1, one head, in the (batch, heads, seq, d) layout that SDPA's fused backends expect.
    q, k, v, do = (
        torch.randn(1, 1, seq_len, d_head, device=device, dtype=dtype, generator=generator) for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = []
    for impl in args.impls:
        base = {
            "impl": impl,
            "dtype": dtype_name,
            "seq_len": seq_len,
            "d_head": d_head,
            "batch_size": 1,
            "causal": True,
        }
        diff = None
        try:
            attend = implementation(impl, seq_len, device)
            with torch.no_grad():
                diff = (attend(q, k, v).float() - expected.float()).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a failing cell becomes a row, the sweep goes on
            rows += [failure_row(base, p, exc) for p in args.passes]
            attend = None
            free_memory()
            continue
        for pass_name in args.passes:
            print(
                f"[flash] {impl} {dtype_name} d={d_head} seq={seq_len} {pass_name} ...",
                file=sys.stderr,
                flush=True,
            )
            try:
                ms = time_pass(attend, q, k, v, do, pass_name, args.warmup_ms, args.rep_ms)
            except Exception as exc:  # noqa: BLE001
                rows.append({**failure_row(base, pass_name, exc), "max_abs_diff_vs_sdpa": diff})
            else:
                rows.append(
                    {
                        **base,
                        "pass": pass_name,
                        "ms": ms,
                        "status": "ok",
                        "error": None,
                        "max_abs_diff_vs_sdpa": diff,
                    }
                )
            finally:
                for t in (q, k, v):
                    t.grad = None
                free_memory()
        attend = None
        free_memory()
    return rows


def failure_row(base: dict, pass_name: str, exc: BaseException) -> dict:
    status = "OOM" if is_oom(exc) else "error"
    message = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
    print(f"[flash]   {status}: {message}", file=sys.stderr, flush=True)
    return {
        **base,
        "pass": pass_name,
        "ms": None,
        "status": status,
        "error": message,
        "max_abs_diff_vs_sdpa": None,
    }


def run(args: argparse.Namespace) -> list[dict]:
    cells = [(dt, d, n) for dt in args.dtypes for d in args.d_heads for n in args.seq_lens]
    if not torch.cuda.is_available():
        return [
            {
                "impl": impl,
                "dtype": dt,
                "seq_len": n,
                "d_head": d,
                "batch_size": 1,
                "causal": True,
                "pass": p,
                "ms": None,
                "status": "skipped",
                "reason": "needs CUDA",
            }
            for dt, d, n in cells
            for impl in args.impls
            for p in args.passes
        ]
    device = torch.device("cuda")
    rows = []
    for dtype_name, d_head, seq_len in cells:
        rows += run_cell(args, dtype_name, d_head, seq_len, device)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, vars(args))


if __name__ == "__main__":
    main()
