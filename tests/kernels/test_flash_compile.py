"""The Triton FlashAttention as PyTorch operators under torch.compile: opcheck, fake-tensor shapes, a sequence of
shapes through one compiled function (default, dynamic=True, fullgraph=True) checked against float64, and a
compiled Transformer step without graph breaks.

On a machine without CUDA the kernels run in Triton's interpreter at small sizes; with CUDA (run this file
alone, `python -m pytest tests/kernels/test_flash_compile.py`: other test modules switch the interpreter on) they run
compiled on the GPU at the sizes below, with fp16 and longer sequences too.
"""

import os

import torch

from ..fresh_process import triton_imported_compiled

ON_GPU = torch.cuda.is_available()
TRITON_PREIMPORTED = triton_imported_compiled()
if not ON_GPU:
    # The interpreter must be chosen before triton is imported (see test_flash_attention.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from cs336_systems.kernels import flash_triton  # noqa: E402
from cs336_systems.kernels.flash_attention import (  # noqa: E402
    FlashAttentionTriton,
    flash_attention_backward,
    flash_attention_forward,
)
from cs336_systems.model.transformer import ModelConfig, TransformerLM  # noqa: E402

from ..attention_reference import reference, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(
    not ON_GPU and (TRITON_PREIMPORTED or not flash_triton.INTERPRET),
    reason="triton was imported before TRITON_INTERPRET=1: run this file alone",
)
DEVICE = "cuda" if ON_GPU else "cpu"

# (batch, heads, N_q, N_k, d, causal, dtype): odd lengths, N_q != N_k, every head dim on the GPU, one after the
# other through the same compiled function, so that the second and later shapes meet a compiled graph.
if ON_GPU:
    SHAPES = [
        (1, 4, 1024, 1024, 64, True, torch.bfloat16),
        (2, 4, 2048, 2048, 64, True, torch.bfloat16),
        (1, 4, 777, 777, 128, True, torch.bfloat16),
        (2, 3, 333, 517, 32, False, torch.float16),
        (1, 2, 1000, 129, 16, False, torch.float32),
        (3, 2, 129, 1000, 128, True, torch.float16),
        (1, 8, 4097, 4097, 64, True, torch.bfloat16),
        (2, 1, 61, 61, 16, True, torch.float32),
        (1, 2, 1537, 1537, 128, False, torch.float32),
        # head dims that are not powers of two, up to the widest (256-wide tiles, float32 included)
        (1, 2, 1000, 1000, 80, True, torch.bfloat16),
        (2, 2, 515, 515, 160, False, torch.float32),
        (1, 3, 2048, 2048, 96, True, torch.float16),
        (1, 2, 300, 300, 256, True, torch.bfloat16),
        (2, 1, 100, 77, 8, False, torch.float32),
    ]
    # fp32 runs tl.dot in TF32 on the GPU; bf16 and fp16 round P and dS before their matmuls.
    TOLERANCE = {torch.float32: 1e-2, torch.float16: 1e-2, torch.bfloat16: 3e-2}
else:
    SHAPES = [
        (1, 2, 32, 32, 16, True, torch.float32),
        (2, 1, 47, 33, 32, False, torch.float32),
        (1, 2, 33, 47, 16, True, torch.bfloat16),
    ]
    TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
COMPILE_MODES = {"default": {}, "dynamic": {"dynamic": True}, "fullgraph": {"fullgraph": True}}


