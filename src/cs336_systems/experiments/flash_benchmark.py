"""FlashAttention-2 benchmark grid: our Triton kernels against PyTorch attention.

The spec's grid (§1.3.2 e) is batch 1, one head, causal; `--heads`, `--tokens` and `--no-causal` set the shapes
of the grid against PyTorch's fastest attention (many heads, batch = tokens / seq_len). For every dtype x head
dim x sequence length, each implementation is timed with `triton.testing.do_bench` (median) on the forward, the
backward and forward + backward, all in one run:
- `triton`: ours (Triton forward and backward) eagerly, through `flash_attention` as the model calls it (from a
  shape's second call on launched from C++ by `flash_replay`); `triton_compiled`: `FlashAttentionTriton` under
  torch.compile; `triton_op` eagerly through the torch.library operators (which `triton` bypasses, as costly on
  the host);
- `pytorch_naive`: softmax(Q K^T / sqrt(d) [+ causal mask]) V, materialising the scores;
- `flex`: FlexAttention (a causal block mask or none), compiled;
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` with PyTorch's own backend choice, and `sdpa_flash`,
  `sdpa_cudnn` pinned to one backend.
With `--rounds R` every implementation is timed R times per cell, the implementations' order reversed every
other round, so that neither always runs right after the other (under a power cap the clock a kernel gets
depends on what ran before it): one row per round, `round` 0..R-1, and a reader takes the median over rounds.
One row per (impl, dtype, seq_len, d_head, pass[, round]) with `tier` (the kernel tier ours ran, `flash_tiers`;
"pytorch" for PyTorch's), `ms`, `tflops` (FLOP convention in the sidecar) and `status` (ok / OOM / error), plus
`max_abs_diff_vs_sdpa`, the largest difference of the implementation's output from SDPA's in that cell, and
`first_call_s`, the implementation's first forward + backward in that cell (synchronised): where the cell needs
it, compiling and autotuning.

Without CUDA our kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, as in the kernels' tests), where a
time says nothing about them: nothing is timed, and per cell our forward and backward are checked instead against
SDPA in float64 on the same inputs. One row per (dtype, seq_len, d_head) and pass (`forward`: the output;
`backward`: the largest of dQ, dK, dV) for `triton` alone, with `interpreted` True, `ms` empty, `rel_err` (max |ours
- reference| / max |reference|), its bound `tolerance`, `max_abs_diff_vs_sdpa` (the output against SDPA in the
cell's dtype) and `status` ok (within the bound), mismatch, or error.

`--host-overhead` measures instead what a call costs the CPU (CUDA only; skipped rows without it): per cell,
implementation and pass (forward; forward + backward through `torch.autograd.grad`), `host_us`, the CPU time of
`--calls` calls issued without synchronising, per call (median of `--repeats` runs), and `wall_us`, until the GPU
finished them; beside them the launch of an empty Triton kernel, through Triton's dispatch and through our launch
cache. The rows are written to --out and printed as a table, e.g.
`--host-overhead --seq-lens 128 256 512 1024 --d-heads 64 --dtypes bfloat16 --impls triton triton_op sdpa`.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch._functorch.config

from cs336_systems import cli
from cs336_systems.bench import flash_variants as bench
from cs336_systems.kernels import triton_interpreter
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import free_memory

IMPLS = (
    "triton",
    *bench.FORCED_TIERS,
    "triton_compiled",
    "triton_op",
    "pytorch_naive",
    "flex",
    "sdpa",
    "sdpa_flash",
    "sdpa_cudnn",
)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CHECKED_PASSES = ("forward", "backward")  # off CUDA: what the interpreter checks, per cell


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument(
        "--seq-lens", type=cli.positive_int, nargs="+", required=True, help="e.g. 128 256 ... 65536"
    )
    p.add_argument(
        "--d-heads", type=cli.head_dim, nargs="+", required=True, help="head dimensions, e.g. 16 32 64 128"
    )
    p.add_argument("--dtypes", nargs="+", required=True, choices=sorted(DTYPES), help="precisions of Q, K, V")
    p.add_argument("--heads", type=cli.positive_int, default=1, help="attention heads per sequence")
    p.add_argument(
        "--tokens", type=cli.positive_int, help="batch = max(1, tokens // seq_len) (default: batch 1)"
    )
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask")
    p.add_argument(
        "--impls",
        nargs="+",
        choices=IMPLS,
        default=["triton", "pytorch_naive", "sdpa"],
        help="implementations to time",
    )
    p.add_argument(
        "--passes",
        nargs="+",
        choices=bench.PASSES,
        default=list(bench.PASSES),
        help="what is timed per implementation",
    )
    bench.add_do_bench_args(p, warmup_ms=25, rep_ms=100, note=" per measurement")
    p.add_argument(
        "--rounds",
        type=cli.positive_int,
        default=1,
        help="times each implementation is timed per cell, interleaved (the order reversed every other round)",
    )
    p.add_argument(
        "--host-overhead",
        action="store_true",
        help="measure the host time per call instead of the GPU time (see above)",
    )
    p.add_argument(
        "--calls",
        type=cli.positive_int,
        default=100,
        help="--host-overhead: calls per run, never synchronised",
    )
    p.add_argument(
        "--repeats", type=cli.positive_int, default=20, help="--host-overhead: runs per measurement"
    )
    return p.parse_args(argv)


def batch_size(args: argparse.Namespace, seq_len: int) -> int:
    return max(1, args.tokens // seq_len) if args.tokens else 1


def cell_columns(args: argparse.Namespace, dtype_name: str, d_head: int, seq_len: int) -> dict:
    return {
        "dtype": dtype_name,
        "seq_len": seq_len,
        "d_head": d_head,
        "batch_size": batch_size(args, seq_len),
        "heads": args.heads,
        "causal": args.causal,
    }


def first_call_seconds(attend: bench.Attention, q, k, v, do) -> float | None:
    """One synchronised forward + backward: compiling and autotuning where this cell is the first to need it.
    None where it fails (an OOM of the backward, say): the passes then say why, each in its own row."""
    start = time.perf_counter()
    try:
        bench.pass_step(attend, "forward_backward", q, k, v, do)()
        if q.is_cuda:
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        bench.failure(exc, "flash")
        return None
    finally:
        for t in (q, k, v):
            t.grad = None
        free_memory()
    return time.perf_counter() - start


def run_cell(args: argparse.Namespace, dtype_name: str, d_head: int, seq_len: int, device: torch.device):
    from triton.testing import do_bench

    columns = cell_columns(args, dtype_name, d_head, seq_len)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    # (batch, heads, seq, d): the layout SDPA's fused backends and FlexAttention expect.
    shape = (columns["batch_size"], args.heads, seq_len, d_head)
    q, k, v, do = (
        torch.randn(*shape, device=device, dtype=DTYPES[dtype_name], generator=generator) for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        expected = bench.sdpa_attention(causal=args.causal)(q, k, v)
    flops = bench.forward_flops(seq_len, d_head, args.heads, args.causal) * columns["batch_size"]
    rows, ready = [], {}
    for impl in args.impls:  # each implementation's first call (compiling, autotuning) and check, once
        base = {"impl": impl, "tier": None, **columns}
        try:
            base["tier"] = bench.tier(impl, q, args.causal)
            attend = bench.attention(impl, seq_len, device, args.causal)
            setup = {"first_call_s": first_call_seconds(attend, q, k, v, do)}
            setup["max_abs_diff_vs_sdpa"] = bench.max_abs_diff(attend, q, k, v, expected)
            ready[impl] = (base, attend, setup)
        except Exception as exc:  # noqa: BLE001 - a failing cell becomes a row, the sweep goes on
            failed = bench.failure(exc, "flash")
            rows += [{**base, "pass": p, **failed, "max_abs_diff_vs_sdpa": None} for p in args.passes]
        finally:
            attend = None
            free_memory()
    for round_ in range(args.rounds):
        for impl in round_order(list(ready), round_):
            base, attend, setup = ready[impl]
            for pass_name in args.passes:
                bench.log("flash", f"{impl} {dtype_name} {tuple(shape)} causal={args.causal} {pass_name} ...")
                try:
                    step = bench.pass_step(attend, pass_name, q, k, v, do)
                    ms = do_bench(
                        step,
                        warmup=args.warmup_ms,
                        rep=args.rep_ms,
                        grad_to_none=[q, k, v],
                        return_mode="median",
                    )
                    tflops = flops * bench.PASS_FLOP_FACTOR[pass_name] / (ms * 1e-3) / 1e12
                    result = {"ms": ms, "tflops": tflops, "status": "ok", "error": None}
                except Exception as exc:  # noqa: BLE001
                    result = bench.failure(exc, "flash")
                finally:
                    step = None
                    for t in (q, k, v):
                        t.grad = None
                    free_memory()
                rows.append({**base, "pass": pass_name, "round": round_, **result, **setup})
    return rows


def round_order(impls: list[str], round_: int) -> list[str]:
    """The implementations in their given order in even rounds, reversed in odd ones."""
    return impls if round_ % 2 == 0 else impls[::-1]


def check_cell(args: argparse.Namespace, dtype_name: str, d_head: int, seq_len: int) -> list[dict]:
    """Off CUDA: our kernels' forward and backward in the interpreter against the float64 reference (no timing)."""
    columns = cell_columns(args, dtype_name, d_head, seq_len)
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(args.seed)
    shape = (columns["batch_size"], args.heads, seq_len, d_head)
    q, k, v, do = (torch.randn(*shape, dtype=dtype, generator=generator) for _ in range(4))
    base = {"impl": "triton", "tier": None, **columns, "ms": None, "interpreted": True}
    tolerance = bench.CHECK_TOLERANCE[dtype]
    bench.log("flash", f"triton {dtype_name} {shape} causal={args.causal}: checked in the interpreter ...")
    try:
        base["tier"] = bench.tier("triton", q, args.causal)
        attend = bench.attention("triton", seq_len, q.device, args.causal)
        errors = bench.check_against_reference(attend, q, k, v, do, args.causal)
        expected = bench.sdpa_attention(causal=args.causal)(q, k, v)
        diff = bench.max_abs_diff(attend, q, k, v, expected)
    except Exception as exc:  # noqa: BLE001 - a failing cell becomes a row, the sweep goes on
        failed = bench.failure(exc, "flash")
        return [{**base, "pass": p, **failed, "tolerance": tolerance} for p in CHECKED_PASSES]
    return [
        {
            **base,
            "pass": p,
            "status": "ok" if errors[p] <= tolerance else "mismatch",
            "rel_err": errors[p],
            "tolerance": tolerance,
            "reference": bench.CHECK_REFERENCE,
            "max_abs_diff_vs_sdpa": diff,
        }
        for p in CHECKED_PASSES
    ]


