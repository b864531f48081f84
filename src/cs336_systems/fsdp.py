"""Fully-sharded data parallel (2026 handout §7): each rank stores 1/world of every Linear and Embedding weight.

    fsdp = FullyShardedDataParallel(model, compute_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(fsdp.parameters())     # each rank's shards and the replicated parameters
    loss_fn(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()               # shard gradients reduced, replicated ones averaged
    optimizer.step()
    full = fsdp.gather_full_params()                     # every parameter, full, by its name in `model`

**What is sharded.** The `weight` of every layer that is a `torch.nn.Linear` or `torch.nn.Embedding`, or whose
class is named `Linear` or `Embedding` and holds a 2-D `weight` Parameter: other packages' layers that behave
like them (the basics model's own Linear, weight (d_out, d_in) used as `x @ W.T`, and Embedding, weight
(vocab, d) indexed by ids). A trainable weight becomes a flat shard of ceil(numel / world) elements in the
weight's own dtype (the master weights: float32 for a float32 model, whatever `compute_dtype`; bf16 for a bf16
model, as the 2026 leaderboard stores them), the last rank's padded with zeros, registered in the layer under its
old name, so `model.named_parameters()` names the shards; everything else (norms, biases) is replicated and its
gradients are averaged. A frozen weight stays whole and frozen; a weight shared by two layers (tied) is refused
at construction.

**Units.** Weights are gathered and freed by unit: by default each sharded layer is its own unit; `units` (a
list of submodules, e.g. the Transformer blocks) makes every sharded layer inside one of them part of that unit,
gathered before the unit's forward and freed after it, with the hooks on the unit itself. A unit that is a
`torch.compile`d module keeps the hooks outside the compiled code (they resize storage and launch collectives,
which would break its graph), so the compiled blocks of the leaderboard's train step can be sharded.

**Forward.** A unit's full weights exist only around its use: all-gathered (in `compute_dtype`: each rank
casts its shard into its own chunk of the gathered buffer, and the all-gather runs in place) into buffers whose
storage is freed after the unit's forward. The gathers of the unit at position i (in the order the units ran in
the first forward) start once the unit at i - prefetch_distance has finished its forward, asynchronously, and
are waited for right before the unit runs.

**Backward.** The mirror image: a unit's weights are gathered again into the same storage (which autograd
saved) once the unit prefetch_distance after it has finished its backward (all its weight gradients are ready),
and waited for before the unit's own backward (a hook on its output's gradient). Each weight's gradient, once
accumulated, is reduce-scattered (in the shard's dtype) to its owner asynchronously and its storage freed again;
`finish_gradient_synchronization` waits for the outstanding reductions and writes each shard's `.grad` (the
average over ranks), so any torch.optim optimizer steps only its shard. The replicated parameters' gradients,
small, are averaged there in one all-reduce.

At world size 1 there is nothing to communicate: a "gather" is the cast into the buffer and the gradient is
the shard's, with the same buffers, hooks and freeing (so one GPU measures the machinery's own cost).

Memory per rank: the shards and replicated parameters with their gradients and optimizer state, plus the full
weights of the few units gathered at a time and, briefly, a layer's full gradient while it is being reduced.
With `measure_communication = True`, each finish_gradient_synchronization leaves in `last_communication` (a
StepCommunication) the step's waits for all-gathers (exposed communication: CUDA events around each wait on the
compute stream, wall time on gloo) and for the final synchronisation, and the bytes this rank received or sent;
it is read after the step, so measuring does not synchronise the device mid-step.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed import CommunicationTimer, all_gather_flat, reduce_scatter_flat

SHARDED_CLASS_NAMES = ("Linear", "Embedding")


def is_sharded_layer(module: nn.Module) -> bool:
    """A Linear or Embedding layer of torch or of another package (see the module docstring)."""
    weight = module._parameters.get("weight")
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return False
    return isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ in SHARDED_CLASS_NAMES


@dataclass
class StepCommunication:
    """What one step of `measure_communication` waited for: a CommunicationTimer per all-gather wait (the compute
    stream idle until the gathered weight was there) and one for finish_gradient_synchronization (until the last
    reduction had finished), and the bytes this rank received or sent. `stats()` reads the timers: call it once the
    step is over, so that reading does not stall the step it measures."""

    gather_waits: list[CommunicationTimer]
    sync_wait: CommunicationTimer
    bytes_moved: dict[str, float]

    def stats(self) -> dict[str, float]:
        return {"gather_wait_s": sum(timer.seconds for timer in self.gather_waits),
                "sync_wait_s": self.sync_wait.seconds, **self.bytes_moved}


class _ShardedWeight:
    """One layer's weight: its shard (a Parameter of the layer, in the weight's dtype) and the full weight's
    buffer."""

    def __init__(self, name: str, layer: nn.Module, rank: int, world: int, compute_dtype: torch.dtype):
        weight = layer.weight
        self.name, self.layer, self.shape, self.numel = name, layer, weight.shape, weight.numel()
        self.world = world
        self.shard_numel = math.ceil(self.numel / world)
        padded = torch.zeros(self.shard_numel * world, dtype=weight.dtype, device=weight.device)
        padded[: self.numel] = weight.detach().reshape(-1)
        self.shard = nn.Parameter(padded[rank * self.shard_numel : (rank + 1) * self.shard_numel].clone())
        layer._parameters["weight"] = self.shard  # the layer's parameter is now its shard, under the same name
        # The gathered weight: a flat buffer (what the all-gather writes) and `full`, a leaf tensor on the same
        # storage with its own version counter, which the layer computes with and autograd saves; the storage is
        # freed between uses (resized to 0) and refilled before the backward reads it again.
        self.buffer = torch.empty(self.shard_numel * world, dtype=compute_dtype, device=weight.device)
        self.full = torch.empty(0, dtype=compute_dtype, device=weight.device)
        self.full.set_(self.buffer.untyped_storage(), 0, self.shape)
        self.full.requires_grad_(True)
        self.local = self.buffer[rank * self.shard_numel : (rank + 1) * self.shard_numel]  # this rank's chunk
        self.free()
        self.gather_work: dist.Work | None = None

    @property
    def gathered(self) -> bool:
        return self.buffer.untyped_storage().nbytes() > 0

    def start_gather(self) -> bool:
        """Refill the full weight from every rank's shard (cast to the compute dtype), asynchronously; False if
        it is gathered already."""
        if self.gathered:
            return False
        self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
        self.local.copy_(self.shard.detach())
        if self.world > 1:
            self.gather_work = all_gather_flat(self.buffer, self.local, async_op=True)
        return True

    def free(self) -> None:
        self.buffer.untyped_storage().resize_(0)

    def use_full_weight(self) -> None:
        self.layer._parameters["weight"] = self.full  # type: ignore[assignment]  (a leaf tensor, not a Parameter)

    def use_shard(self) -> None:
        self.layer._parameters["weight"] = self.shard


def _broadcast_from_rank0(module: nn.Module) -> None:
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)


class FullyShardedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, prefetch_distance: int = 2,
                 units: Iterable[nn.Module] = ()):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialised process group (dist.init_process_group)")
        if prefetch_distance < 1:
            raise ValueError(f"prefetch_distance must be >= 1, got {prefetch_distance}")
        if dist.get_backend() == "nccl":
            on_cpu = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if not t.is_cuda]
            if on_cpu:
                raise ValueError(f"NCCL needs CUDA tensors; move the model to its GPU before wrapping: {on_cpu[:5]}")
        self.module = module
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.prefetch_distance = prefetch_distance
        _broadcast_from_rank0(module)

        unit_of = self._unit_modules(module, list(units))
        self.weights: list[_ShardedWeight] = []
        # unit module -> indices into self.weights; by default each sharded layer is its own unit
        grouped: dict[nn.Module, list[int]] = {}
        owner: dict[int, str] = {}
        for layer_name, layer in module.named_modules():
            if not is_sharded_layer(layer):
                continue
            name = f"{layer_name}.weight" if layer_name else "weight"
            if id(layer.weight) in owner:
                raise ValueError(f"{type(self).__name__}: {name} and {owner[id(layer.weight)]} are one tied "
                                 "Parameter; tied weights cannot be sharded")
            owner[id(layer.weight)] = name
            if layer.weight.requires_grad:
                dtype = compute_dtype or layer.weight.dtype
                grouped.setdefault(unit_of.get(layer, layer), []).append(len(self.weights))
                self.weights.append(_ShardedWeight(name, layer, self.rank, self.world, dtype))
        self.units: list[tuple[nn.Module, list[int]]] = list(grouped.items())
        sharded = {id(w.shard) for w in self.weights}
        self.replicated = [p for p in module.parameters() if p.requires_grad and id(p) not in sharded]

        self.order: list[int] = []  # indices into self.units in the order they ran (first forward)
        self._position: dict[int, int] = {}  # unit index -> its position in self.order
        self._seen: list[int] = []
        self._in_backward = False  # from the backward's first unit until the next forward or synchronisation
        self._unit_of_weight = {w: u for u, (_, indices) in enumerate(self.units) for w in indices}
        self._grads_pending = [0] * len(self.units)  # per unit, weight gradients its backward has yet to produce
        self._reductions: list[tuple[dist.Work | None, torch.Tensor, nn.Parameter]] = []
        self.device = self.weights[0].full.device if self.weights else torch.device("cpu")
        self.measure_communication = False
        self._gather_waits: list[CommunicationTimer] = []
        self.last_communication: StepCommunication | None = None
        self._bytes = dict.fromkeys(("bytes_all_gathered", "bytes_reduce_scattered", "bytes_all_reduced"), 0.0)
        # ("gather" | "forward_done" | "backward_done", unit) when record_events (tests check the prefetch rule)
        self.events: list[tuple[str, int]] = []
        self.record_events = False

        this = weakref.ref(self)
        for unit, (unit_module, _) in enumerate(self.units):
            unit_module.register_forward_pre_hook(_hook(this, "_before_forward", unit))
            unit_module.register_forward_hook(_hook(this, "_after_forward", unit))
        for index, weight in enumerate(self.weights):
            weight.full.register_post_accumulate_grad_hook(_hook(this, "_gradient_ready", index))

    @staticmethod
    def _unit_modules(module: nn.Module, units: list[nn.Module]) -> dict[nn.Module, nn.Module]:
        """Each sharded layer inside one of `units` -> that unit; the units must be disjoint submodules."""
        inside = {id(m) for m in module.modules()}
        unit_of: dict[nn.Module, nn.Module] = {}
        for i, unit in enumerate(units):
            if id(unit) not in inside:
                raise ValueError(f"units[{i}] ({type(unit).__name__}) is not a submodule of the wrapped module")
            for layer in unit.modules():
                if layer in unit_of:
                    raise ValueError(f"units[{i}] ({type(unit).__name__}) overlaps an earlier unit")
                unit_of[layer] = unit
        return unit_of

    # ------------------------------------------------------------------------------------------------ forward

    def forward(self, *args, **kwargs):
        self._seen, self._in_backward = [], False
        return self.module(*args, **kwargs)

    def _neighbour(self, unit: int, offset: int) -> int | None:
        """The unit `offset` positions after `unit` in the order of the forward (before it, if negative)."""
        position = self._position.get(unit, unit) + offset  # before the first forward ends: module order
        if not 0 <= position < len(self.units):
            return None
        return self.order[position] if self.order else position

    def _gather(self, unit: int | None) -> None:
        if unit is None:
            return
        started = False
        for index in self.units[unit][1]:
            weight = self.weights[index]
            if weight.start_gather():
                started = True
                self._bytes["bytes_all_gathered"] += (
                    (self.world - 1) * weight.shard_numel * weight.buffer.element_size())
        if started and self.record_events:
            self.events.append(("gather", unit))

    def _wait_gathered(self, unit: int) -> None:
        self._gather(unit)
        for index in self.units[unit][1]:
            weight = self.weights[index]
            if weight.gather_work is not None:
                timer = CommunicationTimer(self.device) if self.measure_communication else None
                weight.gather_work.wait()
                if timer is not None:
                    self._gather_waits.append(timer.stop())
                weight.gather_work = None

    def _before_forward(self, unit: int, *_) -> None:
        if self._in_backward:  # activation checkpointing recomputes the unit's forward for its backward
            self._wait_gathered(unit)
            for index in self.units[unit][1]:
                self.weights[index].use_full_weight()
            return
        if not self.order:
            self._seen.append(unit)
        if self._neighbour(unit, -1) is None:  # nothing before it has run: the first units may gather now
            for ahead in range(1, self.prefetch_distance):
                self._gather(self._neighbour(unit, ahead))
        self._wait_gathered(unit)
        for index in self.units[unit][1]:
            self.weights[index].use_full_weight()

    def _after_forward(self, unit: int, _module, _inputs, output) -> None:
        for index in self.units[unit][1]:
            self.weights[index].use_shard()
        if self._in_backward:  # a recomputation: the backward still needs the weights (_gradient_ready frees them)
            return
        for index in self.units[unit][1]:
            self.weights[index].free()
        if self.record_events:
            self.events.append(("forward_done", unit))
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(_hook(weakref.ref(self), "_before_backward", unit))
        self._gather(self._neighbour(unit, self.prefetch_distance))
        if not self.order and len(self._seen) == len(self.units):
            self.order = list(self._seen)
            self._position = {unit: position for position, unit in enumerate(self.order)}

    # ----------------------------------------------------------------------------------------------- backward

    def _before_backward(self, unit: int, _grad) -> None:
        self._in_backward = True
        if self._neighbour(unit, 1) is None:  # the backward's first unit: prefetch as the forward does
            for behind in range(1, self.prefetch_distance):
                self._gather(self._neighbour(unit, -behind))
        self._grads_pending[unit] = len(self.units[unit][1])
        self._wait_gathered(unit)

    def _gradient_ready(self, index: int, full: torch.Tensor) -> None:
        weight = self.weights[index]
        grad = full.grad.reshape(-1)
        full.grad = None
        weight.use_shard()  # a recomputation stopped early (checkpointing) may not have put the shard back
        weight.free()
        unit = self._unit_of_weight[index]
        self._grads_pending[unit] -= 1
        if self._grads_pending[unit] == 0:  # the unit's backward is done: prefetch, before its reductions queue
            if self.record_events:
                self.events.append(("backward_done", unit))
            self._gather(self._neighbour(unit, -self.prefetch_distance))
        grad = grad.to(weight.shard.dtype)
        if self.world == 1:
            self._reductions.append((None, grad, weight.shard))
            return
        padding = weight.buffer.numel() - weight.numel
        if padding:
            grad = torch.nn.functional.pad(grad, (0, padding))
        out = torch.empty(weight.shard_numel, dtype=grad.dtype, device=full.device)
        work = reduce_scatter_flat(out, grad, op=dist.ReduceOp.SUM, async_op=True)
        self._bytes["bytes_reduce_scattered"] += (self.world - 1) * weight.shard_numel * grad.element_size()
        self._reductions.append((work, out, weight.shard))

    def _average_replicated_gradients(self) -> None:
        """One all-reduce of every replicated gradient (norms: a few KiB each), averaged in place."""
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if self.world == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(self.world)
        for grad, averaged in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(averaged.view_as(grad))
        self._bytes["bytes_all_reduced"] += 2 * (self.world - 1) / self.world * flat.nbytes

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradients' reductions; then every shard and replicated parameter holds the average over
        ranks of its gradient (in the shard's dtype for the shards)."""
        timer = CommunicationTimer(self.device) if self.measure_communication else None
        self._in_backward = False
        for weight in self.weights:  # a prefetched layer whose backward did not run must not stay gathered
            if weight.gather_work is not None:
                weight.gather_work.wait()
                weight.gather_work = None
            weight.free()
        self._average_replicated_gradients()
        for work, reduced, param in self._reductions:
            if work is not None:
                work.wait()
                reduced.div_(self.world)
            param.grad = reduced if param.grad is None else param.grad + reduced
        self._reductions.clear()
        if timer is not None:
            self.last_communication = StepCommunication(self._gather_waits, timer.stop(), self._bytes)
        self._gather_waits = []
        self._bytes = dict.fromkeys(self._bytes, 0.0)  # a new dict: the last step's stays with its record

    # --------------------------------------------------------------------------------------------- full state

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the wrapped module, full (the shards all-gathered in their dtype), keyed by its name
        in `module.named_parameters()`. A collective: every rank must call it."""
        full = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        for weight in self.weights:
            gathered = torch.empty(weight.shard_numel * self.world, dtype=weight.shard.dtype, device=weight.shard.device)
            all_gather_flat(gathered, weight.shard.detach())
            full[weight.name] = gathered[: weight.numel].view(weight.shape).clone()
        return full


def _hook(wrapper: weakref.ref, method: str, *bound) -> Callable:
    """A hook calling `method` of the wrapper while it lives (hooks hold no reference to it)."""

    def call(*args):
        live = wrapper()
        if live is not None:
            return getattr(live, method)(*bound, *args)
        return None

    return call


FSDP = FullyShardedDataParallel
