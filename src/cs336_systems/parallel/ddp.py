"""Data parallel wrappers around a plain nn.Module, from naive to bucketed with overlap (spec §2.2-2.3).

Every wrapper broadcasts rank 0's parameters and buffers at construction and averages the gradients of the
trainable parameters over ranks, so that a step on n/world_size examples per rank equals a single-process step
on all n. One interface for all four:

    ddp = BucketedDDP(model, bucket_size_mb=25)   # or by name: wrap("bucketed", model, 25)
    loss_fn(ddp(x), y).backward()
    ddp.finish_gradient_synchronization()         # gradients are averaged after this returns
    optimizer.step()

Move the model to its device before wrapping; the set of trainable parameters is fixed at construction. Each
trainable parameter must receive a gradient in every step (one backward per finish_gradient_synchronization);
otherwise finish_gradient_synchronization raises a RuntimeError naming the parameters that got none.
Benchmarks set `measure_communication = True` to make finish_gradient_synchronization record, in
`last_communication`, a CommunicationTimer of the communication it waited for: all of it for naive/flat, only the
part not hidden behind backward for overlap/bucketed.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from cs336_systems.accounting.units import MIB
from cs336_systems.parallel.distributed import CommunicationTimer


def _grad_accumulated(wrapper: weakref.ref, index: int, param: nn.Parameter) -> None:
    if (live := wrapper()) is not None:
        live._grad_accumulated(index, param)


class _DataParallel(nn.Module):
    """Common parts: rank 0's state broadcast, the trainable-parameter list, readiness hooks, timing."""

    def __init__(self, module: nn.Module):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs an initialised process group (dist.init_process_group)"
            )
        if dist.get_backend() == "nccl":
            on_cpu = [
                name for name, t in [*module.named_parameters(), *module.named_buffers()] if not t.is_cuda
            ]
            if on_cpu:
                raise ValueError(
                    f"backend nccl needs the model on its GPU before wrapping; on the CPU: {on_cpu}"
                )
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            # parameters() and buffers() yield a tied tensor once: it is broadcast (and later reduced) once.
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.measure_communication = False
        self.last_communication: CommunicationTimer | None = None
        self._ready = [False] * len(self.params)
        # The hook holds the wrapper weakly: a strong reference would make parameter -> hook -> wrapper -> module ->
        # parameter a cycle through autograd's C++ side, which the garbage collector cannot free, so every model
        # ever wrapped (with its gradients and optimizer state) would stay on the GPU.
        this = weakref.ref(self)
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(_grad_accumulated, this, index))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _grad_accumulated(self, index: int, param: nn.Parameter) -> None:
        if self._ready[index]:
            raise RuntimeError(
                f"parameter {self.param_names[index]} got a second gradient before "
                f"finish_gradient_synchronization; {type(self).__name__} supports one backward pass per step"
            )
        self._ready[index] = True
        self._on_grad_ready(index)

    def _on_grad_ready(self, index: int) -> None:
        """Called during backward once parameter `index` has its full gradient for this step."""

    def _synchronize(self) -> None:
        """Average the gradients of all ready parameters over ranks, blocking until they are final."""
        raise NotImplementedError

    def finish_gradient_synchronization(self) -> None:
        """Complete this step's gradient averaging; call after backward and before optimizer.step()."""
        device = self.params[0].device if self.params else torch.device("cpu")
        timer = CommunicationTimer(device) if self.measure_communication else None
        try:
            self._synchronize()
            missing = [name for name, ready in zip(self.param_names, self._ready, strict=True) if not ready]
            if missing:
                raise RuntimeError(
                    f"{type(self).__name__}: no gradient this step for parameter(s) {missing}; every "
                    "trainable parameter must take part in the loss (freeze unused ones with requires_grad_(False))"
                )
        finally:
            self._ready = [False] * len(self.params)
        if timer is not None:
            self.last_communication = timer.stop()

    def _ready_params(self) -> list[nn.Parameter]:
        return [p for p, ready in zip(self.params, self._ready, strict=True) if ready]


class NaiveDDP(_DataParallel):
    """One blocking all-reduce per parameter, after the backward pass."""

    def _synchronize(self) -> None:
        for param in self._ready_params():
            dist.all_reduce(param.grad)
            param.grad.div_(self.world_size)


