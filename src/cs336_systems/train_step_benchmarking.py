"""The 2026 leaderboard's training step (handout §9): one complete AdamW step of the ~8B Transformer, built by
one of several stacks so that each piece's worth can be measured.

    zero_grad(set_to_none=True) -> summed cross-entropy of the LM head's logits -> backward -> optimizer.step()

A stack says how the same model is run (`STACKS`):
- `plain`: our TransformerLM as it is, the spec's naive baseline (materialised attention scores, eager logits);
- `native`: what PyTorch alone offers: SDPA (its fastest backend), selective checkpointing of every block
  (`torch.utils.checkpoint`, matmul and attention outputs kept), each checkpointed block `torch.compile`d, the LM
  head and loss in chunks of tokens whose logits are recomputed in backward (`checkpoint` per chunk), fused AdamW;
- `ours`: the same with our FlashAttention (Triton) and our fused LM head + cross-entropy (Triton,
  cs336_systems.fused_cross_entropy), and the `ours_*` variants that put one PyTorch piece back, so the writeup
  shows what each of ours is worth.
Weights, gradients and AdamW state are in the run's dtype (bf16 in the leaderboard's config).

MFU counts model FLOPs only (recomputation is not counted): per sequence of T tokens,
6·T·(L·(4d² + 3·d·d_ff) + d·V) + L·6·T²·d, over the GPU's dense bf16 peak (`PEAK_TFLOPS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cs336_systems import checkpointing
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.profiling import MATMUL, profile_step

# The leaderboard's model (handout §9): d_model, d_ff, layers, heads, vocabulary, context.
LEADERBOARD = {"d_model": 4096, "d_ff": 11_008, "num_layers": 34, "num_heads": 32, "vocab_size": 151_936,
               "context_length": 32_768}
HEADS = ("eager", "chunked", "fused")
# Dense bf16 tensor-core peak (TFLOP/s) by a substring of the device's name; MFU is left out elsewhere.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}


@dataclass(frozen=True)
class Stack:
    attention: str  # ModelConfig.attention
    head: str  # eager: logits then cross_entropy; chunked: PyTorch, per token chunk; fused: our Triton kernel
    checkpoint: str  # ModelConfig.checkpoint
    compile_blocks: bool  # torch.compile each (checkpointed) block
    fused_adamw: bool  # torch.optim.AdamW(fused=True) on CUDA


STACKS = {
    "plain": Stack("naive", "eager", "none", compile_blocks=False, fused_adamw=False),
    "native": Stack("sdpa", "chunked", "selective", compile_blocks=True, fused_adamw=True),
    "ours": Stack("flash_triton", "fused", "selective", compile_blocks=True, fused_adamw=True),
    "ours_sdpa": Stack("sdpa", "fused", "selective", compile_blocks=True, fused_adamw=True),
    "ours_chunked_head": Stack("flash_triton", "chunked", "selective", compile_blocks=True, fused_adamw=True),
    # no recomputation at all: the bound checkpointing pays against, where the activations fit
    "ours_no_checkpoint": Stack("flash_triton", "fused", "none", compile_blocks=True, fused_adamw=True),
}


class _CheckpointedBlock(nn.Module):
    """A block under a selective checkpoint policy, as one module, so torch.compile traces the checkpoint too."""

    def __init__(self, block: nn.Module, policy: str):
        super().__init__()
        self.block, self.policy = block, policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint_selectively(self.block, x, self.policy)


def build_model(stack: Stack, dims: dict, device: torch.device, dtype: torch.dtype, compile_blocks: bool) -> TransformerLM:
    """The model of `dims` (LEADERBOARD's keys) in `dtype` on `device`, its blocks run as the stack says."""
    selective = stack.checkpoint in checkpointing.SELECTIVE and compile_blocks
    cfg = ModelConfig(**dims, attention=stack.attention, checkpoint="none" if selective else stack.checkpoint)
    model = TransformerLM(cfg).to(device=device, dtype=dtype)
    if compile_blocks:
        blocks = [_CheckpointedBlock(b, stack.checkpoint) if selective else b for b in model.blocks]
        model.blocks = nn.ModuleList(torch.compile(b) for b in blocks)
    return model


def summed_loss(model: TransformerLM, tokens: torch.Tensor, targets: torch.Tensor, head: str, chunk: int) -> torch.Tensor:
    """The summed cross-entropy of the model's next-token logits, the head computed as `head` says."""
    from cs336_systems.fused_cross_entropy import fused_linear_cross_entropy

    h = model.hidden(tokens).flatten(0, 1)
    weight, targets = model.lm_head.weight, targets.flatten()
    if head == "eager":
        return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")
    if head == "fused":
        return fused_linear_cross_entropy(h, weight, targets, chunk=chunk, reduction="sum")
    return sum(checkpoint(_chunk_loss, h[i : i + chunk], weight, targets[i : i + chunk], use_reentrant=False)
               for i in range(0, h.shape[0], chunk))


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")


class TrainStep:
    """The spec's train_step for one stack on a fixed batch of random tokens: `step()` runs it once."""

    def __init__(self, stack: Stack, dims: dict, batch_size: int, device: torch.device, dtype: torch.dtype,
                 compile_blocks: bool = True, head_chunk: int = 8192, seed: int = 0):
        torch.manual_seed(seed)
        self.stack, self.head_chunk = stack, head_chunk
        self.model = build_model(stack, dims, device, dtype, compile_blocks and stack.compile_blocks)
        fused = stack.fused_adamw and device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused or None)
        g = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.randint(dims["vocab_size"], (batch_size, dims["context_length"] + 1), generator=g).to(device)
        self.tokens, self.targets = ids[:, :-1], ids[:, 1:]

    def loss(self) -> torch.Tensor:
        return summed_loss(self.model, self.tokens, self.targets, self.stack.head, self.head_chunk)

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def model_flops(dims: dict, num_layers: int, tokens_per_sequence: int, sequences: int) -> float:
    """Model FLOPs of one training step (forward and backward, no recomputation), the handout's convention."""
    d, d_ff, vocab, t = dims["d_model"], dims["d_ff"], dims["vocab_size"], tokens_per_sequence
    per_sequence = 6 * t * (num_layers * (4 * d * d + 3 * d * d_ff) + d * vocab) + num_layers * 6 * t * t * d
    return float(per_sequence * sequences)


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


# Where a kernel's time goes, by the first pattern its name matches (CUDA kernels; aten ops on the CPU):
# attention (ours, cuDNN's, FlashAttention's), the loss's kernels, the optimizer's, matmuls, and the rest
# (norms, activations, RoPE, casts: mostly torch.compile's fused kernels).
COMPONENTS = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention", re.IGNORECASE)),
    ("head + loss", re.compile(r"cross_entropy|softmax|nll_loss", re.IGNORECASE)),
    ("optimizer", re.compile(r"multi_tensor|adam|_foreach_", re.IGNORECASE)),
    ("matmul", MATMUL),
)
OTHER = "elementwise and other"


def component_of(kernel: str) -> str:
    return next((name for name, pattern in COMPONENTS if pattern.search(kernel)), OTHER)


def component_times(train: TrainStep, device: torch.device) -> dict[str, float]:
    """Milliseconds of one profiled step (after one untimed) per component (COMPONENTS), on the device's clock."""
    rows = profile_step(train.step, warmup=1, steps=1, device=device)
    times = dict.fromkeys([*(name for name, _ in COMPONENTS), OTHER], 0.0)
    for row in rows:
        if row.get("record") == "kernel":
            times[component_of(row["name"])] += row["time_ms_per_step"]
    return times

