"""The benchmarked workload: a model on random tokens and one step of it (forward, forward+backward, train)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from cs336_systems.model import ATTENTION, ModelConfig, TransformerLM

MODES = ("forward", "forward_backward", "train_step")
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags that define a model and its batch; shared by every experiment that runs the Transformer."""
    g = parser.add_argument_group("model")
    g.add_argument("--size", default="custom", help="label of the model size (for the results table)")
    g.add_argument("--d-model", type=int, required=True)
    g.add_argument("--d-ff", type=int, required=True)
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--num-heads", type=int, required=True)
    g.add_argument("--vocab-size", type=int, default=10_000)
    g.add_argument("--batch-size", type=int, default=4)
    g.add_argument("--attention", choices=sorted(ATTENTION), default="naive")


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject model flags that define no model (e.g. --d-model not divisible by --num-heads) at parse time,
    before any work starts, with ModelConfig's own message."""
    try:
        model_config(args, context_length=1)
    except ValueError as error:
        parser.error(f"the model flags define no model: {error}")


def model_config(args: argparse.Namespace, context_length: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab_size,
        context_length=context_length,
        d_model=args.d_model,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        d_ff=args.d_ff,
        attention=args.attention,
    )


def random_batch(
    cfg: ModelConfig, batch_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token inputs and next-token targets of shape (batch, context_length)."""
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.context_length + 1), device=device)
    return tokens[:, :-1], tokens[:, 1:]


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def make_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: tuple[torch.Tensor, torch.Tensor],
    mode: str,
    autocast_dtype: torch.dtype | None = None,
) -> Callable[[], None]:
    """One step of `mode`. `forward` is inference (no autograd graph); `train_step` needs an optimizer."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; choose one of {MODES}")
    if mode == "train_step" and optimizer is None:
        raise ValueError("mode 'train_step' needs an optimizer")
    inputs, targets = batch
    device = inputs.device

    def loss() -> torch.Tensor:
        with record_function("forward"), autocast_context(device, autocast_dtype):
            logits = model(inputs)
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def forward() -> None:
        with torch.no_grad():
            loss()

    def forward_backward() -> None:
        value = loss()
        with record_function("backward"):
            value.backward()
        model.zero_grad(set_to_none=True)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        with record_function("backward"):
            value.backward()
        with record_function("optimizer_step"):
            optimizer.step()

    return {"forward": forward, "forward_backward": forward_backward, "train_step": train_step}[mode]


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
