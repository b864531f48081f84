"""The LM head and the cross-entropy loss in one, without the (tokens x vocab) logits (2026 leaderboard).

    loss = fused_linear_cross_entropy(h, weight, targets)   # == cross_entropy(h @ weight.T, targets, reduction="sum")

At the leaderboard's shape the logits alone are 65,536 x 151,936 values (20 GB in bf16, twice that with their
gradient). Here tokens go in chunks: a chunk's logits come from one matmul; a Triton kernel turns each row, in
place, into the loss's gradient with respect to it (softmax - one-hot, from an online logsumexp over the row) and
writes the row's loss; two more matmuls give the chunk's gradient of `h` and add its share of the weight's. So the
gradients are made during the forward, where the softmax is at hand, and the backward only scales them by the
incoming gradient (one pass over each, by a Triton kernel). Extra memory: one chunk's logits, the gradient of `h`,
and the weight's gradient (float32, accumulated over chunks).

The kernel runs compiled on CUDA and in Triton's CPU interpreter (TRITON_INTERPRET=1), as the tests do.
Targets must lie in [0, vocab): checking would synchronise the device, so an out-of-range id is undefined here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cs336_systems.kernels import (
    triton_interpreter,  # Below every logit a float32 row holds; masked lanes start and stay there, so they add exp(-huge) = 0 to the sum.
)

_FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr, targets_ptr, loss_ptr, n_cols, row_stride, scale, BLOCK: tl.constexpr
):
    """One program per row: the row's loss, and the row overwritten with scale * (softmax - one-hot)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    target = tl.load(targets_ptr + row)
    # Online logsumexp, lane by lane: m = running max, s = sum of exp(x - m).
    m = tl.full([BLOCK], _FLOOR, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=_FLOOR).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    row_max = tl.max(m, 0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
    target_logit = tl.load(row_ptr + target).to(tl.float32)
    tl.store(loss_ptr + row, lse - target_logit)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(row_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
        tl.store(row_ptr + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=inside)


def cross_entropy_rows_(logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Each row's cross-entropy (float32), with `logits` (rows x vocab, rows contiguous) overwritten by
    scale * (softmax - one-hot): the gradient of scale * loss.sum() with respect to the logits."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be a 2-D tensor with contiguous rows, got shape {tuple(logits.shape)} "
            f"and strides {logits.stride()}"
        )
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets must have shape ({logits.shape[0]},), got {tuple(targets.shape)}")
    if not logits.is_cuda and not triton_interpreter.enabled():
        raise ValueError(
            f"the cross-entropy kernel needs CUDA tensors, but logits are on {logits.device}; set "
            "TRITON_INTERPRET=1 (before importing triton) to run it on the CPU"
        )
    if triton_interpreter.enabled():
        triton_interpreter.patch()
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    block = min(4096, triton.next_power_of_2(logits.shape[1]))
    _cross_entropy_rows_kernel[(logits.shape[0],)](
        logits,
        targets.contiguous(),
        loss,
        logits.shape[1],
        logits.stride(0),
        scale,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return loss


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """out += a @ b (out = a @ b if `first`: out's old values are never read, so it need not be zeroed),
    accumulated in out's dtype (float32) even where a and b are bf16/fp16."""
    beta = 0 if first else 1
    if a.dtype == out.dtype:
        out.addmm_(a, b, beta=beta)
    elif out.is_cuda:
        torch.addmm(out, a, b, beta=beta, out_dtype=out.dtype, out=out)
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype), beta=beta)


@triton.jit
def _scaled_copy_kernel(src_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = src * scale (a 0-d tensor), in float32 and rounded once to out's dtype; flat, contiguous."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    scale = tl.load(scale_ptr).to(tl.float32)
    x = tl.load(src_ptr + offsets, mask=inside).to(tl.float32)
    tl.store(out_ptr + offsets, (x * scale).to(out_ptr.dtype.element_ty), mask=inside)


def _scaled(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """src * scale in float32, rounded once to `dtype`, in one pass. (torch.mul(..., out=) of a float32 tensor into a
    bf16 one takes PyTorch's casting path: 2.30 ms for the 8B model's 2.3 GiB head gradient on an H200, in two launches
    past 2 GiB; this kernel 0.86 ms.)"""
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    block = 4096
    _scaled_copy_kernel[(triton.cdiv(src.numel(), block),)](
        src, scale.to(torch.float32), out, src.numel(), BLOCK=block, num_warps=8
    )
    return out


class FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, mean: bool):
        n = h.shape[0]
        scale = 1.0 / n if mean else 1.0
        loss = torch.empty(n, dtype=torch.float32, device=h.device)
        grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if h.requires_grad else None
        # the first chunk's product is written into it, not added (no zero fill: 0.5 ms for the 8B model's head)
        new = torch.empty if n else torch.zeros
        grad_weight = (
            new(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad else None
        )
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            logits = h[rows] @ weight.T
            loss[rows] = cross_entropy_rows_(logits, targets[rows], scale)
            if grad_h is not None:
                torch.mm(logits, weight, out=grad_h[rows])
            if grad_weight is not None:
                _add_product(grad_weight, logits.T, h[rows], first=start == 0)
            del logits  # else it lives on while the next chunk's logits are made: two chunks' at the peak
        ctx.save_for_backward(grad_h, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss.sum() * scale

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_weight = ctx.saved_tensors
        if grad_h is not None:
            grad_h = _scaled(grad_h, grad_loss, grad_h.dtype)
        if grad_weight is not None:
            # scaled in float32 and rounded once, straight into the weight's dtype: no float32 temporary of the
            # weight's size (2.3 GiB for the 8B model's head) beside the saved accumulator
            grad_weight = _scaled(grad_weight, grad_loss, ctx.weight_dtype)
        return grad_h, grad_weight, None, None, None


def fused_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk: int = 8192, reduction: str = "sum"
) -> torch.Tensor:
    """cross_entropy(h @ weight.T, targets, reduction) for h (..., d), weight (vocab, d) and targets (...),
    `chunk` tokens at a time. reduction: "sum" (the leaderboard's) or "mean"."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"h (..., d) and weight (vocab, d) must agree on d: got h {tuple(h.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    if targets.shape != h.shape[:-1]:
        raise ValueError(
            f"targets must have h's leading shape {tuple(h.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return FusedLinearCrossEntropy.apply(
        h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), chunk, reduction == "mean"
    )
