"""Optimizer state sharding (spec §3, ZeRO stage 1 style): each rank keeps optimizer state for its shard only.

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    loss.backward(); average_gradients(model)   # every rank holds the same averaged gradients
    optimizer.step()                             # each rank updates its shard, then all shards are exchanged

Parameters are assigned to ranks whole, largest first to the least-loaded rank (`balanced_partition`), so
every rank computes the same assignment without communicating. After the inner step the ranks exchange the
updated shards with all-gathers of flat buffers, one series per (device type, dtype). On NCCL this beats a
broadcast from each owner: in a ring all-gather every rank sends its shard at the same time, so each link
carries (n-1)/n of the Ψ parameters once, while broadcasts send one root's shard at a time down the whole
chain, so each link carries all Ψ: about n/(n-1) times as long (2x on 2 GPUs), with n collectives (or one per
parameter) instead of one. The buffers are exchanged in chunks of at most `GATHER_CHUNK_BYTES` (received
bytes), which bounds the transient memory of the exchange; shards shorter than the longest are padded.

Without an initialised process group the optimizer runs as world size 1 (one shard, no communication).
`state_dict()` is collective: every rank returns the consolidated state in the format of `torch.optim`,
indexed over all parameters, so a checkpoint loads at any world size (and into the plain `optimizer_cls`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.accounting.units import MIB
from cs336_systems.parallel.distributed import all_gather_flat
from cs336_systems.parallel.partition import balanced_partition

# Upper bound on the receive buffer of one all-gather round; the send buffer is 1/world_size of it.
GATHER_CHUNK_BYTES = 256 * MIB

_NOT_HYPERPARAMETERS = ("params", "param_names")


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer_cls` so that each rank holds its state for about 1/world_size of the parameters."""

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        self.optimizer_cls = optimizer_cls
        self.rank_loads = [0] * self.world_size  # elements assigned to each rank so far
        self._owner: dict[torch.Tensor, int] = {}
        self.local_optimizer: torch.optim.Optimizer | None = None
        super().__init__(params, defaults=kwargs)  # calls add_param_group for every group
        self.state = self.local_optimizer.state  # the view users see: this rank's shard

    def owner(self, param: torch.Tensor) -> int:
        """The rank that holds the optimizer state of `param` and updates it."""
        return self._owner[param]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # validates the group and fills in the defaults
        group = self.param_groups[-1]
        for index, param in enumerate(group["params"]):
            if not param.is_contiguous():
                raise ValueError(
                    f"ShardedOptimizer: parameter {index} of the new group (shape {tuple(param.shape)}) is "
                    "not contiguous; shards are exchanged through flat buffers"
                )
        new_params = list(dict.fromkeys(p for p in group["params"] if p not in self._owner))
        owners, self.rank_loads = balanced_partition(
            [p.numel() for p in new_params], self.world_size, self.rank_loads
        )
        self._owner.update(zip(new_params, owners, strict=True))

        local_group = {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}
        mine = [i for i, p in enumerate(group["params"]) if self._owner[p] == self.rank]
        local_group["params"] = [group["params"][i] for i in mine]
        if "param_names" in group:
            local_group["param_names"] = [group["param_names"][i] for i in mine]
        if self.local_optimizer is None:
            # An empty shard is fine: torch optimizers accept a group without parameters.
            self.local_optimizer = self.optimizer_cls([local_group], **self.defaults)
        else:
            self.local_optimizer.add_param_group(local_group)
        # The inner class fills in its own defaults (e.g. AdamW's betas); show them in our param_groups too.
        for key, value in self.local_optimizer.param_groups[-1].items():
            group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        # param_groups is the user's handle (LR schedulers write to it): copy its hyperparameters to the shard
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            local_group.update({k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS})
        if closure is None:
            loss = self.local_optimizer.step(**kwargs)
        else:
            with torch.enable_grad():
                loss = self.local_optimizer.step(closure, **kwargs)
        self._exchange_shards()
        return loss

    def _exchange_shards(self) -> None:
        """Give every rank the updated parameters of every other rank's shard."""
        if self.world_size == 1:
            return
        # Same order on every rank: param_groups order, each parameter once. A frozen parameter without a
        # gradient is never updated, so it stays out (ranks agree on both flags, as they ran the same code).
        shards_by_kind: dict[tuple[str, torch.dtype], list[list[torch.Tensor]]] = {}
        for param in dict.fromkeys(p for group in self.param_groups for p in group["params"]):
            if param.requires_grad or param.grad is not None:
                shards = shards_by_kind.setdefault(
                    (param.device.type, param.dtype), [[] for _ in self.rank_loads]
                )
                shards[self._owner[param]].append(param)
        for kind in sorted(shards_by_kind, key=str):
            self._all_gather_shards(shards_by_kind[kind])

    def _all_gather_shards(self, shards: list[list[torch.Tensor]]) -> None:
        offsets = [_cumulative_numel(shard) for shard in shards]
        longest = max(offset[-1] for offset in offsets)
        if longest == 0:
            return
        like = next(p for shard in shards for p in shard)
        chunk = max(1, min(longest, GATHER_CHUNK_BYTES // (like.element_size() * self.world_size)))
        send = torch.empty(chunk, dtype=like.dtype, device=like.device)
        received = torch.empty(self.world_size * chunk, dtype=like.dtype, device=like.device)
        for start in range(0, longest, chunk):
            _copy_flat_range(shards[self.rank], offsets[self.rank], start, send, to_buffer=True)
            all_gather_flat(received, send)
            for rank in range(self.world_size):
                if rank != self.rank:
                    piece = received[rank * chunk : (rank + 1) * chunk]
                    _copy_flat_range(shards[rank], offsets[rank], start, piece, to_buffer=False)

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state of all shards (collective: every rank must call it, and every rank gets it).

        Same format as `torch.optim.Optimizer.state_dict()` over all parameters; state tensors are on the CPU.
        """
        local = super().state_dict()  # self.state is this rank's shard, indexed over all parameters
        local_state = {index: _to_cpu(state) for index, state in local["state"].items()}
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, local_state)
        else:
            gathered = [local_state]
        merged = {index: state for part in gathered for index, state in part.items()}
        return {"state": dict(sorted(merged.items())), "param_groups": local["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (saved at any world size, or by a plain `optimizer_cls`); each rank keeps
        its own shard of it."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ValueError("state_dict must be a dict with keys 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} parameter groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        saved_index: dict[torch.Tensor, int] = {}
        for number, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"parameter group {number} has {len(group['params'])} parameters, the state_dict's has "
                    f"{len(saved['params'])}"
                )
            for param, index in zip(group["params"], saved["params"], strict=True):
                saved_index.setdefault(param, index)
            group.update({k: v for k, v in saved.items() if k not in _NOT_HYPERPARAMETERS})

        # Re-index this rank's shard in the inner optimizer's own numbering (its groups, in order).
        local_state, local_groups, local_index = {}, [], 0
        for local_group, saved in zip(self.local_optimizer.param_groups, saved_groups, strict=True):
            packed = {k: v for k, v in saved.items() if k not in _NOT_HYPERPARAMETERS}
            packed["params"] = []
            if "param_names" in local_group:
                packed["param_names"] = local_group["param_names"]
            for param in local_group["params"]:
                index = saved_index[param]
                if index in state_dict["state"]:
                    local_state[local_index] = state_dict["state"][index]
                packed["params"].append(local_index)
                local_index += 1
            local_groups.append(packed)
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.local_optimizer.state  # load_state_dict replaced the inner state object


def _cumulative_numel(params: list[torch.Tensor]) -> list[int]:
    offsets = [0]
    for param in params:
        offsets.append(offsets[-1] + param.numel())
    return offsets


def _copy_flat_range(
    params: list[torch.Tensor], offsets: list[int], start: int, buffer: torch.Tensor, to_buffer: bool
) -> None:
    """Copy elements [start, start + len(buffer)) of the concatenation of `params` to or from `buffer`."""
    stop = min(start + buffer.numel(), offsets[-1])
    param_pieces, buffer_pieces = [], []
    first = bisect.bisect_right(offsets, start) - 1
    for param, begin, end in zip(params[first:], offsets[first:-1], offsets[first + 1 :], strict=True):
        if begin >= stop:
            break
        lo, hi = max(begin, start), min(end, stop)
        param_pieces.append(param.detach().view(-1)[lo - begin : hi - begin])
        buffer_pieces.append(buffer[lo - start : hi - start])
    if param_pieces:
        if to_buffer:
            torch._foreach_copy_(buffer_pieces, param_pieces)
        else:
            torch._foreach_copy_(param_pieces, buffer_pieces)


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    # Pickled device tensors would unpickle onto the sender's device index; CPU is safe on every rank.
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