def host_overhead(args: argparse.Namespace, cells: list[tuple], device: torch.device) -> list[dict]:
    """`--host-overhead`: host and wall time per call of each implementation and pass, per cell, and of an empty
    kernel's launch; skipped rows off CUDA (interpreted kernels say nothing about a GPU's host)."""
    measure = {"calls": args.calls, "repeats": args.repeats}
    rows = []
    for name in bench.EMPTY_KERNELS:
        row = {"impl": name, "tier": None, "pass": "launch", **measure}
        rows.append({**row, **_host_times(args, device, bench.empty_launch, name, device)})
    for dtype_name, d_head, seq_len in cells:
        columns = cell_columns(args, dtype_name, d_head, seq_len)
        shape = (columns["batch_size"], args.heads, seq_len, d_head)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        q, k, v, do = (
            torch.randn(*shape, device=device, dtype=DTYPES[dtype_name], generator=generator)
            for _ in range(4)
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for impl in args.impls:
            torch._dynamo.reset()  # a compiled impl meets a fresh cache in each cell
            # One forward and backward first, as training has run before the forward timed here: a shape's
            # flash_replay plan is registered at its first backward, so a forward alone would time the Python path.
            if device.type == "cuda":
                with contextlib.suppress(Exception):  # an impl that fails says why in its rows below
                    _attention_step(args, impl, "forward_backward", q, k, v, do)()
            for pass_name in bench.HOST_PASSES:
                row = {"impl": impl, "tier": None, **columns, "pass": pass_name, **measure}
                try:
                    row["tier"] = bench.tier(impl, q, args.causal)
                except Exception as exc:  # noqa: BLE001 - no tier runs these inputs: a row that says why
                    rows.append({**row, **bench.failure(exc, "flash")})
                    continue
                step = (_attention_step, args, impl, pass_name, q, k, v, do)
                rows.append({**row, **_host_times(args, device, *step)})
                bench.log(
                    "flash", f"{impl} {pass_name} {shape}: {rows[-1].get('host_us')} us per call on the host"
                )
    return rows


def _attention_step(args: argparse.Namespace, impl: str, pass_name: str, q, k, v, do):
    return bench.host_step(bench.attention(impl, q.shape[-2], q.device, args.causal), pass_name, q, k, v, do)


def _host_times(args: argparse.Namespace, device: torch.device, make_step, *make_args) -> dict:
    """host_us and wall_us of the step `make_step(*make_args)` builds (on CUDA), or the columns of why not."""
    if device.type != "cuda":
        return bench.skipped_without_cuda()
    try:
        times = bench.host_time_us(make_step(*make_args), device, args.calls, args.repeats)
    except Exception as exc:  # noqa: BLE001
        return bench.failure(exc, "flash")
    finally:
        free_memory()
    return {**times, "status": "ok", "error": None}


def run(args: argparse.Namespace) -> list[dict]:
    cells = [(dt, d, n) for dt in args.dtypes for d in args.d_heads for n in args.seq_lens]
    if args.host_overhead:
        return host_overhead(args, cells, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if not torch.cuda.is_available():
        return [row for dt, d, n in cells for row in check_cell(args, dt, d, n)]
    # The timed backward reuses one forward's graph (retain_graph), which a compiled backward with donated
    # buffers (FlexAttention's, under torch.compile) refuses: compile without them in this process.
    torch._functorch.config.donated_buffer = False
    rows = []
    for dtype_name, d_head, seq_len in cells:
        # FlexAttention compiles per shape: a fresh Dynamo cache per cell keeps its recompile limit out of reach.
        torch._dynamo.reset()
        rows += run_cell(args, dtype_name, d_head, seq_len, torch.device("cuda"))
    return rows


def main(argv: list[str] | None = None) -> None:
    # Off CUDA our kernels run in the interpreter, chosen before anything imports triton (the --d-heads check does).
    triton_interpreter.use_off_cuda(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    args = parse_args(argv)
    rows = run(args)
    write_rows(rows, args.out, {**vars(args), "flop_convention": bench.FLOP_CONVENTION})
    if args.host_overhead:
        print(bench.host_overhead_table(rows))


if __name__ == "__main__":
    main()
