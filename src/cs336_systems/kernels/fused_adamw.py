"""AdamW as one Triton kernel per parameter tensor (2026 leaderboard): read the weight, its gradient and both
moments once, write the weight and the moments once, all arithmetic in float32 whatever the storage dtype.

    optimizer = FusedAdamW(model.parameters(), lr=1e-4)   # the update of torch.optim.AdamW, same defaults

The optimizer step is memory-bound: per element it moves the weight, gradient and two moments in and three of them
out (14 bytes in bf16), so one pass over each tensor is all a fast step needs. Under a sharding wrapper the
parameters are flat shards, a few large tensors, so the step is a few launches. It runs compiled on CUDA and in
Triton's CPU interpreter (TRITON_INTERPRET=1), as the tests do. Options torch.optim.AdamW has beyond these
(amsgrad, maximize, capturable, differentiable) are not offered.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cs336_systems.kernels import triton_interpreter

_BLOCK = 1024


@triton.jit
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    n,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step_size,
    bias_correction2_sqrt,
    BLOCK: tl.constexpr,
):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments) of one block of elements."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    m = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
    p = p * (1.0 - lr * weight_decay)
    m = m + (g - m) * (1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(param_ptr + offsets, p.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offsets, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update, one kernel launch per parameter tensor; the moments are kept in each
    parameter's dtype (as torch.optim.AdamW keeps them)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"FusedAdamW needs lr, eps, weight_decay >= 0 and betas in [0, 1): got lr={lr}, "
                f"betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        if triton_interpreter.enabled():
            triton_interpreter.patch()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.is_contiguous() or not p.grad.is_contiguous():
                    raise ValueError(
                        f"FusedAdamW needs contiguous parameters and gradients: got strides "
                        f"{p.stride()} and {p.grad.stride()} for shape {tuple(p.shape)}"
                    )
                if p.device.type != "cuda" and not triton_interpreter.enabled():
                    raise RuntimeError(
                        "FusedAdamW runs its Triton kernel on CUDA; set TRITON_INTERPRET=1 (before "
                        "importing triton) to run it on the CPU"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                step = state["step"]
                n = p.numel()
                _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
                    p,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    n,
                    group["lr"],
                    beta1,
                    beta2,
                    group["eps"],
                    group["weight_decay"],
                    group["lr"] / (1 - beta1**step),
                    math.sqrt(1 - beta2**step),
                    BLOCK=_BLOCK,
                )
        return loss
