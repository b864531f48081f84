"""Our RoPE and our FlashAttention as one autograd node (cs336_systems.kernels.rope_attention): the same output and
the same gradient of the QKV projection as the two ops apart, to the bit, in Triton's CPU interpreter (set before
anything imports triton; a fresh process where it came too late)."""

import os

from ..fresh_process import assert_passes_in_fresh_process, triton_imported_compiled

TRITON_PREIMPORTED = triton_imported_compiled()
os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402
import torch  # noqa: E402

from cs336_systems.kernels.flash_attention import flash_attention  # noqa: E402
from cs336_systems.kernels.rope import rope_qkv  # noqa: E402
from cs336_systems.kernels.rope_attention import rope_attention  # noqa: E402
from cs336_systems.model.transformer import ModelConfig, RotaryEmbedding, TransformerLM  # noqa: E402

from ..dispatch_log import OpLog  # noqa: E402

launches_kernels = pytest.mark.skipif(
    TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process instead"
)


@launches_kernels
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", [(1, 33, 2, 16), (2, 19, 3, 32)], ids=str)
def test_one_node_computes_what_rope_and_attention_apart_do(shape, causal):
    """(batch, seq, heads, d_head): batch 1 (attention's backward writes the projection's gradient in place) and 2
    (through copies), odd lengths."""
    batch, seq, heads, d_head = shape
    g = torch.Generator().manual_seed(seq)
    qkv = torch.randn(batch, seq, 3, heads, d_head, generator=g, requires_grad=True)
    rope = RotaryEmbedding(d_head, seq + 3, 10_000.0)
    cos, sin = rope.cos[:seq], rope.sin[:seq]
    fused = rope_attention(qkv, cos, sin, is_causal=causal)
    apart = flash_attention(*rope_qkv(qkv, cos, sin), is_causal=causal)
    do = torch.randn(fused.shape, generator=g)
    (fused_grad,) = torch.autograd.grad(fused, qkv, do)
    (apart_grad,) = torch.autograd.grad(apart, qkv, do)
    assert torch.equal(fused, apart) and fused.stride() == apart.stride()  # O heads-last, in V's order
    assert torch.equal(fused_grad, apart_grad) and fused_grad.shape == qkv.shape


@launches_kernels
def test_the_model_runs_one_backward_op_for_rope_and_attention():
    """With our RoPE and our attention the block's backward is one op that returns the projection's gradient, not
    attention's backward and then RoPE's."""
    cfg = ModelConfig(context_length=11, d_model=32, num_heads=2, attention="flash_triton", rope="triton")
    attention = TransformerLM(cfg).blocks[0].attn
    out = attention(torch.randn(1, 11, 32))
    with OpLog() as ops:
        out.sum().backward()
    assert "cs336.rope_attention_backward.default" in ops.names
    assert not [
        name for name in ops.names if "flash_attention_backward" in name or "rope_qkv_backward" in name
    ]


def test_bad_inputs_are_refused_by_name():
    rope = RotaryEmbedding(8, 7, 10_000.0)
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seq, 3, heads, d_head\).*\(1, 7, 2, 2, 8\)"):
        rope_attention(torch.zeros(1, 7, 2, 2, 8), rope.cos, rope.sin)


@pytest.mark.skipif(not TRITON_PREIMPORTED, reason="the kernel tests ran in this process")
def test_kernel_tests_in_fresh_process():
    assert_passes_in_fresh_process(__file__)
