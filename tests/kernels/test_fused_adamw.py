"""Our AdamW kernel (cs336_systems.kernels.fused_adamw) against torch.optim.AdamW, in Triton's CPU interpreter (set before
anything imports triton; a fresh process where it came too late, as in tests/kernels/test_fused_cross_entropy.py)."""

import os

from ..fresh_process import assert_passes_in_fresh_process, triton_imported_compiled

TRITON_PREIMPORTED = triton_imported_compiled()
os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402
import torch  # noqa: E402

from cs336_systems.kernels.fused_adamw import FusedAdamW  # noqa: E402

launches_kernels = pytest.mark.skipif(
    TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process instead"
)
SHAPES = [(37,), (5, 129), (3001,)]  # odd sizes: a ragged last block
HYPER = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}


def train(optimizer_class, dtype: torch.dtype, steps: int, **options) -> list[torch.Tensor]:
    """The weights after `steps` steps from the same start on the same gradients (one seed for all)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=g).to(dtype) for shape in SHAPES]
    optimizer = optimizer_class(params, **HYPER, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        optimizer.step()
    return params


@launches_kernels
def test_float32_matches_torchs_adamw():
    ours, theirs = (
        train(FusedAdamW, torch.float32, 6),
        train(torch.optim.AdamW, torch.float32, 6, foreach=False),
    )
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@launches_kernels
def test_bf16_is_at_least_as_close_to_float32_as_torchs_bf16():
    """In bf16 (weights and moments) every step rounds; computing each update in float32 and rounding once (to
    nearest even) keeps ours as close to the float32 run as torch's bf16 AdamW, or closer."""
    exact = train(torch.optim.AdamW, torch.float32, 10, foreach=False)
    ours = train(FusedAdamW, torch.bfloat16, 10)
    theirs = train(torch.optim.AdamW, torch.bfloat16, 10, foreach=False)
    for a, b, ref in zip(ours, theirs, exact, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.float() - ref).abs().mean() <= (b.float() - ref).abs().mean()


@launches_kernels
def test_parameters_without_gradients_are_left_alone():
    p, q = torch.ones(10), torch.ones(10)
    p.grad = torch.ones(10)
    FusedAdamW([p, q], lr=0.1).step()
    assert (p < 1).all() and torch.equal(q, torch.ones(10))


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match=r"betas in \[0, 1\): got lr=0.001, betas=\(0.9, 1.0\)"):
        FusedAdamW([torch.zeros(2, requires_grad=True)], betas=(0.9, 1.0))


@launches_kernels
def test_non_contiguous_parameters_are_refused():
    p = torch.zeros(4, 6).t()
    p.grad = torch.ones(4, 6).t()
    with pytest.raises(ValueError, match=r"contiguous parameters and gradients: got strides \(1, 6\)"):
        FusedAdamW([p]).step()


@pytest.mark.skipif(not TRITON_PREIMPORTED, reason="the kernel tests ran in this process")
def test_kernel_tests_in_fresh_process():
    assert_passes_in_fresh_process(__file__)
