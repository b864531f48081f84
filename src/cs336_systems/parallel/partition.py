"""How parameters are divided among ranks: the one rule that the sharded optimizer runs and the accounting
predicts (torch-free, so the accounting stays importable without torch)."""

from __future__ import annotations


def balanced_partition(
    sizes: list[int], world_size: int, loads: list[int] | None = None
) -> tuple[list[int], list[int]]:
    """Assign items to ranks, largest first, each to the least-loaded rank (lowest rank on ties).

    `loads` are the ranks' sizes so far (for items added later); returns (owner of each item, new loads).
    Deterministic, so every rank computes the same assignment without communicating.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size if loads is None else list(loads)
    if len(loads) != world_size:
        raise ValueError(f"loads has {len(loads)} entries for world_size {world_size}")
    owners = [0] * len(sizes)
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[item] = rank
        loads[rank] += sizes[item]
    return owners, loads
