"""Timing attention for the FlashAttention-2 benchmarks (spec §1.3.2-1.3.3): the implementations they compare,
the step `triton.testing.do_bench` times for each pass, the FLOP convention and the rows of a failure; off the GPU,
where our kernels run in Triton's CPU interpreter, the check of what they compute against a float64 reference;
the kernel tier a row's implementation ran (`tier`); and the host time per call (`host_time_us`), which decides
the time of short sequences, where the GPU finishes a call's kernels faster than the CPU issues them.

An implementation is a function of (q, k, v) of shape (..., seq, d) that returns attention, causal unless it was
built with `causal=False`. Importing this module does not import triton (a CLI may still choose the interpreter).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from cs336_systems import cli
from cs336_systems.measure.timing import is_oom, sync

Attention = Callable[[Tensor, Tensor, Tensor], Tensor]
PASSES = ("forward", "backward", "forward_backward")
# Attention FLOPs: the forward's two matmuls (over the unmasked half where causal); the backward's five are 2.5x.
FLOP_CONVENTION = (
    "causal: forward 4*N^2*d*heads/2 (not causal: 4*N^2*d*heads); backward 2.5x forward; forward_backward 3.5x "
    "forward"
)
PASS_FLOP_FACTOR = {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5}


def forward_flops(seq_len: int, d_head: int, heads: int, causal: bool = True) -> float:
    """Per sequence (times the batch for a batch)."""
    full = 4 * seq_len**2 * d_head * heads
    return full / 2 if causal else full


def naive_attention(seq_len: int, device: torch.device, causal: bool = True) -> Attention:
    """softmax(Q K^T / sqrt(d) [+ causal mask]) V, materialising the (seq x seq) scores; the mask is built once."""
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1) if causal else None

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    return attend


def batched(attend: Attention) -> Attention:
    """`attend`, which needs (batch, heads, seq, d), also for (heads, seq, d) inputs: they get a batch of 1."""

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attend(q[None], k[None], v[None])[0] if q.dim() == 3 else attend(q, k, v)

    return run


def sdpa_attention(backend=None, causal: bool = True) -> Attention:
    """`scaled_dot_product_attention`, pinned to `backend` (an SDPBackend) or with PyTorch's own choice."""
    from torch.nn.attention import sdpa_kernel

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return batched(attend)


def flex_attention(seq_len: int, device: torch.device, causal: bool = True) -> Attention:
    """FlexAttention with a causal block mask (built once for this length) or none; compiled on the GPU, where
    `torch.compile` generates its fused kernels (eager FlexAttention materialises the scores)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    block_mask = None
    if causal:
        block_mask = create_block_mask(
            lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq_len, seq_len, device=str(device)
        )
    run = torch.compile(flex, dynamic=False) if device.type == "cuda" else flex
    return batched(lambda q, k, v: run(q, k, v, block_mask=block_mask))


def attention(impl: str, seq_len: int, device: torch.device, causal: bool = True) -> Attention:
    """The implementation named `impl`: `triton` (ours, eager, the tier chosen for the inputs, through
    `flash_attention` as the model calls it: from a shape's second call on, launched from C++ by `flash_replay`
    unless $CS336_FLASH_REPLAY=0), `triton_portable`
    and `triton_hopper` (ours with that tier forced: FORCED_TIERS), `triton_compiled` (ours under torch.compile),
    `triton_op` (ours eagerly through the torch.library operators that torch.compile calls, where `triton` calls the
    kernels directly), `pytorch_naive`, `flex` (FlexAttention, compiled on the GPU), `sdpa`, or SDPA pinned to one
    backend, `sdpa_flash` or `sdpa_cudnn`. Ours run the tier `tier(impl, q)` names ($CS336_FLASH_TIER forces one)."""
    from torch.nn.attention import SDPBackend

    from cs336_systems.kernels.flash_attention import (
        FlashAttentionTriton,
        flash_attention,
        flash_attention_forward,
    )

    if impl == "triton" or impl in FORCED_TIERS:  # what the model calls: a recorded shape replays from C++
        return lambda q, k, v: flash_attention(q, k, v, causal, tier=FORCED_TIERS.get(impl))
    if impl == "triton_compiled":
        compiled = torch.compile(FlashAttentionTriton.apply)
        return lambda q, k, v: compiled(q, k, v, causal)
    if impl == "triton_op":  # the operator's own autograd formula runs the backward operator
        return lambda q, k, v: flash_attention_forward(q, k, v, causal)[0]
    if impl == "pytorch_naive":
        return naive_attention(seq_len, device, causal)
    if impl == "flex":
        return flex_attention(seq_len, device, causal)
    backends = {
        "sdpa": None,
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    if impl not in backends:
        raise ValueError(f"unknown attention implementation {impl!r}")
    return sdpa_attention(backends[impl], causal)


# Ours with one kernel tier forced (flash_tiers), so that both tiers can be timed side by side.
FORCED_TIERS = {"triton_portable": "portable", "triton_hopper": "hopper"}
# The tier column of PyTorch's attention (not "n/a", which pandas reads back as a missing value).
PYTORCH_TIER = "pytorch"


def tier(impl: str, q: Tensor, causal: bool = True) -> str:
    """The kernel tier that runs `impl` on inputs like `q`: for ours (`triton*`) as `flash_tiers.tier_for` names it,
    PYTORCH_TIER for PyTorch's attention."""
    if not impl.startswith("triton"):
        return PYTORCH_TIER
    from cs336_systems.kernels import flash_tiers

    return flash_tiers.tier_for(q, causal, FORCED_TIERS.get(impl))


