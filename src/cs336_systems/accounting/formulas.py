"""Back-of-the-envelope accounting, every step kept so a write-up can show the derivation (no torch needed).

- `xxl_memory`, `xxl_fsdp_memory`, `fsdp_tp_compute_bound_batch`: communication_accounting (a)-(c) of
  ADDENDUM.md §2.4, for a stack of FFN blocks (two linear layers each; no attention, embeddings or output
  layer).
- `training_state_memory`: bytes of parameters, gradients and optimizer state, unsharded and per rank under
  optimizer state sharding (optimizer_state_sharding_accounting).
- `data_parallel_communication`: bytes each rank sends per step for DDP, ZeRO stage 1 and our sharded
  optimizer.
- `sharding_prediction`: both of the above for one rank of the sharding benchmark, as a dict.
- `fsdp_memory`: the training state per rank under DDP and FSDP and the peak saving expected from FSDP
  (2026 §7 fsdp_accounting a).
- `collective_bytes`: bytes one rank sends in a ring all-gather, reduce-scatter or all-reduce.

The others return a list of `Quantity` (name, value, unit, formula); `values(quantities)` gives a
name -> value dict. Sizes are in bytes; "GB" means 10^9 bytes, as in accelerators' sizes (80 GB H100).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cs336_systems.parallel.partition import balanced_partition

DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp64": 8,
    "float64": 8,
}


@dataclass(frozen=True)
class Quantity:
    name: str
    value: float
    unit: str
    formula: str

    def row(self) -> dict[str, Any]:
        """A tidy row: quantity, value, unit, formula."""
        return {"quantity": self.name, "value": self.value, "unit": self.unit, "formula": self.formula}


def values(quantities: list[Quantity]) -> dict[str, float]:
    return {q.name: q.value for q in quantities}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _positive(**named: float) -> None:
    for name, value in named.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


# ----------------------------------------------------------------------------------------------------
# communication_accounting (ADDENDUM.md §2.4)


@dataclass(frozen=True)
class FFNStack:
    """The XXL model of §2.4: num_blocks x (Linear d_model->d_ff, Linear d_ff->d_model), no biases."""

    d_model: int = 16384
    d_ff: int = 53248
    num_blocks: int = 126

    def __post_init__(self) -> None:
        _positive(d_model=self.d_model, d_ff=self.d_ff, num_blocks=self.num_blocks)

    @property
    def num_params(self) -> int:
        return 2 * self.num_blocks * self.d_model * self.d_ff


def xxl_memory(
    model: FFNStack,
    batch_size: int,
    seq_len: int,
    device_memory_bytes: float = 80e9,
    master_dtype: str = "fp32",
    grad_dtype: str = "fp32",
    optimizer_dtype: str = "fp32",
    optimizer_moments: int = 2,
    activation_dtype: str = "bf16",
) -> list[Quantity]:
    """(a) Master weights, accumulated gradients, optimizer state and saved activations on one device."""
    _positive(batch_size=batch_size, seq_len=seq_len, device_memory_bytes=device_memory_bytes)
    n = model.num_params
    weights = n * dtype_bytes(master_dtype)
    grads = n * dtype_bytes(grad_dtype)
    optimizer = n * optimizer_moments * dtype_bytes(optimizer_dtype)
    states = weights + grads + optimizer
    # Backward of y = x W needs x (for dW = x^T dy): each block saves its input (d_model) and hidden (d_ff).
    act_per_token = model.num_blocks * (model.d_model + model.d_ff) * dtype_bytes(activation_dtype)
    tokens = batch_size * seq_len
    activations = act_per_token * tokens
    return [
        Quantity("num_params", n, "parameters", "N = 2 * num_blocks * d_model * d_ff"),
        Quantity(
            "master_weights_bytes", weights, "bytes", f"N * {dtype_bytes(master_dtype)} ({master_dtype})"
        ),
        Quantity(
            "accumulated_gradients_bytes", grads, "bytes", f"N * {dtype_bytes(grad_dtype)} ({grad_dtype})"
        ),
        Quantity(
            "optimizer_state_bytes",
            optimizer,
            "bytes",
            f"N * {optimizer_moments} moments * {dtype_bytes(optimizer_dtype)} ({optimizer_dtype})",
        ),
        Quantity("states_bytes", states, "bytes", "master weights + gradients + optimizer state"),
        Quantity("states_devices", states / device_memory_bytes, "devices", "states_bytes / device_memory"),
        Quantity(
            "states_devices_needed",
            math.ceil(states / device_memory_bytes),
            "devices",
            "ceil(states_devices)",
        ),
        Quantity(
            "activation_bytes_per_token",
            act_per_token,
            "bytes/token",
            f"num_blocks * (d_model + d_ff) * {dtype_bytes(activation_dtype)} ({activation_dtype}): "
            "the input of each linear layer is saved for backward",
        ),
        Quantity("tokens", tokens, "tokens", "batch_size * seq_len"),
        Quantity(
            "activation_bytes", activations, "bytes", "activation_bytes_per_token * batch_size * seq_len"
        ),
        Quantity(
            "total_devices_needed",
            math.ceil((states + activations) / device_memory_bytes),
            "devices",
            "ceil((states_bytes + activation_bytes) / device_memory)",
        ),
    ]


def xxl_fsdp_memory(
    model: FFNStack,
    batch_size: int,
    seq_len: int,
    device_memory_bytes: float = 95e9,
    n_fsdp: int | None = None,
) -> list[Quantity]:
    """(b) Weights, gradients, optimizer state and half of the activations sharded over N_FSDP devices.

    Per device: S / N_FSDP + A / 2 + A / (2 N_FSDP) with S the states of (a) and A its activations. The
    smallest N_FSDP that fits solves S/n + A/2 + A/(2n) <= M, i.e. n >= (S + A/2) / (M - A/2)
    (impossible if A/2 >= M).
    """
    base = values(xxl_memory(model, batch_size, seq_len))
    states, activations = base["states_bytes"], base["activation_bytes"]

    def per_device(n: int) -> float:
        return states / n + activations / 2 + activations / (2 * n)

    def smallest_fitting(state_bytes: float, act_bytes: float) -> float:
        if act_bytes / 2 >= device_memory_bytes:
            return math.inf
        n = max(1, math.ceil((state_bytes + act_bytes / 2) / (device_memory_bytes - act_bytes / 2)))
        while (
            n > 1 and state_bytes / (n - 1) + act_bytes / 2 + act_bytes / (2 * (n - 1)) <= device_memory_bytes
        ):
            n -= 1  # guard against float rounding of the ceiling
        return n

    n_min = smallest_fitting(states, activations)
    expression = "S / N_FSDP + A / 2 + A / (2 N_FSDP)"
    rows = [
        Quantity("states_bytes", states, "bytes", "S = master weights + gradients + optimizer state (a)"),
        Quantity(
            "activation_bytes", activations, "bytes", "A = activation_bytes_per_token * batch_size * seq_len"
        ),
        Quantity(
            "n_fsdp_states_only",
            smallest_fitting(states, 0),
            "devices",
            "ceil(S / device_memory): activations ignored",
        ),
        Quantity("n_fsdp_needed", n_min, "devices", "smallest n with S/n + A/2 + A/(2n) <= device_memory"),
    ]
    if math.isfinite(n_min):
        rows.append(
            Quantity(
                "per_device_bytes_at_n_fsdp_needed",
                per_device(n_min),
                "bytes",
                f"{expression} at N_FSDP = {n_min}",
            )
        )
    if n_fsdp is not None:
        _positive(n_fsdp=n_fsdp)
        rows.append(
            Quantity("per_device_bytes", per_device(n_fsdp), "bytes", f"{expression} at N_FSDP = {n_fsdp}")
        )
    return rows


def fsdp_tp_compute_bound_batch(
    model: FFNStack,
    flops_per_s: float = 4.6e14,
    ici_bytes_per_s: float = 2 * 9e10,
    fsdp: int = 16,
    tp: int = 4,
    fsdp_axes: int = 2,
    tp_axes: int = 1,
) -> list[Quantity]:
    """(c) Forward pass of mixed FSDP (X) + tensor parallelism (Y), TPU mesh, after the scaling book.

    "How to Scale Your Model", training chapter, "Mixed FSDP and Tensor Parallelism", per layer, bf16:
        T_math = 2*2*B*D*F / (N*C)                       (two matmuls of 2 B D F FLOPs, over N = X*Y chips)
        T_FSDP = 2*2*D*F / (Y*W*M_X)                     (all-gather W_in[D_X,F_Y], W_out[F_Y,D_X]; 2 bytes)
        T_TP   = 2*2*B*D / (X*W*M_Y)                     (all-gather In[B_X,D_Y], reduce-scatter Out; 2 bytes)
    Comms overlap with compute, so it is compute bound when T_math >= T_FSDP + T_TP. Dividing by 4D/C and
    writing alpha = C/W: B*F/N >= alpha*F/(Y*M_X) + alpha*B/(X*M_Y) (each term a time in units of 4D/C), so
        B >= alpha*F/(Y*M_X) / (F/N - alpha/(X*M_Y))     (B in tokens; never if F/N <= alpha/(X*M_Y)).
    The book's bound for the best split of N into X*Y is B/N > 4 alpha^2 / (F*M_X*M_Y), a cross-check.
    """
    _positive(flops_per_s=flops_per_s, ici_bytes_per_s=ici_bytes_per_s, fsdp=fsdp, tp=tp)
    _positive(fsdp_axes=fsdp_axes, tp_axes=tp_axes)
    f, n = model.d_ff, fsdp * tp
    alpha = flops_per_s / ici_bytes_per_s
    margin = f / n - alpha / (fsdp * tp_axes)
    fsdp_term = alpha * f / (tp * fsdp_axes)
    global_batch = fsdp_term / margin if margin > 0 else math.inf
    per_device = global_batch / n
    per_device_tokens = math.ceil(per_device) if math.isfinite(per_device) else math.inf
    optimal_split_bound = 4 * alpha**2 / (f * fsdp_axes * tp_axes)
    return [
        Quantity("alpha", alpha, "FLOP/byte", "C / W_ici"),
        Quantity("num_devices", n, "devices", "N = X * Y"),
        Quantity("t_math_per_token", f / n, "4D/C s", "F / N: T_math = B * F/N * 4D/C"),
        Quantity(
            "t_tp_per_token", alpha / (fsdp * tp_axes), "4D/C s", "alpha / (X M_Y): T_TP = B * this * 4D/C"
        ),
        Quantity("t_fsdp", fsdp_term, "4D/C s", "alpha F / (Y M_X): T_FSDP = this * 4D/C"),
        Quantity("min_global_batch", global_batch, "tokens", "alpha F/(Y M_X) / (F/N - alpha/(X M_Y))"),
        Quantity("min_per_device_batch", per_device, "tokens", "min_global_batch / N"),
        Quantity("per_device_batch", per_device_tokens, "tokens", "ceil(min_per_device_batch)"),
        Quantity("global_batch", per_device_tokens * n, "tokens", "per_device_batch * N"),
        Quantity("per_fsdp_shard_batch", per_device_tokens * n / fsdp, "tokens", "global_batch / X"),
        Quantity(
            "optimal_split_min_per_device_batch",
            optimal_split_bound,
            "tokens",
            "4 alpha^2 / (F * M_X * M_Y): lowest B/N over all splits X*Y = N (scaling book)",
        ),
    ]


# ----------------------------------------------------------------------------------------------------
# optimizer_state_sharding_accounting (ADDENDUM.md §3)


def training_state_memory(
    param_numels: list[int],
    world_size: int,
    param_dtype: str = "fp32",
    grad_dtype: str = "fp32",
    state_dtype: str = "fp32",
    state_tensors_per_param: int = 2,
) -> list[Quantity]:
    """Bytes of parameters, gradients and optimizer state (AdamW: 2 moments) per rank, unsharded and sharded.

    Sharded, rank r keeps the state of the parameters `balanced_partition` gives it (whole tensors, so the
    largest rank can hold more than the ideal 1/world_size); AdamW's scalar `step` counters are ignored.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    psi = sum(param_numels)
    state_per_element = state_tensors_per_param * dtype_bytes(state_dtype)
    _, loads = balanced_partition(list(param_numels), world_size)
    rows = [
        Quantity("num_params", psi, "parameters", "Psi = sum of parameter sizes"),
        Quantity(
            "parameters_bytes", psi * dtype_bytes(param_dtype), "bytes", f"Psi * {dtype_bytes(param_dtype)}"
        ),
        Quantity(
            "gradients_bytes", psi * dtype_bytes(grad_dtype), "bytes", f"Psi * {dtype_bytes(grad_dtype)}"
        ),
        Quantity(
            "optimizer_state_bytes",
            psi * state_per_element,
            "bytes",
            f"Psi * {state_tensors_per_param} * {dtype_bytes(state_dtype)}",
        ),
        Quantity(
            "sharded_optimizer_state_bytes_ideal",
            psi * state_per_element / world_size,
            "bytes",
            "optimizer_state_bytes / world_size",
        ),
        Quantity(
            "sharded_optimizer_state_bytes_max_rank",
            max(loads) * state_per_element,
            "bytes",
            "largest rank's share under balanced_partition * state bytes per element",
        ),
    ]
    rows += [
        Quantity(
            f"sharded_optimizer_state_bytes_rank{rank}", load * state_per_element, "bytes", "rank's share"
        )
        for rank, load in enumerate(loads)
    ]
    return rows


