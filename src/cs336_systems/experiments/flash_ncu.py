"""Nsight Compute profile of our FlashAttention kernels beside SDPA's cuDNN attention, at given shapes.

For each `--shapes` entry BxHxNxD (batch, heads, sequence, head dim; causal, bf16), `ncu` runs this module as a
workload (`--workload SHAPE`) that tunes and warms every implementation, then profiles one forward and one
backward of each: ours through each kernel tier that runs the shape on this GPU (`triton_hopper`: the Gluon
kernels for sm_90; `triton_portable`: the Triton kernels, backward = preprocess, dK/dV and dQ passes), called
through the tier's functions, and `scaled_dot_product_attention` pinned to cuDNN (its forward, and its backward
through autograd).
One row per profiled kernel: the unit (`impl`, `pass`), `kernel`, `duration_ms`, the tensor-core pipe's busy share
(`tensor_pipe_pct`), the matmul work executed (`tensor_ops`), SM and memory
throughput as shares of peak and which is higher (`bound`), achieved occupancy, registers per thread, block and
grid size, the two largest stall reasons (warp cycles per issued instruction), and for our kernels the tile
config the autotuner chose. Without CUDA, or without `ncu` on the PATH, every row is `skipped` with the reason.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cs336_systems import cli
from cs336_systems.bench import flash_variants as bench
from cs336_systems.kernels.flash_triton import unsupported_head_dim
from cs336_systems.measure import ncu
from cs336_systems.measure.provenance import write_rows

# The profiled units, in the workload's order: each kernel tier of ours that runs the shape, then cuDNN.
TIERS = ("hopper", "portable")
UNITS = [
    *({"impl": f"triton_{tier}", "pass": p} for tier in TIERS for p in ("forward", "backward")),
    {"impl": "sdpa_cudnn", "pass": "forward"},
    {"impl": "sdpa_cudnn", "pass": "backward"},
]


def tiers_for(d: int) -> list[str]:
    """The tiers of ours that run a causal bf16 shape of head dim d on this GPU (flash_tiers)."""
    from cs336_systems.kernels import flash_tiers

    device = torch.device("cuda")
    ran = []
    for tier in TIERS:
        try:
            if flash_tiers.get(tier).supports(device, torch.bfloat16, d, True):
                ran.append(tier)
        except flash_tiers.TierUnavailableError:
            pass
    return ran


def units(d: int) -> list[dict]:
    ran = {f"triton_{tier}" for tier in tiers_for(d)}
    return [u for u in UNITS if u["impl"] in ran or not u["impl"].startswith("triton")]


def shape(text: str) -> tuple[int, int, int, int]:
    """BxHxNxD, e.g. 1x32x32768x128."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not BxHxNxD (batch x heads x seq x d_head), e.g. 1x16x16384x64"
        )
    b, h, n, d = map(int, parts)
    if (problem := unsupported_head_dim(d)) is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return b, h, n, d


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, seed=False)
    p.add_argument("--shapes", type=shape, nargs="+", help="BxHxNxD each, e.g. 1x32x32768x128")
    p.add_argument(
        "--workload",
        type=shape,
        help="(run by ncu) profile this shape; --out gets the autotuned tile configs",
    )
    args = p.parse_args(argv)
    if (args.shapes is None) == (args.workload is None):
        p.error(
            "give exactly one of --shapes (profile them with ncu) and --workload (the process ncu profiles)"
        )
    return args


def shape_columns(b: int, h: int, n: int, d: int) -> dict:
    return {"batch_size": b, "heads": h, "seq_len": n, "d_head": d, "dtype": "bfloat16", "causal": True}


def workload(b: int, h: int, n: int, d: int, configs_out: str) -> None:
    """Warm-up (autotuning, cuDNN's plan, the marker's compile), then the profiled units, each after a marker."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cs336_systems.kernels import flash_tiers, flash_triton

    tiers = [flash_tiers.get(tier) for tier in tiers_for(d)]
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b * h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q4, k4, v4 = (t.view(b, h, n, d).detach().requires_grad_() for t in (q, k, v))
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    def cudnn_forward() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True)

    def run_units(profiled: bool) -> None:
        if profiled:
            torch.cuda.profiler.start()
        for tier in tiers:
            ncu.mark_unit(flag)
            o, lse = tier.forward(q, k, v, True)
            ncu.mark_unit(flag)
            tier.backward(q, k, v, o, do, lse, True)
        ncu.mark_unit(flag)
        out = cudnn_forward()
        ncu.mark_unit(flag)
        torch.autograd.grad(out, (q4, k4, v4), do.view(b, h, n, d))
        torch.cuda.synchronize()
        if profiled:
            torch.cuda.profiler.stop()

    run_units(profiled=False)
    run_units(profiled=True)
    kernels = (
        flash_triton.flash_fwd_kernel,
        flash_triton.flash_bwd_dkdv_kernel,
        flash_triton.flash_bwd_dq_kernel,
    )
    configs = {kernel.fn.__name__: str(getattr(kernel, "best_config", "")) for kernel in kernels}
    Path(configs_out).write_text(json.dumps(configs))


def profile(b: int, h: int, n: int, d: int, metrics: list[str]) -> list[dict]:
    """ncu over the workload of one shape: tidy rows, or one `error` row per unit saying why there are none."""
    columns = shape_columns(b, h, n, d)
    with tempfile.TemporaryDirectory() as tmp:
        report, configs = Path(tmp) / "flash.ncu-rep", Path(tmp) / "configs.json"
        workload_cmd = [
            sys.executable,
            "-m",
            "cs336_systems.experiments.flash_ncu",
            "--workload",
            f"{b}x{h}x{n}x{d}",
            "--out",
            str(configs),
        ]
        bench.log("flash_ncu", f"profiling {b}x{h}x{n}x{d} ...")
        done = subprocess.run(
            ncu.command(report, workload_cmd, metrics), stdout=sys.stderr, stderr=sys.stderr
        )
        try:
            if done.returncode != 0:
                raise RuntimeError(f"ncu exited with {done.returncode} (see the log)")
            rows = ncu.credit_to_units(ncu.kernels(ncu.raw_page(report)), units(d))
            chosen = json.loads(configs.read_text())
        except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
            failed = {"status": "error", "error": str(exc).splitlines()[0][:300]}
            bench.log("flash_ncu", f"  error: {failed['error']}")
            return [{**columns, **unit, **failed} for unit in units(d)]
    for row in rows:
        row.update(columns, config=chosen.get(row["kernel"]), status="ok")
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    reason = "needs CUDA" if not torch.cuda.is_available() else None
    if reason is None and shutil.which("ncu") is None:
        reason = "needs Nsight Compute (ncu on the PATH)"
    if reason:
        return [
            {**shape_columns(*s), **unit, "status": "skipped", "reason": reason}
            for s in args.shapes
            for unit in UNITS
        ]
    metrics = ncu.requested_metrics(ncu.available_metrics())
    return [row for s in args.shapes for row in profile(*s, metrics)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.workload:
        workload(*args.workload, configs_out=args.out)
        return
    write_rows(run(args), args.out, {**vars(args), "flop_convention": bench.FLOP_CONVENTION})


if __name__ == "__main__":
    main()
