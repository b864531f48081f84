"""The benchmarked workload: a model on random tokens and one step of it (forward, forward+backward, train)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from cs336_systems.model.transformer import ModelConfig, TransformerLM

MODES = ("forward", "forward_backward", "train_step")
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def random_batch(
    cfg: ModelConfig, batch_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token inputs and next-token targets of shape (batch, context_length)."""
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.context_length + 1), device=device)
    return tokens[:, :-1], tokens[:, 1:]


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def next_token_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy of the model's next-token logits (the loss of every experiment but the 2026
    leaderboard's, whose model computes its own summed loss: training.stacks)."""
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TrainingStep:
    """The one training step of every experiment, phase by phase:

        zero_grad -> forward (loss) -> backward -> sync_gradients() -> optimizer.step()

    What differs between experiments is passed in, never copied: the model (wrapped for data parallelism or
    not, its attention set in its config), the optimizer (AdamW, sharded, ZeRO, our fused AdamW),
    `sync_gradients` (a DDP or FSDP wrapper's finish_gradient_synchronization), the autocast dtype and the loss
    (`loss_fn(model, batch)`; the 2026 leaderboard's stacks pass their model's own). Each phase is a method, so an
    experiment can time or measure between phases; `mode()` gives the three steps that the benchmarks time."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        batch: tuple[torch.Tensor, torch.Tensor],
        autocast_dtype: torch.dtype | None = None,
        sync_gradients: Callable[[], None] | None = None,
        loss_fn: Callable[
            [torch.nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor
        ] = next_token_loss,
    ) -> None:
        self.model, self.optimizer, self.batch = model, optimizer, batch
        self.autocast_dtype = autocast_dtype
        self.sync_gradients = sync_gradients or (lambda: None)
        self.loss_fn = loss_fn

    def loss(self) -> torch.Tensor:
        with record_function("forward"), autocast_context(self.batch[0].device, self.autocast_dtype):
            return self.loss_fn(self.model, self.batch)

    def forward(self) -> None:
        """Inference: the loss without an autograd graph."""
        with torch.no_grad():
            self.loss()

    def gradients(self) -> torch.Tensor:
        """zero_grad, forward and backward: this step's gradients, not yet synchronised; returns the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        value = self.loss()
        with record_function("backward"):
            value.backward()
        return value.detach()

    def optimizer_step(self) -> None:
        with record_function("optimizer_step"):
            self.optimizer.step()

    def train_step(self) -> torch.Tensor:
        """One whole step; returns its loss (detached)."""
        loss = self.gradients()
        self.sync_gradients()
        self.optimizer_step()
        return loss

    def forward_backward(self) -> None:
        """Forward and backward without an optimizer; the gradients are freed at the end, as a step would."""
        value = self.loss()
        with record_function("backward"):
            value.backward()
        self.model.zero_grad(set_to_none=True)

    def mode(self, mode: str) -> Callable[[], None]:
        """The step that a benchmark times as `mode` (MODES). `forward` is inference; `train_step` needs an
        optimizer."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}; choose one of {MODES}")
        if mode == "train_step" and self.optimizer is None:
            raise ValueError("mode 'train_step' needs an optimizer")
        return getattr(self, mode)


def build(
    cfg: ModelConfig, device: torch.device, compile: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, initialised directly on `device` (a 3B-parameter init on the CPU takes minutes), optionally
    torch.compile'd, and its AdamW optimizer (state is created lazily at the first step).

    A compiled model is compiled from scratch for its one input shape, as in a fresh process: without the reset,
    a second context length in the same process would get a dynamic-shape graph (automatic dynamic shapes), and
    past the recompile limit the model would silently run eagerly."""
    with torch.device(device):
        model = TransformerLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if compile:
        torch.compiler.reset()
        model = torch.compile(model, dynamic=False)
    return model, optimizer


def training_step(
    cfg: ModelConfig,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    compile: bool = False,
    seed: int = 0,
) -> TrainingStep:
    """A fresh model of `cfg` (seeded, optionally compiled), its AdamW and a random batch, as one TrainingStep:
    how every cell of a single-GPU sweep starts, so that cells do not share state."""
    torch.manual_seed(seed)
    model, optimizer = build(cfg, device, compile=compile)
    return TrainingStep(model, optimizer, random_batch(cfg, batch_size, device), autocast_dtype)


def model_parameters(cfg: ModelConfig) -> list[torch.nn.Parameter]:
    """The trainable parameters of the model of `cfg` on the meta device: their shapes and dtypes, no memory."""
    with torch.device("meta"):
        return [p for p in TransformerLM(cfg).parameters() if p.requires_grad]
