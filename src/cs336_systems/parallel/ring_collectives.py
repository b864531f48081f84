"""The ring collectives of the 2026 handout §8.1 on torch.distributed point-to-point messages (gloo or nccl).

Each rank sends to (rank + 1) mod N and receives from (rank - 1) mod N, one chunk per step; `Traffic` counts
the bytes this rank sent and the steps it took, to check against parallelism.bytes_sent_per_device and
parallelism.COLLECTIVE_STEPS. Tensors are split along dim 0, which must divide by the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None  # None: the default (world) group


@dataclass
class Traffic:
    bytes_sent: int = 0
    steps: int = 0


def _ring_step(send: torch.Tensor, receive: torch.Tensor, traffic: Traffic, group: Group) -> None:
    """Send to the right neighbour and receive from the left one at once (both non-blocking, so no rank
    waits for its receiver before receiving itself). Neighbours are ranks of `group` (None: the world)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    right, left = ((rank + step) % world for step in (1, -1))
    if group is not None:  # point-to-point peers are global ranks
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    ops = [
        dist.P2POp(dist.isend, send.contiguous(), right, group),
        dist.P2POp(dist.irecv, receive, left, group),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    traffic.bytes_sent += send.numel() * send.element_size()
    traffic.steps += 1


def _chunks(x: torch.Tensor, world: int) -> list[torch.Tensor]:
    if x.shape[0] % world:
        raise ValueError(f"dim 0 of shape {tuple(x.shape)} does not divide by the world size {world}")
    return list(x.chunk(world))


def ring_all_gather(chunk: torch.Tensor, traffic: Traffic | None = None, group: Group = None) -> torch.Tensor:
    """Every rank's chunk, concatenated along dim 0 in rank order (as all_gather_into_tensor)."""
    traffic = Traffic() if traffic is None else traffic
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = torch.empty((world * chunk.shape[0], *chunk.shape[1:]), dtype=chunk.dtype, device=chunk.device)
    parts = _chunks(out, world)
    parts[rank].copy_(chunk)
    for t in range(1, world):
        # Pass on the chunk received in the previous step (own chunk first).
        _ring_step(parts[(rank - t + 1) % world], parts[(rank - t) % world], traffic, group)
    return out


def ring_reduce_scatter(x: torch.Tensor, traffic: Traffic | None = None, group: Group = None) -> torch.Tensor:
    """Chunk `rank` of the sum over ranks of x (as reduce_scatter_tensor with SUM)."""
    traffic = Traffic() if traffic is None else traffic
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    partial = _chunks(x.clone(), world)  # y: this rank's partial sums, chunk by chunk
    received = torch.empty_like(partial[0])
    for t in range(1, world):
        _ring_step(partial[(rank - t) % world], received, traffic, group)
        partial[(rank - t - 1) % world] += received
    return partial[rank].clone()


def ring_all_reduce(x: torch.Tensor, traffic: Traffic | None = None, group: Group = None) -> torch.Tensor:
    """Sum over ranks: a ring reduce-scatter, then a ring all-gather of the reduced chunks."""
    traffic = Traffic() if traffic is None else traffic
    return ring_all_gather(ring_reduce_scatter(x, traffic, group), traffic, group)


def alternate_all_reduce(
    x: torch.Tensor, traffic: Traffic | None = None, group: Group = None
) -> torch.Tensor:
    """§8.1's alternative: each rank forwards whole inputs around the ring and adds each one it receives."""
    traffic = Traffic() if traffic is None else traffic
    world = dist.get_world_size(group)
    total = x.clone()
    passing, received = x.clone(), torch.empty_like(x)  # a copy: its buffer is received into later
    for _ in range(1, world):
        _ring_step(passing, received, traffic, group)
        total += received
        passing, received = received, passing  # forward what just arrived; reuse the old buffer
    return total
