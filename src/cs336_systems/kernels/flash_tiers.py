"""FlashAttention kernel tiers: which implementation of the kernels' contract runs for given inputs.

A tier provides `supports(device, dtype, head_dim, is_causal) -> bool`, `forward(q, k, v, is_causal, out=None) ->
(o, lse)` and `backward(q, k, v, o, do, lse, is_causal, out=None, rope=None) -> (dq, dk, dv)` on (batch, seq, d)
tensors of any strides (a tier copies what its kernels cannot read in place), returning contiguous tensors, except
where `out` is given: the forward writes O there, the backward dQ, dK and dV (any strides), directly where its
kernels can; with `rope` (RoPE's tables cos, sin, (seq, d / 2)) the backward returns dQ and dK rotated back by them,
as RoPE's backward (kernels/rope.py) would: the contract of `flash_triton.flash_forward` / `flash_backward`:
- "portable": the Triton kernels of `flash_triton`, on any CUDA GPU and, interpreted, on the CPU;
- "hopper": the module `cs336_systems.kernels.hopper` (GPU only), imported at first use; a module that is missing,
  fails to import with an ImportError or lacks one of the three functions is an unavailable tier.

`tier_for(q, is_causal, tier)` names the tier that runs. The request is `tier` if given, else the environment
variable CS336_FLASH_TIER, else "auto": "auto" takes the first of TIERS (hopper, then portable) that supports the
inputs; "portable" or "hopper" forces that tier, and a forced tier that cannot run the inputs is an error saying
why. The answer is cached per (device, dtype, head dim, causal, request), so the same inputs always meet the same
tier: a forward and the backward of the logsumexp it saved included.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cs336_systems.kernels import flash_triton

ENV = "CS336_FLASH_TIER"
HOPPER_MODULE = "cs336_systems.kernels.hopper"
TIERS = ("hopper", "portable")  # the order "auto" tries them in: fastest first
REQUESTS = ("auto", *TIERS)


class TierUnavailableError(RuntimeError):
    """A forced tier cannot run the inputs (or, with "auto", no tier can)."""


@dataclass(frozen=True)
class Tier:
    name: str
    supports: Callable[[torch.device, torch.dtype, int, bool], bool]
    forward: Callable
    backward: Callable


_loaded: dict[str, Tier | str] = {}  # name -> the tier, or why it is unavailable
_chosen: dict[tuple, str] = {}  # (device, dtype, head dim, causal, request) -> tier name


def reset() -> None:
    """Forget loaded tiers and cached choices (after the hopper module changed, say)."""
    _loaded.clear()
    _chosen.clear()


def _load(name: str) -> Tier | str:
    if name == "portable":
        return Tier(name, flash_triton.supports, flash_triton.flash_forward, flash_triton.flash_backward)
    try:
        module = importlib.import_module(HOPPER_MODULE)
    except ImportError as exc:
        return f"{HOPPER_MODULE} cannot be imported ({exc})"
    missing = [f for f in ("supports", "forward", "backward") if not callable(getattr(module, f, None))]
    if missing:
        return f"{HOPPER_MODULE} has no {', '.join(missing)}()"
    return Tier(name, module.supports, module.forward, module.backward)


def get(name: str) -> Tier:
    """The tier named `name` (one that `tier_for` chose)."""
    tier = _loaded.get(name)
    if tier is None:
        tier = _loaded[name] = _load(name)
    if isinstance(tier, str):
        raise TierUnavailableError(f"the FlashAttention tier {name!r} is unavailable: {tier}")
    return tier


def request(tier: str | None = None) -> str:
    """What is asked for: `tier` if given, else $CS336_FLASH_TIER, else "auto"."""
    return tier or os.environ.get(ENV) or "auto"


def tier_for(q: torch.Tensor, is_causal: bool, tier: str | None = None) -> str:
    """The name of the tier that runs attention of queries like `q` (..., seq, d); see the module docstring."""
    key = (q.device, q.dtype, q.shape[-1], is_causal, request(tier))
    name = _chosen.get(key)
    if name is None:
        name = _chosen[key] = _choose(*key)
    return name


def _choose(device: torch.device, dtype: torch.dtype, head_dim: int, is_causal: bool, request: str) -> str:
    if request not in REQUESTS:
        raise ValueError(f"FlashAttention tier must be one of {REQUESTS} (tier= or ${ENV}), got {request!r}")
    why = {}
    for name in TIERS if request == "auto" else (request,):
        try:
            tier = get(name)
        except TierUnavailableError as exc:
            why[name] = str(exc).partition(": ")[2]
            continue
        if tier.supports(device, dtype, head_dim, is_causal):
            return name
        why[name] = f"it does not support {dtype} on {device} at head dim {head_dim}, is_causal={is_causal}"
    if request == "auto":
        reasons = "; ".join(f"{name}: {reason}" for name, reason in why.items())
        raise TierUnavailableError(f"no FlashAttention tier can run these inputs ({reasons})")
    raise TierUnavailableError(
        f"the FlashAttention tier {request!r} was forced (tier= or ${ENV}) but cannot run: {why[request]}"
    )
