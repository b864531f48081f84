"""Our embedding backward (cs336_systems.kernels.embedding) against a float64 sum and against nn.Embedding, in Triton's
CPU interpreter (set before anything imports triton; a fresh process where it came too late)."""

import os

from ..fresh_process import assert_passes_in_fresh_process, triton_imported_compiled

TRITON_PREIMPORTED = triton_imported_compiled()
os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cs336_systems.kernels.embedding import embedding, embedding_backward  # noqa: E402
from cs336_systems.model.transformer import ModelConfig, TransformerLM  # noqa: E402

launches_kernels = pytest.mark.skipif(
    TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process instead"
)
# (vocab, d, ids' shape): repeated ids in a small vocabulary, a width over one program's block of columns and not a
# multiple of it, one token, and ids that all differ
SHAPES = [(11, 37, (3, 41)), (5, 1030, (2, 9)), (7, 16, (1, 1)), (1000, 64, (1, 5))]


@launches_kernels
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_gradient_is_the_float64_sum_rounded_once(shape, dtype, ids_dtype):
    vocab, d, ids_shape = shape
    g = torch.Generator().manual_seed(vocab + d)
    weight = torch.randn(vocab, d, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(vocab, ids_shape, generator=g).to(ids_dtype)
    grad = torch.randn(*ids_shape, d, generator=g).to(dtype)
    out = embedding(ids, weight)
    assert torch.equal(out, F.embedding(ids, weight))
    out.backward(grad)
    expected = torch.zeros(vocab, d, dtype=torch.float64).index_add_(
        0, ids.flatten(), grad.flatten(0, -2).double()
    )
    assert weight.grad.dtype == dtype and weight.grad.shape == (vocab, d)
    if dtype == torch.bfloat16:  # float32 sums of a few bf16 values are exact: one rounding, to the nearest
        assert torch.equal(weight.grad, expected.to(dtype))
    else:
        torch.testing.assert_close(weight.grad.double(), expected, atol=1e-6, rtol=1e-6)


@launches_kernels
@pytest.mark.parametrize("tokens", [64, 61])
def test_a_long_run_of_one_id_sums_the_same_every_time(tokens):
    """Every token the same id (a run over many loop steps, whole or ragged): its row is the sum, twice bit for bit
    the same (no atomics), every other row zero."""
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(tokens, 24, generator=g)
    ids = torch.full((tokens,), 4)
    first = embedding_backward(grad, ids, 9)
    assert torch.equal(first, embedding_backward(grad, ids, 9))
    torch.testing.assert_close(first[4].double(), grad.double().sum(0), atol=1e-5, rtol=1e-6)
    assert torch.equal(first[torch.arange(9) != 4], torch.zeros(8, 24))
    assert torch.equal(first[torch.arange(9) != 4], torch.zeros(8, 24))


@launches_kernels
@pytest.mark.parametrize("compiled", [False, True])
def test_model_with_the_kernel_trains_as_with_nn_embedding(compiled):
    """The same model, the embedding's gradient by our kernel or by nn.Embedding's backward: the loss and every
    gradient agree in float32 (eager, and the whole model compiled)."""
    results = {}
    for backward in ("torch", "triton"):
        torch.manual_seed(0)
        cfg = ModelConfig(
            vocab_size=53,
            context_length=23,
            d_model=32,
            num_layers=2,
            num_heads=2,
            d_ff=40,
            embedding=backward,
        )
        model = TransformerLM(cfg)
        run = torch.compile(model) if compiled else model
        tokens = torch.randint(53, (2, 23), generator=torch.Generator().manual_seed(1))
        loss = F.cross_entropy(run(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        results[backward] = [loss.detach(), *(p.grad for p in model.parameters())]
    for ours, module in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(ours, module, atol=1e-6, rtol=1e-5)


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(
        ValueError, match=r"ids must be int32 or int64.*ids torch.float32, weight of shape \(4, 3\)"
    ):
        embedding(torch.zeros(2), torch.zeros(4, 3))
    with pytest.raises(
        ValueError, match=r"ModelConfig.embedding='cuda'; choose one of \['torch', 'triton'\]"
    ):
        ModelConfig(embedding="cuda")


@pytest.mark.skipif(not TRITON_PREIMPORTED, reason="the kernel tests ran in this process")
def test_kernel_tests_in_fresh_process():
    assert_passes_in_fresh_process(__file__)
