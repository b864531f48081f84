"""Measuring activation checkpointing (2026 §3.2): a train step's memory split into the fixed part (weights and
optimizer state) and the peak of forward + backward, and one block's residual sizes for the model of
`cs336_systems.model.checkpointing`."""

from __future__ import annotations

import torch

from cs336_systems.accounting.units import MIB
from cs336_systems.measure.timing import sync
from cs336_systems.model import checkpointing
from cs336_systems.model.transformer import ModelConfig, TransformerBlock
from cs336_systems.training.workload import TrainingStep, autocast_context


def train_step_memory(training: TrainingStep, device: torch.device) -> dict[str, float]:
    """One train step's memory (CUDA), in MiB: `base_mib`, allocated with the gradients freed (weights and AdamW
    state, so run a step first); `forward_backward_peak_mib`, the peak before the optimizer step (activations
    and the gradients made so far: what checkpointing changes); `step_peak_mib`, the peak of the whole step
    (AdamW's update may set it); `activation_peak_mib` = forward_backward_peak_mib - base_mib."""
    training.optimizer.zero_grad(set_to_none=True)
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    before_update = {}

    def read_peak(*_: object) -> None:
        before_update["peak"] = torch.cuda.max_memory_allocated(device)

    hook = training.optimizer.register_step_pre_hook(read_peak)
    try:
        training.train_step()
        sync(device)
    finally:
        hook.remove()
    return {
        "base_mib": base / MIB,
        "forward_backward_peak_mib": before_update["peak"] / MIB,
        "step_peak_mib": torch.cuda.max_memory_allocated(device) / MIB,
        "activation_peak_mib": (before_update["peak"] - base) / MIB,
    }


def block_sizes(
    cfg: ModelConfig, batch_size: int, device: torch.device, autocast_dtype: torch.dtype | None
) -> dict[str, int]:
    """The residual model's sizes for one block of `cfg`, in bytes: `residual_bytes` (R, what its forward saves
    for backward, measured), `checkpoint_bytes` (c, one block input: batch x context x d_model fp32: the
    residual stream stays fp32 under autocast) and `grad_bytes_per_block` (w, its fp32 parameter gradients)."""
    torch.manual_seed(0)
    with torch.device(device):
        block = TransformerBlock(cfg)
        x = torch.randn(batch_size, cfg.context_length, cfg.d_model, requires_grad=True)
    with autocast_context(device, autocast_dtype):
        residual = checkpointing.saved_bytes(lambda: block(x))
    return {
        "residual_bytes": residual,
        "checkpoint_bytes": x.numel() * x.element_size(),
        "grad_bytes_per_block": sum(p.numel() * p.element_size() for p in block.parameters()),
    }
