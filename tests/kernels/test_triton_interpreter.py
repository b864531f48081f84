"""The Triton-interpreter patch (cs336_systems.kernels.triton_interpreter) on small kernels that hit its four gaps.

Each check runs in a fresh interpreter-mode process: whether kernels are interpreted is fixed when triton is
imported, and another test module may have imported it compiled.
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    '''
    import sys

    import torch
    import triton
    import triton.language as tl

    from cs336_systems.kernels import triton_interpreter
    assert triton_interpreter.enabled()
    if sys.argv[1] == "patched":
        triton_interpreter.patch()
        from triton.runtime import interpreter

        dot = interpreter.InterpreterBuilder.create_dot
        triton_interpreter.patch()  # a second call changes nothing
        assert interpreter.InterpreterBuilder.create_dot is dot


    @triton.jit
    def prefix_sums(X, Out, N: tl.constexpr):
        """Row i of Out is the sum of X's rows 0..i: a loop bound derived from program_id."""
        row = tl.program_id(0)
        cols = tl.arange(0, N)
        acc = tl.zeros([N], dtype=tl.float32)
        for i in range(0, row + 1):
            acc += tl.load(X + i * N + cols)
        tl.store(Out + row * N + cols, acc)


    @triton.jit
    def matmul(A, B, C, N: tl.constexpr):
        offs = tl.arange(0, N)
        tile = offs[:, None] * N + offs[None, :]
        tl.store(C + tile, tl.dot(tl.load(A + tile), tl.load(B + tile)))


    @triton.jit
    def to_bf16(X, Out, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Out + offs, tl.load(X + offs).to(tl.bfloat16))


    N = 16
    g = torch.Generator().manual_seed(0)
    if sys.argv[2] == "restore":
        names = ("arange", "load", "num_programs", "program_id")
        builtins = {(m, name): getattr(m, name) for m in (tl, tl.core) for name in names}
        from cs336_systems.kernels.flash_attention import flash_attention  # kernels that call @triton.jit helpers

        q, k, v = (torch.randn(1, 2, 20, 16, generator=g, requires_grad=True) for _ in range(3))
        flash_attention(q, k, v, True, tier="portable").sum().backward()
        still_patched = [f"{m.__name__}.{name}" for (m, name), f in builtins.items() if getattr(m, name) is not f]
        assert not still_patched, f"left patched after the launch: {still_patched}"
    elif sys.argv[2] == "round":
        # float32 values between two bf16 neighbours, nearer the larger magnitude, and exact ties (to even)
        x = torch.tensor([1 + 2**-8 + 2**-10, -(1 + 2**-8 + 2**-10), 1 + 2**-8, 1 + 3 * 2**-8] * (N // 4))
        out = torch.empty(N, dtype=torch.bfloat16)
        to_bf16[(1,)](x, out, N=N)
        assert torch.equal(out, x.bfloat16()), (out, x.bfloat16())
    elif sys.argv[2] == "loop":
        x = torch.randn(4, N, generator=g)
        out = torch.empty_like(x)
        prefix_sums[(4,)](x, out, N=N)
        torch.testing.assert_close(out, x.cumsum(0))
    else:
        a, b = (torch.randn(N, N, generator=g).bfloat16() for _ in range(2))
        c = torch.empty(N, N)
        matmul[(1,)](a, b, c, N=N)
        # bf16 x bf16 products are exact in float32: only the order of the sums may differ.
        torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-6, atol=1e-5)
    print("ok")
    '''
)


def run_check(tmp_path, patched: str, check: str) -> subprocess.CompletedProcess:
    script = tmp_path / "check.py"  # a file, not -c: triton.jit reads the kernels' source
    script.write_text(SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, str(script), patched, check], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("check", ["loop", "bf16_dot", "round", "restore"])
def test_patched_interpreter_runs_the_kernels_correctly(tmp_path, check):
    result = run_check(tmp_path, "patched", check)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_unpatched_interpreter_gets_bf16_dot_wrong(tmp_path):
    # The gap the patch covers is real in the pinned Triton; once this fails, upstream has fixed it.
    result = run_check(tmp_path, "unpatched", "bf16_dot")
    assert result.returncode != 0 and "Mismatched elements" in result.stderr, result.stderr[-3000:]


def test_unpatched_interpreter_truncates_to_bf16(tmp_path):
    result = run_check(tmp_path, "unpatched", "round")
    assert result.returncode != 0 and "AssertionError" in result.stderr, result.stderr[-3000:]


def test_enabled_reads_the_environment(monkeypatch):
    from cs336_systems.kernels import triton_interpreter

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_interpreter.enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_interpreter.enabled()
