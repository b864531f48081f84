"""How our FlashAttention reaches its kernels: the launch cache (Triton's dispatch at a shape's first launch only),
the kernel tiers (`flash_tiers`: chosen once per key, forced by argument or environment, the backward on the
forward's tier), and the eager path that bypasses the torch.library operators which torch.compile still uses.

The kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported, as in
test_flash_attention.py); a fake hopper module stands in for the GPU-only tier.
"""

import os
import sys
import types

from ..dispatch_log import OpLog
from ..fresh_process import assert_passes_in_fresh_process, triton_imported_compiled

TRITON_PREIMPORTED = triton_imported_compiled()
os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cs336_systems.kernels import flash_attention, flash_tiers, flash_triton  # noqa: E402
from cs336_systems.kernels.flash_attention import FlashAttentionTriton  # noqa: E402

launches_kernels = pytest.mark.skipif(
    TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process instead"
)


def qkv(batch, n_q, n_k, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*batch, n, d, generator=g).to(dtype) for n in (n_q, n_k, n_k, n_q)]


def forward_backward(q, k, v, do, causal, **kwargs):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = flash_attention.flash_attention(*leaves, is_causal=causal, **kwargs)
    return (o.detach(), *torch.autograd.grad(o, leaves, do))


@pytest.fixture(autouse=True)
def fresh_tiers(monkeypatch):
    monkeypatch.delenv(flash_tiers.ENV, raising=False)
    flash_tiers.reset()
    yield
    flash_tiers.reset()


# ----------------------------------------------------------------------------------------------------------
# Launch cache
# ----------------------------------------------------------------------------------------------------------
AUTOTUNED = ("flash_fwd_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel")


def no_autotuner(monkeypatch):
    """From here on, a launch through an autotuner fails the test."""
    for name in AUTOTUNED:

        def refuse(*args, name=name, **kwargs):
            raise AssertionError(f"{name} went through the autotuner")

        monkeypatch.setattr(getattr(flash_triton, name), "run", refuse)


@launches_kernels
def test_cached_launches_compute_what_the_autotuned_first_launch_did(monkeypatch):
    flash_triton.clear_launch_cache()
    shapes = [((2,), 40, 40, 16, True), ((1, 2), 33, 47, 32, False)]
    inputs = [qkv(batch, n_q, n_k, d, seed=i) for i, (batch, n_q, n_k, d, _) in enumerate(shapes)]
    first = [forward_backward(*x, causal) for x, (*_, causal) in zip(inputs, shapes, strict=True)]
    for launcher in (flash_triton._fwd, flash_triton._preprocess, flash_triton._dkdv, flash_triton._dq):
        assert len(launcher.launches) == 2  # one recorded launch per shape

    no_autotuner(monkeypatch)
    for _ in range(2):  # second and third calls, the shapes interleaved
        for x, (*_, causal), expected in zip(inputs, shapes, first, strict=True):
            for got, want in zip(forward_backward(*x, causal), expected, strict=True):
                assert torch.equal(got, want)  # bitwise


@launches_kernels
def test_a_new_shape_goes_through_triton_once(monkeypatch):
    flash_triton.clear_launch_cache()
    q, k, v, do = qkv((2,), 40, 40, 16)
    forward_backward(q, k, v, do, True)
    q2, k2, v2, do2 = qkv((3,), 20, 20, 16, seed=1)
    calls = []
    run = flash_triton.flash_fwd_kernel.run
    monkeypatch.setattr(
        flash_triton.flash_fwd_kernel, "run", lambda *a, **kw: calls.append(1) or run(*a, **kw)
    )
    for _ in range(3):
        flash_triton.flash_forward(q2.view(-1, 20, 16), k2.view(-1, 20, 16), v2.view(-1, 20, 16), True)
        flash_triton.flash_forward(q[0:2], k[0:2], v[0:2], True)
    assert calls == [1]


@launches_kernels
def test_misaligned_inputs_are_never_cached():
    # Triton specialises a kernel on 16-byte aligned pointers: a view 4 bytes in must go through Triton each time.
    flash_triton.clear_launch_cache()
    q, k, v, _ = qkv((2,), 24, 24, 16)
    shifted = [torch.empty(t.numel() + 1)[1:].view(t.shape).copy_(t) for t in (q, k, v)]
    assert shifted[0].data_ptr() % 16 != 0
    o, lse = flash_triton.flash_forward(*shifted, True)
    assert flash_triton._fwd.launches == {}
    o_aligned, lse_aligned = flash_triton.flash_forward(q, k, v, True)
    assert torch.equal(o, o_aligned) and torch.equal(lse, lse_aligned)


