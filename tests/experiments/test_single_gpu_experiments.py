"""The single-GPU experiment CLIs on CPU at tiny sizes: profiler, mixed precision, memory profile, attention.

Tests that need a GPU (the CUDA paths of the profiler, memory snapshots and attention memory) are marked and run
when the suite runs on a CUDA machine.
"""

import json
import math
import os
import stat
from pathlib import Path

import pandas as pd
import pytest
import torch

from cs336_systems.accounting.attention_memory import naive_attention_memory
from cs336_systems.bench import attention_timing
from cs336_systems.experiments import (
    attention_benchmark,
    memory_profile,
    mixed_precision_benchmark,
    profile_model,
)
from cs336_systems.measure import profiling
from cs336_systems.model.transformer import naive_attention

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TINY_MODEL = ["--size", "tiny", "--batch-size", "2"]  # tiny: d_model 64, 4 heads (d_head 16), 2 layers


# ---------------------------------------------------------------- mixed precision


def test_accumulation_loops_match_the_known_float_results(tmp_path):
    out = tmp_path / "acc.csv"
    mixed_precision_benchmark.main(["accumulation", "--out", str(out)])
    rows = pd.read_csv(out).set_index("variant")
    assert list(rows.index) == [1, 2, 3, 4]
    # float32 sum of float32(0.01); float16 sum drifts low; float16(0.01) = 0.010002136... summed in float32.
    assert rows.loc[1, "value"] == pytest.approx(10.0001, abs=1e-4)
    assert rows.loc[2, "value"] == pytest.approx(9.9531, abs=1e-4)
    assert rows.loc[3, "value"] == pytest.approx(10.0021, abs=1e-4)
    assert rows.loc[4, "value"] == rows.loc[3, "value"]
    assert list(rows["result_dtype"]) == ["float32", "float16", "float32", "float32"]
    assert (rows["abs_error"] - (rows["value"] - 10.0).abs()).abs().max() < 1e-12
    assert rows.loc[2, "abs_error"] > 100 * rows.loc[1, "abs_error"]


# Autocast rules (float16, float32 parameters). CUDA runs layer_norm in float32; CPU autocast has no float32 rule
# for layer_norm, so LayerNorm keeps its float16 input's dtype there. Loss: cross_entropy's log_softmax/nll_loss
# run in float32 on both; gradients take the dtype of the float32 parameters.
AUTOCAST_FP16_RULES = {
    "cuda": {"parameters": "float32", "fc1 output": "float16", "layernorm output": "float32",
             "logits": "float16", "loss": "float32", "gradients": "float32"},
    "cpu": {"parameters": "float32", "fc1 output": "float16", "layernorm output": "float16",
            "logits": "float16", "loss": "float32", "gradients": "float32"},
}  # fmt: skip


def _observed_dtypes(tmp_path: Path, device: str, dtypes: list[str]) -> pd.DataFrame:
    out = tmp_path / "dtypes.csv"
    mixed_precision_benchmark.main(
        ["autocast-dtypes", "--device", device, "--dtypes", *dtypes, "--out", str(out)]
    )
    return pd.read_csv(out)


def test_autocast_dtypes_follow_the_cpu_autocast_rules(tmp_path):
    rows = _observed_dtypes(tmp_path, "cpu", ["float16", "bfloat16"])
    assert set(rows["device"]) == {"cpu"}
    fp16 = rows[rows["autocast_dtype"] == "float16"].set_index("quantity")["dtype"].to_dict()
    assert fp16 == AUTOCAST_FP16_RULES["cpu"]
    bf16 = rows[rows["autocast_dtype"] == "bfloat16"].set_index("quantity")["dtype"].to_dict()
    assert bf16 == {k: v.replace("float16", "bfloat16") for k, v in AUTOCAST_FP16_RULES["cpu"].items()}


@needs_cuda
def test_autocast_dtypes_follow_the_cuda_autocast_rules(tmp_path):
    rows = _observed_dtypes(tmp_path, "cuda", ["float16"])
    assert rows.set_index("quantity")["dtype"].to_dict() == AUTOCAST_FP16_RULES["cuda"]


# ---------------------------------------------------------------- profiler


