"""The SwiGLU FFN of the 2026 handout §8 (y = (f(x W1) * x W2) W3, f = SiLU) under DP, FSDP, TP and 2D FSDP x TP,
with the forward and backward written out as the handout's equations (no autograd) and every collective a ring
collective of cs336_systems.parallel.ring_collectives, so the bytes each device sends are counted. Matmul FLOPs are
counted with torch.utils.flop_counter.FlopCounterMode, phase by phase, to check against cs336_systems.accounting.parallelism.

Every function takes the full tensors (the same on every rank) and slices out this device's part, so a test
can compare each device's results with the single-device FFN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from cs336_systems.parallel.ring_collectives import (
    Group,
    Traffic,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)


@dataclass
class Counted:
    """What one device computed and what it cost: matmul FLOPs and bytes sent, per phase."""

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)
    traffic: dict[str, Traffic] = field(default_factory=dict)


def silu_grad(a: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(a)
    return s * (1 + a * (1 - s))


def _shard(t: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return t.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


class _Phase:
    """Counts the matmul FLOPs and ring bytes of one phase (forward or backward) into `counted`."""

    def __init__(self, counted: Counted, name: str):
        self.counted, self.name, self.traffic = counted, name, Traffic()
        self.flop_mode = FlopCounterMode(display=False)

    def __enter__(self) -> Traffic:
        self.flop_mode.__enter__()
        return self.traffic

    def __exit__(self, *exc) -> None:
        self.flop_mode.__exit__(*exc)
        self.counted.flops[self.name] = self.flop_mode.get_total_flops()
        self.counted.traffic[self.name] = self.traffic


def _local_forward(x, w1, w2, w3):
    x1, x2 = x @ w1, x @ w2
    z = torch.nn.functional.silu(x1) * x2
    return x1, x2, z, z @ w3


def _local_backward(dy, x, x1, x2, z, w1, w2, w3):
    """Eqs. 24-30 on whatever shards are given; dx is this shard's partial sum where the width is sharded."""
    dz = dy @ w3.T
    dx2 = dz * torch.nn.functional.silu(x1)
    dx1 = dz * silu_grad(x1) * x2
    return {"dx": dx1 @ w1.T + dx2 @ w2.T, "dW3": z.T @ dy, "dW2": x.T @ dx2, "dW1": x.T @ dx1}


def data_parallel(x, w1, w2, w3, dy, group: Group = None) -> Counted:
    counted, x, dy = Counted(), _shard(x, 0, group), _shard(dy, 0, group)
    with _Phase(counted, "forward"):
        x1, x2, z, y = _local_forward(x, w1, w2, w3)
    with _Phase(counted, "backward") as traffic:
        grads = _local_backward(dy, x, x1, x2, z, w1, w2, w3)
        for name in ("dW1", "dW2", "dW3"):
            grads[name] = ring_all_reduce(grads[name], traffic, group)
    counted.outputs = {"y": y, **grads}
    return counted


def fsdp(x, w1, w2, w3, dy, group: Group = None) -> Counted:
    """Weights sharded along dim 0; gathered before the forward and again before the backward."""
    counted, x, dy = Counted(), _shard(x, 0, group), _shard(dy, 0, group)
    shards = [_shard(w, 0, group) for w in (w1, w2, w3)]
    with _Phase(counted, "forward") as traffic:
        full = [ring_all_gather(s, traffic, group) for s in shards]
        x1, x2, z, y = _local_forward(x, *full)
        del full  # discarded after use: FSDP's point
    with _Phase(counted, "backward") as traffic:
        full = [ring_all_gather(s, traffic, group) for s in shards]
        grads = _local_backward(dy, x, x1, x2, z, *full)
        for name in ("dW1", "dW2", "dW3"):
            grads[name] = ring_reduce_scatter(grads[name], traffic, group)
    counted.outputs = {"y": y, **grads}
    return counted


def tensor_parallel(x, w1, w2, w3, dy, group: Group = None) -> Counted:
    """W1, W2 column-parallel, W3 row-parallel (eqs. 47-51); the backward of 8.4(a)."""
    counted = Counted()
    w1, w2, w3 = _shard(w1, 1, group), _shard(w2, 1, group), _shard(w3, 0, group)
    with _Phase(counted, "forward") as traffic:
        x1, x2, z, y_partial = _local_forward(x, w1, w2, w3)
        y = ring_all_reduce(y_partial, traffic, group)
    with _Phase(counted, "backward") as traffic:
        grads = _local_backward(dy, x, x1, x2, z, w1, w2, w3)
        grads["dx"] = ring_all_reduce(grads["dx"], traffic, group)
    counted.outputs = {"y": y, **grads}
    return counted


def fsdp_tp_forward(x, w1, w2, w3, fsdp_group: Group, tp_group: Group) -> Counted:
    """Eqs. 52-59: weights sharded by TP then by FSDP along the other dimension; the batch by FSDP. Bytes are
    counted per axis (`forward_fsdp`, `forward_tp`), the two collectives §8.5 (b) overlaps."""
    counted, x = Counted(), _shard(x, 0, fsdp_group)
    w1, w2 = (_shard(_shard(w, 1, tp_group), 0, fsdp_group) for w in (w1, w2))
    w3 = _shard(_shard(w3, 0, tp_group), 1, fsdp_group)
    fsdp_traffic, tp_traffic = Traffic(), Traffic()
    with _Phase(counted, "forward"):
        w1, w2 = (ring_all_gather(w, fsdp_traffic, fsdp_group) for w in (w1, w2))
        w3 = ring_all_gather(w3.T.contiguous(), fsdp_traffic, fsdp_group).T  # gathered along D: dim 1
        *_, y_partial = _local_forward(x, w1, w2, w3)
        y = ring_all_reduce(y_partial, tp_traffic, tp_group)
    counted.traffic.update(forward_fsdp=fsdp_traffic, forward_tp=tp_traffic)
    counted.outputs = {"y": y}
    return counted
