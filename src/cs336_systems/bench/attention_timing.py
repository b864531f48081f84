"""Timing an attention function's forward and backward passes, with the CUDA memory around the backward pass
(spec §1.2.1, §1.3.1 a): the attention (eager or torch.compile'd), its random inputs and the timed backward."""

from __future__ import annotations

import timeit
from collections.abc import Callable

import torch

from cs336_systems.measure.cuda_memory import allocated_mib, reset_peak
from cs336_systems.measure.timing import sync
from cs336_systems.model.transformer import naive_attention

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
VARIANTS = ("eager", "compiled")


def attention_variant(variant: str) -> Attention:
    """The Transformer's naive attention, as is (`eager`) or torch.compile'd (`compiled`)."""
    if variant not in VARIANTS:
        raise ValueError(f"attention variant {variant!r}; choose one of {VARIANTS}")
    if variant == "eager":
        return naive_attention
    # A fresh compile per cell: dynamo's recompile limit (8 shapes per function) would otherwise silently fall
    # back to eager part-way through the grid. dynamic=False: one specialised graph per shape, as benchmarked.
    torch._dynamo.reset()
    return torch.compile(naive_attention, dynamic=False)


def random_inputs(
    batch: int, seq: int, d: int, dtype: torch.dtype, device: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Q, K, V of shape (batch, seq, d) that require gradients, and the output gradient dO."""
    qkv = [torch.randn(batch, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    return qkv, torch.randn(batch, seq, d, device=device, dtype=dtype)


def time_backward(
    attend: Attention,
    inputs: list[torch.Tensor],
    grad_out: torch.Tensor,
    warmup: int,
    passes: int,
    device: torch.device,
) -> tuple[list[float], dict[str, float | None]]:
    """Seconds per backward pass (each after an untimed forward) and the memory seen around the last one:
    allocated right before `out.backward(dO)`, and the peaks of its forward and of its backward pass (MiB;
    None off CUDA)."""
    times, memory = [], {}
    for i in range(warmup + passes):
        for x in inputs:
            x.grad = None
        reset_peak(device)
        out = attend(*inputs)
        sync(device)
        memory = {
            "mem_before_backward_mib": allocated_mib(device),
            "peak_forward_mib": allocated_mib(device, peak=True),
        }
        reset_peak(device)
        start = timeit.default_timer()
        out.backward(grad_out)
        sync(device)
        elapsed = timeit.default_timer() - start
        memory["peak_backward_mib"] = allocated_mib(device, peak=True)
        del out
        if i >= warmup:
            times.append(elapsed)
    return times, memory


def warm_up_libraries(dtype: torch.dtype, device: torch.device) -> None:
    """One tiny forward/backward first, so library workspaces (cuBLAS) are allocated before any cell's baseline."""
    x = torch.randn(1, 8, 8, device=device, dtype=dtype, requires_grad=True)
    naive_attention(x, x, x).sum().backward()
    sync(device)
