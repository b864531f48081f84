"""A pre-norm Transformer language model (the CS336 "basics" architecture) with pluggable attention.

token embedding -> num_layers x [x + MHA(RMSNorm(x)), x + SwiGLU(RMSNorm(x))] -> RMSNorm -> LM head.
No biases, RoPE on queries and keys, untied input embedding and output head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from cs336_systems.model import checkpointing
from cs336_systems.model.sizes import MODEL_SIZES

# Attention takes q, k, v of shape (batch, heads, seq, d_head) and returns the same shape.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 10_000
    context_length: int = 256
    d_model: int = 768
    num_layers: int = 12
    num_heads: int = 12
    d_ff: int = 3072
    rope_theta: float = 10_000.0
    attention: str = "naive"
    rope: str = "torch"  # RoPE on q and k: "torch" (RotaryEmbedding) or "triton" (cs336_systems.kernels.rope)
    # the token embedding's backward: "torch" (nn.Embedding's) or "triton" (cs336_systems.kernels.embedding)
    embedding: str = "torch"
    checkpoint: str = "none"  # activation checkpointing of the blocks: cs336_systems.model.checkpointing

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"ModelConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
            )
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"ModelConfig: d_head={self.d_model // self.num_heads} must be even for RoPE")
        if self.attention not in ATTENTION:
            raise ValueError(f"ModelConfig.attention={self.attention!r}; choose one of {sorted(ATTENTION)}")
        if self.rope not in ROPE:
            raise ValueError(f"ModelConfig.rope={self.rope!r}; choose one of {list(ROPE)}")
        if self.embedding not in EMBEDDING:
            raise ValueError(f"ModelConfig.embedding={self.embedding!r}; choose one of {list(EMBEDDING)}")
        checkpointing.parse(self.checkpoint, self.num_layers)

    @classmethod
    def from_name(cls, size: str, **fields) -> ModelConfig:
        """The model of a named size (sizes.MODEL_SIZES) with `fields` (context_length, attention, ...) set; a
        field may also override one of the size's dimensions (a depth study's num_layers, say)."""
        if size not in MODEL_SIZES:
            raise ValueError(f"unknown model size {size!r}; known: {', '.join(MODEL_SIZES)}")
        return cls(**{**MODEL_SIZES[size], **fields})

    def num_parameters(self) -> int:
        """Closed-form parameter count: embeddings + head, 4d^2 attention + 3 d d_ff SwiGLU + 2 norms per layer."""
        d, v = self.d_model, self.vocab_size
        per_layer = 4 * d * d + 3 * d * self.d_ff + 2 * d
        return 2 * v * d + self.num_layers * per_layer + d


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention that materialises the (seq x seq) score matrix; profiler ranges per stage."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    with record_function("attention/scores"):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
        scores = scores.masked_fill(~causal, float("-inf"))
    with record_function("attention/softmax"):
        probs = torch.softmax(scores, dim=-1)
    with record_function("attention/output"):
        return probs @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def flash_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from cs336_systems.kernels.flash_attention import flash_attention

    return flash_attention(q, k, v, is_causal=True, impl="triton")


ATTENTION: dict[str, AttentionFn] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash_triton": flash_triton_attention,
}

# How RoPE is applied: the module below, or one Triton kernel each way that also splits and joins the projection.
ROPE = ("torch", "triton")
# How the token embedding's weight gradient is computed: nn.Embedding's backward, or our Triton kernel.
EMBEDDING = ("torch", "triton")


class TokenEmbedding(nn.Embedding):
    """nn.Embedding (its parameters, initialisation and forward) whose weight gradient our Triton kernel computes
    where `backward` is "triton" (cs336_systems.kernels.embedding)."""

    def __init__(self, vocab_size: int, d_model: int, backward: str = "torch"):
        super().__init__(vocab_size, d_model)
        self.backward_kernel = backward

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.backward_kernel == "torch":
            return super().forward(tokens)
        from cs336_systems.kernels.embedding import embedding

        return embedding(tokens, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: the mean of squares loses precision in half types.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotates consecutive feature pairs (2i, 2i+1) of each head by angle pos * theta^(-2i/d_head)."""

    def __init__(self, d_head: int, context_length: int, theta: float):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        angles = torch.arange(context_length, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope = RotaryEmbedding(cfg.d_model // cfg.num_heads, cfg.context_length, cfg.rope_theta)
        self.rope_kernel = cfg.rope == "triton"
        self.attend = ATTENTION[cfg.attention]
        # our RoPE and our attention as one autograd node: attention's backward writes the projection's gradient
        self.rope_attention = self.rope_kernel and cfg.attention == "flash_triton"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        # (batch, seq, 3 d_model) -> three tensors of (batch, heads, seq, d_head)
        qkv = self.qkv(x).view(batch, seq, 3, self.num_heads, -1)
        if self.rope_attention:
            from cs336_systems.kernels.rope_attention import rope_attention

            y = rope_attention(qkv, self.rope.cos[:seq], self.rope.sin[:seq])
        else:
            if self.rope_kernel:
                from cs336_systems.kernels.rope import rope_qkv

                q, k, v = rope_qkv(qkv, self.rope.cos[:seq], self.rope.sin[:seq])
            else:
                q, k, v = qkv.permute(2, 0, 3, 1, 4)
                positions = torch.arange(seq, device=x.device)
                q, k = self.rope(q, positions), self.rope(k, positions)
            y = self.attend(q, k, v)
        # a view where y is laid out heads-last (our attention writes O in v's order, and v is a heads-last slice: of
        # qkv, or of our RoPE's output in qkv's layout)
        return self.out(y.transpose(1, 2).reshape(batch, seq, d_model))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function("attention"):
            x = x + self.attn(self.attn_norm(x))
        with record_function("feed_forward"):
            return x + self.ffn(self.ffn_norm(x))


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.embedding)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab)."""
        return self.lm_head(self.hidden(tokens))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) int64 -> the final normalised hidden states (batch, seq, d_model), which the LM head
        turns into logits (a fused head + loss takes them instead: cs336_systems.kernels.fused_cross_entropy)."""
        if tokens.shape[-1] > self.cfg.context_length:
            raise ValueError(
                f"sequence length {tokens.shape[-1]} exceeds context_length {self.cfg.context_length}"
            )
        x = self.embedding(tokens)
        x = checkpointing.run_blocks(self.blocks, x, self.cfg.checkpoint)
        return self.final_norm(x)

    def describe(self) -> dict:
        return {**asdict(self.cfg), "num_parameters": sum(p.numel() for p in self.parameters())}


