"""Our RoPE kernels (cs336_systems.kernels.rope) against a float64 rotation and against the model's RotaryEmbedding,
in Triton's CPU interpreter (set before anything imports triton; a fresh process where it came too late)."""

import os

from ..dispatch_log import OpLog
from ..fresh_process import assert_passes_in_fresh_process, triton_imported_compiled

TRITON_PREIMPORTED = triton_imported_compiled()
os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402
import torch  # noqa: E402

from cs336_systems.kernels.rope import rope_qkv  # noqa: E402
from cs336_systems.model.transformer import ModelConfig, RotaryEmbedding, TransformerLM  # noqa: E402

launches_kernels = pytest.mark.skipif(
    TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process instead"
)
# (batch, seq, heads, d_head): odd lengths (a ragged last block of positions), a head dim that is not a power of
# two, the smallest head dim, and more (batch, head) pairs than one program's worth
SHAPES = [(2, 19, 3, 8), (1, 33, 2, 80), (1, 5, 1, 2), (3, 17, 5, 16)]


def reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q and k rotated and v, each (batch, heads, seq, d_head), in float64 from qkv (batch, seq, 3, heads, d_head)."""
    q, k, v = qkv.double().permute(2, 0, 3, 1, 4)
    c, s = cos.double(), sin.double()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)

    return rotate(q), rotate(k), v


def tables(seq: int, d_head: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rope = RotaryEmbedding(d_head, seq + 3, 10_000.0)  # a longer table, sliced as the model slices it
    return rope.cos[:seq].to(dtype), rope.sin[:seq].to(dtype)


@launches_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_backward_match_float64(shape, dtype):
    batch, seq, heads, d_head = shape
    g = torch.Generator().manual_seed(sum(shape))
    qkv = torch.randn(batch, seq, 3, heads, d_head, generator=g).to(dtype).requires_grad_()
    cos, sin = tables(seq, d_head, torch.float32)
    # the kernel rounds the tables to the activations' dtype, as the model does
    ref_qkv = qkv.detach().double().requires_grad_()
    expected = reference(ref_qkv, cos.to(dtype), sin.to(dtype))
    got = rope_qkv(qkv, cos, sin)
    # one rounding of a float32 result to the dtype: half an ulp of values up to ~5
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    for name, a, b in zip("qkv", got, expected, strict=True):
        assert a.shape == (batch, heads, seq, d_head) and a.dtype == dtype, name
        torch.testing.assert_close(a.double(), b, **tol, msg=f"{name} of {shape}")
    # q, k and v are slices of one new tensor in the projection's layout (v heads-last, as the projection's own)
    storage = got[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in got) and storage != qkv.data_ptr()
    assert [t.stride() for t in got] == [qkv[:, :, i].transpose(1, 2).stride() for i in range(3)]
    # k's gradient transposed in memory, as a materialised attention's backward hands it over
    grads = [torch.randn(t.shape, generator=g).to(dtype) for t in got]
    grads[1] = grads[1].transpose(-1, -2).contiguous().transpose(-1, -2)
    torch.autograd.backward(got, grads)
    torch.autograd.backward(expected, [gr.double() for gr in grads])
    assert qkv.grad.shape == qkv.shape and qkv.grad.is_contiguous()
    torch.testing.assert_close(qkv.grad.double(), ref_qkv.grad, **tol)


@launches_kernels
def test_gradient_of_an_unused_output_is_zero():
    qkv = torch.randn(1, 7, 3, 2, 8, requires_grad=True)
    q, k, v = rope_qkv(qkv, *tables(7, 8, torch.float32))
    q.sum().backward()
    assert qkv.grad[:, :, 0].abs().sum() > 0
    assert torch.equal(qkv.grad[:, :, 1:], torch.zeros_like(qkv.grad[:, :, 1:]))


@launches_kernels
@pytest.mark.parametrize("compiled", [False, True])
def test_model_with_the_kernel_trains_as_with_the_module(compiled):
    """The same model, RoPE by our kernel or by RotaryEmbedding: the loss and every gradient agree in float32 (eager
    and each block compiled)."""
    results = {}
    for rope in ("torch", "triton"):
        torch.manual_seed(0)
        cfg = ModelConfig(
            vocab_size=53, context_length=23, d_model=32, num_layers=2, num_heads=2, d_ff=40, rope=rope
        )
        model = TransformerLM(cfg)
        if compiled:
            model.blocks = torch.nn.ModuleList(torch.compile(b) for b in model.blocks)
        tokens = torch.randint(53, (2, 23), generator=torch.Generator().manual_seed(1))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        results[rope] = [loss.detach(), *(p.grad for p in model.parameters())]
    for ours, module in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(ours, module, atol=1e-6, rtol=1e-5)


@launches_kernels
@pytest.mark.parametrize("rope", ["torch", "triton"])
def test_the_output_projection_reads_our_attention_without_a_copy(rope):
    """V a heads-last slice (of the projection, or of our RoPE's output in its layout), O in V's order from our
    attention: the output projection's (batch, seq, d_model) input is a view of O, with no copy between them."""
    for batch in (1, 2):
        cfg = ModelConfig(context_length=11, d_model=32, num_heads=2, attention="flash_triton", rope=rope)
        attention = TransformerLM(cfg).blocks[0].attn
        with OpLog() as ops:
            attention(torch.randn(batch, 11, 32))
        assert "cs336.flash_attention_forward.default" in ops.names
        assert not [name for name in ops.names if "clone" in name or "copy" in name], ops.names


def test_bad_inputs_are_refused_by_name():
    cos, sin = tables(7, 8, torch.float32)
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seq, 3, heads, d_head\).*\(1, 7, 2, 2, 8\)"):
        rope_qkv(torch.zeros(1, 7, 2, 2, 8), cos, sin)
    with pytest.raises(ValueError, match=r"cos and sin must be \(seq, d_head / 2\) = \(6, 4\).*cos \(7, 4\)"):
        rope_qkv(torch.zeros(1, 6, 3, 2, 8), cos, sin)
    with pytest.raises(ValueError, match=r"ModelConfig.rope='cuda'; choose one of \['torch', 'triton'\]"):
        ModelConfig(rope="cuda")


@pytest.mark.skipif(not TRITON_PREIMPORTED, reason="the kernel tests ran in this process")
def test_kernel_tests_in_fresh_process():
    assert_passes_in_fresh_process(__file__)
