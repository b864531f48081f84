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

import torch

from cs336_systems import cli
from cs336_systems import flash_benchmarking as bench
from cs336_systems.benchmarking import free_memory
from cs336_systems.flash_triton import SUPPORTED_HEAD_DIMS
from cs336_systems.provenance import write_rows

IMPLS = ("triton", "pytorch_naive", "sdpa")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument(
        "--seq-lens", type=cli.positive_int, nargs="+", required=True, help="e.g. 128 256 ... 65536"
    )
    p.add_argument("--d-heads", type=int, nargs="+", required=True, choices=SUPPORTED_HEAD_DIMS)
    p.add_argument("--dtypes", nargs="+", required=True, choices=sorted(DTYPES))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--passes", nargs="+", choices=bench.PASSES, default=list(bench.PASSES))
    bench.add_do_bench_args(p, warmup_ms=25, rep_ms=100, note=" per measurement")
    return p.parse_args(argv)


def cell_columns(dtype_name: str, d_head: int, seq_len: int) -> dict:
    return {"dtype": dtype_name, "seq_len": seq_len, "d_head": d_head, "batch_size": 1, "causal": True}


def run_cell(args: argparse.Namespace, dtype_name: str, d_head: int, seq_len: int, device: torch.device):
    from triton.testing import do_bench

    generator = torch.Generator(device=device).manual_seed(args.seed)
    # Batch 1, one head, in the (batch, heads, seq, d) layout that SDPA's fused backends expect.
    q, k, v, do = (
        torch.randn(1, 1, seq_len, d_head, device=device, dtype=DTYPES[dtype_name], generator=generator)
        for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        expected = bench.sdpa_attention()(q, k, v)
    rows = []
    for impl in args.impls:
        base = {"impl": impl, **cell_columns(dtype_name, d_head, seq_len)}
        try:
            attend = bench.attention(impl, seq_len, device)
            diff = bench.max_abs_diff(attend, q, k, v, expected)
        except Exception as exc:  # noqa: BLE001 - a failing cell becomes a row, the sweep goes on
            failed = bench.failure(exc, "flash")
            rows += [{**base, "pass": p, **failed, "max_abs_diff_vs_sdpa": None} for p in args.passes]
            attend = None
            free_memory()
            continue
        for pass_name in args.passes:
            bench.log("flash", f"{impl} {dtype_name} d={d_head} seq={seq_len} {pass_name} ...")
            try:
                step = bench.pass_step(attend, pass_name, q, k, v, do)
                ms = do_bench(
                    step, warmup=args.warmup_ms, rep=args.rep_ms, grad_to_none=[q, k, v], return_mode="median"
                )
                result = {"ms": ms, "status": "ok", "error": None}
            except Exception as exc:  # noqa: BLE001
                result = bench.failure(exc, "flash")
            finally:
                step = None
                for t in (q, k, v):
                    t.grad = None
                free_memory()
            rows.append({**base, "pass": pass_name, **result, "max_abs_diff_vs_sdpa": diff})
        attend = None
        free_memory()
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    cells = [(dt, d, n) for dt in args.dtypes for d in args.d_heads for n in args.seq_lens]
    if not torch.cuda.is_available():
        return [
            {"impl": impl, **cell_columns(dt, d, n), "pass": p, **bench.skipped_without_cuda()}
            for dt, d, n in cells
            for impl in args.impls
            for p in args.passes
        ]
    rows = []
    for dtype_name, d_head, seq_len in cells:
        rows += run_cell(args, dtype_name, d_head, seq_len, torch.device("cuda"))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, vars(args))


if __name__ == "__main__":
    main()
