"""Timing helpers shared by the benchmarks: synchronise, warm up, time every step, summarise."""

from __future__ import annotations

import signal
import statistics
import threading
import timeit
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def sync(device: torch.device | str) -> None:
    """Wait for queued device work; a no-op on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# Ctrl-C raises KeyboardInterrupt wherever the main thread is; where that is a finalizer the garbage collector runs
# (free_memory, between cells) or C code that clears Python errors, the interrupt is lost and a sweep runs on to its
# end (the likely cause of a job that ran to its end after Ctrl-C, once, in the interrupted-run test). The handler
# below also remembers the request, and every step and cell checks it.
_interrupted = threading.Event()


def _remember_and_interrupt(signum, frame) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt if SIGINT arrived, even where its own KeyboardInterrupt was lost. The first call in
    the main thread of a process with Python's default SIGINT handler installs the handler that remembers it."""
    if _interrupted.is_set():
        raise KeyboardInterrupt("SIGINT arrived earlier")
    if (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
        and threading.current_thread() is threading.main_thread()
    ):
        signal.signal(signal.SIGINT, _remember_and_interrupt)


def time_phases(
    phases: dict[str, Callable[[], object]], warmup: int, steps: int, device: torch.device | str
) -> list[dict[str, float]]:
    """Run a step made of `phases` (in order) `warmup` times untimed, then `steps` times, synchronising after
    each phase; return per timed step the seconds of each phase."""
    for _ in range(warmup):
        stop_if_interrupted()
        for phase in phases.values():
            phase()
        sync(device)
    times = []
    for _ in range(steps):
        stop_if_interrupted()
        step = {}
        for name, phase in phases.items():
            start = timeit.default_timer()
            phase()
            sync(device)
            step[name] = timeit.default_timer() - start
        times.append(step)
    return times


def time_steps(fn: Callable[[], object], warmup: int, steps: int, device: torch.device | str) -> list[float]:
    """Run `fn` `warmup` times untimed, then `steps` times, synchronising after each; return seconds per step."""
    return [step["step"] for step in time_phases({"step": fn}, warmup, steps, device)]


def summarize(times_s: list[float]) -> dict[str, float]:
    """Mean, standard deviation and median of step times, in milliseconds."""
    ms = [t * 1e3 for t in times_s]
    return {
        "mean_ms": statistics.fmean(ms),
        "std_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0,
        "median_ms": statistics.median(ms),
    }


def is_oom(exc: BaseException) -> bool:
    """True for a CUDA (or CPU allocator) out-of-memory error, which sweeps record as an `OOM` row."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def or_oom(measure: Callable[[], T]) -> T | str:
    """`measure()`, or the string "OOM" when it runs out of memory (any other error propagates); frees memory
    afterwards either way, so the next cell of a sweep starts clean."""
    stop_if_interrupted()
    try:
        return measure()
    except Exception as exc:
        if not is_oom(exc):
            raise
        return "OOM"
    finally:
        free_memory()


def free_memory() -> None:
    """Release cached blocks between sweep cells so one cell's OOM does not poison the next."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; an unknown device, or `cuda` without a GPU, is a ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{name!r} is not a device (auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name!r}: CUDA is not available on this machine")
    return device


def rows_or_oom(
    tag: str, cell: str, measure: Callable[[], list[dict]], oom_rows: Callable[[], list[dict]]
) -> list[dict]:
    """One cell of a sweep: the rows `measure()` gives, or, when it runs out of memory, the rows `oom_rows()`
    gives (called before memory is freed, so it can still read the allocator's peaks); any other error
    propagates. Progress and the OOM go to stderr as `[tag] cell ...`; memory is freed afterwards either way,
    so the next cell starts clean."""
    import sys

    stop_if_interrupted()
    print(f"[{tag}] {cell} ...", file=sys.stderr, flush=True)
    try:
        return measure()
    except Exception as exc:
        if not is_oom(exc):
            raise
        print(f"[{tag}]   OOM: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        return oom_rows()
    finally:
        free_memory()
