"""The fused LM head + cross-entropy against cross_entropy(h @ W.T) in float64, on odd sizes, in Triton's CPU
interpreter (set before anything imports triton; see tests/kernels/test_flash_attention.py for the fresh-process rerun)."""

import os
import weakref

from ..fresh_process import assert_passes_in_fresh_process, triton_imported_compiled

TRITON_PREIMPORTED = triton_imported_compiled()
os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from cs336_systems.kernels.fused_cross_entropy import cross_entropy_rows_, fused_linear_cross_entropy  # noqa: E402

launches_kernels = pytest.mark.skipif(
    TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process instead"
)


def inputs(tokens: int, d: int, vocab: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, d, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=g) / d**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    return h, weight, targets


def reference(h, weight, targets, reduction):
    """Loss and gradients of the unfused head in float64, from the same (rounded) inputs."""
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, weight))
    loss = F.cross_entropy(h64 @ w64.T, targets, reduction=reduction)
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# (tokens, d, vocab, chunk): vocab not a multiple of the kernel's block, the last chunk short, a chunk of one token
SHAPES = [(37, 24, 101, 8), (16, 16, 5000, 16), (9, 8, 4099, 1)]


@launches_kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_loss_and_gradients_match_the_unfused_head(shape, reduction, dtype, tolerance):
    tokens, d, vocab, chunk = shape
    h, weight, targets = inputs(tokens, d, vocab, dtype, seed=tokens + vocab)
    loss = fused_linear_cross_entropy(h, weight, targets, chunk=chunk, reduction=reduction)
    (loss * 1.5).backward()  # a non-unit incoming gradient reaches both
    want_loss, want_h, want_weight = reference(h, weight, targets, reduction)
    assert h.grad.dtype == dtype and weight.grad.dtype == dtype
    assert rel_err(loss, want_loss) < tolerance
    assert rel_err(h.grad, 1.5 * want_h) < tolerance
    assert rel_err(weight.grad, 1.5 * want_weight) < tolerance


@launches_kernels
def test_leading_dimensions_and_a_frozen_weight():
    h, weight, targets = inputs(2 * 7, 16, 33, torch.float32, seed=1)
    weight.requires_grad_(False)
    loss = fused_linear_cross_entropy(h.detach().view(2, 7, 16).requires_grad_(), weight, targets.view(2, 7))
    assert loss.item() == pytest.approx(
        F.cross_entropy(h.detach() @ weight.T, targets, reduction="sum").item(), rel=1e-5
    )
    loss.backward()


@launches_kernels
def test_the_row_kernel_writes_the_logits_gradient_in_place():
    logits = torch.randn(5, 300, dtype=torch.float64).float()
    targets = torch.tensor([0, 299, 7, 150, 42])
    expected_loss = F.cross_entropy(logits.double(), targets, reduction="none")
    expected_grad = 0.5 * (torch.softmax(logits.double(), -1) - F.one_hot(targets, 300))
    loss = cross_entropy_rows_(logits, targets, scale=0.5)
    assert torch.allclose(loss.double(), expected_loss, atol=1e-5)
    assert torch.allclose(logits.double(), expected_grad, atol=1e-6)


class LiveLogits(TorchDispatchMode):
    """Counts the chunks' logits (the outputs of mm of `shape`) alive at once, and the most ever."""

    def __init__(self, shape: tuple[int, int]):
        super().__init__()
        self.shape, self.live, self.most = shape, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default and tuple(out.shape) == self.shape:
            self.live += 1
            self.most = max(self.most, self.live)
            weakref.finalize(out, self._freed)
        return out

    def _freed(self) -> None:
        self.live -= 1


@launches_kernels
def test_one_chunks_logits_at_a_time():
    """The head's extra memory is one chunk's logits (2.3 GiB at the leaderboard's 8,192 tokens), not two."""
    h, weight, targets = inputs(3 * 5, 8, 11, torch.float32, seed=2)
    with LiveLogits((5, 11)) as logits:
        fused_linear_cross_entropy(h, weight, targets, chunk=5).backward()
    assert logits.most == 1


class Float32Allocations(TorchDispatchMode):
    """Records the float32 tensors of `shape` that operators create in memory of their own (not a view or an alias
    of an input's, as the Triton interpreter's `set_` of a kernel's argument is)."""

    def __init__(self, shape: tuple[int, int]):
        super().__init__()
        self.shape, self.made = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and tuple(out.shape) == self.shape:
            inputs = torch.utils._pytree.tree_leaves((args, kwargs))
            storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
            if out.untyped_storage().data_ptr() not in storages:
                self.made.append(func)
        return out


@launches_kernels
def test_the_backward_scales_the_weight_gradient_without_a_float32_copy():
    """The weight's gradient goes from the float32 accumulator to bf16 in one operator: no float32 temporary of the
    weight's size in the backward (2.3 GiB for the 8B model's head), and the same values as scaling then rounding."""
    h, weight, targets = inputs(12, 8, 19, torch.bfloat16, seed=3)
    loss = fused_linear_cross_entropy(h, weight, targets, chunk=5)
    (_, accumulator) = loss.grad_fn.saved_tensors
    expected = (accumulator * 0.75).to(torch.bfloat16)
    with Float32Allocations(tuple(weight.shape)) as made:
        (loss * 0.75).backward()
    assert made.made == []
    assert torch.equal(weight.grad, expected)


@launches_kernels
def test_no_tokens_give_zero_loss_and_gradients():
    """The weight's accumulator is written by the first chunk, not zeroed first: with no chunk it must still be 0."""
    h, weight, targets = inputs(0, 8, 11, torch.float32, seed=4)
    loss = fused_linear_cross_entropy(h, weight, targets)
    loss.backward()
    assert (
        loss.item() == 0.0 and torch.equal(weight.grad, torch.zeros_like(weight)) and h.grad.shape == (0, 8)
    )


def test_bad_inputs_name_what_is_wrong():
    h, weight, targets = inputs(4, 8, 11, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"must agree on d: got h \(4, 8\) and weight \(11, 9\)"):
        fused_linear_cross_entropy(h, torch.zeros(11, 9), targets)
    with pytest.raises(ValueError, match=r"targets must have h's leading shape \(4,\), got \(5,\)"):
        fused_linear_cross_entropy(h, weight, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction must be 'sum' or 'mean', got 'none'"):
        fused_linear_cross_entropy(h, weight, targets, reduction="none")
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        fused_linear_cross_entropy(h, weight, targets, chunk=0)


@pytest.mark.skipif(not TRITON_PREIMPORTED, reason="the kernel tests ran in this process")
def test_kernel_tests_in_fresh_process():
    assert_passes_in_fresh_process(__file__)