def inputs(batch, heads, n_q, n_k, d, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    make = lambda n: torch.randn(batch, heads, n, d, generator=g, device=DEVICE).to(dtype)
    return make(n_q), make(n_k), make(n_k), make(n_q)


def test_operators_pass_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch of both operators."""
    q, k, v, do = inputs(1, 2, 20, 37, 16, torch.float32)
    torch.library.opcheck(flash_attention_forward, (q.requires_grad_(), k.requires_grad_(), v, True))
    o, lse = flash_attention_forward(q.detach(), k.detach(), v, True)
    torch.library.opcheck(flash_attention_backward, (q.detach(), k.detach(), v, o, do, lse, True))
    # A forced kernel tier is an argument of both operators (the one tier that runs here: portable).
    torch.library.opcheck(flash_attention_forward, (q, k, v, True, "portable"))
    torch.library.opcheck(flash_attention_backward, (q.detach(), k.detach(), v, o, do, lse, True, "portable"))
    # A heads-last V (contiguous Q, K): O in V's order, the fake implementation's strides the real ones'
    for batch in (1, 2):
        q, k, v, _ = inputs(batch, 3, 20, 20, 16, torch.float32)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
        torch.library.opcheck(flash_attention_forward, (q, k, v, True))
        assert flash_attention_forward(q, k, v, True)[0].stride() == v.stride()


@pytest.mark.parametrize("shape", [(3, 1, 2, 77, 5, 32), (1, 1, 1, 1, 1, 16), (2, 129, 1000, 128)], ids=str)
def test_fake_tensors_get_the_output_shapes_without_running_a_kernel(shape):
    """Shapes for compilation come from the fake implementations: odd lengths, N_q != N_k, any batch dims."""
    *batch, n_q, d = shape
    n_k = n_q + 3
    with FakeTensorMode():
        q = torch.empty(*batch, n_q, d, device=DEVICE)
        k = v = torch.empty(*batch, n_k, d, device=DEVICE)
        o, lse = flash_attention_forward(q, k, v, True)
        dq, dk, dv = flash_attention_backward(q, k, v, o, torch.empty_like(o), lse, True)
    assert (o.shape, o.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, q.shape[:-1], torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert o.is_contiguous() and lse.is_contiguous()


def test_fake_implementation_names_a_bad_shape():
    with FakeTensorMode(), pytest.raises(ValueError, match="same head dim"):
        flash_attention_forward(
            torch.empty(1, 8, 16, device=DEVICE), torch.empty(1, 8, 32, device=DEVICE),
            torch.empty(1, 8, 32, device=DEVICE), False,
        )  # fmt: skip


@pytest.mark.parametrize("mode", COMPILE_MODES)
# Each dtype, causal flag and size-1 dimension is a graph of its own (up to one per shape): above dynamo's
# default limit of 8, `default` would quietly run the rest eagerly and `fullgraph` would fail.
@torch._dynamo.config.patch(recompile_limit=len(SHAPES))
def test_one_compiled_function_runs_a_sequence_of_shapes(mode):
    torch.compiler.reset()
    attention = torch.compile(FlashAttentionTriton.apply, **COMPILE_MODES[mode])
    for batch, heads, n_q, n_k, d, causal, dtype in SHAPES:
        q, k, v, do = inputs(batch, heads, n_q, n_k, d, dtype, seed=n_q + n_k)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o = attention(q, k, v, causal)
        o.backward(do)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        o64, _ = reference(q64, k64, v64, causal)
        o64.backward(do.double())
        errors = {
            name: rel_err(actual, expected)
            for name, actual, expected in [
                ("O", o, o64), ("dQ", q.grad, q64.grad), ("dK", k.grad, k64.grad), ("dV", v.grad, v64.grad)
            ]
        }  # fmt: skip
        bad = {name: err for name, err in errors.items() if not err < TOLERANCE[dtype]}
        assert not bad, f"{mode}, shape {(batch, heads, n_q, n_k, d, causal, dtype)}: errors {bad}"


def test_compiled_transformer_with_flash_attention_has_no_graph_break():
    """One graph for a step's forward and loss (backward is compiled from it) and the same gradients as eager."""
    cfg = ModelConfig(vocab_size=64, context_length=48, d_model=64, num_layers=1, num_heads=4, d_ff=128,
                      attention="flash_triton")  # fmt: skip
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(DEVICE)
    tokens = torch.randint(64, (2, 33), device=DEVICE)  # an odd length, below the context length
    loss_fn = lambda x, y: F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    torch.compiler.reset()
    explanation = torch._dynamo.explain(loss_fn)(tokens[:, :-1], tokens[:, 1:])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1

    loss_fn(tokens[:, :-1], tokens[:, 1:]).backward()
    eager = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.compiler.reset()
    # Inductor's C++ code generation for a whole model takes minutes on a CPU; AOT autograd (which runs the fake
    # implementations and builds the backward graph) is the part that concerns the operators.
    backend = "inductor" if ON_GPU else "aot_eager"
    torch.compile(loss_fn, fullgraph=True, backend=backend)(tokens[:, :-1], tokens[:, 1:]).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, eager[name], rtol=1e-4, atol=1e-5), name
