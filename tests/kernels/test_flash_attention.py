"""FlashAttention-2 (PyTorch and Triton) against plain float64 softmax attention, on fresh random inputs.

The Triton kernels run in Triton's CPU interpreter. Triton fixes interpreted-or-compiled when a kernel (its own
library kernels included) is decorated, so TRITON_INTERPRET=1 must be set before anything imports triton: it is
set here, first. If another test module imported triton earlier, the tests that launch kernels cannot run in
this process; they are then skipped here and run by `test_kernel_tests_in_fresh_process` in a subprocess.
"""

import os

from ..fresh_process import assert_passes_in_fresh_process, triton_imported_compiled

TRITON_PREIMPORTED = triton_imported_compiled()
os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cs336_systems.kernels import flash_triton  # noqa: E402
from cs336_systems.kernels.flash_attention import (  # noqa: E402
    FlashAttentionPyTorch,
    FlashAttentionTriton,
    compiled_backward,
    compiled_on_cuda,
    flash_attention,
    flash_backward_reference,
)

from ..attention_reference import reference, rel_err  # noqa: E402

launches_kernels = pytest.mark.skipif(
    TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process instead"
)
IMPLS = ["pytorch", pytest.param("triton", marks=launches_kernels)]
CLASSES = {"pytorch": FlashAttentionPyTorch, "triton": FlashAttentionTriton}
# Relative error bounds (max abs error / max abs reference). fp32 is tight: the PyTorch version computes in fp32
# and the interpreter's fp32 dot is exact fp32. bf16 rounds P to bf16 before P @ V (by design), O and the
# gradients; dQ and dK also inherit the rounding of O through D = rowsum(O * dO), a cancelling difference:
# over many seeds their errors reach ~2%, O's ~0.8%.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

# (leading batch shape, N_q, N_k, d, is_causal): odd lengths (ragged last tiles), N_q != N_k, a length that is
# a multiple of every interpreter tile (the unmasked EVEN path), and head dims that are not powers of two (the
# kernels pad their tiles to 16, 32, 128 and 256 columns), ragged or not.
CASES = [
    ((), 33, 33, 16, True),
    ((2,), 47, 47, 32, False),
    ((2,), 64, 64, 32, True),
    ((2, 3), 33, 47, 16, False),
    ((2,), 47, 33, 16, False),
    ((2,), 80, 47, 16, True),
    ((1,), 33, 80, 16, True),
    ((1,), 40, 40, 128, True),
    ((1,), 130, 130, 64, True),
    ((2,), 21, 21, 5, True),
    ((1,), 47, 33, 24, False),
    ((1,), 64, 64, 80, True),
    ((1,), 33, 33, 160, True),
]


def case_id(case) -> str:
    batch, n_q, n_k, d, causal = case
    return f"b{'x'.join(map(str, batch)) or '0'}-q{n_q}-k{n_k}-d{d}-{'causal' if causal else 'full'}"


def random_inputs(batch, n_q, n_k, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*batch, n, d, generator=g).to(dtype) for n in (n_q, n_k, n_k))
    do = torch.randn(*batch, n_q, d, generator=g).to(dtype)
    return q, k, v, do