class FlatDDP(_DataParallel):
    """One all-reduce of all gradients flattened into a single tensor, after the backward pass."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(
                f"FlatDDP needs all trainable parameters on one dtype and device, got {sorted(kinds)}"
            )

    def _synchronize(self) -> None:
        grads = [p.grad for p in self._ready_params()]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(self.world_size)
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(averaged)


class OverlapIndividualDDP(_DataParallel):
    """An asynchronous all-reduce per parameter, launched from its gradient hook while backward goes on."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _on_grad_ready(self, index: int) -> None:
        grad = self.params[index].grad
        # Averaged as sum(g / world): the division runs during backward instead of after the last all-reduce.
        grad.div_(self.world_size)
        self._pending.append(dist.all_reduce(grad, async_op=True))

    def _synchronize(self) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            work.wait()


class _Bucket:
    """A persistent flat buffer for the gradients of a group of parameters, reduced with one collective."""

    def __init__(self, indices: list[int], params: list[nn.Parameter]):
        self.indices = indices
        self.buffer = torch.zeros(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        # Views into the buffer, one per parameter, in bucket order.
        self.slots = dict(zip(indices, self.buffer.split([p.numel() for p in params]), strict=True))
        self.num_ready = 0
        self.work: dist.Work | None = None


class BucketedDDP(_DataParallel):
    """Gradients packed into buckets of at most `bucket_size_mb` MiB, each all-reduced asynchronously as soon
    as all of its gradients are ready.

    Buckets are filled in reverse registration order (roughly the order backward produces gradients); a
    parameter larger than the cap gets a bucket of its own; bucket_size_mb None puts everything into one bucket.
    Buckets are launched strictly in bucket order, so every rank issues the same sequence of collectives.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None):
        if bucket_size_mb is not None and not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive or None, got {bucket_size_mb}")
        super().__init__(module)
        self.bucket_size_mb = bucket_size_mb
        cap_bytes = float("inf") if bucket_size_mb is None else bucket_size_mb * MIB
        groups: list[list[int]] = []
        group_bytes = 0
        for index in reversed(range(len(self.params))):
            param = self.params[index]
            nbytes = param.numel() * param.element_size()
            previous = self.params[groups[-1][-1]] if groups else None
            if (
                previous is None
                or group_bytes + nbytes > cap_bytes
                or (previous.dtype, previous.device) != (param.dtype, param.device)
            ):
                groups.append([])
                group_bytes = 0
            groups[-1].append(index)
            group_bytes += nbytes
        self.buckets = [_Bucket(group, [self.params[i] for i in group]) for group in groups]
        self._bucket_of = {i: bucket for bucket in self.buckets for i in bucket.indices}
        self._next_launch = 0

    def _on_grad_ready(self, index: int) -> None:
        bucket = self._bucket_of[index]
        # Packed already divided by the world size, so the all-reduced bucket holds the average. (With
        # set_to_none=False the gradient is the slot itself, and this divides it in place.)
        torch.div(self.params[index].grad.reshape(-1), self.world_size, out=bucket.slots[index])
        bucket.num_ready += 1
        while self._next_launch < len(self.buckets):
            candidate = self.buckets[self._next_launch]
            if candidate.num_ready < len(candidate.indices):
                break
            candidate.work = dist.all_reduce(candidate.buffer, async_op=True)
            self._next_launch += 1

    def _synchronize(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                # Each gradient becomes a view of its slot: nothing is copied back after the last all-reduce.
                for i in bucket.indices:
                    self.params[i].grad = bucket.slots[i].view_as(self.params[i])
            bucket.work = None
            bucket.num_ready = 0
        self._next_launch = 0


# Our wrappers by name, from naive to bucketed with overlap, in the order the experiments report them.
WRAPPERS: dict[str, type[_DataParallel]] = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapIndividualDDP,
    "bucketed": BucketedDDP,
}


def wrap(name: str, module: nn.Module, bucket_size_mb: float | None = None) -> _DataParallel:
    """`module` wrapped by our wrapper `name` (WRAPPERS); `bucket_size_mb` is the bucketed wrapper's cap."""
    if name not in WRAPPERS:
        raise ValueError(f"unknown wrapper {name!r}; choose one of {list(WRAPPERS)}")
    return BucketedDDP(module, bucket_size_mb) if name == "bucketed" else WRAPPERS[name](module)