class FakeCompiled:
    """A `CompiledKernel`'s launch surface: the launcher (`run`), the function handle and packed metadata."""

    function, packed_metadata = 1234, ("packed",)

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid, "stream": stream}


class FakeAutotuner(flash_triton.Autotuner):
    """An autotuned kernel X, Y, N, scale, D (constexpr), BLOCK (tuned) that records its launches through Triton."""

    def __init__(self):  # no Autotuner.__init__: nothing to tune
        self.fn = types.SimpleNamespace(arg_names=["X", "Y", "N", "scale", "D", "BLOCK"])
        self.best_config = flash_triton.triton.Config({"BLOCK": 32}, num_warps=4, num_stages=2)
        self.compiled = FakeCompiled()
        self.calls = []

    def run(self, *args, grid, warmup, **kwargs):
        self.calls.append((args, kwargs, grid(kwargs | self.best_config.kwargs)))
        return self.compiled


def on_a_fake_gpu(monkeypatch) -> tuple[FakeAutotuner, flash_triton.CachedLaunch]:
    """The compiled-kernel path (not interpreting) on device 0, stream 77: a fake kernel and its launch cache."""
    monkeypatch.setattr(flash_triton, "INTERPRET", False)
    device = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda index: 77)
    monkeypatch.setattr(flash_triton, "driver", types.SimpleNamespace(active=device))
    kernel = FakeAutotuner()
    return kernel, flash_triton.CachedLaunch(kernel)


