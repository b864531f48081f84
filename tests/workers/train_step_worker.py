"""Run under torchrun (gloo, CPU) by tests/training/test_train_step_benchmark.py: each sharded stack of the leaderboard's
train step against the same stack unsharded, on the batch of every rank's sequences.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/train_step_worker.py STACK \
        [--compile] [--initial-only]

The sharded model, built on the meta device and initialised shard by shard, starts from exactly the unsharded
model's weights and buffers (built whole with the same seed). Then two steps (none with --initial-only): the
summed loss over ranks equals the unsharded loss, and the updated full weights equal the unsharded model's, where
that one's loss is divided by the world size (the sharded stacks average gradients over ranks). float32, our
Triton kernels in the interpreter.
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before our kernels import triton

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cs336_systems.parallel.distributed import distributed  # noqa: E402
from cs336_systems.parallel.fsdp import FullyShardedDataParallel  # noqa: E402
from cs336_systems.training.stacks import STACKS, build_step  # noqa: E402

DIMS = {"d_model": 64, "d_ff": 96, "num_layers": 2, "num_heads": 4, "vocab_size": 97, "context_length": 19}


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, FullyShardedDataParallel):
        return model.gather_full_params()
    return {
        name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        for name, p in model.named_parameters()
    }


def check_initial_values(stack_name: str, sharded: torch.nn.Module, whole: torch.nn.Module) -> None:
    """Every weight (gathered) and buffer of the sharded model equals the unsharded one's, to the bit; nothing
    is left on the meta device."""
    mine = full_weights(sharded)
    for name, weight in whole.named_parameters():
        assert torch.equal(mine[name], weight), f"{stack_name}: initial {name} differs from the plain model's"
    buffers = dict(sharded.named_buffers())
    for name, buffer in whole.named_buffers():
        theirs = buffers[f"module.{name}" if isinstance(sharded, FullyShardedDataParallel) else name]
        assert torch.equal(theirs, buffer), f"{stack_name}: buffer {name} differs from the plain model's"
    assert not any(t.is_meta for t in [*sharded.parameters(), *sharded.buffers()]), stack_name


def main(stack_name: str, compiled: bool, initial_only: bool) -> None:
    with distributed(backend="gloo", timeout_s=600) as ctx:
        stack = STACKS[stack_name]
        make = lambda s: build_step(
            s, DIMS, 1, ctx.device, torch.float32, compile_blocks=compiled, head_chunk=16
        )
        sharded = make(stack)
        whole = make(dataclasses.replace(stack, sharding="none"))
        # the unsharded model sees every rank's sequence (build_step draws rank r's from seed + r)
        ids = [
            torch.randint(
                DIMS["vocab_size"],
                (1, DIMS["context_length"] + 1),
                generator=torch.Generator().manual_seed(r),
            )
            for r in range(ctx.world_size)
        ]
        whole.batch = torch.cat(ids)[:, :-1], torch.cat(ids)[:, 1:]
        check_initial_values(stack_name, sharded.model, whole.model)
        # the units our FSDP never gathers for the backward: those whose backward reads no weights
        if isinstance(sharded.model, FullyShardedDataParallel):
            skipped = {
                type(sharded.model.units[u][0]).__name__ for u in sharded.model._not_gathered_for_backward
            }
            expected = {"TokenEmbedding", *(["LossHead"] if stack.head == "fused" else [])}
            assert skipped == expected, (
                f"{stack_name}: {skipped} not gathered for the backward, not {expected}"
            )
        for step in range(0 if initial_only else 2):
            loss = sharded.train_step()
            dist.all_reduce(loss)
            whole.optimizer.zero_grad(set_to_none=True)
            expected = whole.loss()
            (expected / ctx.world_size).backward()
            whole.optimizer.step()
            torch.testing.assert_close(
                loss, expected.detach(), rtol=1e-5, atol=0, msg=f"{stack_name} loss, step {step}"
            )
            mine, theirs = full_weights(sharded.model), dict(whole.model.named_parameters())
            assert mine.keys() == theirs.keys(), mine.keys() ^ theirs.keys()
            for name, weight in mine.items():
                torch.testing.assert_close(
                    weight,
                    theirs[name].detach(),
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, n=name, k=step: f"{stack_name} step {k}, {n}: {m}",
                )
        if ctx.is_main:
            print(
                f"TRAIN STEP {stack_name}{' compiled' if compiled else ''}"
                f"{' initial values' if initial_only else ''} OK on {ctx.world_size} ranks",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1], "--compile" in sys.argv[2:], "--initial-only" in sys.argv[2:])
