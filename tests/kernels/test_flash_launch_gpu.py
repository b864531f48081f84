"""The launch cache of the portable tier on a GPU (`gpu` marker): after a shape's first call our kernels are
launched from the compiled kernel's own launcher (no autotuner, no JIT binding), and the later calls compute bitwise
what the first one did, within tolerance of float64 attention. `test_flash_launch.py` checks the same cache in the
CPU interpreter, with a stand-in for the compiled launcher; this file checks the launcher itself.
"""

import pytest
import torch

from cs336_systems.kernels import flash_attention, flash_triton

from ..attention_reference import reference, rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# As test_flash_compile.py on the GPU: fp32 matmuls may run in TF32.
TOLERANCE = {torch.float32: 1e-2, torch.float16: 1e-2, torch.bfloat16: 3e-2}
LAUNCHERS = {"forward": "_fwd", "preprocess": "_preprocess", "dK dV": "_dkdv", "dQ": "_dq"}
# (batch, heads, tokens, head dim, causal, dtype): odd and power-of-two lengths, every dtype.
SHAPES = [
    (2, 4, 130, 64, True, torch.bfloat16),
    (1, 3, 1000, 128, False, torch.float16),
    (3, 2, 77, 32, True, torch.float32),
    (1, 2, 1024, 64, False, torch.bfloat16),
]


def _forward_backward(q, k, v, do, causal):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = flash_attention.flash_attention(*leaves, is_causal=causal, tier="portable")
    return (o.detach(), *torch.autograd.grad(o, leaves, do))


def _refuse_triton_dispatch(monkeypatch):
    """From here on a launch through the autotuner or the JIT's argument binding fails the test."""
    for attribute in LAUNCHERS.values():
        cached = getattr(flash_triton, attribute)
        for kernel in dict.fromkeys((cached.kernel, cached.fn)):  # the same object for a plain JIT kernel

            def refuse(*args, kernel=kernel, **kwargs):
                raise AssertionError(f"{kernel} went through Triton's dispatch after the first launch")

            monkeypatch.setattr(kernel, "run", refuse)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cached_launches_repeat_the_first_launch_bitwise(shape, monkeypatch):
    if flash_triton.INTERPRET:
        pytest.skip("flash_triton was imported under TRITON_INTERPRET=1: run this file alone")
    batch, heads, n, d, causal, dtype = shape
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, do = (torch.randn(batch, heads, n, d, generator=g, device="cuda").to(dtype) for _ in range(4))
    flash_triton.clear_launch_cache()
    first = _forward_backward(q, k, v, do, causal)
    for name, attribute in LAUNCHERS.items():
        assert len(getattr(flash_triton, attribute).launches) == 1, f"{name}: one recorded launch"

    _refuse_triton_dispatch(monkeypatch)
    for _ in range(2):
        for name, got, want in zip(
            ("O", "dQ", "dK", "dV"), _forward_backward(q, k, v, do, causal), first, strict=True
        ):
            assert torch.equal(got, want), f"{name} differs from the first call's"

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = reference(q64, k64, v64, causal)[0]
    expected = (o64.detach(), *torch.autograd.grad(o64, (q64, k64, v64), do.double()))
    errors = {
        name: rel_err(a, e) for name, a, e in zip(("O", "dQ", "dK", "dV"), first, expected, strict=True)
    }
    assert all(err < TOLERANCE[dtype] for err in errors.values()), errors  # NaN fails too
