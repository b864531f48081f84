"""`flash_replay.describe`: a recording of launches -> one step of a plan, with stand-ins for Triton's compiled
kernels and TMA descriptors (the replay itself runs on a GPU: test_flash_launch_gpu.py)."""

from types import SimpleNamespace

import pytest
import torch

from cs336_systems.kernels import flash_replay

DESC = "tensordesc<bf16[1,64,64],layout>"


def compiled(signature: dict, **metadata):
    md = {"name": "k", "num_ctas": 1, "launch_cooperative_grid": False, "launch_pdl": False,
          "global_scratch_size": 0, "profile_scratch_size": 0, "tensordesc_meta": None, "num_warps": 4,
          "shared": 1024} | metadata  # fmt: skip
    return SimpleNamespace(
        src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(**md), function=77
    )


def recorded(kernel, grid, trailing):
    return SimpleNamespace(compiled=kernel, grid=grid, trailing=trailing)


def descriptor(t, block):
    strides = list(torch.empty(t.shape, device="meta").stride())
    return SimpleNamespace(base=t, shape=list(t.shape), strides=strides, block_shape=block, padding="zero")


def test_slots_are_inputs_then_allocations_and_arguments_keep_the_kernel_order():
    q, k = torch.empty(2, 64, 64, dtype=torch.bfloat16), torch.empty(2, 64, 64, dtype=torch.bfloat16)
    o, lse, scratch = torch.empty_like(q), torch.empty(2, 64), torch.empty(2, 64)
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 64, 32], "fp4_padded": False}
    fwd = compiled({"q": DESC, "L": "*fp32", "S": "*fp32", "N": "i32", "BIG": "i64", "scale": "fp32",
                    "BLOCK": "constexpr"}, tensordesc_meta=[meta], num_warps=12)  # fmt: skip
    records = [(recorded(fwd, (4, 2), (128, 2**40, 0.5, 64)), (descriptor(q, [1, 64, 64]), lse, scratch))]
    step = flash_replay.describe((q, k), (o, lse), records)

    assert [shape for shape, _ in step["inputs"]] == [[2, 64, 64], [2, 64, 64]]
    assert [(shape, dtype.dtype) for shape, dtype in step["buffers"]] == [
        ([2, 64, 64], torch.bfloat16), ([2, 64], torch.float32), ([2, 64], torch.float32)]  # fmt: skip
    assert step["outputs"] == [2, 3]  # o, lse: after the two inputs
    function, grid, block, shared, args = step["launches"][0]
    assert (function, grid, block, shared) == (77, [4, 2, 1], 12 * 32, 1024)
    # the descriptor's box is the compiled kernel's (block_size), not the descriptor's block; BLOCK is skipped
    assert args == [("d", 0, [2, 64, 64], [1, 64, 32], 3, 2, 9, 0), ("p", 3), ("p", 4), ("i", 128),
                    ("l", 2**40), ("f", 0.5)]  # fmt: skip


@pytest.mark.parametrize(
    "problem, match",
    [
        ("uncached", "Triton's dispatch"),
        ("scratch", "scratch memory"),
        ("cluster", "cluster"),
        ("view", "not a whole allocation"),
        ("bool argument", "type i1"),
        ("arity", "arguments recorded"),
    ],
)
def test_what_a_plan_cannot_repeat_is_refused(problem, match):
    q, lse = torch.empty(2, 8, 16), torch.empty(2, 8)
    kernel = compiled({"q": "*fp32", "L": "*fp32", "flag": "i1" if problem == "bool argument" else "i32"},
                      global_scratch_size=64 if problem == "scratch" else 0,
                      num_ctas=2 if problem == "cluster" else 1)  # fmt: skip
    trailing = () if problem == "arity" else (1,)
    launch = None if problem == "uncached" else recorded(kernel, (1,), trailing)
    buffer = torch.empty(2, 9)[:, 1:] if problem == "view" else lse
    with pytest.raises(flash_replay.Unreplayable, match=match):
        flash_replay.describe((q,), (), [(launch, (q, buffer))])


def test_inputs_sharing_an_address_are_retried_not_refused():
    q = torch.empty(2, 8, 16)
    with pytest.raises(flash_replay.Aliased):
        flash_replay.describe((q, q.view(2, 8, 16)), (), [])
    key = ("shape",) + (None,) * 10
    flash_replay._refuse(key, flash_replay.Aliased("inputs share an address"))
    assert key not in flash_replay._refused


def test_nothing_is_recorded_off_the_gpu():
    q = torch.empty(1, 2, 8, 16)
    assert not flash_replay.wanted(flash_replay.key(q, q, q, True, None))
    assert flash_replay.plan_for(q, q, q, True, None) is None