def test_profile_rows_hold_timer_ranges_matmul_ops_and_attention_flops(tmp_path):
    out, traces = tmp_path / "profile.csv", tmp_path / "traces"
    profile_model.main([
        *TINY_MODEL, "--context-lengths", "16", "--warmup", "1", "--steps", "2", "--device", "cpu",
        "--trace-dir", str(traces), "--out", str(out),
    ])  # fmt: skip
    rows = pd.read_csv(out)
    assert (rows["status"] == "ok").all()
    assert set(rows["mode"]) == {"forward", "forward_backward", "train_step"}
    for mode, cell in rows.groupby("mode"):
        timer = cell[cell["record"] == "python_timer"]
        ranges = cell[cell["record"] == "range"].set_index("name")
        kernels = cell[cell["record"] == "kernel"]
        assert len(timer) == 1 and timer["time_ms_per_step"].iloc[0] > 0
        assert ranges.loc["forward", "count_per_step"] == 1 and ranges.loc["forward", "time_ms_per_step"] > 0
        # The forward range lies inside the timed step.
        assert ranges.loc["forward", "time_ms_per_step"] <= timer["time_ms_per_step"].iloc[0] * 1.01
        assert ranges.loc["attention/softmax", "count_per_step"] == 2  # one per layer
        matmuls = set(kernels.loc[kernels["is_matmul"], "name"])
        assert {"aten::mm", "aten::bmm"} <= matmuls
        assert not kernels.loc[kernels["name"] == "aten::_softmax", "is_matmul"].any()
        assert kernels["share"].sum() == pytest.approx(1.0)
        assert kernels["name"].str.startswith("aten::").all()
        assert ("backward" in ranges.index) == (mode != "forward")
        assert ("optimizer_step" in ranges.index) == (mode == "train_step")
        # FLOPs per step = per call (B=2, H=4, S=16, d_head=16) times the 2 layers.
        squares = 2 * 4 * 16**2
        assert ranges.loc["attention/scores", "flops_per_step"] == 2 * (2 * squares * 16)
        assert ranges.loc["attention/softmax", "flops_per_step"] == 2 * (5 * squares)
        assert ranges.loc["attention/output", "flops_per_step"] == 2 * (2 * squares * 16)
    # A forward pass runs 2 layers x (qkv, out, w1, w2, w3) + lm_head = 11 matrix products, backward twice that.
    forward_mm = rows[(rows["mode"] == "forward") & (rows["name"] == "aten::mm")]["count_per_step"].iloc[0]
    train_mm = rows[(rows["mode"] == "train_step") & (rows["name"] == "aten::mm")]["count_per_step"].iloc[0]
    assert forward_mm == 11 and train_mm == 33
    for mode in ("forward", "forward_backward", "train_step"):
        trace = json.loads((traces / f"trace_tiny_16_{mode}.json").read_text())
        assert any(e.get("name") == "forward" for e in trace["traceEvents"])


