"""The 2026 leaderboard's training step (handout §9): one complete AdamW step of the ~8B Transformer, built by
one of several stacks so that each piece's worth can be measured.

    zero_grad(set_to_none=True) -> summed cross-entropy of the LM head's logits -> backward -> optimizer.step()

A stack says how the same model is run (`STACKS`):
- `plain`: our TransformerLM as it is, the spec's naive baseline (materialised attention scores, eager logits);
- `native`: what PyTorch alone offers: SDPA (its fastest backend), selective checkpointing of every block
  (`torch.utils.checkpoint`, matmul and attention outputs kept), each checkpointed block and the final norm
  `torch.compile`d, the LM head and loss in chunks of tokens whose logits are recomputed in backward (`checkpoint`
  per chunk), torch.optim.AdamW(fused=True);
- `ours`: the same with our FlashAttention (Triton), our RoPE kernels (Triton, cs336_systems.kernels.rope: q and k
  rotated and v copied into one tensor, which selective checkpointing keeps, and the projection's gradient
  written, in one pass each), our fused LM head + cross-entropy (Triton, cs336_systems.kernels.fused_cross_entropy),
  our AdamW kernel (Triton, cs336_systems.kernels.fused_adamw) and the embedding's weight gradient by our kernel
  (Triton, cs336_systems.kernels.embedding), and the `ours_*` variants that put one PyTorch
  piece back, so the writeup shows what each of ours is worth;
- `ours_fp32_master`: ours with float32 master weights: weights, gradients and AdamW state in float32, the step's
  forward and backward under autocast to the run's dtype (the matmuls and our kernels in bf16);
- `*_fsdp`: the stack sharded over the ranks of the process group, each rank training on its own sequences:
  `native_fsdp` with PyTorch's FSDP2 (`fully_shard` on every block, the head and the root), `ours_fsdp` with our
  FullyShardedDataParallel (a compiled block, the head and the embedding as units, hooks outside the compiled
  code; cs336_systems.parallel.fsdp), `plain_fsdp` the naive baseline under ours. Their model is built on the
  meta device and sharded, then each rank initialises its shards one layer at a time with the plain model's
  initial weights from the same seed (`build_sharded`): no GPU holds the whole model.
Weights, gradients and AdamW state are in the run's dtype (bf16 in the leaderboard's config), sharded or not,
except under `fp32_master`.
The model runs as a `LossModel` (tokens, targets -> summed loss), whose `head` module holds the LM head and the
loss, so that a sharding wrapper gathers the head's weight around the loss that uses it.

MFU counts model FLOPs only (recomputation is not counted): per sequence of T tokens,
6·T·(L·(4d² + 3·d·d_ff) + d·V) + L·6·T²·d, over the GPU's dense bf16 peak (`PEAK_TFLOPS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cs336_systems.measure.profiling import MATMUL, profile_step
from cs336_systems.model import checkpointing
from cs336_systems.model.transformer import ModelConfig, TransformerLM, initial_values
from cs336_systems.parallel.fsdp import FullyShardedDataParallel
from cs336_systems.training.workload import TrainingStep

# The leaderboard's model (handout §9): d_model, d_ff, layers, heads, vocabulary, context.
LEADERBOARD = {
    "d_model": 4096,
    "d_ff": 11_008,
    "num_layers": 34,
    "num_heads": 32,
    "vocab_size": 151_936,
    "context_length": 32_768,
}
HEADS = ("eager", "chunked", "fused")
# The heads that take their tokens in chunks (LossHead), and the chunk a benchmark gives them unless told.
CHUNKED_HEADS = ("chunked", "fused")
DEFAULT_HEAD_CHUNK = 8192
# The run's dtypes by name (weights, gradients and AdamW state; a *_fp32_master stack's compute).
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Dense bf16 tensor-core peak (TFLOP/s) by a substring of the device's name; MFU is left out elsewhere.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}


@dataclass(frozen=True)
class Stack:
    label: str  # how the writeup names it
    attention: str  # ModelConfig.attention
    head: str  # eager: logits then cross_entropy; chunked: PyTorch, per token chunk; fused: our Triton kernel
    checkpoint: str  # ModelConfig.checkpoint
    compile_blocks: bool  # torch.compile each (checkpointed) block
    optimizer: (
        str  # torch (torch.optim.AdamW's default), torch_fused (its fused=True, on CUDA) or ours (FusedAdamW)
    )
    sharding: str = "none"  # none, ours (our FSDP) or fsdp2 (PyTorch's fully_shard): over the process group
    fp32_master: bool = (
        False  # float32 weights, gradients and AdamW state; compute under autocast to the run's dtype
    )
    rope: str = "torch"  # ModelConfig.rope
    embedding: str = "torch"  # ModelConfig.embedding


# Ours, and ours with one piece put back to PyTorch's (or dropped): what each of ours is worth.
_OURS = Stack(
    "ours",
    "flash_triton",
    "fused",
    "selective",
    compile_blocks=True,
    optimizer="ours",
    rope="triton",
    embedding="triton",
)
_NATIVE = Stack(
    "PyTorch-native stack", "sdpa", "chunked", "selective", compile_blocks=True, optimizer="torch_fused"
)
_PLAIN = Stack(
    "plain TransformerLM (the spec's naive baseline)",
    "naive",
    "eager",
    "none",
    compile_blocks=False,
    optimizer="torch",
)
_PIECES_PUT_BACK = {  # name suffix: (label suffix, the piece as PyTorch has it)
    "sdpa": ("with SDPA's attention", {"attention": "sdpa"}),
    "chunked_head": ("with PyTorch's chunked head", {"head": "chunked"}),
    "torch_adamw": ("with torch.optim.AdamW(fused=True)", {"optimizer": "torch_fused"}),
    "torch_rope": ("with compiled PyTorch's RoPE", {"rope": "torch"}),
}
_OURS_FSDP = replace(
    _OURS, label="ours under our FSDP (compiled blocks, head and embedding as units)", sharding="ours"
)
STACKS = {
    "plain": _PLAIN,
    "native": _NATIVE,
    "ours": _OURS,
    **{
        f"ours_{name}": replace(_OURS, label=f"ours {label}", **piece)
        for name, (label, piece) in _PIECES_PUT_BACK.items()
    },
    # no recomputation at all: the bound checkpointing pays against, where the activations fit
    "ours_no_checkpoint": replace(_OURS, label="ours without checkpointing", checkpoint="none"),
    # what mixed precision's usual float32 master weights cost against the leaderboard's all-bf16 state
    "ours_fp32_master": replace(_OURS, label="ours with float32 master weights", fp32_master=True),
    # sharded over the process group's ranks (the leaderboard's two GPUs)
    "plain_fsdp": replace(
        _PLAIN, label="plain TransformerLM under our FSDP (the spec's naive baseline)", sharding="ours"
    ),
    "native_fsdp": replace(
        _NATIVE,
        label="PyTorch-native stack under FSDP2 (`fully_shard` per block, head and root)",
        sharding="fsdp2",
    ),
    "ours_fsdp": _OURS_FSDP,
    # what our pieces are worth at the leaderboard's scale: each put back to PyTorch's, the rest of ours kept
    **{
        f"ours_fsdp_{name}": replace(_OURS_FSDP, label=f"ours under our FSDP {label}", **piece)
        for name, (label, piece) in _PIECES_PUT_BACK.items()
    },
}
SHARDINGS = ("none", "ours", "fsdp2")


def unsharded(name: str) -> str | None:
    """The one-GPU stack a sharded stack shards: the one of sharding "none" with every other setting equal (not the
    label); None where there is none."""
    pieces = replace(STACKS[name], label="", sharding="none")
    return next((n for n, s in STACKS.items() if replace(s, label="") == pieces), None)


class _CheckpointedBlock(nn.Module):
    """A block under a selective checkpoint policy, as one module, so torch.compile traces the checkpoint too."""

    def __init__(self, block: nn.Module, policy: str):
        super().__init__()
        self.block, self.policy = block, policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint_selectively(self.block, x, self.policy)


class LossHead(nn.Module):
    """The LM head and the summed cross-entropy of its next-token logits, computed as `kind` says (HEADS)."""

    def __init__(self, lm_head: nn.Module, kind: str, chunk: int):
        super().__init__()
        self.lm_head, self.kind, self.chunk = lm_head, kind, chunk

    @property
    def reads_weight_in_backward(self) -> bool:
        """Whether the backward reads the LM head's weight: not the fused kernel's, which made its gradients in the
        forward (a sharded stack need not gather the weight again)."""
        return self.kind != "fused"

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from cs336_systems.kernels.fused_cross_entropy import fused_linear_cross_entropy

        weight = self.lm_head.weight
        if self.kind == "eager":
            return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")
        if self.kind == "fused":
            if torch.is_autocast_enabled(
                h.device.type
            ):  # autocast does not reach our kernel: cast as it would
                dtype = torch.get_autocast_dtype(h.device.type)
                h, weight = h.to(dtype), weight.to(dtype)
            return fused_linear_cross_entropy(h, weight, targets, chunk=self.chunk, reduction="sum")
        return sum(
            checkpoint(
                _chunk_loss, h[i : i + self.chunk], weight, targets[i : i + self.chunk], use_reentrant=False
            )
            for i in range(0, h.shape[0], self.chunk)
        )


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")


class LossModel(nn.Module):
    """(tokens, targets) -> the summed cross-entropy: the TransformerLM's embedding and blocks (`lm`, its final
    hidden states) and a LossHead (`head`) that holds the LM head, moved out of `lm`."""

    def __init__(self, lm: TransformerLM, head: str, chunk: int):
        super().__init__()
        self.head = LossHead(lm.lm_head, head, chunk)
        lm.lm_head = (
            nn.Identity()
        )  # one owner per weight (sharding wrappers need that); lm.hidden() is all we call
        self.lm = lm

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.head(self.lm.hidden(tokens).flatten(0, 1), targets.flatten())


def build_model(
    stack: Stack, dims: dict, device: torch.device, dtype: torch.dtype, compile_blocks: bool, head_chunk: int
) -> LossModel:
    """The model of `dims` (LEADERBOARD's keys) in `dtype` (float32 under `fp32_master`) on `device` (built there:
    an 8B model's fp32 initialisation would take minutes on the CPU), its blocks run as the stack says."""
    return as_loss_model(
        new_lm(stack, dims, device, dtype, compile_blocks), stack, compile_blocks, head_chunk
    )


def new_lm(
    stack: Stack, dims: dict, device: torch.device, dtype: torch.dtype, compile_blocks: bool
) -> TransformerLM:
    """The TransformerLM of `dims` built on `device` in `dtype` (float32 under `fp32_master`); its config checkpoints
    the blocks unless a compiled block does it itself (selective checkpointing)."""
    selective = stack.checkpoint in checkpointing.SELECTIVE and compile_blocks
    cfg = ModelConfig(
        **dims,
        attention=stack.attention,
        rope=stack.rope,
        embedding=stack.embedding,
        checkpoint="none" if selective else stack.checkpoint,
    )
    with torch.device(device):
        return TransformerLM(cfg).to(dtype=torch.float32 if stack.fp32_master else dtype)


def as_loss_model(lm: TransformerLM, stack: Stack, compile_blocks: bool, head_chunk: int) -> LossModel:
    """`lm` run as the stack says: each block compiled (with its selective checkpoint) and the final norm compiled,
    as a LossModel."""
    if compile_blocks:
        selective = stack.checkpoint in checkpointing.SELECTIVE
        blocks = [_CheckpointedBlock(b, stack.checkpoint) if selective else b for b in lm.blocks]
        lm.blocks = nn.ModuleList(torch.compile(b) for b in blocks)
        # eager, the final RMSNorm is a dozen float32 passes over the hidden states, forward and backward
        lm.final_norm = torch.compile(lm.final_norm)
    return LossModel(lm, stack.head, head_chunk)


def build_sharded(
    stack: Stack, dims: dict, device: torch.device, dtype: torch.dtype, compile_blocks: bool, head_chunk: int
) -> nn.Module:
    """The model sharded over the process group's ranks as the stack says, never whole on any rank: built on the
    meta device, sharded (each rank allocates its shards on `device`), then every parameter and buffer set from
    the plain model's initial values, one layer at a time (transformer.initial_values: the plain model's draws
    from the same seed, so the same weights), each rank keeping its shard. A rank holds its shards and at most
    one of the model's top-level children (the embedding, a block or the LM head) whole, in float32 as the plain
    model draws it, with one of its weights cast to `dtype`."""
    lm = new_lm(stack, dims, torch.device("meta"), dtype, compile_blocks)
    values = initial_values(lm, device)  # its children now, before they are compiled or moved
    model = shard(as_loss_model(lm, stack, compile_blocks, head_chunk), stack.sharding, device)
    set_value = model.set_full_value if isinstance(model, FullyShardedDataParallel) else _set_fsdp2_value
    for owner, name, value in values:
        set_value(owner, name, value)
        del value  # before the next child is built
    return model


@torch.no_grad()
def _set_fsdp2_value(owner: nn.Module, name: str, value: torch.Tensor) -> None:
    """A parameter (a DTensor sharded by FSDP2: this rank's chunk of `value`) or buffer set from its full value."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    target = getattr(owner, name)
    value = value.to(target.dtype)
    if isinstance(target, DTensor):  # src_data_rank None: each rank chunks its own copy, nothing is sent
        value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    target.copy_(value)


def shard(model: LossModel, sharding: str, device: torch.device) -> nn.Module:
    """The model sharded over the process group's ranks as `sharding` says (SHARDINGS), its shards on `device`
    (a model on the meta device: uninitialised there); `none` returns it."""
    if sharding == "none":
        return model
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"sharding {sharding!r} needs a process group: run under cs336_systems.parallel.launch"
        )
    units = [*model.lm.blocks, model.head]
    if sharding == "ours":
        # the embedding's gradient comes from the token ids, not its weight; the fused head's from its forward
        unread = [model.lm.embedding, *([] if model.head.reads_weight_in_backward else [model.head])]
        return FullyShardedDataParallel(model, units=units, device=device, backward_without_weights=unread)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    sharded = fully_shard(model, mesh=mesh)
    return sharded.to_empty(device=device) if any(p.is_meta for p in sharded.parameters()) else sharded


def build_step(
    stack: Stack,
    dims: dict,
    batch_size: int,
    device: torch.device,
    dtype: torch.dtype,
    compile_blocks: bool = True,
    head_chunk: int = DEFAULT_HEAD_CHUNK,
    seed: int = 0,
) -> TrainingStep:
    """The spec's train_step for one stack, as the one TrainingStep: the model built as the stack says (a sharded
    stack's on the meta device, then each rank's shards initialised as the plain model's weights: build_sharded),
    its AdamW, and a fixed batch of random tokens (`batch_size` sequences on this rank; under a sharded stack each
    rank draws its own, from seed + rank); the loss is the model's own (summed cross-entropy)."""
    torch.manual_seed(seed)
    make = build_model if stack.sharding == "none" else build_sharded
    model = make(stack, dims, device, dtype, compile_blocks and stack.compile_blocks, head_chunk)
    if (
        stack.optimizer == "ours"
    ):  # imported here: it imports triton, which must not come before the CLI's mode
        from cs336_systems.kernels.fused_adamw import FusedAdamW

        optimizer = FusedAdamW(model.parameters(), lr=1e-4)
    else:
        fused = stack.optimizer == "torch_fused" and device.type == "cuda"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    rank = dist.get_rank() if stack.sharding != "none" else 0
    g = torch.Generator(device="cpu").manual_seed(seed + rank)
    ids = torch.randint(dims["vocab_size"], (batch_size, dims["context_length"] + 1), generator=g).to(device)
    # Under fp32_master the forward (and so the backward) computes in the run's dtype.
    autocast = dtype if stack.fp32_master and dtype != torch.float32 else None
    # Our FSDP's reductions finish after backward (FSDP2's inside it); then each shard holds its average.
    sync = model.finish_gradient_synchronization if isinstance(model, FullyShardedDataParallel) else None
    return TrainingStep(model, optimizer, (ids[:, :-1], ids[:, 1:]), autocast, sync, loss_fn=own_loss)


def own_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A LossModel's loss: it takes the targets itself."""
    return model(*batch)


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


def kernel_times(train: TrainingStep, device: torch.device, steps: int = 1) -> dict[str, tuple[float, float]]:
    """Per kernel name (on the CPU, per aten op): milliseconds and calls per step over `steps` profiled steps
    (after one untimed), on the device's clock."""
    rows = profile_step(train.train_step, warmup=1, steps=steps, device=device)
    return {
        row["name"]: (row["time_ms_per_step"], row["count_per_step"])
        for row in rows
        if row.get("record") == "kernel"
    }


def component_times(kernels: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The milliseconds of `kernels` (kernel_times) per component (COMPONENTS)."""
    times = dict.fromkeys([*(name for name, _ in COMPONENTS), OTHER], 0.0)
    for name, (ms, _) in kernels.items():
        times[component_of(name)] += ms
    return times
