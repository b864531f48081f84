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
storage is freed after the unit's forward. A unit's collectives are started as one group (on NCCL one kernel
per unit and pass, as FSDP2's one collective per unit, without its copies into and out of one flat buffer; on
2x H200 at 34 layers, one machine, the leaderboard's step took 4.54 s with one collective per weight, 4.48 s
grouped). The gathers of the unit at position i (in the order the units ran in
the first forward) start once the unit at i - prefetch_distance has finished its forward, asynchronously, and
are waited for right before the unit runs.

**Backward.** The mirror image: a unit's weights are gathered again into the same storage (which autograd
saved) once the unit prefetch_distance after it has finished its backward (all its weight gradients are ready),
and waited for before the unit's own backward (a hook on its output's gradient). Each weight's full storage is
freed once its gradient has accumulated; once the unit's last gradient is there, the unit's gradients are
reduce-scattered (in the shards' dtype) to their owners asynchronously;
`finish_gradient_synchronization` waits for the outstanding reductions and writes each shard's `.grad` (the
average over ranks), so any torch.optim optimizer steps only its shard. The replicated parameters' gradients,
small, are averaged there in one all-reduce. `backward_without_weights` names units whose backward reads none of
their weights (an embedding's gradient comes from the token ids alone; a head that made its gradients in the
forward, as the fused LM head + loss does): they are never gathered for the backward, only for a forward
(a recomputation under activation checkpointing included). For the 2026 leaderboard's embedding and fused head
(1,187 MiB each in bf16) that is two all-gathers a step fewer, one of them the backward's first, which nothing
hides.

**Mixed precision.** With `compute_dtype`, each unit's floating-point inputs and its replicated parameters
(biases; norms inside a unit) are cast to it around the unit's forward, as FSDP2's MixedPrecisionPolicy does, so
ordinary torch.nn models (a float32 LayerNorm before a biased Linear) run; the casts are differentiable, so those
parameters keep float32 gradients. Modules of replicated parameters outside every unit (norms) get their
floating-point inputs in their parameters' dtype, as autocast runs norms in float32.

