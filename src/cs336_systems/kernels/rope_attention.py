"""Our RoPE and our causal FlashAttention as one autograd node (the model with `rope="triton"` and
`attention="flash_triton"`, as the 2026 leaderboard's stack runs it).

    o = rope_attention(qkv, cos, sin)   # qkv: (batch, seq, 3, heads, d_head) -> o: (batch, heads, seq, d_head)

The forward is RoPE's op (q and k rotated, v copied, into one tensor in qkv's layout) and then attention's. The
backward is one op that returns the projection's gradient itself: attention's backward writes dQ, dK and dV into
the slices of one tensor in qkv's layout, dQ and dK rotated back on the way (the tier's `rope` argument: the Hopper
tier rotates dQ in its float32 accumulator's conversion and dK in the backward's epilogue, and stores both and dV
where they lie; the portable tier rotates with RoPE's kernel), so no launch of RoPE's backward remains and no second
gradient tensor is made. Apart, RoPE's backward took attention's three gradients and wrote a new tensor from them
in three launches (kernels/rope.py). A custom op may not return tensors that alias each other, hence one tensor
out, its slices taken outside.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cs336_systems.kernels import flash_attention, flash_tiers, rope


def _slices(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v of a (batch, seq, 3, heads, d_head) tensor, each a (batch, heads, seq, d_head) view."""
    return tuple(t[:, :, i].transpose(1, 2) for i in range(3))


@torch.library.custom_op("cs336::rope_attention_backward", mutates_args=())
def rope_attention_backward(
    rotated: Tensor,
    O: Tensor,
    dO: Tensor,
    L: Tensor,
    cos: Tensor,
    sin: Tensor,
    is_causal: bool,
    tier: str | None = None,
) -> Tensor:
    """The gradient of the QKV projection (rotated's shape and layout) from O's: attention's backward into its
    slices, dQ and dK rotated back on the way (by the tier: flash_tiers)."""
    grad = rotated.new_empty(rotated.shape)
    q, k, v = _slices(rotated)
    chosen = flash_tiers.tier_for(q, is_causal, tier)
    flash_attention._backward(q, k, v, O, dO, L, is_causal, chosen, out=_slices(grad), rope=(cos, sin))
    return grad


@rope_attention_backward.register_fake
def _(rotated, O, dO, L, cos, sin, is_causal: bool, tier: str | None = None) -> Tensor:
    return rotated.new_empty(rotated.shape)


class _RotaryAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor, is_causal: bool, tier: str | None) -> Tensor:
        rotated = rope.rope_qkv_forward(qkv, cos, sin)
        O, L = flash_attention.flash_attention_forward(*_slices(rotated), is_causal, tier)
        ctx.save_for_backward(rotated, O, L, cos, sin)
        ctx.is_causal, ctx.tier = is_causal, tier
        return O

    @staticmethod
    def backward(ctx, dO: Tensor):
        rotated, O, L, cos, sin = ctx.saved_tensors
        grad = rope_attention_backward(rotated, O, dO, L, cos, sin, ctx.is_causal, ctx.tier)
        return grad, None, None, None, None


def rope_attention(
    qkv: Tensor, cos: Tensor, sin: Tensor, is_causal: bool = True, tier: str | None = None
) -> Tensor:
    """Attention over q, k and v of the QKV projection qkv (batch, seq, 3, heads, d_head), q and k rotated by the
    tables cos, sin (seq, d_head / 2) as `rope.rope_qkv` does: O (batch, heads, seq, d_head), in v's dimension order
    (heads-last). Differentiable in qkv."""
    rope.check(qkv, cos, sin)
    return _RotaryAttention.apply(qkv, cos.contiguous(), sin.contiguous(), is_causal, tier)