def data_parallel_communication(
    num_params: int, world_size: int, grad_dtype: str = "fp32", param_dtype: str = "fp32"
) -> list[Quantity]:
    """Bytes each rank sends per step with ring collectives, which move (n-1)/n of the buffer per phase.

    DDP: all-reduce of gradients = reduce-scatter + all-gather = 2 Psi. ZeRO stage 1 (P_os, Rajbhandari et al.
    2020): reduce-scatter of gradients (each rank only needs its shard's) + all-gather of updated parameters =
    2 Psi, the same as DDP. Ours (and torch's ZeroRedundancyOptimizer): all-reduce of the full gradient
    (2 Psi) + exchange of updated parameters (Psi) = 3 Psi, 1.5x DDP.
    """
    _positive(num_params=num_params, world_size=world_size)
    ring = (world_size - 1) / world_size
    g, p = dtype_bytes(grad_dtype), dtype_bytes(param_dtype)
    allreduce = 2 * ring * num_params * g
    reduce_scatter = ring * num_params * g
    allgather = ring * num_params * p
    return [
        Quantity("ring_factor", ring, "1", "(n - 1) / n"),
        Quantity("ddp_psi_units", 2, "Psi", "all-reduce = reduce-scatter + all-gather"),
        Quantity("ddp_bytes_per_rank", allreduce, "bytes", "2 (n-1)/n Psi * grad bytes"),
        Quantity("zero1_psi_units", 2, "Psi", "reduce-scatter gradients + all-gather parameters"),
        Quantity(
            "zero1_bytes_per_rank", reduce_scatter + allgather, "bytes", "(n-1)/n Psi (grad + param bytes)"
        ),
        Quantity("sharded_psi_units", 3, "Psi", "all-reduce gradients + all-gather parameters"),
        Quantity(
            "sharded_bytes_per_rank", allreduce + allgather, "bytes", "(n-1)/n Psi (2 grad + param bytes)"
        ),
    ]