def max_abs_diff(attend: Attention, q: Tensor, k: Tensor, v: Tensor, expected: Tensor) -> float:
    with torch.no_grad():
        return (attend(q, k, v).float() - expected.float()).abs().max().item()


# Off the GPU: the bound on our kernels' relative error (max |ours - reference| / max |reference|) against a float64
# reference in the interpreter, per dtype, as tests/kernels/test_flash_attention.py bounds it: the interpreter's
# float32 dot is exact float32; bfloat16 rounds P before P @ V, and O and the gradients.
CHECK_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
CHECK_REFERENCE = "SDPA in float64 on the same inputs"


def relative_error(got: Tensor, expected: Tensor) -> float:
    """max |got - expected| / max |expected|, in float64."""
    return ((got.double() - expected).abs().max() / expected.abs().max()).item()


def check_against_reference(
    attend: Attention, q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool = True
) -> dict[str, float]:
    """One forward and backward of `attend` (the backward of `o` against `do`) beside SDPA's in float64 on the same
    inputs: `forward`, the relative error of the output, and `backward`, the largest of dQ's, dK's and dV's."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = attend(*leaves)
    o.backward(do)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*exact, is_causal=causal)
    reference.backward(do.double())
    return {
        "forward": relative_error(o.detach(), reference.detach()),
        "backward": max(relative_error(t.grad, r.grad) for t, r in zip(leaves, exact, strict=True)),
    }


def pass_step(attend: Attention, pass_name: str, q: Tensor, k: Tensor, v: Tensor, do: Tensor | None):
    """What do_bench times for one pass: the backward is of `o` against the gradient `do`, or of `o.sum()` when
    `do` is None (the spec's leaderboard test); the timed backward reuses one forward's graph."""

    def loss_and_grad(o: Tensor) -> tuple[Tensor, Tensor | None]:
        return (o.sum(), None) if do is None else (o, do)

    if pass_name == "forward":
        return lambda: attend(q, k, v)
    if pass_name == "backward":
        loss, grad = loss_and_grad(attend(q, k, v))
        return lambda: loss.backward(grad, retain_graph=True)
    if pass_name == "forward_backward":

        def forward_backward() -> None:
            loss, grad = loss_and_grad(attend(q, k, v))
            loss.backward(grad)

        return forward_backward
    raise ValueError(f"pass must be one of {PASSES}, got {pass_name!r}")


# ----------------------------------------------------------------------------------------------------------
# Host overhead: the CPU's time per call, apart from the GPU's.
# ----------------------------------------------------------------------------------------------------------
HOST_PASSES = ("forward", "forward_backward")
EMPTY_KERNELS = ("empty_triton_kernel", "empty_triton_kernel_cached")  # the floor of a launch, two ways


def host_step(attend: Attention, pass_name: str, q: Tensor, k: Tensor, v: Tensor, do: Tensor) -> Callable:
    """One call of a pass as training issues it: the forward (recording the graph), or the forward and its backward
    through `torch.autograd.grad` (no gradient accumulates from call to call)."""
    if pass_name == "forward":
        return lambda: attend(q, k, v)
    if pass_name == "forward_backward":
        return lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), do)
    raise ValueError(f"pass must be one of {HOST_PASSES}, got {pass_name!r}")


def empty_launch(name: str, device: torch.device) -> Callable:
    """A launch of a Triton kernel that does nothing, through Triton's own dispatch (`empty_triton_kernel`) or the
    launch cache our kernels use after their first call (`empty_triton_kernel_cached`)."""
    from cs336_systems.kernels import flash_triton

    x = torch.empty(16, device=device)
    if name == "empty_triton_kernel":
        return lambda: flash_triton.empty_kernel[(1,)](x)
    if name == "empty_triton_kernel_cached":
        launcher = flash_triton.CachedLaunch(flash_triton.empty_kernel)
        return lambda: launcher((), (1,), (x,), dict)
    raise ValueError(f"empty kernel launch must be one of {EMPTY_KERNELS}, got {name!r}")


def host_time_us(step: Callable, device: torch.device, calls: int, repeats: int) -> dict[str, float]:
    """Per call, the medians over `repeats` runs of `calls` calls: `host_us`, the CPU's time to issue them (no
    synchronisation inside the run), and `wall_us`, until the device finished them too. Keep calls x launches per
    call below the launch queue's depth (about a thousand) so that the host never waits for the device: then
    host_us is the host's own cost, and wall_us close to host_us says that the host, not the GPU, is the limit."""
    step()  # compiled, tuned and cached before timing
    host, wall = [], []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            step()
        issued = time.perf_counter()
        sync(device)
        done = time.perf_counter()
        host.append((issued - start) / calls * 1e6)
        wall.append((done - start) / calls * 1e6)
    return {"host_us": statistics.median(host), "wall_us": statistics.median(wall)}


