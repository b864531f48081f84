"""Worker for tests/parallel/test_ddp.py, run by the real launcher:
    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/ddp_worker.py {equality,fail,teardown}

`equality` checks every DDP wrapper against single-process training on the full batch, on every rank, and
exits non-zero (through cs336_systems.parallel.distributed's error handling) at the first mismatch. `fail` makes rank 1
raise while rank 0 waits in a collective, to show the job ends quickly instead of hanging. `teardown` trains a
step with every wrapper and then checks that leaving the job stopped all of gloo's threads.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems import adapters
from cs336_systems.parallel.ddp import BucketedDDP, FlatDDP, NaiveDDP
from cs336_systems.parallel.distributed import distributed, gather_to_rank0

DTYPE = torch.float64  # float64 so that "equal to single-process training" can be checked tightly
STEPS = 4
REPEATS = 3  # the same training repeated inside one launch, so an ordering race has several chances to show
EXAMPLES_PER_RANK = 3


class ToyModel(nn.Module):
    """Linear layers and a LayerNorm, with a frozen bias, a frozen parameter and a buffer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc1.bias.requires_grad_(False)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4, bias=False)
        self.frozen_scale = nn.Parameter(torch.rand(4) + 1, requires_grad=False)
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.frozen_scale + self.offset

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(n, 8, generator=generator, dtype=DTYPE)
        return inputs, torch.randn(n, 4, generator=generator, dtype=DTYPE)

    loss_fn = staticmethod(nn.functional.mse_loss)
    # Reverse registration order: fc2.weight 512 B, norm.bias 128 B, norm.weight 128 B, fc1.weight 1024 B.
    two_bucket_mb = 800 / 2**20  # [fc2.weight, norm.bias, norm.weight] and [fc1.weight], larger than the cap