def saved_logsumexp(o: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The one saved tensor of shape (..., N_q); fails unless there is exactly one."""
    matches = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(matches) == 1, [tuple(t.shape) for t in o.grad_fn.saved_tensors]
    return matches[0]


def run_and_compare(impl, batch, n_q, n_k, d, causal, dtype, seed):
    q, k, v, do = random_inputs(batch, n_q, n_k, d, dtype, seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flash_attention(q, k, v, causal, impl=impl)
    lse = saved_logsumexp(o, q).detach().clone()
    o.backward(do)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference(q64, k64, v64, causal)
    o_ref.backward(do.double())

    assert o.shape == q.shape and o.dtype == dtype
    assert lse.dtype == torch.float32
    tol = TOLERANCE[dtype]
    errors = {
        "O": rel_err(o, o_ref),
        "L": rel_err(lse, lse_ref),
        "dQ": rel_err(q.grad, q64.grad),
        "dK": rel_err(k.grad, k64.grad),
        "dV": rel_err(v.grad, v64.grad),
    }
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    bad = {name: err for name, err in errors.items() if not err < tol}
    assert not bad, f"relative errors above {tol}: {bad}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_float64_reference(impl, case, dtype):
    run_and_compare(impl, *case, dtype, seed=CASES.index(case))


@launches_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]], ids=case_id)
def test_triton_with_compiled_backward_matches_reference(case, dtype):
    # On CPU the "compiled" backward runs eagerly: the same math as on CUDA, without the compiler.
    run_and_compare("triton_compiled_backward", *case, dtype, seed=7)


def test_triton_backward_is_one_of_the_named_choices():
    q, k, v = (t.requires_grad_() for t in _qkv())
    with pytest.raises(ValueError, match=r"backward must be one of \['compiled', 'triton'\], got 'cuda'"):
        FlashAttentionTriton.apply(q, k, v, False, "cuda")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_matches_sdpa_on_heads_layout(impl, causal, batch):
    # The model's layout (batch, heads, seq, d_head), here a non-contiguous transpose of (batch, seq, heads, d)
    # (at batch 1 the tiers get it as a (heads, seq, d) view, at batch 2 as a copy), and the leaderboard's
    # o.sum().backward() (an expanded, stride-0 gradient). SDPA's is_causal is top-left aligned like ours.
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(batch, 37, 3, 32, generator=g).transpose(1, 2).requires_grad_() for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    actual = flash_attention(q, k, v, is_causal=causal, impl=impl)
    actual.sum().backward()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    if impl == "triton":  # O in v's order, heads-last: written in place at batch 1, copied in at batch 2
        assert actual.transpose(1, 2).is_contiguous()
    for grad, expected_grad in zip((q.grad, k.grad, v.grad), expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)


@launches_kernels
def test_causal_rows_ignore_future_keys():
    # Changing keys and values after position t must not change outputs at positions <= t.
    q, k, v, _ = random_inputs((1,), 48, 48, 16, torch.float32, seed=3)
    k2, v2 = k.clone(), v.clone()
    k2[:, 30:] += 5.0
    v2[:, 30:] -= 5.0
    for cls in CLASSES.values():
        o1, o2 = cls.apply(q, k, v, True), cls.apply(q, k2, v2, True)
        torch.testing.assert_close(o1[:, :30], o2[:, :30], rtol=0, atol=0)
        assert not torch.allclose(o1[:, 30:], o2[:, 30:])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batch", [(), (2,), (2, 3)], ids=["b0", "b2", "b2x3"])
def test_saves_exactly_one_logsumexp(impl, batch):
    q, k, v, _ = random_inputs(batch, 33, 33, 16, torch.float32, seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = CLASSES[impl].apply(q, k, v, False)
    saved = o.grad_fn.saved_tensors
    assert len(saved) == 5  # L, Q, K, V, O
    lse = saved_logsumexp(o, q)
    assert lse.shape == batch + (33,)
    _, lse_ref = reference(q.detach(), k.detach(), v.detach(), False)
    assert rel_err(lse, lse_ref) < 1e-6


def test_backward_reference_matches_autograd():
    q, k, v, do = random_inputs((2,), 29, 29, 16, torch.float32, seed=9)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64, lse64 = reference(q64, k64, v64, True)
    o64.backward(do.double())
    for fn in (flash_backward_reference, compiled_backward):
        dq, dk, dv = fn(q, k, v, o64.detach().float(), do, lse64.float(), True)
        for actual, expected in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
            assert rel_err(actual, expected) < 1e-5


class FakeCudaTensor:
    device = torch.device("cuda")


def test_compiled_on_cuda_falls_back_to_eager_once_compilation_fails(monkeypatch):
    calls = []
    compiles = []

    def broken_compile(fn):
        compiles.append(fn)

        def compiled(*args):
            raise RuntimeError("inductor: no C++ compiler")

        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    attend = compiled_on_cuda(lambda x: calls.append(x.device.type) or "eager")
    cuda, cpu = FakeCudaTensor(), torch.zeros(1)
    assert attend(cpu) == "eager" and compiles == []  # the CPU runs eagerly, nothing compiled
    with pytest.warns(UserWarning, match=r"failed .*no C\+\+ compiler.*running it eagerly"):
        assert attend(cuda) == "eager"
    assert attend(cuda) == "eager" and len(compiles) == 1  # no second attempt
    assert calls == ["cpu", "cuda", "cuda"]


def test_compiled_on_cuda_does_not_hide_out_of_memory(monkeypatch):
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "compile", lambda fn: out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        compiled_on_cuda(lambda x: x)(FakeCudaTensor())


@pytest.mark.skipif(not TRITON_PREIMPORTED, reason="the kernel tests ran in this process")
def test_kernel_tests_in_fresh_process():
    assert_passes_in_fresh_process(__file__)


# ----------------------------------------------------------------------------------------------------------
# Errors: one clear message naming what is wrong.
# ----------------------------------------------------------------------------------------------------------
def _qkv(n_q=16, n_k=16, d=16, dtype=torch.float32, batch=(2,)):
    return random_inputs(batch, n_q, n_k, d, dtype, seed=0)[:3]


@pytest.mark.parametrize("impl", ["pytorch", "triton"])
def test_rejects_bad_shapes(impl):
    fn = CLASSES[impl].apply
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"head dim d: Q \(2, 16, 16\), K \(2, 16, 32\)"):
        fn(q, torch.randn(2, 16, 32), torch.randn(2, 16, 32), False)
    with pytest.raises(ValueError, match=r"K and V must have the same shape"):
        fn(q, k, torch.randn(2, 17, 16), False)
    with pytest.raises(ValueError, match=r"leading \(batch\) dims"):
        fn(q, torch.randn(3, 16, 16), torch.randn(3, 16, 16), False)
    with pytest.raises(ValueError, match=r"shape \(\.\.\., seq, d\)"):
        fn(torch.randn(16), k, v, False)
    with pytest.raises(ValueError, match=r">= 1"):
        fn(torch.randn(2, 0, 16), k, v, False)


@pytest.mark.parametrize("impl", ["pytorch", "triton"])
def test_rejects_bad_types_and_devices(impl):
    fn = CLASSES[impl].apply
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"share one dtype: Q torch.float32, K torch.bfloat16"):
        fn(q, k.bfloat16(), v, False)
    with pytest.raises(ValueError, match=r"one device: Q cpu, K meta"):
        fn(q, k.to("meta"), v, False)
    with pytest.raises(TypeError, match=r"K must be a torch.Tensor, got list"):
        fn(q, [1.0], v, False)
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got int"):
        fn(q, k, v, 1)


def test_triton_rejects_unsupported_head_dim_and_dtype():
    q, k, v = _qkv(d=257)
    with pytest.raises(
        ValueError,
        match=r"head dim 257 is not supported by the Triton kernels \(they take 1 to 256\): Q \(2, 16, 257\)",
    ):
        FlashAttentionTriton.apply(q, k, v, False)
    q, k, v = _qkv(dtype=torch.float64)
    with pytest.raises(TypeError, match=r"torch.float64 is not supported by the Triton kernels"):
        FlashAttentionTriton.apply(q, k, v, False)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(flash_triton, "INTERPRET", False)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"need CUDA tensors, but Q is on cpu; set TRITON_INTERPRET=1"):
        FlashAttentionTriton.apply(q, k, v, False)


def test_flash_attention_rejects_unknown_impl():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"impl must be one of .* got 'cuda'"):
        flash_attention(q, k, v, impl="cuda")


# ----------------------------------------------------------------------------------------------------------
# Benchmark CLIs: on a machine without CUDA they write skipped rows (and validate flags first).
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the GPU benchmarks")
@launches_kernels
def test_flash_benchmark_checks_our_kernels_in_the_interpreter_without_cuda(tmp_path):
    from cs336_systems.experiments import flash_benchmark

    out = tmp_path / "flash.csv"
    flash_benchmark.main(
        ["--seq-lens", "40", "64", "--d-heads", "16", "--dtypes", "float32", "bfloat16", "--out", str(out)]
    )
    rows = pd.read_csv(out)
    assert len(rows) == 2 * 2 * 2  # dtypes x seq lens x (forward, backward), ours alone, nothing timed
    assert set(rows["impl"]) == {"triton"} and rows["interpreted"].all() and rows["ms"].isna().all()
    assert set(rows["tier"]) == {"portable"}  # the tier that ran, as flash_tiers chose it on the CPU
    assert set(rows["status"]) == {"ok"}, rows[["dtype", "seq_len", "pass", "status", "rel_err"]]
    assert (rows["rel_err"] <= rows["tolerance"]).all()
    assert set(rows["tolerance"]) == {1e-5, 3e-2}
    assert json.loads(out.with_suffix(".json").read_text())["params"]["seq_lens"] == [40, 64]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the GPU benchmarks")
def test_leaderboard_writes_skipped_rows_without_cuda(tmp_path):
    from cs336_systems.experiments import flash_leaderboard as leaderboard

    out = tmp_path / "leaderboard.csv"
    leaderboard.main(
        [
            "--heads",
            "2",
            "--seq-len",
            "256",
            "--d-head",
            "32",
            "--warmup-ms",
            "1",
            "--rep-ms",
            "5",
            "--out",
            str(out),
        ]
    )
    rows = pd.read_csv(out)
    assert set(rows["status"]) == {"skipped"} and set(rows["reason"]) == {"needs CUDA"}
    assert {"triton_compiled", "sdpa_flash", "sdpa_cudnn"} <= set(rows["impl"])
    assert "tier" in rows.columns and rows["tier"].isna().all()  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the GPU benchmarks")
@launches_kernels
def test_flash_benchmark_host_overhead_without_cuda_writes_skipped_rows(tmp_path, capsys):
    from cs336_systems.experiments import flash_benchmark

    out = tmp_path / "host.csv"
    argv = ["--host-overhead", "--seq-lens", "32", "64", "--d-heads", "16", "--dtypes", "float32"]
    flash_benchmark.main([*argv, "--impls", "triton", "triton_op", "sdpa", "--calls", "5", "--out", str(out)])
    rows = pd.read_csv(out)
    assert len(rows) == 2 + 2 * 3 * 2  # two empty-kernel launches; seq lens x impls x (forward, fwd+bwd)
    assert set(rows["status"]) == {"skipped"} and (rows["calls"] == 5).all()
    empty = rows["impl"].str.startswith("empty")
    assert rows[empty]["tier"].isna().all()  # no tier's kernels, only a launch
    tiers = rows[~empty].groupby("impl")["tier"].agg(set).to_dict()
    assert tiers == {"triton": {"portable"}, "triton_op": {"portable"}, "sdpa": {"pytorch"}}
    table = capsys.readouterr().out
    assert "host_us" in table and "triton_op" in table and table.count("skipped") == len(rows)


def fake_do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
    """triton.testing.do_bench needs CUDA; this runs `fn` three times on the CPU and reports 1 ms each."""
    for _ in range(3):
        for t in grad_to_none or []:
            t.grad = None
        fn()
    return [1.0, 1.0, 1.0] if return_mode == "all" else 1.0


@launches_kernels
def test_flash_benchmark_cell_runs_every_pass_on_cpu(monkeypatch):
    # The CUDA code path of one grid cell, on the CPU with a stand-in for do_bench.
    import triton.testing

    from cs336_systems.experiments import flash_benchmark

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    args = flash_benchmark.parse_args(
        ["--seq-lens", "40", "--d-heads", "16", "--dtypes", "float32", "--out", "x"]
    )
    rows = pd.DataFrame(flash_benchmark.run_cell(args, "float32", 16, 40, torch.device("cpu")))
    assert len(rows) == 9 and set(rows["status"]) == {"ok"}, rows[["impl", "pass", "status", "error"]]
    assert (rows["max_abs_diff_vs_sdpa"] < 1e-5).all()
    assert rows.groupby("impl")["tier"].agg(set).to_dict() == {
        "triton": {"portable"}, "pytorch_naive": {"pytorch"}, "sdpa": {"pytorch"}
    }  # fmt: skip


def test_flash_benchmark_rounds_interleave_the_implementations(monkeypatch):
    # --rounds 3: every implementation timed once per round, their order reversed every other round.
    import triton.testing

    from cs336_systems.experiments import flash_benchmark

    called, timed = [], []
    real_attention = flash_benchmark.bench.attention

    def attention(impl, *args, **kwargs):
        attend = real_attention(impl, *args, **kwargs)

        def tagged(q, k, v):
            called.append(impl)
            return attend(q, k, v)

        return tagged

    def recording_do_bench(fn, **kwargs):
        called.clear()
        ms = fake_do_bench(fn, **kwargs)
        timed.append(set(called))
        return ms

    monkeypatch.setattr(triton.testing, "do_bench", recording_do_bench)
    monkeypatch.setattr(flash_benchmark.bench, "attention", attention)
    argv = ["--seq-lens", "24", "--d-heads", "16", "--dtypes", "float32", "--impls", "pytorch_naive", "sdpa"]
    args = flash_benchmark.parse_args([*argv, "--passes", "forward", "--rounds", "3", "--out", "x"])
    rows = pd.DataFrame(flash_benchmark.run_cell(args, "float32", 16, 24, torch.device("cpu")))
    order = ["pytorch_naive", "sdpa", "sdpa", "pytorch_naive", "pytorch_naive", "sdpa"]
    assert list(rows["round"]) == [0, 0, 1, 1, 2, 2] and list(rows["impl"]) == order
    assert timed == [{impl} for impl in order]  # what each measurement ran is what its row names
    assert set(rows["status"]) == {"ok"} and rows["first_call_s"].notna().all()


@launches_kernels
def test_flash_benchmark_many_heads_not_causal_batch_from_tokens(monkeypatch):
    # The grid against PyTorch's attention: heads, batch = tokens / seq_len, no mask; FLOPs of the full square.
    import triton.testing

    from cs336_systems.experiments import flash_benchmark

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    argv = ["--seq-lens", "40", "--d-heads", "16", "--dtypes", "float32", "--heads", "2", "--tokens", "130"]
    args = flash_benchmark.parse_args([*argv, "--no-causal", "--impls", "triton", "sdpa_flash", "--out", "x"])
    rows = pd.DataFrame(flash_benchmark.run_cell(args, "float32", 16, 40, torch.device("cpu"))).set_index(
        "impl"
    )
    assert (rows["batch_size"] == 3).all() and (rows["heads"] == 2).all() and not rows["causal"].any()
    ours = rows.loc["triton"].set_index("pass")
    assert set(ours["status"]) == {"ok"} and (ours["max_abs_diff_vs_sdpa"] < 1e-5).all()
    assert (ours["first_call_s"] > 0).all()
    assert ours.loc["forward", "tflops"] == pytest.approx(3 * 4 * 40**2 * 16 * 2 / 1e-3 / 1e12)
    assert set(rows.loc["sdpa_flash", "status"]) == {"ok"}  # PyTorch has a CPU flash kernel too


@launches_kernels
def test_leaderboard_measurements_run_on_cpu(monkeypatch):
    import triton.testing

    from cs336_systems.experiments import flash_leaderboard as leaderboard

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # Triton kernels compile only for CUDA
    args = leaderboard.parse_args(["--heads", "2", "--seq-len", "40", "--d-head", "16", "--out", "x"])
    rows = pd.DataFrame(leaderboard.measure_all(args, {}, torch.device("cpu"))).set_index(["impl", "pass"])
    ours = rows.loc[["triton_compiled", "triton"]]
    assert set(ours["status"]) == {"ok"}, ours[["status", "error"]]
    assert set(ours["tier"]) == {"portable"}
    assert set(rows.loc[["sdpa_flash", "sdpa_cudnn"], "tier"]) == {"pytorch"}
    assert (ours["max_abs_diff_vs_sdpa"] < 2e-2).all()  # bf16
    fwd_bwd = rows.loc[("triton", "forward_backward")]
    assert fwd_bwd["tflops"] == pytest.approx(3.5 * 4 * 40**2 * 16 * 2 / 2 / 1e-3 / 1e12)
    assert {"sdpa_flash", "sdpa_cudnn"} <= set(rows.index.get_level_values("impl"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--seq-lens", "0", "--d-heads", "16", "--dtypes", "float32"],
        ["--seq-lens", "128", "--d-heads", "300", "--dtypes", "float32"],
        ["--seq-lens", "128", "--d-heads", "16", "--dtypes", "float16"],
        ["--seq-lens", "128", "--d-heads", "16", "--dtypes", "float32", "--rep-ms", "0"],
    ],
)
def test_flash_benchmark_validates_flags(argv, tmp_path):
    from cs336_systems.experiments import flash_benchmark

    with pytest.raises(SystemExit):
        flash_benchmark.main([*argv, "--out", str(tmp_path / "x.csv")])
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize(
    "argv", [["--seq-len", "0"], ["--d-head", "257"], ["--rep-ms", "0"], ["--heads", "-1"]]
)
def test_leaderboard_validates_flags(argv, tmp_path):
    from cs336_systems.experiments import flash_leaderboard as leaderboard

    with pytest.raises(SystemExit):
        leaderboard.main([*argv, "--out", str(tmp_path / "x.csv")])
    assert not (tmp_path / "x.csv").exists()
