"""cs336_systems.measure.profiling: the rows a profiled step gives, kernels attributed to ranges by launch time (fake CUDA
events), attention FLOPs, and the nsys re-run."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import record_function

from cs336_systems.measure import profiling
from cs336_systems.model.transformer import ModelConfig


def _event(name, start, end, device=DeviceType.CPU, id=0, linked=0, annotation=False):
    interval = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, time_range=interval, device_type=device, id=id,
                           linked_correlation_id=linked, is_user_annotation=annotation)  # fmt: skip


def test_cuda_kernels_are_attributed_to_ranges_by_launch_time():
    """Fake CUDA events: backward kernels are launched by ops on another thread and run after the CPU range."""
    cuda = DeviceType.CUDA
    events = [
        _event("forward", 0, 100, annotation=True),
        _event("aten::mm", 10, 20, id=1),
        _event("aten::_softmax", 30, 40, id=2),
        _event("backward", 100, 300, annotation=True),
        _event("aten::mm", 150, 160, id=3),  # autograd thread, inside the backward window
        _event("forward", 50, 400, device=cuda, annotation=True),  # GPU-side annotation: not a kernel
        _event("sm90_xmma_gemm_f32", 60, 160, device=cuda, linked=1),
        _event("softmax_warp_forward", 160, 170, device=cuda, linked=2),
        _event("nvjet_tst_128x64", 310, 350, device=cuda, linked=3),  # runs after the backward range ended
    ]
    ranges = {r["name"]: r for r in profiling.range_rows(events, steps=1, on_cuda=True)}
    assert ranges["forward"]["device_busy_ms_per_step"] == pytest.approx(0.110)
    assert ranges["forward"]["device_span_ms_per_step"] == pytest.approx(0.110)
    assert ranges["backward"]["device_busy_ms_per_step"] == pytest.approx(0.040)
    assert ranges["backward"]["time_ms_per_step"] == pytest.approx(0.040)
    assert ranges["backward"]["cpu_ms_per_step"] == pytest.approx(0.200)
    kernels = {r["name"]: r for r in profiling.kernel_rows(events, steps=2, on_cuda=True)}
    assert set(kernels) == {"sm90_xmma_gemm_f32", "softmax_warp_forward", "nvjet_tst_128x64"}
    assert kernels["sm90_xmma_gemm_f32"]["is_matmul"] and kernels["nvjet_tst_128x64"]["is_matmul"]
    assert not kernels["softmax_warp_forward"]["is_matmul"]
    assert kernels["sm90_xmma_gemm_f32"]["count_per_step"] == 0.5
    assert kernels["sm90_xmma_gemm_f32"]["share"] == pytest.approx(100 / 150)


def test_profile_step_on_cpu_gives_timer_range_and_op_rows_per_step(tmp_path):
    a = torch.randn(32, 32)

    def step():
        with record_function("forward"):
            (a @ a).relu()

    trace = tmp_path / "trace.json"
    rows = profiling.profile_step(step, warmup=1, steps=3, device=torch.device("cpu"), trace=trace)
    by_record = {}
    for row in rows:
        by_record.setdefault(row["record"], {})[row["name"]] = row
    assert (
        set(by_record["python_timer"]) == {"step"}
        and by_record["python_timer"]["step"]["time_ms_per_step"] > 0
    )
    forward = by_record["range"]["forward"]
    assert forward["count_per_step"] == 1 and forward["time_basis"] == "cpu"
    ops = by_record["kernel"]
    assert ops["aten::mm"]["count_per_step"] == 1 and ops["aten::mm"]["is_matmul"]
    assert ops["aten::relu"]["count_per_step"] == 1 and not ops["aten::relu"]["is_matmul"]
    assert sum(op["share"] for op in ops.values()) == pytest.approx(1.0)
    assert any(e.get("name") == "forward" for e in json.loads(trace.read_text())["traceEvents"])


def test_timer_row_summarises_the_timed_steps_in_ms():
    row = profiling.timer_row([0.001, 0.002, 0.006])
    assert row["time_ms_per_step"] == pytest.approx(3.0) and row["median_ms"] == pytest.approx(2.0)
    assert row["std_ms"] == pytest.approx(2.6457513, rel=1e-6)


def test_attention_flops_go_on_the_attention_ranges_only():
    cfg = ModelConfig.from_name("tiny", context_length=16)  # 4 heads of d_head 16
    rows = [
        {"record": "range", "name": "attention/scores", "count_per_step": 2.0},
        {"record": "range", "name": "attention/softmax", "count_per_step": 2.0},
        {"record": "range", "name": "forward", "count_per_step": 1.0},
        {"record": "kernel", "name": "attention/output", "count_per_step": 1.0},
    ]
    flops = [row.get("flops_per_step") for row in profiling.with_attention_flops(rows, cfg, batch_size=2)]
    squares = 2 * 4 * 16**2
    assert flops == [2 * (2 * squares * 16), 2 * (5 * squares), None, None]


def test_without_nsys_on_the_path_nothing_is_rerun(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not profiling.rerun_under_nsys("cs336_systems.experiments.profile_model", [], tmp_path / "nsys_x")
    assert "nsys is not on the PATH" in capsys.readouterr().err
    command = profiling.nsys_command("/bin/nsys", tmp_path / "r", "pkg.mod", ["--a", "1"])
    assert command[:2] == ["/bin/nsys", "profile"] and command[-4:] == ["-m", "pkg.mod", "--a", "1"]
