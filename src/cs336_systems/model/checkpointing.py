"""Activation checkpointing of the Transformer's blocks (2026 handout §3.2), and a model of what it costs.

Policies (`ModelConfig.checkpoint`), all on `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`:
  none       every block saves its residuals for backward
  every:K    one level: K consecutive blocks per checkpoint (the last group may be shorter); each group's
             forward is run again in backward
  nested     recursive: the block list split in halves, each half checkpointed, each half's halves inside it
             checkpointed, down to single blocks: O(log N) checkpoints held at once, O(N log N) forward compute
  selective  one checkpoint per block whose matmul outputs (and attention's: SDPA's or our FlashAttention's; and our
             RoPE kernel's) are kept: only norms, activations and elementwise ops are recomputed
             (`create_selective_checkpoint_contexts`)
  selective:attention
             one checkpoint per block that keeps only attention's outputs: everything else, matmuls included, is
             recomputed; a block then holds about one more block input, and backward does not rerun attention

The model of the residual sizes (`held_during_backward`, `predicted_peak`, `forward_evaluations`): one block
saves R bytes for backward (its input included), a checkpoint is one block input of c bytes, and each block's
parameter gradients (w bytes) appear as its backward runs. Blocks run backward from N down to 1.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
MATMUL_OPS = {aten.mm.default, aten.bmm.default, aten.addmm.default}
ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}
# Our FlashAttention's forward and our RoPE's (custom ops, cs336_systems.kernels.flash_attention and .rope), by name:
# naming the ops themselves would import Triton here.
FLASH_OP, ROPE_OP = "cs336::flash_attention_forward", "cs336::rope_qkv_forward"
# What each selective policy keeps (ops, or custom ops by name); every other op of the block is recomputed in
# backward.
SELECTIVE = {
    "selective": MATMUL_OPS | ATTENTION_OPS | {FLASH_OP, ROPE_OP},
    "selective:attention": ATTENTION_OPS | {FLASH_OP},
}
# Kept only in a compiled block. RoPE's output holds q, k and v: kept, it replaces the QKV projection's output among
# what a compiled block saves (the partitioner saves what backward reads, and nothing reads that then), and nothing
# is rotated again; eager checkpointing would cache both.
COMPILED_ONLY = {ROPE_OP}

# While `saved_bytes` counts, the outputs that selective checkpointing caches are reported here (None: the policy
# cannot see them, as in torch < 2.12, whose policy context has no `op_output`).
_cached_output_seen: contextvars.ContextVar[Callable[[torch.Tensor | None], None] | None] = (
    contextvars.ContextVar("cached_output_seen", default=None)
)


def parse(policy: str, num_layers: int) -> tuple[str, int]:
    """("none" | "every" | "nested" | "selective", K) for a policy name; K is 0 except for every:K. A bad name
    or a K outside 1..num_layers is a ValueError naming the field `ModelConfig.checkpoint`."""
    if policy in ("none", "nested"):
        return policy, 0
    if policy in SELECTIVE:
        return "selective", 0
    kind, _, k = policy.partition(":")
    if kind == "every" and k.isdigit() and 1 <= int(k) <= num_layers:
        return kind, int(k)
    raise ValueError(
        f"ModelConfig.checkpoint={policy!r}: choose none, nested, {', '.join(SELECTIVE)} or every:K with K an integer "
        f"from 1 to num_layers={num_layers}"
    )


def sweep(num_layers: int) -> list[str]:
    """Every policy for a model of `num_layers` blocks: none, every:1 .. every:N, nested, the selective ones."""
    return ["none", *(f"every:{k}" for k in range(1, num_layers + 1)), "nested", *SELECTIVE]


def run_blocks(blocks: Sequence[nn.Module], x: torch.Tensor, policy: str) -> torch.Tensor:
    """x through `blocks` in order, checkpointed by `policy`; plain where nothing is saved for backward anyway."""
    kind, k = parse(policy, len(blocks))
    if kind == "none" or not torch.is_grad_enabled():
        return _sequence(blocks, x)
    if kind == "every":
        for start in range(0, len(blocks), k):
            x = checkpoint(_sequence, blocks[start : start + k], x, use_reentrant=False)
        return x
    if kind == "nested":
        return _nested(blocks, x)
    for block in blocks:
        x = checkpoint_selectively(block, x, policy)
    return x


def checkpoint_selectively(block: nn.Module, x: torch.Tensor, policy: str) -> torch.Tensor:
    """`block(x)` under one of the SELECTIVE policies (a function torch.compile can trace whole)."""
    return checkpoint(block, x, use_reentrant=False, context_fn=_SELECTIVE_CONTEXTS[policy])


def _sequence(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def _nested(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    # The first half is the larger: the second half's backward runs while its own checkpoint is held too.
    if len(blocks) == 1:
        return blocks[0](x)
    half = (len(blocks) + 1) // 2
    x = checkpoint(_nested, blocks[:half], x, use_reentrant=False)
    return checkpoint(_nested, blocks[half:], x, use_reentrant=False)


def _keep(kept: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    keep = op in kept or op.name() in kept
    if op.name() in COMPILED_ONLY:
        # compiled: asked while AOTAutograd traces the block, as SAC itself tells (torch.compiler.is_compiling() did
        # under the CPU machine's torch 2.13, but not under the GPU machines' 2.11)
        keep = keep and torch.utils.checkpoint._is_compiling(op, args, kwargs)
    if keep:
        seen = _cached_output_seen.get()
        if seen is not None:
            if not hasattr(ctx, "op_output"):
                seen(None)
            for out in torch.utils._pytree.tree_leaves(getattr(ctx, "op_output", None)):
                if isinstance(out, torch.Tensor):
                    seen(out)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE_CONTEXTS = {
    name: functools.partial(create_selective_checkpoint_contexts, functools.partial(_keep, kept))
    for name, kept in SELECTIVE.items()
}


def saved_bytes(forward: Callable[[], object]) -> int | None:
    """Bytes that `forward()` keeps for backward: every tensor autograd saves (`saved_tensors_hooks`) and every
    output selective checkpointing caches, each storage counted once, parameters not counted (they exist
    anyway); None where selective checkpointing cached outputs this torch cannot show its policy. The graph is
    dropped afterwards."""
    storages: dict[tuple[torch.device, int], int] = {}
    unknown = False

    def count(t: torch.Tensor | None) -> None:
        nonlocal unknown
        if t is None:
            unknown = True
            return
        if isinstance(t, nn.Parameter):
            return
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        storages[key] = max(storages.get(key, 0), storage.nbytes())

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        # Not `t` itself: an output saved with its own grad_fn would make a reference cycle through C++ that
        # Python's gc cannot see, and the whole graph (model, activations) would outlive the measurement.
        return t.detach()

    token = _cached_output_seen.set(count)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        _cached_output_seen.reset(token)
    return None if unknown else sum(storages.values())


# The model of the residual sizes (§3.2 a, b).


def held_during_backward(
    policy: str, num_layers: int, residual: float, checkpoint_bytes: float
) -> list[float]:
    """Bytes saved for backward that are alive while block i (1..N, list index i-1) runs backward, gradients
    aside: the checkpoints still held and the residuals of the blocks recomputed and not yet done. A block's R
    includes its input, which is the checkpoint it was recomputed from, so that one is not counted twice."""
    kind, k = parse(policy, num_layers)
    n, r, c = num_layers, residual, checkpoint_bytes
    if kind == "none":
        return [i * r for i in range(1, n + 1)]
    if kind == "every":
        # Block i is in group g = (i-1)//K (0-based): the g groups before it hold their checkpoints, and its own
        # group's blocks up to i hold their recomputed residuals.
        return [((i - 1) // k) * c + ((i - 1) % k + 1) * r for i in range(1, n + 1)]
    if kind == "nested":
        held = [0.0] * n
        _nested_held(0, n, 0, r, c, held)
        return held
    raise ValueError(f"the residual model has no formula for {policy!r}")


def _nested_held(start: int, stop: int, outer: int, r: float, c: float, held: list[float]) -> None:
    # Blocks start..stop-1 with `outer` checkpoints held besides this segment's input. The second half runs its
    # backward first, while its input is held as one more checkpoint.
    if stop - start == 1:
        held[start] = outer * c + r
        return
    half = start + (stop - start + 1) // 2
    _nested_held(half, stop, outer + 1, r, c, held)
    _nested_held(start, half, outer, r, c, held)


def predicted_peak(
    policy: str, num_layers: int, residual: float, checkpoint_bytes: float, grad_per_block: float = 0.0
) -> float:
    """Peak bytes of activations (and of the block gradients made so far) during backward: the maximum over
    blocks i of what is held while block i runs backward plus the gradients of blocks i+1..N. With
    grad_per_block 0 it is the peak activation memory of §3.2 (a)."""
    held = held_during_backward(policy, num_layers, residual, checkpoint_bytes)
    return max(h + grad_per_block * (num_layers - i) for i, h in enumerate(held, start=1))


def optimal_k(num_layers: int, residual: float, checkpoint_bytes: float, grad_per_block: float = 0.0) -> int:
    """The one-level K (every:K) with the smallest predicted peak; the smallest such K on ties."""
    return min(
        range(1, num_layers + 1),
        key=lambda k: (
            predicted_peak(f"every:{k}", num_layers, residual, checkpoint_bytes, grad_per_block),
            k,
        ),
    )


def forward_evaluations(policy: str, num_layers: int) -> int:
    """Block forwards run in one forward + backward: N, plus every recomputation. A one-level group is run
    again in full; a nested segment's recomputation stops as soon as its second half's input exists (PyTorch's
    early stop), so it runs its first half only, and then each half's own backward recomputes below it."""
    kind, _ = parse(policy, num_layers)
    if kind == "none":
        return num_layers
    if kind in ("every", "selective"):  # selective runs every block again, less the ops it keeps
        return 2 * num_layers
    if num_layers == 1:
        return 1
    half = (num_layers + 1) // 2
    return num_layers + _nested_backward(half) + _nested_backward(num_layers - half)


def _nested_backward(n: int) -> int:
    # Block forwards in the backward of a checkpointed nested segment of n blocks.
    if n == 1:
        return 1
    half = (n + 1) // 2
    return half + _nested_backward(half) + _nested_backward(n - half)
