"""2026 §3.1 autograd residuals: the saved-tensor recorder, the analytic count against it, and the CLI."""

from __future__ import annotations

import collections
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: flash runs on the CPU

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from cs336_systems.experiments import residuals_benchmark as cli  # noqa: E402
from cs336_systems.kernels import flash_triton  # noqa: E402
from cs336_systems.measure import saved_tensors
from cs336_systems.model.transformer import ModelConfig, RMSNorm, TransformerBlock  # noqa: E402


class Square(nn.Module):
    """x * x saves x twice (one storage); x * w saves the Parameter w; x @ w2^T saves a view of w2."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.w2 = nn.Parameter(torch.ones(d, d))

    def forward(self, x):
        return (x * x * self.w) @ self.w2.t()


def test_recorder_counts_a_storage_once_and_flags_parameters():
    records = saved_tensors.record_saved_tensors(Square(6), torch.randn(4, 6))
    inputs = [r for r in records if r["producer"] == "input"]
    assert len(inputs) == 2 and inputs[1]["alias_of"] == inputs[0]["index"]
    assert [r["counted"] for r in inputs] == [True, False]
    params = [r for r in records if r["is_parameter"]]
    # w itself, and w2^T: a view, not a Parameter object, found by its storage.
    assert sorted((r["shape"], r["is_parameter_object"]) for r in params) == [("6", True), ("6x6", False)]
    assert not any(r["counted"] for r in params)
    total = saved_tensors.totals(records)
    # Counted: x once, x*x (saved by * w) and x*x*w (saved by mm): three 4x6 float32 storages.
    assert total["counted_bytes"] == 3 * 4 * 6 * 4 and total["storages"] == 3
    assert {r["saved_by"] for r in inputs} == {"MulBackward0"}


def _compare(module_name: str, module: nn.Module, batch, seq, d, d_ff=0, heads=1, attention="naive"):
    measured = saved_tensors.record_saved_tensors(module, torch.randn(batch, seq, d))
    analytic = saved_tensors.analytic_residuals(module_name, batch, seq, d, d_ff, heads, attention)

    def key(r):
        return (
            r["module_path"],
            r["saved_by"],
            r["shape"],
            r["dtype"],
            r["is_parameter"],
            r["storage_bytes"],
            r["counted_bytes"],
        )

    assert collections.Counter(map(key, measured)) == collections.Counter(map(key, analytic))
    assert saved_tensors.totals(measured) == saved_tensors.totals(analytic)


@pytest.mark.parametrize("batch, seq, d", [(1, 1, 8), (3, 7, 10), (2, 13, 33)])
def test_analytic_rmsnorm_equals_measured_eager(batch, seq, d):
    _compare("rmsnorm", RMSNorm(d), batch, seq, d)


@pytest.mark.parametrize(
    "batch, seq, d, d_ff, heads", [(1, 5, 12, 20, 2), (3, 7, 24, 36, 3), (2, 9, 20, 44, 5)]
)
def test_analytic_block_equals_measured_eager_naive(batch, seq, d, d_ff, heads):
    cfg = ModelConfig(d_model=d, d_ff=d_ff, num_heads=heads, context_length=seq, num_layers=1)
    _compare("block", TransformerBlock(cfg), batch, seq, d, d_ff, heads)


@pytest.mark.skipif(not flash_triton.INTERPRET, reason="triton was imported before TRITON_INTERPRET=1")
def test_analytic_block_equals_measured_eager_flash():
    cfg = ModelConfig(
        d_model=32, d_ff=40, num_heads=2, context_length=19, num_layers=1, attention="flash_triton"
    )
    _compare("block", TransformerBlock(cfg), 2, 19, 32, 40, 2, "flash_triton")


def test_analytic_naive_block_adds_the_score_matrix_per_head():
    one, two = (
        saved_tensors.totals(saved_tensors.analytic_residuals("block", 2, 8, 16, 32, h))["counted_bytes"]
        for h in (2, 4)
    )
    # Two more heads: two more (T, T) score matrices per batch element in the softmax output, and RoPE's four
    # (T, d_head / 2) tables shrink as d_head halves from 8 to 4.
    assert two - one == 2 * 2 * 8 * 8 * 4 - 4 * 8 * (8 // 2 - 4 // 2) * 4
    with pytest.raises(ValueError, match="no analytic count for attention 'sdpa'"):
        saved_tensors.analytic_residuals("block", 2, 8, 16, 32, 2, "sdpa")


def test_cli_writes_measured_and_analytic_rows(tmp_path):
    out = tmp_path / "saved_tensors.csv"
    cli.main(
        [
            "--size",
            "tiny",
            "--batch-size",
            "2",
            "--context-length",
            "8",
            "--heads",
            "2",
            "--modes",
            "eager",
            "--attention",
            "naive",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    rows = pd.read_csv(out)
    assert set(rows["source"]) == {"measured", "analytic"} and (rows["status"] == "ok").all()
    assert set(zip(rows["module"], rows["attention"], strict=True)) == {
        ("rmsnorm", "none"),
        ("block", "naive"),
    }
    sums = rows.groupby(["module", "source"])["counted_bytes"].sum().unstack()
    assert (sums["measured"] == sums["analytic"]).all()
    assert out.with_suffix(".json").exists()


def test_cli_compiled_rmsnorm_keeps_one_full_size_tensor(tmp_path):
    out = tmp_path / "saved_tensors.csv"
    cli.main(
        [
            "--size",
            "tiny",
            "--batch-size",
            "2",
            "--context-length",
            "8",
            "--heads",
            "2",
            "--modules",
            "rmsnorm",
            "--modes",
            "compiled",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    rows = pd.read_csv(out)
    if (rows["status"] == "skipped").all():
        pytest.skip(f"torch.compile unavailable here: {rows['reason'].iloc[0]}")
    counted = rows[rows["counted"]]
    # The handout's fused RMSNorm: the input and the per-token rsqrt, the weight as a parameter.
    assert sorted(counted["shape"]) == ["2x8x1", "2x8x64"]
    assert rows["is_parameter"].sum() == 1


def test_cli_skips_flash_at_an_unsupported_head_dim(tmp_path):
    out = tmp_path / "saved_tensors.csv"
    # small: d_model 768, so one head is 768 wide, past the kernels' 256
    cli.main(
        [
            "--size",
            "small",
            "--batch-size",
            "2",
            "--context-length",
            "8",
            "--heads",
            "1",
            "--modules",
            "block",
            "--modes",
            "eager",
            "--attention",
            "flash",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    rows = pd.read_csv(out)
    measured = rows[rows["source"] == "measured"]
    assert (
        list(measured["status"]) == ["skipped"]
        and "head dim 768 is not supported" in measured["reason"].iloc[0]
    )
    assert (rows.loc[rows["source"] == "analytic", "status"] == "ok").all()  # the count needs no kernel


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--heads", "3"], "--heads 3: ModelConfig.d_model=64 is not divisible by num_heads=3"),
        (["--heads", "0"], "--heads: must be >= 1"),
        (["--heads", "2", "--modes", "lazy"], "invalid choice: 'lazy'"),
    ],
)
def test_cli_rejects_bad_flags_before_any_work(tmp_path, capsys, flags, message):
    out = tmp_path / "saved_tensors.csv"
    with pytest.raises(SystemExit):
        cli.main(["--size", "tiny", "--context-length", "8", "--out", str(out), *flags])
    assert message in capsys.readouterr().err
    assert not out.exists()
