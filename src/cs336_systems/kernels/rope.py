"""RoPE on the QKV projection's output, and its backward, as Triton kernels (2026 leaderboard).

    q, k, v = rope_qkv(qkv, cos, sin)   # qkv: (batch, seq, 3, heads, d_head), cos/sin: (seq, d_head / 2)

q and k come out rotated (consecutive feature pairs (2i, 2i+1) of each head by the angle whose cosine and sine
the tables give, as the model's RotaryEmbedding), v copied, all three (batch, heads, seq, d_head) views of one new
tensor in qkv's layout. That tensor alone holds what attention reads, so selective checkpointing keeps it in a
compiled block (cs336_systems.model.checkpointing) instead of the projection's output, and nothing is rotated
again in backward. The backward takes the three gradients and writes the projection's gradient in one tensor of
qkv's shape: q's and k's rotated back, v's copied.

Why a kernel of its own: compiled PyTorch does the same rotation, but its backward goes through `select` and
`slice` backwards, which write zero-filled tensors and add them: two kernels of about 0.45 ms each per layer of the
8B model at 32k tokens (H200), beside 0.48 ms for the forward and again for its recomputation under selective
checkpointing: 1.85 ms per layer (the pipeline's kernel maps at e2a718a and 136c003). Here each element is read
once and written once in six launches (three forward, three backward): 0.99 ms per layer (the pipeline's kernel map
at da40cc4), against 1.24 ms for seven when q and k alone were written and rotated again in backward. Beside our
attention the backward's three go too: attention's backward rotates dQ and dK back itself (`rotate` below on the
portable tier, inside the kernels on the Hopper tier) and writes the projection's gradient (kernels/rope_attention.py).
Arithmetic is float32 with the tables rounded to the activations' dtype first, as the model's `cos.to(x.dtype)`
and torch.compile's float32 arithmetic do, so both round the result once.
It runs compiled on CUDA and in Triton's CPU interpreter (TRITON_INTERPRET=1), as the tests do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cs336_systems.kernels import triton_interpreter

_ROWS = 16  # sequence positions per program
if triton_interpreter.enabled():  # decided when triton was imported, as the kernel below was
    triton_interpreter.patch()


@triton.jit
def _rotate_kernel(
    src_ptr,
    dst_ptr,
    cos_ptr,
    sin_ptr,
    seq,
    heads,
    batch_heads,
    src_b,
    src_h,
    src_s,
    src_d,
    dst_b,
    dst_h,
    dst_s,
    dst_d,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROWS: tl.constexpr,
    DIRECTION: tl.constexpr,
):
    """dst = src with each feature pair rotated (DIRECTION 1), rotated back (-1) or copied (0), for ROWS positions
    of one (batch, head); src and dst are (batch, heads, seq, 2 HALF), any strides (a stride of 1 Triton
    specialises, so the usual unit stride along the last dim costs nothing)."""
    # (batch, head) varies fastest: neighbouring programs read one stretch of the projection's rows and of the tables
    bh = tl.program_id(0) % batch_heads
    b, h = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
    rows = tl.program_id(0) // batch_heads * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, 2 * BLOCK_HALF)
    mask = (rows < seq)[:, None] & (cols < 2 * HALF)[None, :]
    src = src_ptr + b * src_b + h * src_h + rows[:, None].to(tl.int64) * src_s + cols[None, :] * src_d
    dst = dst_ptr + b * dst_b + h * dst_h + rows[:, None].to(tl.int64) * dst_s + cols[None, :] * dst_d
    x = tl.load(src, mask=mask)
    if DIRECTION == 0:
        tl.store(dst, x, mask=mask)
    else:
        even, odd = tl.split(tl.reshape(x.to(tl.float32), (ROWS, BLOCK_HALF, 2)))
        pairs = tl.arange(0, BLOCK_HALF)
        table = rows[:, None] * HALF + pairs[None, :]
        in_table = (rows < seq)[:, None] & (pairs < HALF)[None, :]
        c = tl.load(cos_ptr + table, mask=in_table).to(x.dtype).to(tl.float32)
        s = tl.load(sin_ptr + table, mask=in_table).to(x.dtype).to(tl.float32) * DIRECTION
        rotated = tl.reshape(tl.join(even * c - odd * s, even * s + odd * c), (ROWS, 2 * BLOCK_HALF))
        tl.store(dst, rotated.to(x.dtype), mask=mask)


def rotate(src: Tensor, dst: Tensor, cos: Tensor, sin: Tensor, direction: int) -> None:
    """dst[...] = src rotated (1), rotated back (-1) or copied (0); both (batch, heads, seq, d_head) views, the same
    one allowed (each program reads its rows before it writes them); cos, sin (>= seq, d_head / 2), contiguous."""
    batch, heads, seq, d_head = src.shape
    if seq == 0 or batch * heads == 0:
        return
    grid = (triton.cdiv(seq, _ROWS) * batch * heads,)
    half = d_head // 2
    _rotate_kernel[grid](
        src, dst, cos, sin, seq, heads, batch * heads, *src.stride(), *dst.stride(),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), ROWS=_ROWS, DIRECTION=direction,
    )  # fmt: skip


def backward_into(grads: tuple[Tensor, ...], targets: tuple[Tensor, ...], cos: Tensor, sin: Tensor) -> None:
    """RoPE's backward: the gradients of q and k rotated back and v's copied into `targets` (each a
    (batch, heads, seq, d_head) view); a target may be its gradient itself (rotated in place, v's left as it is)."""
    for grad, target, direction in zip(grads, targets, (-1, -1, 0), strict=True):
        if direction or target is not grad:
            rotate(grad, target, cos, sin, direction)


def _heads_first(t: Tensor) -> Tensor:
    """(batch, seq, heads, d_head) -> the (batch, heads, seq, d_head) view of the same memory."""
    return t.transpose(1, 2)


@torch.library.custom_op("cs336::rope_qkv_forward", mutates_args=())
def rope_qkv_forward(qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """qkv (batch, seq, 3, heads, d_head) with q and k rotated and v copied, in a new tensor of that layout. v is
    copied so that the output alone holds all three: selective checkpointing keeps it (instead of the projection's
    output) and nothing is rotated again in backward."""
    out = qkv.new_empty(qkv.shape)
    for i, direction in enumerate((1, 1, 0)):
        rotate(_heads_first(qkv[:, :, i]), _heads_first(out[:, :, i]), cos, sin, direction)
    return out


@rope_qkv_forward.register_fake
def _(qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return qkv.new_empty(qkv.shape)


@torch.library.custom_op("cs336::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The gradient of qkv (batch, seq, 3, heads, d_head) from those of q, k (rotated back) and v (copied), each
    (batch, heads, seq, d_head) with any strides (an attention's backward may hand over transposed ones)."""
    batch, heads, seq, d_head = dq.shape
    dqkv = dq.new_empty(batch, seq, 3, heads, d_head)
    backward_into((dq, dk, dv), tuple(_heads_first(dqkv[:, :, i]) for i in range(3)), cos, sin)
    return dqkv


@rope_qkv_backward.register_fake
def _(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    batch, heads, seq, d_head = dq.shape
    return dq.new_empty(batch, seq, 3, heads, d_head)


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ctx.save_for_backward(cos, sin)
        rotated = rope_qkv_forward(qkv, cos, sin)
        return tuple(_heads_first(rotated[:, :, i]) for i in range(3))

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        # an output left unused arrives as zeros (autograd materialises gradients by default)
        cos, sin = ctx.saved_tensors
        return rope_qkv_backward(dq, dk, dv, cos, sin), None, None


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v), each (batch, heads, seq, d_head), from the QKV projection viewed as (batch, seq, 3, heads, d_head):
    q and k rotated by the tables cos, sin (seq, d_head / 2; any float dtype, rounded to qkv's), v copied; the three
    are views of one new tensor in qkv's layout. Differentiable in qkv."""
    check(qkv, cos, sin)
    return _RotaryQKV.apply(qkv, cos.contiguous(), sin.contiguous())


def check(qkv: Tensor, cos: Tensor, sin: Tensor) -> None:
    """One error naming what is wrong with RoPE's inputs, before any launch."""
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.shape[-1] % 2:
        raise ValueError(
            f"qkv must be (batch, seq, 3, heads, d_head) with d_head even, got {tuple(qkv.shape)}"
        )
    half = (qkv.shape[1], qkv.shape[-1] // 2)
    if cos.shape != half or sin.shape != half:
        raise ValueError(
            f"cos and sin must be (seq, d_head / 2) = {half} for qkv {tuple(qkv.shape)}: "
            f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    if qkv.device.type != "cuda" and not triton_interpreter.enabled():
        raise ValueError(
            f"the RoPE kernel needs CUDA tensors (or TRITON_INTERPRET=1), but qkv is on {qkv.device}"
        )