@launches_kernels
def test_compiled_launches_pass_the_launcher_what_triton_s_jit_passes(monkeypatch):
    # The GPU path, with a stand-in for the compiled kernel: later launches call its launcher with the grid, the
    # current stream, the function and metadata, no hooks, and every argument in the kernel's order.
    kernel, launch = on_a_fake_gpu(monkeypatch)
    x, y = torch.zeros(4), torch.zeros(4)
    for _ in range(3):
        launch(
            ("key",),
            lambda meta: (meta["N"] // meta["BLOCK"], 2),
            (x, y),
            lambda: {"N": 64, "scale": 0.5, "D": 16},
        )
    assert len(kernel.calls) == 1 and kernel.calls[0][2] == (2, 2)  # the first launch went through Triton
    args = (2, 2, 1, 77, 1234, ("packed",), None, None, None, x, y, 64, 0.5, 16, 32)
    assert kernel.compiled.launches == [args, args]

    def hook(metadata):
        pass

    flash_triton.triton.knobs.runtime.launch_enter_hook.add(hook)  # a profiler's hook gets its metadata
    try:
        launch(("key",), None, (x, y), None)
    finally:
        flash_triton.triton.knobs.runtime.launch_enter_hook.remove(hook)
    metadata, enter = kernel.compiled.launches[-1][6:8]
    assert (
        metadata == {"grid": (2, 2), "stream": 77}
        and enter is flash_triton.triton.knobs.runtime.launch_enter_hook
    )


@launches_kernels
def test_tma_descriptors_are_cached_by_their_base_tensor_s_alignment(monkeypatch):
    # The Hopper tier's leading arguments are TMA descriptors: their base tensor's alignment decides, as a tensor's.
    kernel, launch = on_a_fake_gpu(monkeypatch)
    aligned = types.SimpleNamespace(base=torch.zeros(8))
    shifted = types.SimpleNamespace(base=torch.zeros(9)[1:])
    scalars = lambda: {"N": 64, "scale": 0.5, "D": 16}  # noqa: E731
    for _ in range(2):
        launch(("key",), lambda meta: (1,), (aligned, shifted), scalars)
    assert len(kernel.calls) == 2 and launch.launches == {}  # a misaligned base: through Triton every time
    for _ in range(2):
        launch(("key",), lambda meta: (1,), (aligned, aligned), scalars)
    assert len(kernel.calls) == 3 and len(kernel.compiled.launches) == 1


# ----------------------------------------------------------------------------------------------------------
# Tiers
# ----------------------------------------------------------------------------------------------------------
@launches_kernels
def test_auto_picks_portable_on_cpu():
    q = qkv((2,), 16, 16, 16)[0]
    assert flash_tiers.tier_for(q, True) == "portable"
    assert flash_tiers.tier_for(q, True, "auto") == "portable"


@launches_kernels
def test_forcing_hopper_on_cpu_is_one_clear_error(monkeypatch):
    q, k, v, do = qkv((2,), 16, 16, 16)
    with pytest.raises(flash_tiers.TierUnavailableError, match=r"tier 'hopper' was forced .* cannot run: "):
        flash_tiers.tier_for(q, True, "hopper")
    with pytest.raises(flash_tiers.TierUnavailableError, match=r"'hopper' was forced"):
        flash_attention.flash_attention(q, k, v, tier="hopper")
    monkeypatch.setenv(flash_tiers.ENV, "hopper")
    with pytest.raises(flash_tiers.TierUnavailableError, match=r"'hopper' was forced"):
        FlashAttentionTriton.apply(q, k, v, True)


@launches_kernels
def test_a_missing_hopper_module_is_an_unavailable_tier(monkeypatch):
    monkeypatch.setattr(flash_tiers, "HOPPER_MODULE", "cs336_systems.kernels.no_such_tier")
    q = qkv((2,), 16, 16, 16)[0]
    assert flash_tiers.tier_for(q, True) == "portable"
    with pytest.raises(flash_tiers.TierUnavailableError, match=r"no_such_tier cannot be imported"):
        flash_tiers.tier_for(q, True, "hopper")


@launches_kernels
def test_unknown_tier_names_the_choices(monkeypatch):
    q, k, v, _ = qkv((2,), 16, 16, 16)
    with pytest.raises(ValueError, match=r"one of \('auto', 'hopper', 'portable'\).* got 'fast'"):
        flash_attention.flash_attention(q, k, v, tier="fast")
    monkeypatch.setenv(flash_tiers.ENV, "fast")
    with pytest.raises(ValueError, match=r"CS336_FLASH_TIER.* got 'fast'"):
        flash_tiers.tier_for(q, True)
    with pytest.raises(ValueError, match=r"tier='portable' chooses among the Triton kernels"):
        flash_attention.flash_attention(q, k, v, impl="pytorch", tier="portable")


class FakeHopper(types.ModuleType):
    """A hopper tier that runs the portable kernels and records what it was asked."""

    def __init__(self, supported: bool = True):
        super().__init__(flash_tiers.HOPPER_MODULE)
        self.supported = supported
        self.calls: list[str] = []

    def supports(self, device, dtype, head_dim, is_causal):
        self.calls.append(f"supports {device.type} {dtype} {head_dim} {is_causal}")
        return self.supported

    def forward(self, q, k, v, is_causal, out=None):
        self.calls.append("forward")
        return flash_triton.flash_forward(q, k, v, is_causal, out)

    def backward(self, q, k, v, o, do, lse, is_causal, out=None, rope=None):
        self.calls.append("backward")
        return flash_triton.flash_backward(q, k, v, o, do, lse, is_causal, out, rope)


@pytest.fixture
def hopper(monkeypatch):
    fake = FakeHopper()
    monkeypatch.setitem(sys.modules, flash_tiers.HOPPER_MODULE, fake)
    return fake


@launches_kernels
def test_a_hopper_tier_that_supports_the_inputs_runs_forward_and_backward(hopper):
    q, k, v, do = qkv((2, 3), 33, 33, 16)
    assert flash_tiers.tier_for(q, True) == "hopper"
    got = forward_backward(q, k, v, do, True)
    assert hopper.calls == ["supports cpu torch.float32 16 True", "forward", "backward"]
    expected = forward_backward(q, k, v, do, True, tier="portable")
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert hopper.calls[3:] == []  # forcing portable never asks hopper


@launches_kernels
def test_the_choice_is_cached_per_key(hopper):
    q, k, v, do = qkv((2,), 24, 24, 16)
    for _ in range(3):
        forward_backward(q, k, v, do, True)
    forward_backward(q, k, v, do, False)  # another key: asked again
    forward_backward(q[..., :8], k[..., :8], v[..., :8], do[..., :8], False)  # another head dim
    asked = [call for call in hopper.calls if call.startswith("supports")]
    assert asked == ["supports cpu torch.float32 16 True", "supports cpu torch.float32 16 False",
                     "supports cpu torch.float32 8 False"]  # fmt: skip
    assert hopper.calls.count("forward") == hopper.calls.count("backward") == 5


@launches_kernels
def test_auto_passes_over_a_hopper_tier_that_declines(hopper):
    hopper.supported = False
    q, k, v, do = qkv((2,), 24, 24, 16)
    forward_backward(q, k, v, do, True)
    assert flash_tiers.tier_for(q, True) == "portable"
    assert hopper.calls == ["supports cpu torch.float32 16 True"]
    with pytest.raises(
        flash_tiers.TierUnavailableError, match=r"does not support torch.float32 on cpu at head dim"
    ):
        flash_tiers.tier_for(q, True, "hopper")


@launches_kernels
def test_the_backward_runs_the_tier_of_its_forward(hopper, monkeypatch):
    q, k, v, do = (t.requires_grad_() for t in qkv((2,), 24, 24, 16))
    o = FlashAttentionTriton.apply(q, k, v, True)
    # The choice changes between forward and backward: the saved L came from hopper, so hopper's backward runs.
    monkeypatch.setenv(flash_tiers.ENV, "portable")
    flash_tiers.reset()
    o.backward(do)
    assert hopper.calls == ["supports cpu torch.float32 16 True", "forward", "backward"]


# ----------------------------------------------------------------------------------------------------------
# Eager calls bypass the operators; torch.compile and dispatch modes go through them.
# ----------------------------------------------------------------------------------------------------------
def refuse_operators(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went through a torch.library operator")

    monkeypatch.setattr(flash_attention, "flash_attention_forward", refuse)
    monkeypatch.setattr(flash_attention, "flash_attention_backward", refuse)


@launches_kernels
@pytest.mark.parametrize("batch", [(2,), (1, 2)], ids=["3d", "4d"])
def test_eager_calls_do_not_go_through_the_operators(monkeypatch, batch):
    q, k, v, do = qkv(batch, 33, 33, 16)
    expected = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=True)
    refuse_operators(monkeypatch)
    o, dq, dk, dv = forward_backward(q, k, v, do, True)
    torch.testing.assert_close(o.double(), expected, rtol=1e-5, atol=1e-5)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@launches_kernels
def test_compiled_calls_go_through_the_operators():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    q, k, v, do = (t.requires_grad_() for t in qkv((2,), 33, 33, 16))
    torch.compiler.reset()
    o = torch.compile(FlashAttentionTriton.apply, backend=capture, fullgraph=True)(q, k, v, True)
    o.backward(do)
    code = "\n".join(graphs)
    assert "cs336.flash_attention_forward" in code and "cs336.flash_attention_backward" in code
    torch.compiler.reset()


@launches_kernels
def test_dispatch_modes_see_the_forward_operator():
    # Selective activation checkpointing decides by op under a dispatch mode: our forward must be one it sees.
    q, k, v, _ = (t.requires_grad_() for t in qkv((2,), 20, 20, 16))
    with OpLog() as log:
        FlashAttentionTriton.apply(q, k, v, True)
    assert "cs336.flash_attention_forward.default" in log.names


@pytest.mark.skipif(not TRITON_PREIMPORTED, reason="the tests ran in this process")
def test_launch_tests_in_fresh_process():
    assert_passes_in_fresh_process(__file__)


@launches_kernels
def test_while_recording_every_launch_is_recorded_with_its_tensors():
    from cs336_systems.kernels import flash_replay

    q, k, v, do = qkv((1, 2), 20, 20, 16, seed=5)
    forward_backward(q, k, v, do, True, tier="portable")  # each shape's first launch, through Triton
    with flash_replay.recording() as records:  # on the CPU the backward runs in this thread too
        forward_backward(q, k, v, do, True, tier="portable")
    forward_backward(q, k, v, do, True, tier="portable")
    assert [len(tensors) for _, tensors in records] == [5, 3, 8, 7]  # forward, preprocess, dK dV, dQ
    assert all(isinstance(launch, flash_triton.RecordedLaunch) for launch, _ in records)
    assert not flash_replay.wanted(flash_replay.key(q, k, v, True, "portable"))  # interpreted: no plan


@launches_kernels
def test_a_call_is_recorded_only_where_a_backward_follows(monkeypatch):
    from cs336_systems.kernels import flash_replay

    monkeypatch.setattr(flash_replay, "wanted", lambda key: key not in flash_replay._refused)
    flash_replay.reset()
    q, k, v, _ = qkv((1, 2), 24, 24, 16, seed=6)
    with torch.no_grad():
        flash_attention.flash_attention(q, k, v, True, tier="portable")  # inference: nothing recorded
    assert not flash_replay._refused
    # with gradients it is recorded; interpreted launches have no compiled kernel, so the plan is refused
    with pytest.warns(UserWarning, match="stays on the Python path: a launch went through Triton's dispatch"):
        flash_attention.flash_attention(*(t.requires_grad_() for t in (q, k, v)), True, tier="portable")
    flash_replay.reset()