**Exact mode** (`exact=True`): training equal to the bit to single-process training on the whole batch (the
2026 handout's FSDP test in fp32), at the cost of every rank computing every unit over the whole batch. The usual
design sums each weight's gradient over this rank's rows and adds the ranks' sums in the reduce-scatter, which
associates differently from one process's sum over all rows. Here each unit (and each module outside the units
that holds replicated parameters, such as a norm) all-gathers its inputs in global batch order (the ranks' rows
in rank order), runs its forward over the whole batch and keeps this rank's rows; in the backward it all-gathers
the output gradients the same way, runs the unit's forward and backward again over the whole batch (the very
operations one process runs, so the same bits), and keeps its shard of each weight gradient (no reduce-scatter)
and this rank's rows of the input gradient. Replicated gradients come out equal on every rank (no all-reduce).
The result equals one process's when every rank's loss gradient equals that process's rows up to an exact
scaling: a per-rank mean at a power-of-two world size (the average's 1/world is exact), or a loss normalised by
the global batch with `gradient_divide_factor=1` at any world size. Units must take the batch as dimension 0 of
their tensor inputs and return one tensor with it; a module that holds replicated parameters and also contains
sharded layers, and activation checkpointing, are refused.

**A model built on the meta device** (`device` given): each sharded weight gets only its shard on `device`, the
rest of the model (norms, buffers) its full tensors there, all uninitialised and nothing broadcast; then
`set_full_value(module, name, value)` for every parameter and buffer, one at a time, keeps this rank's chunk of a
sharded weight. So a rank never holds more than its shards and whatever full value it is handed (the 2026
leaderboard's stacks hand one layer at a time: cs336_systems.model.transformer.initial_values).

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

from cs336_systems.parallel.distributed import (
    CommunicationTimer,
    all_gather_coalesced,
    all_gather_flat,
    reduce_scatter_coalesced,
)

SHARDED_CLASS_NAMES = ("Linear", "Embedding")
# what last_communication counts, per step: bytes this rank received (all-gathers) or sent (reductions); exact
# mode adds its activations and output gradients
BYTES_KEYS = (
    "bytes_all_gathered",
    "bytes_reduce_scattered",
    "bytes_all_reduced",
    "bytes_activations_gathered",
)


def reduce_op_for(backend: str, divide_factor: float, world: int) -> dist.ReduceOp:
    """The reduce-scatter's op: AVG where the backend averages (NCCL) and the average is what is asked
    (divide_factor == world), else SUM, the shards then divided by divide_factor."""
    return dist.ReduceOp.AVG if backend == "nccl" and divide_factor == world else dist.ReduceOp.SUM


def is_sharded_layer(module: nn.Module) -> bool:
    """A Linear or Embedding layer of torch or of another package (see the module docstring)."""
    weight = module._parameters.get("weight")
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return False
    return isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ in SHARDED_CLASS_NAMES


@dataclass
class StepCommunication:
    """What one step of `measure_communication` waited for: a CommunicationTimer per all-gather wait (the compute
    stream idle until the gathered weight was there), each with the pass that waited ("forward" or "backward",
    recomputations included), and one for finish_gradient_synchronization (until the last reduction had finished),
    and the bytes this rank received or sent. `stats()` reads the timers: call it once the step is over, so that
    reading does not stall the step it measures."""

    gather_waits: list[tuple[str, CommunicationTimer]]
    sync_wait: CommunicationTimer
    bytes_moved: dict[str, float]

    def stats(self) -> dict[str, float]:
        by_pass = {
            f"gather_wait_{name}_s": sum(timer.seconds for phase, timer in self.gather_waits if phase == name)
            for name in ("forward", "backward")
        }
        return {
            "gather_wait_s": sum(by_pass.values()),
            **by_pass,
            "sync_wait_s": self.sync_wait.seconds,
            **self.bytes_moved,
        }


class _ShardedWeight:
    """One layer's weight: its shard (a Parameter of the layer, in the weight's dtype) and the full weight's
    buffer."""

    def __init__(
        self,
        name: str,
        layer: nn.Module,
        rank: int,
        world: int,
        compute_dtype: torch.dtype,
        device: torch.device,
    ):
        weight = layer.weight
        self.name, self.layer, self.shape, self.numel = name, layer, weight.shape, weight.numel()
        self.rank, self.world = rank, world
        self.shard_numel = math.ceil(self.numel / world)
        # a weight on the meta device gets its shard on `device`, zeros until set_full
        self.shard = nn.Parameter(torch.zeros(self.shard_numel, dtype=weight.dtype, device=device))
        if not weight.is_meta:
            self.set_full(weight.detach())
        layer._parameters["weight"] = (
            self.shard
        )  # the layer's parameter is now its shard, under the same name
        # The gathered weight: a flat buffer (what the all-gather writes) and `full`, a leaf tensor on the same
        # storage with its own version counter, which the layer computes with and autograd saves; the storage is
        # freed between uses (resized to 0) and refilled before the backward reads it again.
        self.buffer = torch.empty(self.shard_numel * world, dtype=compute_dtype, device=device)
        self.full = torch.empty(0, dtype=compute_dtype, device=device)
        self.full.set_(self.buffer.untyped_storage(), 0, self.shape)
        self.full.requires_grad_(True)
        self.local = self.own_chunk(self.buffer)  # this rank's chunk
        self.free()

    @torch.no_grad()
    def set_full(self, value: torch.Tensor) -> None:
        """The shard from the full weight `value` (cast to the shard's dtype): this rank's chunk of it; the last
        rank's padding stays zero."""
        start = min(self.numel, self.rank * self.shard_numel)
        mine = value.reshape(-1)[start : start + self.shard_numel]
        self.shard[: mine.numel()].copy_(mine)

    def own_chunk(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a flat tensor of the padded weight's size."""
        return flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    @property
    def gathered(self) -> bool:
        return self.buffer.untyped_storage().nbytes() > 0

    def prepare_gather(self) -> bool:
        """Give the full weight its storage back and cast this rank's shard into its own chunk of it, ready for
        the all-gather (the wrapper starts one per unit); False if it is gathered already."""
        if self.gathered:
            return False
        self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
        self.local.copy_(self.shard.detach())
        return True

    def free(self) -> None:
        self.buffer.untyped_storage().resize_(0)

    def use_full_weight(self, detached: bool = False) -> None:
        # a leaf tensor, not a Parameter; detached: a forward that builds no graph (exact mode's)
        self.layer._parameters["weight"] = self.full.detach() if detached else self.full  # type: ignore[assignment]

    def use_shard(self) -> None:
        self.layer._parameters["weight"] = self.shard


@dataclass
class _ExactCall:
    """One forward of a unit in exact mode, kept for its backward: the module, this rank's inputs (until the
    forward hook) and the inputs over the whole batch, which of them need a gradient, each rank's number of rows,
    the autocast state, and what the module computes with (sharded weights, replicated parameters as (owner,
    name, parameter))."""

    module: nn.Module
    local: tuple
    inputs: tuple
    needs_grad: list[bool]
    rows: list[int]
    autocast: tuple[str, bool, torch.dtype]
    weights: list[_ShardedWeight]
    params: list[tuple[nn.Module, str, nn.Parameter]]
    unit: int | None  # index into FullyShardedDataParallel.units; None for a module of replicated parameters
    cast: (
        torch.dtype | None
    )  # the dtype its floating-point inputs and parameters were cast to (None: as they are)


class _WholeBatch(torch.autograd.Function):
    """This rank's rows of an exact call's output (computed over the whole batch), whose backward is the call's
    backward over the whole batch. Its differentiable inputs are the wrapper's anchor (so that the output needs a
    gradient even when the inputs are token ids) and the rank's inputs that need gradients; the weight and
    parameter gradients are kept by the wrapper, not returned."""

    @staticmethod
    def forward(ctx, wrapper, call: _ExactCall, output: torch.Tensor, _anchor, *inputs: torch.Tensor):
        ctx.wrapper, ctx.call = wrapper, call
        start = sum(call.rows[: wrapper.rank])
        return output.narrow(0, start, call.rows[wrapper.rank]).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, None, None, *ctx.wrapper._exact_backward(ctx.call, grad)


def _broadcast_from_rank0(module: nn.Module) -> None:
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)


def _materialise(module: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer of `module` still on the meta device, allocated on `device` (uninitialised)."""
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is not None and p.is_meta:
                owner._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
        for name, b in owner._buffers.items():
            if b is not None and b.is_meta:
                owner._buffers[name] = torch.empty_like(b, device=device)


class FullyShardedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        prefetch_distance: int = 2,
        units: Iterable[nn.Module] = (),
        exact: bool = False,
        gradient_divide_factor: float | None = None,
        device: torch.device | None = None,
        backward_without_weights: Iterable[nn.Module] = (),
    ):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs an initialised process group (dist.init_process_group)"
            )
        if prefetch_distance < 1:
            raise ValueError(f"prefetch_distance must be >= 1, got {prefetch_distance}")
        if gradient_divide_factor is not None and gradient_divide_factor <= 0:
            raise ValueError(f"gradient_divide_factor must be positive, got {gradient_divide_factor}")
        on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        if on_meta and device is None:
            raise ValueError("a module on the meta device needs `device`, where its shards are to be")
        if dist.get_backend() == "nccl":
            on_cpu = [
                name
                for name, t in [*module.named_parameters(), *module.named_buffers()]
                if not t.is_cuda and not t.is_meta
            ]
            if on_cpu:
                raise ValueError(
                    f"NCCL needs CUDA tensors; move the model to its GPU before wrapping: {on_cpu[:5]}"
                )
        self.module = module
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.prefetch_distance = prefetch_distance
        self.compute_dtype, self.exact = compute_dtype, exact
        # gradients are summed over ranks, then divided by this (the world size: their average)
        self.divide_factor = float(gradient_divide_factor or self.world)
        # NCCL averages inside the reduce-scatter, which saves a pass over every gradient shard after it (the
        # leaderboard's 8 GB of bf16 shards per rank: 4 ms on an H200, the result bit-equal at world size 2);
        # gloo has no AVG, so there the shards are divided
        self._reduce_op = reduce_op_for(dist.get_backend(), self.divide_factor, self.world)
        if not on_meta:
            _broadcast_from_rank0(module)

        unit_of = self._unit_modules(module, list(units))
        unread = self._checked_backward_without_weights(module, unit_of, list(backward_without_weights))
        self.weights: list[_ShardedWeight] = []
        # unit module -> indices into self.weights; by default each sharded layer is its own unit
        grouped: dict[nn.Module, list[int]] = {}
        owner: dict[int, str] = {}
        for layer_name, layer in module.named_modules():
            if not is_sharded_layer(layer):
                continue
            name = f"{layer_name}.weight" if layer_name else "weight"
            if id(layer.weight) in owner:
                raise ValueError(
                    f"{type(self).__name__}: {name} and {owner[id(layer.weight)]} are one tied "
                    "Parameter; tied weights cannot be sharded"
                )
            owner[id(layer.weight)] = name
            if layer.weight.requires_grad:
                dtype = compute_dtype or layer.weight.dtype
                grouped.setdefault(unit_of.get(layer, layer), []).append(len(self.weights))
                where = device if layer.weight.is_meta else layer.weight.device
                self.weights.append(_ShardedWeight(name, layer, self.rank, self.world, dtype, where))
        self._weight_of = {id(w.layer): w for w in self.weights}
        _materialise(module, device)  # the rest of a meta module: replicated parameters (norms), buffers
        self.units: list[tuple[nn.Module, list[int]]] = list(grouped.items())
        self._not_gathered_for_backward = {u for u, (m, _) in enumerate(self.units) if id(m) in unread}
        sharded = {id(w.shard) for w in self.weights}
        self.replicated = [p for p in module.parameters() if p.requires_grad and id(p) not in sharded]
        # per unit, the trainable replicated parameters inside it (biases; norms inside a block): (owner, name, p)
        self._unit_params = [_replicated_params(unit_module, sharded) for unit_module, _ in self.units]
        # the modules outside every unit that hold replicated parameters (norms): with a compute dtype they run in
        # their parameters' dtype; in exact mode each is an exact call of its own
        self.replicated_modules = self._replicated_modules(module, sharded)

        self.order: list[int] = []  # indices into self.units in the order they ran (first forward)
        self._position: dict[int, int] = {}  # unit index -> its position in self.order
        self._seen: list[int] = []
        self._in_backward = False  # from the backward's first unit until the next forward or synchronisation
        self._unit_of_weight = {w: u for u, (_, indices) in enumerate(self.units) for w in indices}
        self._grads_pending = [0] * len(
            self.units
        )  # per unit, weight gradients its backward has yet to produce
        # per unit, its all-gathers in flight, and the weight gradients its backward has produced and not yet
        # reduced (a unit's gradients are reduce-scattered together once the last is there)
        self._gathers: list[list] = [[] for _ in self.units]
        self._unit_grads: list[list[tuple[_ShardedWeight, torch.Tensor]]] = [[] for _ in self.units]
        # reductions in flight: a group's work (None: nothing to wait for), what its results are still to be
        # divided by (1 where the reduce-scatter averaged; divide_factor for a sum, or for an exact call's gradient,
        # which no collective reduced), and its (reduced shard gradient, shard) pairs
        self._reductions: list[tuple[object | None, float, list[tuple[torch.Tensor, nn.Parameter]]]] = []
        self._exact_grads: dict[nn.Parameter, torch.Tensor] = {}  # replicated gradients summed over the batch
        self._calls: dict[nn.Module, list[_ExactCall]] = {}  # exact calls between a module's two hooks
        # an input of every exact call's autograd node, so that its output needs a gradient (token ids do not)
        self._anchor = torch.zeros((), requires_grad=True)
        self.device = self.weights[0].full.device if self.weights else torch.device("cpu")
        self.measure_communication = False
        self._gather_waits: list[tuple[str, CommunicationTimer]] = []
        self.last_communication: StepCommunication | None = None
        self._bytes = dict.fromkeys(BYTES_KEYS, 0.0)
        # ("gather" | "forward_done" | "backward_done", unit) when record_events (tests check the prefetch rule)
        self.events: list[tuple[str, int]] = []
        self.record_events = False

        this = weakref.ref(self)
        for unit, (unit_module, _) in enumerate(self.units):
            unit_module.register_forward_pre_hook(_hook(this, "_before_forward", unit))
            unit_module.register_forward_hook(_hook(this, "_after_forward", unit))
        for replicated in self.replicated_modules if exact or compute_dtype is not None else []:
            replicated.register_forward_pre_hook(_hook(this, "_before_replicated_forward"))
            replicated.register_forward_hook(_hook(this, "_after_replicated_forward"))
        for index, weight in enumerate(self.weights):
            weight.full.register_post_accumulate_grad_hook(_hook(this, "_gradient_ready", index))

    def _checked_backward_without_weights(
        self, module: nn.Module, unit_of: dict[nn.Module, nn.Module], modules: list[nn.Module]
    ) -> set[int]:
        """The ids of `backward_without_weights`'s modules, checked before anything is sharded: each must be a unit
        (a module of `units`, or a sharded layer outside them), and exact mode, whose backward runs each unit's
        forward again, takes none."""
        units = {id(unit) for unit in unit_of.values()}
        units |= {id(m) for m in module.modules() if is_sharded_layer(m) and m not in unit_of}
        strangers = [type(m).__name__ for m in modules if id(m) not in units]
        if strangers:
            raise ValueError(
                f"backward_without_weights: {strangers} are not units (a module of `units`, or a sharded "
                "layer outside them)"
            )
        if modules and self.exact:
            raise ValueError(
                "backward_without_weights: exact mode runs each unit's forward again in its backward"
            )
        return {id(m) for m in modules}

    @staticmethod
    def _unit_modules(module: nn.Module, units: list[nn.Module]) -> dict[nn.Module, nn.Module]:
        """Each sharded layer inside one of `units` -> that unit; the units must be disjoint submodules."""
        inside = {id(m) for m in module.modules()}
        unit_of: dict[nn.Module, nn.Module] = {}
        for i, unit in enumerate(units):
            if id(unit) not in inside:
                raise ValueError(
                    f"units[{i}] ({type(unit).__name__}) is not a submodule of the wrapped module"
                )
            for layer in unit.modules():
                if layer in unit_of:
                    raise ValueError(f"units[{i}] ({type(unit).__name__}) overlaps an earlier unit")
                unit_of[layer] = unit
        return unit_of

    def _replicated_modules(self, module: nn.Module, sharded: set[int]) -> list[nn.Module]:
        """The modules that hold trainable replicated parameters themselves, outside every unit and around none.
        Exact mode refuses one around a unit (it cannot run over the whole batch without running the unit inside
        it again) and one inside another (the inner one would gather the whole batch twice)."""
        in_unit = {id(m) for unit_module, _ in self.units for m in unit_module.modules()}
        owners = []
        for name, owner in module.named_modules():
            if id(owner) in in_unit or not _replicated_params(owner, sharded, recurse=False):
                continue
            if any(id(m) in in_unit for m in owner.modules()):
                if not self.exact:
                    continue
                raise ValueError(
                    f"exact mode: {name or 'the wrapped module'} ({type(owner).__name__}) holds "
                    "replicated parameters and contains sharded layers; its parameters' gradients "
                    "cannot be computed over the whole batch alone: move them into a submodule"
                )
            if self.exact and any(m is not owner and m in owners for m in owner.modules()):
                raise ValueError(
                    f"exact mode: {name} ({type(owner).__name__}) holds replicated parameters and "
                    "contains another module that does"
                )
            owners.append(owner)
        return owners

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

    def _gather(self, unit: int | None, for_backward: bool = False) -> None:
        """Start gathering the unit's weights that are not gathered: one all-gather group per unit (as FSDP2
        issues one all-gather per unit, here without copying the weights into one buffer and out again); for the
        backward, none of a unit whose backward reads no weights."""
        if unit is None or (for_backward and unit in self._not_gathered_for_backward):
            return
        weights = [self.weights[index] for index in self.units[unit][1]]
        weights = [weight for weight in weights if weight.prepare_gather()]
        if not weights:
            return
        if self.world > 1:
            self._gathers[unit].append(
                all_gather_coalesced([w.buffer for w in weights], [w.local for w in weights])
            )
            self._bytes["bytes_all_gathered"] += sum(
                (self.world - 1) * w.shard_numel * w.buffer.element_size() for w in weights
            )
        if self.record_events:
            self.events.append(("gather", unit))

    def _wait_gathered(self, unit: int, for_backward: bool = False) -> None:
        self._gather(unit, for_backward)
        pending, self._gathers[unit] = self._gathers[unit], []
        if not pending:
            return
        timer = CommunicationTimer(self.device) if self.measure_communication else None
        for work in pending:
            work.wait()
        if timer is not None:
            self._gather_waits.append(("backward" if self._in_backward else "forward", timer.stop()))

    def _before_forward(self, unit: int, module: nn.Module, args: tuple) -> tuple:
        weights = [self.weights[index] for index in self.units[unit][1]]
        if self._in_backward:  # activation checkpointing recomputes the unit's forward for its backward
            if self.exact:
                raise RuntimeError(
                    "exact mode does not support activation checkpointing: a unit's forward ran "
                    "again during the backward"
                )
            self._wait_gathered(unit)
            for weight in weights:
                weight.use_full_weight()
            return self._use_compute_dtype(unit, args)
        if not self.order:
            self._seen.append(unit)
        if self._neighbour(unit, -1) is None:  # nothing before it has run: the first units may gather now
            for ahead in range(1, self.prefetch_distance):
                self._gather(self._neighbour(unit, ahead))
        self._wait_gathered(unit)
        if self.exact and torch.is_grad_enabled():
            return self._start_exact_call(
                module, args, weights, self._unit_params[unit], unit, self.compute_dtype
            )
        for weight in weights:
            weight.use_full_weight()
        return self._use_compute_dtype(unit, args)

    def _use_compute_dtype(self, unit: int, args: tuple) -> tuple:
        """The unit's floating-point inputs and replicated parameters in the compute dtype (differentiable
        casts); _after_forward puts the parameters back."""
        if self.compute_dtype is None:
            return args
        for owner, name, param in self._unit_params[unit]:
            owner._parameters[name] = param.to(self.compute_dtype)  # type: ignore[assignment]
        return tuple(_cast(a, self.compute_dtype) for a in args)

    def _after_forward(self, unit: int, module: nn.Module, _inputs, output):
        for index in self.units[unit][1]:
            self.weights[index].use_shard()
        _put_back(self._unit_params[unit])
        if (
            self._in_backward
        ):  # a recomputation: the backward still needs the weights (_gradient_ready frees them)
            return output
        for index in self.units[unit][1]:
            self.weights[index].free()
        if self.record_events:
            self.events.append(("forward_done", unit))
        if self._calls.get(module):
            output = self._finish_exact_call(module, output)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(_hook(weakref.ref(self), "_before_backward", unit))
        self._gather(self._neighbour(unit, self.prefetch_distance))
        if not self.order and len(self._seen) == len(self.units):
            self.order = list(self._seen)
            self._position = {unit: position for position, unit in enumerate(self.order)}
        return output

    # ------------------------------------------------------------------------------------- exact mode (forward)

    def _before_replicated_forward(self, module: nn.Module, args: tuple) -> tuple:
        """A module of replicated parameters outside the units (a norm): with a compute dtype its floating-point
        inputs in its parameters' dtype (as autocast runs norms in float32); in exact mode an exact call."""
        params = _replicated_params(module, set(), recurse=False)
        if self.compute_dtype is not None:
            args = tuple(_cast(a, params[0][2].dtype) for a in args)
        if not self.exact or not torch.is_grad_enabled():
            return args
        if self._in_backward:
            raise RuntimeError(
                "exact mode does not support activation checkpointing: a module's forward ran "
                "again during the backward"
            )
        return self._start_exact_call(module, args, [], params, None, None)

    def _after_replicated_forward(self, module: nn.Module, _inputs, output):
        return self._finish_exact_call(module, output) if self._calls.get(module) else output

    def _start_exact_call(
        self,
        module: nn.Module,
        args: tuple,
        weights: list[_ShardedWeight],
        params: list[tuple[nn.Module, str, nn.Parameter]],
        unit: int | None,
        cast: torch.dtype | None,
    ) -> tuple:
        """Exact mode's forward pre-hook: the module will run over the whole batch (its inputs from every rank,
        in rank order, cast to `cast` with its parameters) with its weights and parameters detached, so that it
        builds no graph; _finish_exact_call keeps this rank's rows and the graph to the backward over the whole
        batch."""
        if any(not isinstance(a, torch.Tensor) for a in args) or not args:
            raise TypeError(
                f"exact mode: {type(module).__name__}'s forward must take tensors only (positional), "
                f"got {[type(a).__name__ for a in args]}"
            )
        local = tuple(_cast(a, cast) for a in args)
        rows = self._rows_per_rank(local)
        inputs = tuple(self._all_gather_rows(a.detach(), rows) for a in local)
        device = local[0].device.type
        autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        needs_grad = [a.requires_grad for a in local]
        call = _ExactCall(module, local, inputs, needs_grad, rows, autocast, weights, params, unit, cast)
        self._calls.setdefault(module, []).append(call)
        for weight in weights:
            weight.use_full_weight(detached=True)
        for owner, name, param in params:
            owner._parameters[name] = _cast(param.detach(), cast)  # type: ignore[assignment]
        return inputs

    def _finish_exact_call(self, module: nn.Module, output):
        call = self._calls[module].pop()
        _put_back(call.params)
        if not isinstance(output, torch.Tensor) or output.shape[0] != sum(call.rows):
            raise TypeError(
                f"exact mode: {type(module).__name__} must return one tensor with the batch as "
                f"dimension 0 ({sum(call.rows)} rows), got {getattr(output, 'shape', type(output))}"
            )
        differentiable = [a for a in call.local if a.requires_grad]
        call.local = ()  # the backward needs only the whole batch's inputs
        return _WholeBatch.apply(self, call, output, self._anchor, *differentiable)

    def _rows_per_rank(self, args: tuple) -> list[int]:
        """Every rank's batch size (dimension 0 of its inputs, which must agree)."""
        sizes = {a.shape[0] if a.dim() else None for a in args}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"exact mode: inputs must share dimension 0, the batch; got shapes "
                f"{[tuple(a.shape) for a in args]}"
            )
        if self.world == 1:
            return [sizes.pop()]
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor([sizes.pop()], device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        return [int(n) for n in every]

    def _all_gather_rows(self, tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Every rank's rows of `tensor`, in rank order (the global batch); shorter ranks' rows padded in transit."""
        if self.world == 1:
            return tensor
        most = max(rows)
        padded = tensor.contiguous()
        if padded.shape[0] < most:
            padded = torch.cat([padded, padded.new_zeros(most - padded.shape[0], *padded.shape[1:])])
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        self._bytes["bytes_activations_gathered"] += (sum(rows) - tensor.shape[0]) * tensor[:1].nbytes
        return torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)])

    # ----------------------------------------------------------------------------------------------- backward

    def _before_backward(self, unit: int, _grad) -> None:
        self._in_backward = True
        if self._neighbour(unit, 1) is None:  # the backward's first unit: prefetch as the forward does
            for behind in range(1, self.prefetch_distance):
                self._gather(self._neighbour(unit, -behind), for_backward=True)
        self._grads_pending[unit] = len(self.units[unit][1])
        self._wait_gathered(unit, for_backward=True)

    def _exact_backward(self, call: _ExactCall, grad: torch.Tensor) -> list[torch.Tensor | None]:
        """An exact call's backward: its forward and backward again over the whole batch (with every rank's
        output gradients), this rank's shard of each weight gradient kept for finish_gradient_synchronization,
        the replicated parameters' gradients summed, and this rank's rows of the input gradients returned."""
        self._in_backward = True
        grad = self._all_gather_rows(grad, call.rows)
        inputs = [
            a.detach().requires_grad_(needs) for a, needs in zip(call.inputs, call.needs_grad, strict=True)
        ]
        device, enabled, dtype = call.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            for weight in call.weights:
                weight.use_full_weight()
            for owner, name, param in call.params:
                owner._parameters[name] = _cast(param, call.cast)  # type: ignore[assignment]
            try:
                output = call.module.forward(*inputs)  # not module(...): its hooks must not run again
            finally:
                for weight in call.weights:
                    weight.use_shard()
                _put_back(call.params)
        wanted = [a for a in inputs if a.requires_grad]
        targets = [*wanted, *(w.full for w in call.weights), *(param for _, _, param in call.params)]
        grads = torch.autograd.grad(output, targets, grad, allow_unused=True)
        input_grads, rest = grads[: len(wanted)], grads[len(wanted) :]
        for weight, weight_grad in zip(call.weights, rest, strict=False):
            flat = torch.zeros_like(weight.buffer) if weight_grad is None else weight_grad.reshape(-1)
            if flat.numel() < weight.buffer.numel():
                flat = torch.nn.functional.pad(flat, (0, weight.buffer.numel() - flat.numel()))
            self._reductions.append(
                (
                    None,
                    self.divide_factor,
                    [(weight.own_chunk(flat).to(weight.shard.dtype).clone(), weight.shard)],
                )
            )
            weight.free()
        for (_, _, param), param_grad in zip(call.params, rest[len(call.weights) :], strict=True):
            if param_grad is not None:
                summed = self._exact_grads.get(param)
                self._exact_grads[param] = param_grad if summed is None else summed + param_grad
        if call.unit is not None:
            self._grads_pending[call.unit] = 0
            self._unit_backward_done(call.unit)
        start = sum(call.rows[: self.rank])
        return [g.narrow(0, start, call.rows[self.rank]) for g in input_grads]

    def _unit_backward_done(self, unit: int) -> None:
        """Every weight gradient of the unit is there: prefetch, before its reductions queue."""
        if self.record_events:
            self.events.append(("backward_done", unit))
        self._gather(self._neighbour(unit, -self.prefetch_distance), for_backward=True)

    def _gradient_ready(self, index: int, full: torch.Tensor) -> None:
        weight = self.weights[index]
        grad = full.grad.reshape(-1)
        full.grad = None
        weight.use_shard()  # a recomputation stopped early (checkpointing) may not have put the shard back
        weight.free()
        unit = self._unit_of_weight[index]
        self._unit_grads[unit].append((weight, grad.to(weight.shard.dtype)))
        self._grads_pending[unit] -= 1
        if self._grads_pending[unit] == 0:
            self._unit_backward_done(unit)  # first, so that the prefetch queues ahead of the reductions
            self._reduce(unit)

    def _reduce(self, unit: int) -> None:
        """Reduce-scatter the unit's gradients produced so far, each to its owner: one group, asynchronously."""
        grads, self._unit_grads[unit] = self._unit_grads[unit], []
        if not grads:
            return
        if self.world == 1:
            self._reductions.append(
                (None, self.divide_factor, [(grad, weight.shard) for weight, grad in grads])
            )
            return
        inputs, outputs = [], []
        for weight, grad in grads:
            padding = weight.buffer.numel() - weight.numel
            inputs.append(torch.nn.functional.pad(grad, (0, padding)) if padding else grad)
            outputs.append(torch.empty(weight.shard_numel, dtype=grad.dtype, device=grad.device))
            self._bytes["bytes_reduce_scattered"] += (
                (self.world - 1) * weight.shard_numel * grad.element_size()
            )
        work = reduce_scatter_coalesced(outputs, inputs, self._reduce_op)
        divide_by = 1.0 if self._reduce_op == dist.ReduceOp.AVG else self.divide_factor
        self._reductions.append(
            (work, divide_by, [(out, weight.shard) for out, (weight, _) in zip(outputs, grads, strict=True)])
        )

    def _average_replicated_gradients(self) -> None:
        """One all-reduce of every replicated gradient (norms: a few KiB each), averaged in place; in exact mode
        each is already the sum over the whole batch, the same on every rank."""
        if self.exact:
            for param, summed in self._exact_grads.items():
                averaged = summed / self.divide_factor if self.divide_factor != 1 else summed
                param.grad = averaged if param.grad is None else param.grad + averaged
            self._exact_grads.clear()
            return
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if self.world == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if self.divide_factor != 1:
            flat.div_(self.divide_factor)
        for grad, averaged in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(averaged.view_as(grad))
        self._bytes["bytes_all_reduced"] += 2 * (self.world - 1) / self.world * flat.nbytes

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradients' reductions; then every shard and replicated parameter holds the average over
        ranks of its gradient (in the shard's dtype for the shards)."""
        timer = CommunicationTimer(self.device) if self.measure_communication else None
        self._in_backward = False
        for unit in range(len(self.units)):
            self._reduce(unit)  # a unit some of whose weights got no gradient: what it did produce
            # a prefetched unit whose backward did not run must not stay gathered
            for work in self._gathers[unit]:
                work.wait()
            self._gathers[unit] = []
        for weight in self.weights:
            weight.free()
        self._average_replicated_gradients()
        for work, divide_by, reduced_shards in self._reductions:
            if work is not None:
                work.wait()
            for reduced, param in reduced_shards:
                if divide_by != 1:
                    reduced.div_(divide_by)
                param.grad = reduced if param.grad is None else param.grad + reduced
        self._reductions.clear()
        if timer is not None:
            self.last_communication = StepCommunication(self._gather_waits, timer.stop(), self._bytes)
        self._gather_waits = []
        self._bytes = dict.fromkeys(self._bytes, 0.0)  # a new dict: the last step's stays with its record

    # --------------------------------------------------------------------------------------------- full state

    @torch.no_grad()
    def set_full_value(self, owner: nn.Module, name: str, value: torch.Tensor) -> None:
        """Initialise parameter or buffer `name` of `owner` (a module inside the wrapped one, as a module built on
        the meta device is) from its full value, cast to its dtype: a sharded weight keeps this rank's chunk,
        anything else the whole value. Nothing is communicated: every rank must pass the same values."""
        weight = self._weight_of.get(id(owner)) if name == "weight" else None
        if weight is not None:
            weight.set_full(value)
        else:
            getattr(owner, name).copy_(value)

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the wrapped module, full (the shards all-gathered in their dtype), keyed by its name
        in `module.named_parameters()`. A collective: every rank must call it."""
        full = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        for weight in self.weights:
            gathered = torch.empty(
                weight.shard_numel * self.world, dtype=weight.shard.dtype, device=weight.shard.device
            )
            all_gather_flat(gathered, weight.shard.detach())
            full[weight.name] = gathered[: weight.numel].view(weight.shape).clone()
        return full


def _replicated_params(
    module: nn.Module, sharded: set[int], recurse: bool = True
) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """The trainable floating-point parameters in `module` (itself only, unless `recurse`) that are not shards,
    as (owner, name, parameter)."""
    owners = module.modules() if recurse else [module]
    return [
        (owner, name, p)
        for owner in owners
        for name, p in owner._parameters.items()
        if p is not None and p.requires_grad and p.is_floating_point() and id(p) not in sharded
    ]


def _cast(value, dtype: torch.dtype | None):
    """A floating-point tensor in `dtype` (a differentiable cast); anything else, or dtype None, as it is."""
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _put_back(params: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    for owner, name, param in params:
        owner._parameters[name] = param


def _hook(wrapper: weakref.ref, method: str, *bound) -> Callable:
    """A hook calling `method` of the wrapper while it lives (hooks hold no reference to it)."""

    def call(*args):
        live = wrapper()
        if live is not None:
            return getattr(live, method)(*bound, *args)
        return None

    return call


FSDP = FullyShardedDataParallel
