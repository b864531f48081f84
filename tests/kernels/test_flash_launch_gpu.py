"""The launch paths of both tiers on a GPU (`gpu` marker): after a shape's first call our kernels are launched
either from the compiled kernel's own launcher (no autotuner, no JIT binding; replay off) or from C++ by the plan
the first call recorded (`flash_replay`: no Python launch at all), and the later calls compute what the first one
did (bitwise, but the Hopper tier's dQ, summed by TMA reductions in no fixed order), within tolerance of float64
attention. `test_flash_launch.py` checks the same cache in the CPU interpreter, with a stand-in for the compiled
launcher; this file checks the launcher itself.
"""

import pytest
import torch

from cs336_systems.kernels import flash_attention, flash_replay, flash_triton, hopper
from cs336_systems.kernels.hopper import flash_attention as hopper_tier

from ..attention_reference import reference, rel_err

# As test_flash_compile.py on the GPU: fp32 matmuls may run in TF32.
TOLERANCE = {torch.float32: 1e-2, torch.float16: 1e-2, torch.bfloat16: 3e-2}
HOPPER_KERNELS = (
    "zero_kernel",
    "flash_fwd_kernel",
    "bwd_preprocess_kernel",
    "flash_bwd_kernel",
    "dq_convert_kernel",
)
# (batch, heads, tokens, head dim, causal, dtype): odd and power-of-two lengths, every dtype a tier takes.
SHAPES = {
    "portable": [
        (2, 4, 130, 64, True, torch.bfloat16),
        (1, 3, 1000, 128, False, torch.float16),
        (3, 2, 77, 32, True, torch.float32),
        (1, 2, 1024, 64, False, torch.bfloat16),
    ],
    "hopper": [
        (2, 4, 130, 64, True, torch.bfloat16),
        (1, 3, 1000, 128, False, torch.float16),
        (1, 2, 1024, 64, False, torch.bfloat16),
    ],
}
CASES = [
    (tier, shape, replay) for tier, shapes in SHAPES.items() for shape in shapes for replay in (False, True)
]


def _launchers(tier: str) -> list:
    if tier == "portable":
        return [flash_triton._fwd, flash_triton._preprocess, flash_triton._dkdv, flash_triton._dq]
    return [hopper_tier._launch(name) for name in HOPPER_KERNELS]


def _forward_backward(q, k, v, do, causal, tier):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = flash_attention.flash_attention(*leaves, is_causal=causal, tier=tier)
    return (o.detach(), *torch.autograd.grad(o, leaves, do))


def _refuse_triton_dispatch(monkeypatch, tier: str):
    """From here on a launch through the autotuner or the JIT's argument binding fails the test."""
    for cached in _launchers(tier):
        for kernel in dict.fromkeys((cached.kernel, cached.fn)):  # the same object for a plain JIT kernel

            def refuse(*args, kernel=kernel, **kwargs):
                raise AssertionError(f"{kernel} went through Triton's dispatch after the first launch")

            monkeypatch.setattr(kernel, "run", refuse)


def _refuse_python_launches(monkeypatch):
    """From here on a launch from Python fails the test: replay launches from C++."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{self.fn} was launched from Python, not replayed")

    monkeypatch.setattr(flash_triton.CachedLaunch, "__call__", refuse)


@pytest.mark.gpu
@pytest.mark.parametrize("tier, shape, replay", CASES, ids=str)
def test_later_launches_repeat_the_first_launch(tier, shape, replay, monkeypatch):
    batch, heads, n, d, causal, dtype = shape
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if flash_triton.INTERPRET:
        pytest.skip("flash_triton was imported under TRITON_INTERPRET=1: run this file alone")
    if tier == "hopper" and not hopper.supports(torch.device("cuda"), dtype, d, causal):
        pytest.skip("the Hopper tier does not run here (needs a capability (9, 0) GPU and Gluon)")
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, do = (torch.randn(batch, heads, n, d, generator=g, device="cuda").to(dtype) for _ in range(4))
    monkeypatch.setenv(flash_replay.ENV, "1" if replay else "0")
    flash_triton.clear_launch_cache()
    hopper_tier.clear_launch_cache()
    flash_replay.reset()
    first = _forward_backward(q, k, v, do, causal, tier)
    for cached in _launchers(tier):
        assert len(cached.launches) == 1, f"{cached.fn}: one recorded launch"
    planned = flash_replay.plan_for(q, k, v, causal, tier) is not None
    assert planned == replay, f"a plan was {'not ' * replay}recorded"

    _refuse_triton_dispatch(monkeypatch, tier)
    if replay:
        _refuse_python_launches(monkeypatch)
    for _ in range(2):
        again = _forward_backward(q, k, v, do, causal, tier)
        for name, got, want in zip(("O", "dQ", "dK", "dV"), again, first, strict=True):
            if tier == "hopper" and name == "dQ":  # TMA reduce-adds: the same sum in another order
                assert rel_err(got, want.double()) < TOLERANCE[dtype], name
            else:
                assert torch.equal(got, want), f"{name} differs from the first call's"

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = reference(q64, k64, v64, causal)[0]
    expected = (o64.detach(), *torch.autograd.grad(o64, (q64, k64, v64), do.double()))
    errors = {
        name: rel_err(a, e) for name, a, e in zip(("O", "dQ", "dK", "dV"), first, expected, strict=True)
    }
    assert all(err < TOLERANCE[dtype] for err in errors.values()), errors  # NaN fails too


@pytest.mark.gpu
def test_replay_names_inputs_that_do_not_match_its_plan():
    """A plan is specialised on shapes: the C++ side refuses other inputs with an error naming the input."""
    if not torch.cuda.is_available() or flash_triton.INTERPRET:
        pytest.skip("needs a CUDA GPU (and flash_triton imported without the interpreter)")
    q, k, v, do = (torch.randn(1, 2, 64, 32, device="cuda", requires_grad=True) for _ in range(4))
    flash_replay.reset()
    torch.autograd.grad(flash_attention.flash_attention(q, k, v, True, tier="portable"), (q, k, v), do)
    plan = flash_replay.plan_for(q, k, v, True, "portable")
    if plan is None:
        pytest.skip("replay is off here (no C++ toolchain, or $CS336_FLASH_REPLAY=0)")
    with pytest.raises(ValueError, match="do not match the recorded plan"):
        flash_replay.attention(q, k[:, :, :32].contiguous(), v, plan)
    with pytest.raises(ValueError, match="no such plan"):
        flash_replay.attention(q, k, v, plan + 1000)