def initial_values(
    model: TransformerLM, device: torch.device
) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """For a TransformerLM built on the meta device: the value each of its parameters and buffers would have had
    if it had been built on `device`, as (its module in `model`, its name there, the value in float32), one
    top-level child (the embedding, a block, the final norm, the LM head) on `device` at a time. After the same
    torch.manual_seed, equal to the plain model's, because the same random draws run in the same order: every
    child's construction (nn.Linear's and nn.Embedding's own initialisation, overwritten but drawn), then
    `_init_weights` child by child (`apply`'s order). A child rebuilt for its values is constructed under a
    forked RNG, so it draws nothing from the run's. The children are read now: wrappers may replace them after
    (a compiled block keeps the block, whose parameters a sharding wrapper then replaces)."""
    cfg, children = model.cfg, dict(model.named_children())
    # TransformerLM.__init__'s children, in its order
    makers = [
        ("embedding", lambda: TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.embedding)),
        *((f"blocks.{i}", lambda: TransformerBlock(cfg)) for i in range(cfg.num_layers)),
        ("final_norm", lambda: RMSNorm(cfg.d_model)),
        ("lm_head", lambda: nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)),
    ]
    targets = [
        children["blocks"][int(name[7:])] if name.startswith("blocks.") else children[name]
        for name, _ in makers
    ]
    forked = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )

    def values() -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
        with torch.device(device):
            for _, make in makers:  # the construction's draws
                make()
            for (_, make), target in zip(makers, targets, strict=True):
                with torch.random.fork_rng(devices=forked):
                    child = make()
                child.apply(_init_weights)
                yield from _tensors(child, target)
                del child  # before the next one is built

    return values()


def _tensors(built: nn.Module, target: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """Every parameter and buffer of `built` as (the same module in `target`, its name, the tensor)."""
    for name, module in built.named_modules():
        owner = target.get_submodule(name)
        for attr, value in [*module._parameters.items(), *module._buffers.items()]:
            if value is not None:
                yield owner, attr, value.detach()


def _init_weights(module: nn.Module) -> None:
    # Truncated normal with std sqrt(2 / (fan_in + fan_out)), as in the basics assignment.
    if isinstance(module, nn.Linear):
        std = math.sqrt(2.0 / (module.in_features + module.out_features))
        nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
    elif isinstance(module, nn.Embedding):
        nn.init.trunc_normal_(module.weight, std=1.0, a=-3.0, b=3.0)