def host_overhead_table(rows: list[dict]) -> str:
    """The rows of a host-overhead run as a text table: host and wall microseconds per call."""
    head = f"{'impl':28} {'tier':9} {'pass':17} {'seq_len':>7} {'host_us':>9} {'wall_us':>9}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        host, wall = (f"{r[c]:9.1f}" if r.get(c) is not None else f"{'-':>9}" for c in ("host_us", "wall_us"))
        seq = r.get("seq_len")
        lines.append(
            f"{r['impl']:28} {r.get('tier') or '-':9} {r['pass']:17} {seq if seq is not None else '-':>7} "
            f"{host} {wall}  {r['status']}"
        )
    return "\n".join(lines)


def add_do_bench_args(p: argparse.ArgumentParser, warmup_ms: int, rep_ms: int, note: str = "") -> None:
    """`--warmup-ms` and `--rep-ms`, the times do_bench spends per measurement."""
    p.add_argument(
        "--warmup-ms", type=cli.nonnegative_int, default=warmup_ms, help=f"do_bench warm-up time{note}"
    )
    p.add_argument("--rep-ms", type=cli.positive_int, default=rep_ms, help=f"do_bench measuring time{note}")


def failure(exc: BaseException, tag: str) -> dict:
    """The columns of a measurement that raised (`OOM` or `error`, with the message's first line); logged."""
    status = "OOM" if is_oom(exc) else "error"
    message = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
    log(tag, f"  {status}: {message}")
    return {"ms": None, "status": status, "error": message}


def skipped_without_cuda() -> dict:
    return {"ms": None, "status": "skipped", "reason": "needs CUDA"}


def log(tag: str, message: str) -> None:
    print(f"[{tag}] {message}", file=sys.stderr, flush=True)
