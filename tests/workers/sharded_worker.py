"""Worker of tests/parallel/test_sharded_optimizer.py: each ShardedOptimizer case, compared with the plain optimizer.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/sharded_worker.py [--save F]
                                                                                          [--load F]

Every rank trains the same toy model on the same batches, so each rank's gradients equal the single-process
ones and the sharded run must match an unsharded optimizer exactly (torch.equal), step by step. `run_all()`
also runs in a plain process without a process group (world size 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.parallel.distributed import distributed
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer

VOCAB, DIM, HIDDEN = 13, 6, 9
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1})
SGD = (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3})
CHECKPOINT_STEPS = 3  # steps before the checkpoint; as many again after loading it


class ToyLM(nn.Module):
    """Tied embedding/output weights, a frozen layer, a frozen bias and a layer that can start frozen."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank (and the reference) builds the same weights
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.late = nn.Linear(DIM, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight
        self.head.bias.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(self.frozen(x) + self.late(x))


def param_groups(model: ToyLM, with_late: bool = True) -> list[dict[str, Any]]:
    # Two groups with their own learning rates (and weight decay), frozen tensors included as users do.
    first = [model.embed.weight, model.up.weight, model.up.bias, model.frozen.weight, model.frozen.bias]
    second = [model.down.weight, model.down.bias, model.head.bias] + (
        [model.late.weight] if with_late else []
    )
    return [{"params": first, "lr": 2e-2}, {"params": second, "lr": 5e-3, "weight_decay": 0.0}]


def train_step(model: ToyLM, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=generator)
    optimizer.zero_grad()
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()


def assert_same_params(case: str, step: int, model: ToyLM, reference: ToyLM) -> None:
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        if not torch.equal(got, want):
            diff = (got - want).abs().max().item()
            raise AssertionError(
                f"{case}: after step {step}, {name} differs from the unsharded run by {diff:.3g}"
            )


def assert_same_state_dict(case: str, got: dict[str, Any], want: dict[str, Any]) -> None:
    if got["param_groups"] != want["param_groups"]:
        raise AssertionError(f"{case}: param_groups {got['param_groups']} != {want['param_groups']}")
    if got["state"].keys() != want["state"].keys():
        raise AssertionError(f"{case}: state indices {sorted(got['state'])} != {sorted(want['state'])}")
    for index, state in want["state"].items():
        for key, value in state.items():
            mine = got["state"][index][key]
            same = torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value
            if not same:
                raise AssertionError(f"{case}: state[{index}][{key!r}] differs: {mine} != {value}")


def assert_sharded_state(case: str, optimizer: ShardedOptimizer) -> None:
    """Each rank holds state for its own parameters only, and together the ranks cover every trained one."""
    trained = {p for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    mine = {p for p in trained if optimizer.owner(p) == optimizer.rank}
    if set(optimizer.state) != mine:
        raise AssertionError(f"{case}: rank {optimizer.rank} holds state for parameters it does not own")
    sizes = [p.numel() for p in dict.fromkeys(p for group in optimizer.param_groups for p in group["params"])]
    loads = optimizer.rank_loads
    # Greedy largest-first keeps the ranks within one parameter of each other.
    if sum(loads) != sum(sizes) or max(loads) - min(loads) > max(sizes):
        raise AssertionError(f"{case}: unbalanced shards {loads} for parameter sizes {sizes}")
    count = torch.tensor([len(optimizer.state)])
    if dist.is_initialized():
        dist.all_reduce(count)
    if count.item() != len(trained):
        raise AssertionError(
            f"{case}: ranks hold state for {count.item()} parameters, {len(trained)} are trained"
        )


def compare_training(case: str, optimizer_cls: type, kwargs: dict[str, Any], steps: int = 4) -> None:
    """Several steps side by side, halving one group's learning rate through the param_groups view."""
    model, reference = ToyLM(), ToyLM()
    sharded = ShardedOptimizer(param_groups(model), optimizer_cls, **kwargs)
    plain = optimizer_cls(param_groups(reference), **kwargs)
    for step in range(steps):
        if step == 2:
            for optimizer in (sharded, plain):
                optimizer.param_groups[0]["lr"] *= 0.5
        train_step(model, sharded, step)
        train_step(reference, plain, step)
        assert_same_params(case, step, model, reference)
    assert_sharded_state(case, sharded)
    assert_same_state_dict(case, sharded.state_dict(), plain.state_dict())


def compare_add_param_group(case: str, optimizer_cls: type, kwargs: dict[str, Any]) -> None:
    """Gradual unfreezing: `late` joins as a third group after two steps."""
    models = ToyLM(), ToyLM()
    for m in models:
        m.late.requires_grad_(False)
    sharded = ShardedOptimizer(param_groups(models[0], with_late=False), optimizer_cls, **kwargs)
    plain = optimizer_cls(param_groups(models[1], with_late=False), **kwargs)
    for step in range(4):
        if step == 2:
            for m, optimizer in zip(models, (sharded, plain), strict=True):
                m.late.requires_grad_(True)
                optimizer.add_param_group({"params": [m.late.weight], "lr": 3e-2})
        train_step(models[0], sharded, step)
        train_step(models[1], plain, step)
        assert_same_params(case, step, *models)
    assert_sharded_state(case, sharded)


def save_checkpoint(path: str) -> None:
    model = ToyLM()
    optimizer = ShardedOptimizer(param_groups(model), ADAMW[0], **ADAMW[1])
    for step in range(CHECKPOINT_STEPS):
        train_step(model, optimizer, step)
    state = optimizer.state_dict()  # collective: every rank takes part
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": state}, path)
    if dist.is_initialized():
        dist.barrier()


def resume_from_checkpoint(path: str) -> None:
    """Load the checkpoint (saved at another world size) into sharded and plain AdamW; both must continue
    exactly like an uninterrupted unsharded run."""
    reference = ToyLM()
    plain_reference = ADAMW[0](param_groups(reference), **ADAMW[1])
    for step in range(2 * CHECKPOINT_STEPS):
        train_step(reference, plain_reference, step)
    for name, cls in (("resume sharded", ShardedOptimizer), ("resume plain AdamW", None)):
        # Loaded afresh each time: optimizers keep (and update in place) the loaded CPU tensors.
        checkpoint = torch.load(path, weights_only=True)
        model = ToyLM()
        model.load_state_dict(checkpoint["model"])
        if cls is None:
            optimizer = ADAMW[0](param_groups(model), **ADAMW[1])
        else:
            optimizer = ShardedOptimizer(param_groups(model), ADAMW[0], **ADAMW[1])
        optimizer.load_state_dict(checkpoint["optimizer"])
        for step in range(CHECKPOINT_STEPS, 2 * CHECKPOINT_STEPS):
            train_step(model, optimizer, step)
        assert_same_params(name, step, model, reference)
        assert_same_state_dict(name, optimizer.state_dict(), plain_reference.state_dict())


def check_tests_can_fail() -> None:
    """With the shard exchange switched off (world size > 1) the comparison must report a difference."""
    exchange = ShardedOptimizer._exchange_shards
    ShardedOptimizer._exchange_shards = lambda self: None
    try:
        compare_training("no exchange", *ADAMW)
    except AssertionError:
        return
    finally:
        ShardedOptimizer._exchange_shards = exchange
    raise AssertionError("training without exchanging shards matched the unsharded run: the test cannot fail")


CASES: dict[str, Callable[[], None]] = {
    "AdamW": lambda: compare_training("AdamW", *ADAMW),
    "SGD momentum": lambda: compare_training("SGD momentum", *SGD),
    "AdamW add_param_group": lambda: compare_add_param_group("AdamW add_param_group", *ADAMW),
    "SGD add_param_group": lambda: compare_add_param_group("SGD add_param_group", *SGD),
}


def run_all(save: str | None = None, load: str | None = None) -> None:
    for case in CASES.values():
        case()
    if dist.is_initialized() and dist.get_world_size() > 1:
        check_tests_can_fail()
    if save:
        save_checkpoint(save)
    if load:
        resume_from_checkpoint(load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--save", help="write a checkpoint after training at this world size")
    parser.add_argument("--load", help="resume from a checkpoint written at another world size")
    args = parser.parse_args()
    with distributed(backend="gloo") as ctx:
        run_all(args.save, args.load)
        if ctx.is_main:
            print(f"sharded optimizer: all cases passed at world size {ctx.world_size}", flush=True)


if __name__ == "__main__":
    main()