class TiedModel(nn.Module):
    """An embedding whose weight is also the output projection's."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)
        self.output = nn.Linear(8, 10, bias=False)
        self.output.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(torch.tanh(self.hidden(self.embed(tokens))))

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(10, (n, 5), generator=generator), torch.randint(10, (n, 5), generator=generator)

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # Reverse registration order: hidden.bias 64 B, hidden.weight 512 B, embed.weight 640 B.
    two_bucket_mb = 600 / 2**20


def wrappers(model_class: type[nn.Module]) -> dict[str, tuple[Callable[[nn.Module], nn.Module], int | None]]:
    """name -> (constructor, expected number of buckets or None)."""
    num_trainable = sum(p.requires_grad for p in model_class().parameters())
    # Overlap and bucketed are built through the assignment's adapter hooks, which its own tests call.
    return {
        "naive": (NaiveDDP, None),
        "flat": (FlatDDP, None),
        "overlap": (adapters.get_ddp_individual_parameters, None),
        "bucketed_one": (lambda m: adapters.get_ddp_bucketed(m, bucket_size_mb=None), 1),
        "bucketed_two": (lambda m: adapters.get_ddp_bucketed(m, bucket_size_mb=model_class.two_bucket_mb), 2),
        "bucketed_per_param": (lambda m: BucketedDDP(m, bucket_size_mb=1e-9), num_trainable),
    }


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def assert_same_state(actual: nn.Module, expected: nn.Module, what: str) -> None:
    for (name, a), b in zip(actual.state_dict().items(), expected.state_dict().values(), strict=True):
        if not torch.allclose(a, b, rtol=1e-10, atol=1e-12):
            raise AssertionError(f"{what}: {name} differs by {(a - b).abs().max().item():.3e}")


def check_equality(
    model_class: type[nn.Module], name: str, make_ddp: Callable, num_buckets: int | None
) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1000)
    reference = model_class().to(DTYPE)  # rank 0's initial weights
    torch.manual_seed(1000 + rank)  # every rank starts from different weights; wrapping must install rank 0's
    local = model_class().to(DTYPE)
    differs = any(
        not torch.equal(a, b) for a, b in zip(state(local).values(), state(reference).values(), strict=True)
    )
    assert rank == 0 or differs, "test setup: rank-local initial weights should differ from rank 0's"
    ddp = make_ddp(local)
    assert_same_state(ddp.module, reference, f"{name}: after wrapping")
    if num_buckets is not None:
        assert len(ddp.buckets) == num_buckets, f"{name}: {len(ddp.buckets)} buckets, expected {num_buckets}"

    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(7)  # same data stream on every rank
    for step in range(STEPS):
        inputs, targets = model_class.batch(generator, EXAMPLES_PER_RANK * world_size)
        mine = slice(rank * EXAMPLES_PER_RANK, (rank + 1) * EXAMPLES_PER_RANK)
        set_to_none = step % 2 == 0  # both ways of clearing gradients between steps
        ddp_optimizer.zero_grad(set_to_none=set_to_none)
        reference_optimizer.zero_grad(set_to_none=set_to_none)

        model_class.loss_fn(reference(inputs), targets).backward()
        reference_optimizer.step()
        model_class.loss_fn(ddp(inputs[mine]), targets[mine]).backward()
        ddp.finish_gradient_synchronization()
        ddp_optimizer.step()
        assert_same_state(ddp.module, reference, f"{name}, {model_class.__name__}, step {step}")


class ModelWithUnusedLayer(ToyModel):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(2, 2)


def check_missing_gradient(name: str, make_ddp: Callable) -> None:
    torch.manual_seed(0)
    ddp = make_ddp(ModelWithUnusedLayer().to(DTYPE))
    inputs, targets = ToyModel.batch(torch.Generator().manual_seed(0), 2)
    nn.functional.mse_loss(ddp(inputs), targets).backward()
    try:
        ddp.finish_gradient_synchronization()
    except RuntimeError as error:
        assert "unused.weight" in str(error) and "unused.bias" in str(error), f"{name}: unclear error {error}"
    else:
        raise AssertionError(f"{name}: no error for parameters without a gradient")


def check_second_backward_is_refused() -> None:
    torch.manual_seed(0)
    ddp = NaiveDDP(ToyModel().to(DTYPE))
    inputs, targets = ToyModel.batch(torch.Generator().manual_seed(0), 2)
    nn.functional.mse_loss(ddp(inputs), targets).backward()
    try:
        nn.functional.mse_loss(ddp(inputs), targets).backward()
    except RuntimeError as error:
        assert "second gradient" in str(error), f"unclear error {error}"
    else:
        raise AssertionError("a second backward before finish_gradient_synchronization was accepted")
    ddp.finish_gradient_synchronization()


def check_wrapped_models_are_freed() -> None:
    """A benchmark wraps model after model: each must be freed once dropped, or GPU memory grows per variant."""
    for name, (make_ddp, _) in wrappers(ToyModel).items():
        model = ToyModel().to(DTYPE)
        alive = weakref.ref(model)
        ddp = make_ddp(model)
        inputs, targets = ToyModel.batch(torch.Generator().manual_seed(0), 2)
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        ddp.finish_gradient_synchronization()
        del model, ddp
        gc.collect()
        assert alive() is None, f"{name}: the wrapped model is still alive after the wrapper was dropped"


def run_equality() -> None:
    for _ in range(REPEATS):
        for model_class in (ToyModel, TiedModel):
            for name, (make_ddp, num_buckets) in wrappers(model_class).items():
                check_equality(model_class, name, make_ddp, num_buckets)
    for name, (make_ddp, _) in wrappers(ModelWithUnusedLayer).items():
        check_missing_gradient(name, make_ddp)
    check_second_backward_is_refused()
    check_wrapped_models_are_freed()
    gathered = gather_to_rank0(dist.get_rank())
    if dist.get_rank() == 0:
        assert gathered == list(range(dist.get_world_size())), gathered
        print(f"DDP equality OK on {dist.get_world_size()} ranks", flush=True)


def train_a_step_with_every_wrapper() -> None:
    """One step per wrapper with a torch.optim optimizer, whose first use imports torch.distributed.nn."""
    for name, (make_ddp, _) in wrappers(ToyModel).items():
        ddp = make_ddp(ToyModel().to(DTYPE))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        inputs, targets = ToyModel.batch(torch.Generator().manual_seed(dist.get_rank()), EXAMPLES_PER_RANK)
        ToyModel.loss_fn(ddp(inputs), targets).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        assert all(torch.isfinite(p).all() for p in ddp.parameters()), name


def backend_threads() -> list[str]:
    """Names of this process's threads that belong to gloo (its worker threads and its TCP loop)."""
    names = [Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    return [name for name in names if "gloo" in name]


def run_fail() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # never completes: rank 1 does not arrive


if __name__ == "__main__":
    mode = sys.argv[1]
    with distributed(backend="gloo", timeout_s=600):
        {"equality": run_equality, "fail": run_fail, "teardown": train_a_step_with_every_wrapper}[mode]()
    if mode == "teardown":
        # Threads still running here would meet the interpreter's shutdown, where a gloo thread that frees a
        # tensor aborts the process (see cs336_systems.parallel.distributed.leave_together).
        assert not backend_threads(), (
            f"gloo threads still running after the process group was destroyed: {backend_threads()}"
        )
        print(f"rank {os.environ['RANK']}: no gloo thread left", flush=True)