def test_profile_out_of_memory_becomes_an_oom_row(tmp_path, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(profile_model.workload, "build", no_memory)
    out = tmp_path / "profile.csv"
    profile_model.main([*TINY_MODEL, "--context-lengths", "16", "--modes", "forward", "--out", str(out)])
    rows = pd.read_csv(out)
    assert list(rows["status"]) == ["OOM"] and list(rows["record"]) == ["status"]


def test_nsys_flag_reexecutes_under_nsys_when_it_is_on_the_path(tmp_path, monkeypatch):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    nsys = fake_bin / "nsys"
    # A stand-in for nsys: record its arguments, drop its own options and run the application.
    nsys.write_text(
        '#!/bin/sh\necho "$@" > "$(dirname "$0")/args.txt"\n'
        'while [ "$1" = profile ] || case "$1" in --*) true;; *) false;; esac; do shift; done\nexec "$@"\n'
    )
    nsys.chmod(nsys.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(profiling.UNDER_NSYS, raising=False)
    out = tmp_path / "profile.csv"
    profile_model.main([
        *TINY_MODEL, "--context-lengths", "8", "--modes", "forward", "--warmup", "0", "--steps", "1",
        "--device", "cpu", "--nsys", "--trace-dir", str(tmp_path / "traces"), "--out", str(out),
    ])  # fmt: skip
    args = (fake_bin / "args.txt").read_text().split()
    assert args[0] == "profile" and f"--output={tmp_path / 'traces' / 'nsys_tiny'}" in args
    assert json.loads(out.with_suffix(".json").read_text())["params"]["under_nsys"] is True
    assert (pd.read_csv(out)["status"] == "ok").all()


@needs_cuda
def test_profile_on_cuda_finds_gemm_kernels_and_backward_device_time(tmp_path):
    out = tmp_path / "profile.csv"
    profile_model.main([*TINY_MODEL, "--context-lengths", "64", "--warmup", "2", "--steps", "2", "--device",
                        "cuda", "--out", str(out)])  # fmt: skip
    rows = pd.read_csv(out)
    kernels = rows[rows["record"] == "kernel"]
    assert kernels["is_matmul"].any() and (~kernels["is_matmul"]).any()
    ranges = rows[(rows["record"] == "range") & (rows["mode"] == "train_step")].set_index("name")
    for name in ("forward", "backward", "optimizer_step", "attention/softmax"):
        assert ranges.loc[name, "device_busy_ms_per_step"] > 0, name
    timer = rows[(rows["record"] == "python_timer") & (rows["mode"] == "forward")]["time_ms_per_step"].iloc[0]
    forward = rows[(rows["record"] == "range") & (rows["mode"] == "forward") & (rows["name"] == "forward")]
    assert forward["device_span_ms_per_step"].iloc[0] <= timer


# ---------------------------------------------------------------- memory profile


def test_memory_profile_without_cuda_writes_skipped_rows_and_the_residual_size(tmp_path):
    out = tmp_path / "memory.csv"
    memory_profile.main([
        *TINY_MODEL, "--context-lengths", "16", "128", "--device", "cpu",
        "--snapshot-dir", str(tmp_path / "snapshots"), "--out", str(out),
    ])  # fmt: skip
    rows = pd.read_csv(out)
    peak = rows[rows["record"] == "peak"]
    assert len(peak) == 2 * 2 * 2  # contexts x modes x precisions
    assert (peak["status"] == "skipped").all() and (peak["reason"] == "needs CUDA").all()
    residual = rows[rows["record"] == "residual_activation"].set_index("context_length")
    assert residual.loc[128, "bytes"] == 2 * 128 * 64 * 4
    assert residual.loc[128, "mib"] == pytest.approx(2 * 128 * 64 * 4 / 2**20)
    allocations = pd.read_csv(tmp_path / "memory_largest_allocations.csv")
    assert list(allocations["status"]) == ["skipped"]


@needs_cuda
def test_memory_profile_on_cuda_writes_snapshots_timelines_and_peaks(tmp_path):
    out, snapshots = tmp_path / "memory.csv", tmp_path / "snapshots"
    memory_profile.main([*TINY_MODEL, "--context-lengths", "64", "--device", "cuda", "--snapshot-dir",
                         str(snapshots), "--out", str(out)])  # fmt: skip
    peak = pd.read_csv(out).query("record == 'peak'")
    assert (peak["status"] == "ok").all()
    assert (peak["peak_allocated_mib"] >= peak["start_allocated_mib"]).all()
    # The rebuilt timeline peaks where the allocator's own peak counter does.
    assert (
        (peak["timeline_peak_mib"] - peak["peak_allocated_mib"]).abs()
        <= 1 + 0.01 * peak["peak_allocated_mib"]
    ).all()
    for name in peak["snapshot"]:
        assert (snapshots / name).exists() and (snapshots / name.replace(".pickle", "_timeline.png")).exists()
    allocations = pd.read_csv(tmp_path / "memory_largest_allocations.csv")
    assert allocations["origin"].notna().any()


# ---------------------------------------------------------------- attention


def test_attention_benchmark_writes_timed_passes_per_cell(tmp_path):
    out = tmp_path / "attention.csv"
    attention_benchmark.main([
        "--batch-size", "2", "--head-dims", "4", "8", "--seq-lens", "8", "16", "--warmup", "1", "--passes", "3",
        "--device", "cpu", "--out", str(out),
    ])  # fmt: skip
    rows = pd.read_csv(out)
    assert len(rows) == 2 * 2 * 2 * 3  # d x seq x phase x passes
    assert (rows["status"] == "ok").all() and (rows["time_ms"] > 0).all()
    assert set(rows["variant"]) == {"eager"} and set(rows["phase"]) == {"forward", "backward"}
    assert rows["mem_before_backward_mib"].isna().all()  # CPU: no allocator counters
    cell = rows[(rows["d"] == 8) & (rows["seq_len"] == 16)].iloc[0]
    expected = naive_attention_memory(2, 16, 8, 4)["before_backward"] / 2**20
    assert cell["formula_before_backward_mib"] == pytest.approx(expected)


def test_compiled_attention_matches_float64_reference_and_runs_in_the_benchmark(tmp_path):
    q, k, v = (torch.randn(2, 16, 8, dtype=torch.float64) for _ in range(3))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(
        torch.ones(16, 16).triu(1).bool(), -math.inf
    )
    reference = torch.softmax(scores, dim=-1) @ v
    compiled = attention_timing.attention_variant("compiled")
    torch.testing.assert_close(
        compiled(q.float(), k.float(), v.float()), reference.float(), rtol=1e-5, atol=1e-5
    )
    out = tmp_path / "attention.csv"
    attention_benchmark.main([
        "--batch-size", "2", "--head-dims", "8", "--seq-lens", "16", "--warmup", "1", "--passes", "2",
        "--variants", "eager", "compiled", "--device", "cpu", "--out", str(out),
    ])  # fmt: skip
    rows = pd.read_csv(out)
    assert rows.groupby(["variant", "phase"]).size().to_dict() == {
        ("compiled", "backward"): 2, ("compiled", "forward"): 2, ("eager", "backward"): 2, ("eager", "forward"): 2,
    }  # fmt: skip


def test_attention_out_of_memory_in_backward_keeps_forward_rows(tmp_path, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(attention_timing, "time_backward", no_memory)
    out = tmp_path / "attention.csv"
    attention_benchmark.main(["--batch-size", "1", "--head-dims", "4", "--seq-lens", "8", "--warmup", "0",
                              "--passes", "2", "--device", "cpu", "--out", str(out)])  # fmt: skip
    rows = pd.read_csv(out)
    assert list(rows["phase"]) == ["forward", "forward", "backward"]
    assert list(rows["status"]) == ["ok", "ok", "OOM"]


@pytest.mark.parametrize(
    "cli, flags, message",
    [
        (attention_benchmark, ["--seq-lens", "0"], "argument --seq-lens: must be >= 1, got 0"),
        (attention_benchmark, ["--passes", "0"], "argument --passes: must be >= 1, got 0"),
        (attention_benchmark, ["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
        (profile_model, [*TINY_MODEL, "--context-lengths", "0"], "argument --context-lengths: must be >= 1"),
        (
            profile_model,
            [*TINY_MODEL, "--context-lengths", "8", "--steps", "0"],
            "argument --steps: must be >= 1",
        ),
        (
            memory_profile,
            [*TINY_MODEL, "--context-lengths", "8", "--top", "0"],
            "argument --top: must be >= 1",
        ),
        (
            memory_profile,
            [*TINY_MODEL, "--context-lengths", "8"],
            "the following arguments are required: --snap",
        ),
        (
            mixed_precision_benchmark,
            ["autocast-dtypes", "--device", "gpu0"],
            "argument --device: 'gpu0' is not a device",
        ),
        (mixed_precision_benchmark, ["rounding"], "argument command: invalid choice: 'rounding'"),
    ],
)
def test_bad_flags_fail_before_any_work(cli, flags, message, tmp_path, capsys):
    out = tmp_path / "x.csv"
    with pytest.raises(SystemExit):
        cli.main([*flags, "--out", str(out)])
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("batch", "seq", "d", "dtype"),
    [(2, 16, 8, torch.float32), (3, 24, 16, torch.float64), (1, 40, 4, torch.bfloat16)],
)
def test_attention_memory_formula_matches_saved_tensors_and_live_memory(batch, seq, d, dtype):
    """Count the bytes autograd saves for backward (unique storages) and everything live before backward."""
    q, k, v = (torch.randn(batch, seq, d, dtype=dtype, requires_grad=True) for _ in range(3))
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = naive_attention(q, k, v)
    grad_out = torch.randn_like(out)
    formula = naive_attention_memory(batch, seq, d, dtype.itemsize)
    assert sum(saved.values()) == formula["saved_for_backward"]
    live = dict(saved)
    for tensor in (q, k, v, out, grad_out):
        live[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    assert sum(live.values()) == formula["before_backward"]


def test_attention_memory_formula_sizes_and_errors():
    terms = naive_attention_memory(8, 16384, 16, 4)
    assert terms["softmax_output"] == 8 * 2**30  # 8 x 16384^2 x 4 bytes = 8 GiB
    assert terms["mask"] == 2**28
    with pytest.raises(ValueError, match="seq"):
        naive_attention_memory(8, 0, 16)


@needs_cuda
def test_attention_memory_before_backward_matches_the_formula_on_cuda(tmp_path):
    out = tmp_path / "attention.csv"
    attention_benchmark.main(["--batch-size", "4", "--head-dims", "64", "--seq-lens", "1024", "--warmup", "1",
                              "--passes", "2", "--device", "cuda", "--out", str(out)])  # fmt: skip
    row = pd.read_csv(out).iloc[0]
    measured = row["mem_before_backward_mib"] - row["baseline_mib"]
    assert measured == pytest.approx(row["formula_before_backward_mib"], rel=0.02)
