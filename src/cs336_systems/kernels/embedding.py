"""The token embedding with its backward as one Triton kernel (2026 leaderboard).

    x = embedding(ids, weight)   # ids: (...) int64, weight: (vocab, d) -> x: (..., d), as F.embedding

The forward is PyTorch's lookup. The backward sums each token's gradient row into its id's row of a zeroed
(vocab, d) gradient: the ids sorted once (stable), then one program per run of equal ids (and block of columns)
adds that run's rows in float32, eight tokens at a time in the tokens' order, and writes the sum rounded once to
the gradient's dtype. Deterministic (no atomics: the same inputs give the same bits), and each gradient row is read
once.

Why a kernel of its own: PyTorch's dense embedding backward (the zero fill, partial sums per segment of sorted ids,
their scatter) takes 2.2-2.7 ms at the 8B step's 32,768 tokens x 4,096 on an H200, on the critical path of a sharded
step, whose end waits for the embedding's gradient, the last one reduced. This one takes 0.7 ms there (uniform ids;
1.3 against 1.5 ms where a Zipf-skewed batch repeats one id 4,274 times): the Hopper tier's FINDINGS.md. It runs
compiled on CUDA and in Triton's CPU interpreter (TRITON_INTERPRET=1), as the tests do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from cs336_systems.kernels import triton_interpreter

# columns per program (8 bf16, 16 bytes, per thread at 4 warps) and tokens per loop step (FINDINGS.md: taller
# tiles were slower)
_BLOCK_D, _ROWS = 1024, 8
if triton_interpreter.enabled():  # decided when triton was imported, as the kernel below was
    triton_interpreter.patch()


@triton.jit
def _sum_runs_kernel(
    grad_ptr, sorted_ptr, order_ptr, out_ptr, n, d, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """out[id] = the sum of grad[order[j]] over the run of j with sorted[j] == id, for the run that starts at this
    program's position (programs inside a run do nothing), columns of one block; ROWS of the run at a time, so that
    a long run (a frequent token) costs one loop step per ROWS tokens. grad, out: rows of d, contiguous."""
    start = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = cols < d
    token = tl.load(sorted_ptr + start)
    previous = tl.load(sorted_ptr + start - 1, mask=start > 0, other=-1)
    if token != previous:
        total = tl.zeros([BLOCK_D], tl.float32)
        j = start
        run_goes_on = True
        while run_goes_on:
            here = j + tl.arange(0, ROWS)
            in_run = tl.load(sorted_ptr + here, mask=here < n, other=-1) == token
            rows = tl.load(order_ptr + here, mask=in_run, other=0)
            in_tile = in_run[:, None] & in_row[None, :]
            tile = tl.load(grad_ptr + rows[:, None] * d + cols[None, :], mask=in_tile, other=0.0)
            total += tl.sum(tile.to(tl.float32), 0)
            j += ROWS
            # a run ends inside the first block of ROWS positions it does not fill
            run_goes_on = tl.sum(in_run.to(tl.int32), 0) == ROWS
        # int64: with int32 ids, vocab x d may pass 2**31
        out_row = out_ptr + token.to(tl.int64) * d
        tl.store(out_row + cols, total.to(out_ptr.dtype.element_ty), mask=in_row)


@torch.library.custom_op("cs336::embedding_backward", mutates_args=())
def embedding_backward(grad: Tensor, ids: Tensor, num_rows: int) -> Tensor:
    """The (num_rows, d) gradient of an embedding's weight from its output's gradient `grad` (n, d) and the n ids."""
    grad = grad.contiguous()
    out = torch.zeros(num_rows, grad.shape[1], dtype=grad.dtype, device=grad.device)
    n = ids.numel()
    if n:
        ordered, order = torch.sort(ids, stable=True)
        _sum_runs_kernel[(n, triton.cdiv(grad.shape[1], _BLOCK_D))](
            grad, ordered, order, out, n, grad.shape[1], ROWS=_ROWS, BLOCK_D=_BLOCK_D, num_warps=4
        )
    return out


@embedding_backward.register_fake
def _(grad: Tensor, ids: Tensor, num_rows: int) -> Tensor:
    return grad.new_empty(num_rows, grad.shape[1])


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.num_rows = weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        return None, embedding_backward(grad.reshape(-1, grad.shape[-1]), ids.reshape(-1), ctx.num_rows)


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """F.embedding(ids, weight), whose weight gradient the kernel above computes."""
    if ids.dtype not in (torch.int32, torch.int64) or weight.dim() != 2:
        raise ValueError(
            f"embedding: ids must be int32 or int64 and weight (vocab, d); got ids {ids.dtype}, "
            f"weight of shape {tuple(weight.shape)}"
        )
    return _Embedding.apply(ids, weight)
