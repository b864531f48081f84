"""The attention implementations and timed steps of the FlashAttention benchmarks (cs336_systems.bench.flash_variants),
on the CPU with the implementations that need no Triton kernel (the kernels' own tests are test_flash_*.py)."""

import argparse
import os

import torch

if not torch.cuda.is_available():
    # The interpreter must be chosen before triton is imported (see test_flash_attention.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from cs336_systems.bench import flash_variants as bench  # noqa: E402


def qkv(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not-causal"])
@pytest.mark.parametrize("shape", [(1, 2, 9, 16), (2, 9, 16)], ids=["batch-heads", "heads"])
@pytest.mark.parametrize("impl", ["pytorch_naive", "sdpa", "flex", "triton", "triton_portable"])
def test_implementations_are_the_attention_they_name(impl, shape, causal):
    q, k, v = qkv(*shape)
    if impl.startswith("triton"):  # the interpreter's kernels take fp32, not fp64
        q, k, v = (t.detach().float() for t in (q, k, v))
    if impl == "flex":  # FlexAttention has no backward on the CPU, and refuses inputs that need one
        q, k, v = (t.detach() for t in (q, k, v))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    got = bench.attention(impl, shape[-2], torch.device("cpu"), causal)(q, k, v)
    torch.testing.assert_close(
        got, expected, **({"atol": 1e-5, "rtol": 1e-5} if impl.startswith("triton") else {})
    )


def test_sdpa_pinned_to_a_backend_runs_that_backend():
    q, k, v = qkv(2, 9, 16)  # (heads, seq, d), as the leaderboard's inputs
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(bench.sdpa_attention(SDPBackend.MATH)(q, k, v), expected)
    with pytest.raises(RuntimeError, match="No viable backend"):  # no cuDNN on the CPU: pinned means pinned
        bench.sdpa_attention(SDPBackend.CUDNN_ATTENTION)(q, k, v)


def test_unknown_implementation_or_pass_is_an_error():
    with pytest.raises(ValueError, match="unknown attention implementation 'cuda'"):
        bench.attention("cuda", 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="pass must be one of"):
        bench.pass_step(lambda q, k, v: q, "sideways", *qkv(1, 4, 8), None)


@pytest.mark.parametrize("with_gradient", [True, False], ids=["do", "sum"])
def test_pass_steps_compute_the_pass_they_name(with_gradient):
    q, k, v = qkv(1, 1, 9, 16)
    do = torch.randn(1, 1, 9, 16, dtype=torch.float64) if with_gradient else None
    attend = bench.naive_attention(9, torch.device("cpu"))
    o = attend(q, k, v)
    expected = torch.autograd.grad(o, (q, k, v), do if with_gradient else torch.ones_like(o))

    forward = bench.pass_step(attend, "forward", q, k, v, do)
    torch.testing.assert_close(forward(), o)
    assert q.grad is None

    backward = bench.pass_step(attend, "backward", q, k, v, do)
    backward()
    backward()  # the graph of the one forward is kept for every timed call
    for t, grad in zip((q, k, v), expected, strict=True):
        torch.testing.assert_close(t.grad, 2 * grad)
        t.grad = None

    bench.pass_step(attend, "forward_backward", q, k, v, do)()
    for t, grad in zip((q, k, v), expected, strict=True):
        torch.testing.assert_close(t.grad, grad)


def test_failure_columns_name_oom_and_the_first_line(capsys):
    oom = bench.failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate\nmore"), "flash")
    assert oom == {"ms": None, "status": "OOM", "error": "CUDA out of memory. Tried to allocate"}
    unnamed = bench.failure(RuntimeError(""), "flash")
    assert unnamed == {"ms": None, "status": "error", "error": "RuntimeError"}
    assert "[flash]   OOM: CUDA out of memory" in capsys.readouterr().err


def test_flops_follow_the_stated_convention():
    assert bench.forward_flops(40, 16, 2) == 4 * 40**2 * 16 * 2 / 2
    assert bench.forward_flops(40, 16, 2, causal=False) == 4 * 40**2 * 16 * 2
    assert bench.PASS_FLOP_FACTOR == {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5}
    assert "4*N^2*d*heads/2" in bench.FLOP_CONVENTION


def test_do_bench_flags_reject_bad_times():
    p = argparse.ArgumentParser()
    bench.add_do_bench_args(p, warmup_ms=25, rep_ms=100)
    assert vars(p.parse_args([])) == {"warmup_ms": 25, "rep_ms": 100}
    for argv in (["--rep-ms", "0"], ["--warmup-ms", "-1"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)


def test_tier_names_ours_and_not_pytorchs():
    q = torch.randn(1, 8, 16)
    assert bench.tier("sdpa_cudnn", q) == bench.tier("pytorch_naive", q) == bench.PYTORCH_TIER == "pytorch"
    if not torch.cuda.is_available():  # ours run the portable Triton kernels in the interpreter
        assert bench.tier("triton", q) == bench.tier("triton_compiled", q) == "portable"
        assert bench.tier("triton_portable", q) == "portable"
        with pytest.raises(
            RuntimeError, match="'hopper' was forced"
        ):  # a forced tier that cannot run: its row
            bench.tier("triton_hopper", q)  # says why (flash_benchmark catches it per cell)


@pytest.mark.parametrize("impl", ["triton", "triton_op"])
def test_host_steps_are_the_passes_they_name(impl):
    q, k, v = (t.detach().float().requires_grad_() for t in qkv(1, 9, 16))
    do = torch.randn(1, 9, 16)
    attend = bench.attention(impl, 9, torch.device("cpu"))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(bench.host_step(attend, "forward", q, k, v, do)(), expected)
    grads = bench.host_step(attend, "forward_backward", q, k, v, do)()
    expected_grads = torch.autograd.grad(expected, (q, k, v), do)
    torch.testing.assert_close(grads, expected_grads, atol=1e-5, rtol=1e-5)
    assert q.grad is None  # nothing accumulates from call to call
    with pytest.raises(ValueError, match="pass must be one of"):
        bench.host_step(attend, "backward", q, k, v, do)


def test_host_time_counts_calls_and_reports_microseconds_per_call():
    calls = []
    times = bench.host_time_us(lambda: calls.append(1), torch.device("cpu"), calls=7, repeats=3)
    assert len(calls) == 1 + 7 * 3  # one untimed call first (compiling, tuning), then the runs
    assert 0 < times["host_us"] <= times["wall_us"] < 1e5


@pytest.mark.parametrize("name", bench.EMPTY_KERNELS)
def test_empty_kernel_launches_run(name):
    launch = bench.empty_launch(name, torch.device("cpu"))
    for _ in range(3):  # the cached one goes through Triton once, then launches directly
        launch()


def test_host_overhead_table_has_a_line_per_row():
    rows = [
        {"impl": "empty_triton_kernel", "tier": None, "pass": "launch", "host_us": 9.8, "wall_us": 10.1,
         "status": "ok"},
        {"impl": "triton", "tier": "portable", "pass": "forward", "seq_len": 128, "host_us": None,
         "wall_us": None, "status": "skipped"},
    ]  # fmt: skip
    lines = bench.host_overhead_table(rows).splitlines()
    assert len(lines) == 2 + 2 and "host_us" in lines[0]
    assert lines[2].split() == ["empty_triton_kernel", "-", "launch", "-", "9.8", "10.1", "ok"]
    assert lines[3].split() == ["triton", "portable", "forward", "128", "-", "-", "skipped"]
