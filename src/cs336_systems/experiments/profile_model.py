"""Profile the Transformer LM with torch.profiler (spec §1.1.4 nsys_profile a-e).

For each context length and mode: build the model, run `--warmup` steps outside the profiled window, then
profile `--steps` steps (CPU + CUDA activity) while timing each with the Python timer. Rows (long format,
one CSV), by `record`:
  python_timer  the Python timer around the profiled steps (synchronised after each)               (a)
  range         a `record_function` range of the model/workload (forward, backward, optimizer_step,
                attention, attention/scores, attention/softmax, attention/output, feed_forward)      (a, e)
  kernel        every CUDA kernel (on CPU: every aten op, by self time), with `is_matmul`       (b, c, d)
Columns per step (divided by `--steps`): `count_per_step` and `time_ms_per_step`, which is
  python_timer: mean of the timed steps;
  range:  CUDA: the range's device span (first to last kernel launched from inside the CPU range);
          CPU: the range's CPU duration;
  kernel: CUDA: total kernel time; CPU: the op's self CPU time.
`share` is a kernel's fraction of all kernel (op) time of the cell; `cpu_ms_per_step` and
`device_busy_ms_per_step` (sum of kernel durations) are given for ranges too.

FLOPs (`flops_per_step`, forward only, all layers: per call times calls per step), with B batch, H heads, S
context, d = d_head: attention/scores 2·B·H·S²·d (the Q Kᵀ matmul; scaling and masking not counted),
attention/output 2·B·H·S²·d (P V), attention/softmax 5·B·H·S² (max, subtract, exp, sum, divide per score).

`--trace-dir` keeps a Chrome/Perfetto trace per mode at the first context length, `trace_<size>_<ctx>_<mode>.json`
(a trace of every cell of the large models would be gigabytes of JSON and minutes of export). `--nsys`: when `nsys`
is on the PATH, the same command is re-run under `nsys profile`; each cell then also runs its profiled steps
under `torch.autograd.profiler.emit_nvtx()` (the record_function ranges become NVTX ranges; warm-up and
profiled steps get NVTX ranges of their own).
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cs336_systems import workload
from cs336_systems.benchmarking import free_memory, is_oom, resolve_device, summarize, time_steps
from cs336_systems.model import ModelConfig
from cs336_systems.provenance import write_rows

RANGES = (
    "forward",
    "backward",
    "optimizer_step",
    "attention",
    "attention/scores",
    "attention/softmax",
    "attention/output",
    "feed_forward",
)
MATMUL = re.compile(r"gemm|matmul|xmma|cutlass|nvjet|^aten::(mm|addmm|bmm|baddbmm|addbmm)$", re.IGNORECASE)
UNDER_NSYS = "CS336_UNDER_NSYS"  # set in the re-executed child so it does not re-exec again


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload.add_model_args(p)
    p.add_argument("--context-lengths", type=int, nargs="+", required=True)
    p.add_argument("--modes", nargs="+", choices=workload.MODES, default=list(workload.MODES))
    p.add_argument("--warmup", type=int, default=5, help="steps before the profiled window")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--autocast", choices=sorted(workload.AUTOCAST), default="none")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", help="folder for Chrome/Perfetto traces (and the nsys report)")
    p.add_argument("--nsys", action="store_true", help="re-run under `nsys profile` when nsys is on the PATH")
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be >= 1")
    if any(c < 1 for c in args.context_lengths):
        p.error("--context-lengths must be positive")
    workload.check_model_args(p, args)
    return args


def attention_flops(cfg: ModelConfig, batch_size: int, context_length: int) -> dict[str, int]:
    """FLOPs of one call of each naive-attention range (the convention is in the module docstring)."""
    d_head = cfg.d_model // cfg.num_heads
    squares = batch_size * cfg.num_heads * context_length**2
    return {
        "attention/scores": 2 * squares * d_head,
        "attention/softmax": 5 * squares,
        "attention/output": 2 * squares * d_head,
    }


def _is_kernel(event) -> bool:
    return (
        event.device_type == DeviceType.CUDA
        and not event.is_user_annotation
        and event.name not in RANGES
        and not event.name.startswith("ProfilerStep")
    )


def kineto_events(prof: profile) -> list[SimpleNamespace]:
    """The profiler's raw events with the CPU-op -> kernel link (`linked_correlation_id`).

    FunctionEvent carries that link only from torch 2.12 on; the raw Kineto events carry it in every 2.x release,
    so the CUDA path reads those (times in microseconds on one clock, like FunctionEvent's).
    """
    events = []
    for e in prof.profiler.kineto_results.events():
        start, end = e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3
        interval = SimpleNamespace(start=start, end=end, elapsed_us=lambda s=start, t=end: t - s)
        events.append(
            SimpleNamespace(
                name=e.name(),
                time_range=interval,
                device_type=e.device_type(),
                id=e.correlation_id(),
                linked_correlation_id=e.linked_correlation_id(),
                is_user_annotation=getattr(e, "is_user_annotation", lambda: False)(),
            )
        )
    return events


def range_rows(events: Iterable, steps: int, on_cuda: bool) -> list[dict]:
    """Per record_function range: calls, CPU time and (CUDA) the kernels launched from inside it, per step.

    Kernels are attributed by *launch* time (the CPU start of the op that launched them), not by run time:
    the GPU lags the CPU, and the backward pass runs on the autograd engine's own thread, so neither the
    device time window nor the CPU call tree of the `backward` range would find them.
    """
    events = list(events)
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]
    launched: list[tuple[float, float, float, float]] = []  # (launch, start, end, duration) in us
    if on_cuda:
        launch_of: dict[int, float] = {}
        for e in cpu_ops:
            if e.linked_correlation_id == 0:
                launch_of[e.id] = min(e.time_range.start, launch_of.get(e.id, float("inf")))
        for k in filter(_is_kernel, events):
            start, end = k.time_range.start, k.time_range.end
            launched.append((launch_of.get(k.linked_correlation_id, start), start, end, end - start))
        launched.sort()
    launch_times = [k[0] for k in launched]

    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in cpu_ops:
        if r.name not in RANGES:
            continue
        t = totals[r.name]
        t["count"] += 1
        t["cpu_us"] += r.time_range.elapsed_us()
        inside = launched[
            bisect.bisect_left(launch_times, r.time_range.start) : bisect.bisect_right(
                launch_times, r.time_range.end
            )
        ]
        if inside:
            t["busy_us"] += sum(k[3] for k in inside)
            t["span_us"] += max(k[2] for k in inside) - min(k[1] for k in inside)
    rows = []
    for name, t in totals.items():
        cpu_ms = t["cpu_us"] / 1e3 / steps
        span_ms = t["span_us"] / 1e3 / steps if on_cuda else None
        rows.append(
            {
                "record": "range",
                "name": name,
                "count_per_step": t["count"] / steps,
                "time_ms_per_step": span_ms if on_cuda else cpu_ms,
                "cpu_ms_per_step": cpu_ms,
                "device_busy_ms_per_step": t["busy_us"] / 1e3 / steps if on_cuda else None,
                "device_span_ms_per_step": span_ms,
                "time_basis": "device span" if on_cuda else "cpu",
            }
        )
    return rows


def kernel_rows(events: Iterable, steps: int, on_cuda: bool) -> list[dict]:
    """Per CUDA kernel name (total device time); on CPU per aten op (self CPU time: nothing counts twice)."""
    count: dict[str, int] = defaultdict(int)
    total_us: dict[str, float] = defaultdict(float)
    for e in events:
        if on_cuda and _is_kernel(e):
            us = e.time_range.elapsed_us()
        elif not on_cuda and e.device_type == DeviceType.CPU and e.name.startswith("aten::"):
            us = e.self_cpu_time_total
        else:
            continue
        count[e.name] += 1
        total_us[e.name] += us
    grand_total = sum(total_us.values()) or 1.0
    return [
        {
            "record": "kernel",
            "name": name,
            "count_per_step": count[name] / steps,
            "time_ms_per_step": total_us[name] / 1e3 / steps,
            "share": total_us[name] / grand_total,
            "is_matmul": bool(MATMUL.search(name)),
            "time_basis": "device" if on_cuda else "cpu self",
        }
        for name in sorted(total_us, key=total_us.get, reverse=True)
    ]


def profile_cell(
    args: argparse.Namespace, cfg: ModelConfig, mode: str, device: torch.device, trace: Path | None
) -> list[dict]:
    """Warm up, profile `--steps` steps of `mode` and return the python_timer, range and kernel rows."""
    on_cuda = device.type == "cuda"
    nvtx = on_cuda and bool(os.environ.get(UNDER_NSYS))
    torch.manual_seed(args.seed)
    model, optimizer = workload.build(cfg, device)
    batch = workload.random_batch(cfg, args.batch_size, device)
    step = workload.make_step(model, optimizer, batch, mode, workload.AUTOCAST[args.autocast])
    if nvtx:
        torch.cuda.nvtx.range_push("warmup")
    time_steps(step, args.warmup, 0, device)
    if nvtx:
        torch.cuda.nvtx.range_pop()

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        times = time_steps(step, 0, args.steps, device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    if nvtx:
        with (
            torch.autograd.profiler.emit_nvtx(),
            torch.cuda.nvtx.range(f"profiled {trace.stem if trace else mode}"),
        ):
            time_steps(step, 0, args.steps, device)

    timer = summarize(times)
    rows = [
        {
            "record": "python_timer",
            "name": "step",
            "count_per_step": 1.0,
            "time_ms_per_step": timer["mean_ms"],
            "std_ms": timer["std_ms"],
            "median_ms": timer["median_ms"],
            "time_basis": "python timer",
        }
    ]
    events = kineto_events(prof) if on_cuda else prof.events()
    rows += range_rows(events, args.steps, on_cuda)
    rows += kernel_rows(events, args.steps, on_cuda)
    flops = attention_flops(cfg, args.batch_size, cfg.context_length)
    for row in rows:
        if row["record"] == "range" and row["name"] in flops:
            row["flops_per_step"] = flops[row["name"]] * row["count_per_step"]
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    trace_dir = Path(args.trace_dir) if args.trace_dir else None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for context_length in args.context_lengths:
        cfg = workload.model_config(args, context_length)
        for mode in args.modes:
            base = {
                "size": args.size,
                "context_length": context_length,
                "batch_size": args.batch_size,
                "mode": mode,
                "autocast": args.autocast,
                "attention": args.attention,
                "warmup": args.warmup,
                "steps": args.steps,
                "device": device.type,
            }
            traced = trace_dir is not None and context_length == args.context_lengths[0]
            trace = trace_dir / f"trace_{args.size}_{context_length}_{mode}.json" if traced else None
            print(f"[profile] {args.size} ctx={context_length} {mode} ...", file=sys.stderr, flush=True)
            try:
                rows += [
                    {**base, **row, "status": "ok"} for row in profile_cell(args, cfg, mode, device, trace)
                ]
            except Exception as exc:  # noqa: BLE001 - only OOM is recorded, everything else re-raised
                if not is_oom(exc):
                    raise
                rows.append({**base, "record": "status", "status": "OOM"})
                print(f"[profile]   OOM: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
            finally:
                free_memory()
    return rows


def nsys_command(argv: list[str], args: argparse.Namespace, nsys: str) -> list[str]:
    folder = Path(args.trace_dir) if args.trace_dir else Path(args.out).parent
    report = folder / f"nsys_{args.size}"
    return [
        nsys,
        "profile",
        "--trace=cuda,nvtx,osrt",
        "--force-overwrite=true",
        f"--output={report}",
        sys.executable,
        "-m",
        "cs336_systems.experiments.profile_model",
        *argv,
    ]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    under_nsys = bool(os.environ.get(UNDER_NSYS))
    if args.nsys and not under_nsys:
        nsys = shutil.which("nsys")
        if nsys is not None:
            if args.trace_dir:
                Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
            done = subprocess.run(nsys_command(argv, args, nsys), env={**os.environ, UNDER_NSYS: "1"})
            if done.returncode != 0:
                raise SystemExit(f"nsys profile failed with exit status {done.returncode}")
            return
        print(
            "[profile] --nsys: nsys is not on the PATH; profiling with torch.profiler only", file=sys.stderr
        )
    write_rows(run(args), args.out, {**vars(args), "under_nsys": under_nsys})


if __name__ == "__main__":
    main()
