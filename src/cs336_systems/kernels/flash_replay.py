"""Replay: a FlashAttention tier's launches issued from C++, so that a call costs the host about what SDPA's does.

At short sequences attention is bound by the host, not the GPU: on an H100 at 128 tokens our kernels run 15 us
forward + backward, while the Python path costs the host several hundred microseconds (the autograd Function, the
validation, a tier's allocations, TMA descriptors and launches, and the backward's Python on autograd's device
thread), against about 200 us for SDPA's C++ path. So once per shape, and only in eager mode:

1. the first forward and backward run the tier in Python while `CachedLaunch` records each launch (`recording`);
2. `describe` turns the records into a plan: slots (the inputs, then every buffer the tier allocated, identified by
   address), each launch's compiled kernel, grid and arguments (pointers and TMA descriptors of slots, scalars),
   and the slots returned;
3. the C++ extension (`flash_replay.cpp`, built by torch.utils.cpp_extension at the first plan, cached by torch
   between processes) registers the plan, and from then on `attention` runs calls of that shape there: buffers
   allocated, descriptors encoded, the same compiled kernels launched, and the autograd Function in C++.

A tier can be replayed when its forward and backward allocate only with `torch.empty*` (no buffer is zeroed by its
allocation) and launch only through `CachedLaunch`: both tiers do. A recording is refused, and that shape stays on
the Python path, for whatever a plan cannot repeat: an uncached launch, scratch memory, cooperative or cluster
launches, an argument type the C++ side does not pack, a buffer that is not a whole allocation. Inputs that share
an address, or that are not contiguous, are not recorded (the next call tries again). Off the GPU (the
interpreter), under torch.compile or a dispatch mode, when the extension cannot be built, or with
$CS336_FLASH_REPLAY=0, nothing changes: the Python path runs.
"""

from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from cs336_systems.kernels import flash_tiers, flash_triton

ENV = "CS336_FLASH_REPLAY"

_plans: dict[tuple, int] = {}  # key -> the C++ plan's id
_refused: set[tuple] = set()  # keys whose recording a plan cannot repeat: never recorded again
# plan id -> its inputs' (shape, dtype), for the error raised for inputs that do not match
_inputs: dict[int, list] = {}
_native = None  # the built extension; False when it cannot be built here
_build_lock = threading.Lock()


class Unreplayable(Exception):
    """What a recording shows that a plan cannot repeat."""


class Aliased(Unreplayable):
    """Inputs that share an address: this call cannot be recorded, the next one may be."""


def key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, tier: str | None) -> tuple:
    """What a plan is specialised on: shapes, dtypes, devices, the causal flag and the tier request."""
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, is_causal,
            flash_tiers.request(tier))  # fmt: skip


def plan_for(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, tier: str | None
) -> int | None:
    """The registered plan of these inputs' shape, or None (then the Python path runs, and may record one)."""
    if not _plans or type(is_causal) is not bool or os.environ.get(ENV) == "0":
        return None
    return _plans.get(key(q, k, v, is_causal, tier))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: int) -> torch.Tensor:
    """Attention of q over k, v by a registered plan, differentiable (its backward is the plan's, in C++)."""
    out = _native.attention(q, k, v, plan)
    if out is None:  # the C++ side returns None rather than throwing through its autograd Function
        expected = _inputs.get(plan, "no such plan")
        got = [(tuple(t.shape), t.dtype, str(t.device)) for t in (q, k, v)]
        raise ValueError(f"flash replay: inputs {got} do not match the recorded plan {plan}: {expected}")
    return out


def wanted(plan_key: tuple) -> bool:
    """Whether to record the Python path's call of this shape."""
    return (
        _native is not False
        and plan_key not in _plans
        and plan_key not in _refused
        and os.environ.get(ENV, "1") != "0"
        and not flash_triton.INTERPRET
        and plan_key[6].type == "cuda"
        and plan_key[6].index == torch.cuda.current_device()  # the recorded kernels are this device's
    )


@contextmanager
def recording():
    """Collects the (RecordedLaunch, tensors) of every CachedLaunch in this thread while it lasts."""
    records: list = []
    flash_triton.RECORDING.launches = records
    try:
        yield records
    finally:
        flash_triton.RECORDING.launches = None


def record_forward(plan_key: tuple, inputs: tuple, outputs: tuple, records: list):
    """The forward step of a plan (kept until its backward), or None when it cannot be one."""
    try:
        return plan_key, describe(inputs, outputs, records)
    except Unreplayable as exc:
        _refuse(plan_key, exc)
        return None


def register(forward, inputs: tuple, outputs: tuple, records: list) -> None:
    """Complete `record_forward`'s step with the recorded backward and register the plan with the C++ side."""
    plan_key, forward_step = forward
    try:
        backward_step = describe(inputs, outputs, records)
    except Unreplayable as exc:
        _refuse(plan_key, exc)
        return
    native = _load()
    if native is not None:
        plan = _plans[plan_key] = native.register_plan(plan_key[6].index, forward_step, backward_step)
        _inputs[plan] = [(tuple(shape), dtype.dtype) for shape, dtype in forward_step["inputs"]]