def sharding_prediction(
    variant: str, param_numels: list[int], rank: int, world_size: int
) -> dict[str, float]:
    """What the sharding benchmark predicts for one rank: bytes of parameters, gradients and optimizer state
    (`unsharded` AdamW; `sharded`, ours, this rank's `balanced_partition` share; `zero`, PyTorch's
    ZeroRedundancyOptimizer, the ideal 1/world_size), and bytes the rank sends per step."""
    memory = values(training_state_memory(param_numels, world_size))
    state = {
        "unsharded": memory["optimizer_state_bytes"],
        "sharded": memory.get(f"sharded_optimizer_state_bytes_rank{rank}", 0.0),
        "zero": memory["sharded_optimizer_state_bytes_ideal"],
    }[variant]
    comm = values(data_parallel_communication(sum(param_numels), world_size)) if world_size > 1 else {}
    comm_key = "ddp_bytes_per_rank" if variant == "unsharded" else "sharded_bytes_per_rank"
    return {
        "parameters": memory["parameters_bytes"],
        "gradients": memory["gradients_bytes"],
        "optimizer_state": state,
        "communication": comm.get(comm_key, 0.0),
    }


# ----------------------------------------------------------------------------------------------------
# fsdp_accounting (2026 §7 a)


def collective_bytes(collective: str, full_bytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring collective over a tensor of `full_bytes` (its full, unsharded size):
    all-gather and reduce-scatter (n-1)/n of it, all-reduce twice that (a reduce-scatter, then an all-gather)."""
    _positive(world_size=world_size)
    phases = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
    if collective not in phases:
        raise ValueError(f"unknown collective {collective!r}; choose one of {list(phases)}")
    return phases[collective] * (world_size - 1) / world_size * full_bytes


def fsdp_memory(
    unit_numels: list[int],
    replicated_numel: int,
    world_size: int,
    compute_dtype: str = "fp32",
    prefetch_distance: int = 2,
) -> list[Quantity]:
    """Training state per rank under DDP and FSDP, and the peak saving FSDP should bring (2026 §7 a).

    `unit_numels`: the sizes of the sharded units (every Linear and Embedding weight); `replicated_numel`: the
    parameters every rank keeps whole (the norms). fp32 master weights and gradients and AdamW's two fp32
    moments are 16 bytes per parameter: DDP holds 16 Psi on every rank, FSDP 16 Psi_s / n of the sharded
    parameters and 16 Psi_r of the replicated ones. Activations are ignored: both run the same batch per rank,
    so they cancel in the difference.

    Two expectations. The handout's, which ignores FSDP's gathered buffers: 16 Psi - FSDP state. And the one the
    benchmark measures against our bucketed DDP at the end of backward, when every gradient exists: that DDP
    also keeps its flat gradient buckets (4 Psi) beside autograd's gradients, and FSDP holds gathered units, at
    most `prefetch_distance` units' full weights in the compute dtype at once plus, in backward, one unit's full
    fp32 gradient before its reduce-scatter (bounded with the largest unit).
    """
    _positive(world_size=world_size, prefetch_distance=prefetch_distance)
    if not unit_numels:
        raise ValueError("unit_numels is empty: FSDP needs at least one sharded unit")
    n, c = world_size, dtype_bytes(compute_dtype)
    sharded, largest = sum(unit_numels), max(unit_numels)
    psi = sharded + replicated_numel
    ddp_state = 16 * psi
    buckets = 4 * psi
    fsdp_state = 16 * (sharded / n + replicated_numel)
    buffers = prefetch_distance * largest * c + largest * 4
    return [
        Quantity("sharded_params", sharded, "parameters", "Psi_s = sum of Linear and Embedding weights"),
        Quantity("replicated_params", replicated_numel, "parameters", "Psi_r = the norms' weights"),
        Quantity("largest_unit_params", largest, "parameters", "the largest sharded weight"),
        Quantity(
            "ddp_state_bytes", ddp_state, "bytes", "16 (Psi_s + Psi_r): fp32 weights, gradients, 2 moments"
        ),
        Quantity(
            "ddp_bucket_bytes", buckets, "bytes", "4 Psi: our bucketed DDP's flat fp32 gradient buckets"
        ),
        Quantity("fsdp_state_bytes", fsdp_state, "bytes", f"16 (Psi_s / {n} + Psi_r)"),
        Quantity(
            "fsdp_gathered_bytes",
            buffers,
            "bytes",
            f"{prefetch_distance} units' weights x {c} bytes ({compute_dtype}) + one unit's fp32 gradient, "
            "largest unit",
        ),
        Quantity("saving_handout_bytes", ddp_state - fsdp_state, "bytes", "DDP state - FSDP state"),
        Quantity(
            "saving_vs_our_ddp_bytes",
            ddp_state + buckets - fsdp_state - buffers,
            "bytes",
            "DDP state + buckets - FSDP state - gathered units",
        ),
    ]