def _refuse(plan_key: tuple, why: Unreplayable) -> None:
    if isinstance(why, Aliased):
        return
    _refused.add(plan_key)
    warnings.warn(
        f"FlashAttention replay: shape {tuple(plan_key[0])} stays on the Python path: {why}", stacklevel=4
    )


def reset() -> None:
    """Forget every plan and refusal (the extension's registered plans stay, unused)."""
    _plans.clear()
    _refused.clear()


def _load():
    """The C++ extension, built at first use (a minute, then cached by torch); None where it cannot be built."""
    global _native
    with _build_lock:
        if _native is None:
            try:
                from torch.utils import cpp_extension

                source = Path(__file__).with_name("flash_replay.cpp")
                _native = cpp_extension.load(
                    name="cs336_flash_replay", sources=[str(source)], extra_cflags=["-O2"], with_cuda=True
                )
            except Exception as exc:  # noqa: BLE001 - no compiler or CUDA headers: the Python path it is
                warnings.warn(
                    f"FlashAttention replay is off: its C++ extension cannot be built ({exc})", stacklevel=3
                )
                _native = False
    return _native or None


# ----------------------------------------------------------------------------------------------------------
# A recording -> a step of a plan: what the C++ side's `register_plan` parses.
# ----------------------------------------------------------------------------------------------------------
def describe(inputs: tuple, outputs: tuple, records: list) -> dict:
    """One step (forward or backward) of a plan from the inputs the tier was given, the outputs it returned and
    its recorded launches. Raises Unreplayable for anything a plan cannot repeat."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    slot_of: dict[int, int] = {}
    shapes: list = []
    buffers: list = []

    def slot(t: torch.Tensor) -> int:
        """An input's slot, or a buffer's: the tier allocated what is not an input."""
        ptr = t.data_ptr()
        if ptr not in slot_of:
            if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
                raise Unreplayable(f"a buffer of shape {tuple(t.shape)} is not a whole allocation")
            slot_of[ptr] = len(shapes) + len(buffers)
            buffers.append((list(t.shape), torch.empty(0, dtype=t.dtype)))
        return slot_of[ptr]

    for t in inputs:
        if t.data_ptr() in slot_of:
            raise Aliased("inputs share an address")
        slot_of[t.data_ptr()] = len(shapes)
        shapes.append((list(t.shape), torch.empty(0, dtype=t.dtype)))
    output_slots = []
    for t in outputs:
        if t.data_ptr() in slot_of:
            raise Unreplayable("an output is an input")
        output_slots.append(slot(t))
    launches = []
    for launch, tensors in records:
        if launch is None or launch.compiled is None:
            raise Unreplayable("a launch went through Triton's dispatch (a misaligned pointer)")
        launches.append(_launch(launch, tensors, slot, TMA_DTYPE_DEVICE_TO_HOST))
    return {"inputs": shapes, "buffers": buffers, "launches": launches, "outputs": output_slots}


def _launch(launch, tensors: tuple, slot, tma_dtype: dict) -> tuple:
    compiled = launch.compiled
    md = compiled.metadata
    if md.num_ctas != 1 or md.launch_cooperative_grid or md.launch_pdl:
        raise Unreplayable(f"{md.name}: cluster, cooperative or PDL launch")
    if md.global_scratch_size or getattr(md, "profile_scratch_size", 0):
        raise Unreplayable(f"{md.name}: needs scratch memory")
    signature = compiled.src.signature  # every argument by name, in order; "constexpr" for compile-time ones
    values = (*tensors, *launch.trailing)
    if len(signature) != len(values):
        raise Unreplayable(f"{md.name}: {len(values)} arguments recorded, its signature has {len(signature)}")
    descriptors = iter(md.tensordesc_meta or ())
    args = []
    for ty, value in zip(signature.values(), values, strict=True):
        if ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            meta = next(descriptors, None)
            if meta is None or meta["fp4_padded"]:
                raise Unreplayable(f"{md.name}: a descriptor not lowered to a TMA descriptor")
            base = value.base
            if list(value.strides) != list(torch.empty(value.shape, device="meta").stride()):
                raise Unreplayable(f"{md.name}: a descriptor over a non-contiguous view")
            padding = 1 if value.padding == "nan" else 0
            # the box TMA moves: the compiled kernel's (at d = 128 half the descriptor's block, 128-byte rows)
            args.append(("d", slot(base), list(value.shape), list(meta["block_size"]),
                         meta["swizzle"], meta["elem_size"], tma_dtype[meta["elem_type"]], padding))  # fmt: skip
        elif ty.startswith("*"):
            args.append(("p", slot(value)))
        elif ty in ("i32", "i64"):
            args.append(("i" if ty == "i32" else "l", int(value)))
        elif ty in ("fp32", "f32"):
            args.append(("f", float(value)))
        else:
            raise Unreplayable(f"{md.name}: an argument of type {ty}")
    grid = (*launch.grid, 1, 1)[:3]
    return (compiled.function, list(grid), 32 * md.num_warps, md.shared, args)
