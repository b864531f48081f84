"""The timeline of one step from a Chrome trace (cs336_systems.measure.timeline), on hand-made traces with the answer
worked out by hand, and on a real trace of a few CPU steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cs336_systems.measure.timeline import (
    kernel_kind,
    outermost,
    record_timeline,
    short_name,
    stream_timeline,
    timeline,
)


def event(cat: str, name: str, ts: float, dur: float, tid: int | str = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_a_cuda_trace_gives_the_last_steps_kernels_by_stream_with_nccl_marked():
    trace = {
        "traceEvents": [
            event("user_annotation", "traced_step_0", 0, 100),
            event("kernel", "ampere_sgemm_128x64_tn", 10, 5, tid=7, stream=7),  # the earlier step: dropped
            event("user_annotation", "traced_step_1", 200, 100),
            event("cpu_op", "aten::mm", 201, 3),  # CPU operators are not kernels
            event(
                "kernel",
                "void at::native::(anonymous namespace)::vectorized<4>(int, float*)",
                210,
                20,
                7,
                stream=7,
            ),
            event(
                "kernel",
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                220,
                40,
                tid=13,
                stream=13,
            ),
            event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 265, 2, tid=7, stream=7),
            event("kernel", "after_the_step", 300, 5, tid=7, stream=7),  # starts where the step ends: dropped
            {"ph": "i", "name": "marker", "ts": 250},
        ]
    }
    rows = timeline(trace, "traced_step_1")
    assert [(r["lane"], r["name"], r["communication"]) for r in rows] == [
        ("stream 7", "at::native::vectorized", False),
        ("stream 13", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", True),
        ("stream 7", "Memcpy DtoD", False),
    ]
    assert [(r["start_ms"], r["end_ms"]) for r in rows] == [(0.01, 0.03), (0.02, 0.06), (0.065, 0.067)]
    with pytest.raises(ValueError, match="0 annotations named 'traced_step_5'"):
        timeline(trace, "traced_step_5")


def test_a_cpu_trace_gives_outermost_operators_and_gloos_collectives_on_worker_threads():
    main, gloo_a, gloo_b = 100, "worker-a", "worker-b"
    trace = {
        "traceEvents": [
            event("user_annotation", "traced_step_0", 1000, 500, tid=main),
            event("user_annotation", "forward", 1001, 100, tid=main),  # an annotation, not an operator
            event("cpu_op", "aten::linear", 1010, 50, tid=main),
            event("cpu_op", "aten::matmul", 1015, 40, tid=main),  # inside aten::linear: not outermost
            event("cpu_op", "c10d::allreduce_", 1200, 10, tid=main),  # the launch of a collective
            event("user_annotation", "gloo:all_reduce", 1205, 60, tid=gloo_b),
            event("user_annotation", "gloo:all_reduce", 1300, 30, tid=gloo_a),
            event("cpu_op", "aten::copy_", 1310, 5, tid=gloo_a),  # a worker's operator: in the worker's lane
            event("cpu_op", "aten::empty", 1320, 5, tid=7),  # a thread without collectives: no lane
            event("cpu_op", "aten::add_", 1400, 20, tid=main),
        ]
    }
    rows = timeline(trace, "traced_step_0")
    assert [(r["lane"], r["name"], r["communication"]) for r in rows] == [
        ("main thread", "aten::linear", False),
        ("main thread", "c10d::allreduce_", True),
        ("thread 2", "gloo:all_reduce", True),  # worker threads numbered in sorted order of their ids
        ("thread 1", "gloo:all_reduce", True),
        ("thread 1", "aten::copy_", False),
        ("main thread", "aten::add_", False),
    ]
    assert rows[0]["start_ms"] == 0.01 and rows[0]["end_ms"] == 0.06


def test_a_cuda_step_gives_kernels_by_kind_and_the_layer_whose_forward_launched_them():
    main = 100
    trace = {
        "traceEvents": [
            event("user_annotation", "traced_step_0", 1000, 1000, tid=main),
            event("user_annotation", "fsdp_layer_0", 1010, 90, tid=main),
            event("user_annotation", "fsdp_layer_1", 1100, 100, tid=main),
            event("user_annotation", "fsdp_layer_x", 1100, 100, tid=main),  # not a layer number: ignored
            event("gpu_user_annotation", "fsdp_layer_0", 1050, 30, tid=7),  # the GPU copy: not a CPU range
            event("cuda_runtime", "cudaMemcpyAsync", 1005, 2, tid=main, correlation=3),  # before any layer
            event("cuda_runtime", "cudaLaunchKernel", 1020, 2, tid=main, correlation=1),
            event("cuda_driver", "cuLaunchKernelEx", 1030, 2, tid=main, correlation=4),
            event("cuda_runtime", "cudaLaunchKernel", 1110, 2, tid=main, correlation=2),
            event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 1010, 5, tid=7, stream=7, correlation=3),
            event(
                "kernel", "ampere_bf16_s16816gemm_bf16_128x64_tn", 1050, 30, tid=7, stream=7, correlation=1
            ),
            event(
                "kernel",
                "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                1040,
                100,
                tid=20,
                stream=20,
                correlation=4,
            ),
            event(
                "kernel",
                "void at::native::vectorized<4>(int, float*)",
                1150,
                20,
                tid=7,
                stream=7,
                correlation=2,
            ),
            event(
                "kernel",
                "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL",
                1300,
                50,
                tid=20,
                stream=20,
                correlation=99,
            ),  # its launch is not in the trace
        ]
    }
    rows = stream_timeline(trace, "traced_step_0", layer_prefix="fsdp_layer_")
    assert [(r["stream"], r["kind"], r["name"], r["layer"]) for r in rows] == [
        (7, "memcpy", "Memcpy HtoD", None),
        (20, "all_gather", "ncclDevKernel_AllGather_RING_LL", 0),
        (7, "compute", "ampere_bf16_s16816gemm_bf16_128x64_tn", 0),
        (7, "compute", "at::native::vectorized", 1),
        (20, "reduce_scatter", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", None),
    ]
    assert [(r["start_ms"], r["end_ms"]) for r in rows][1] == (0.04, 0.14)
    assert [r["layer"] for r in stream_timeline(trace, "traced_step_0")] == [None] * 5  # no prefix: no layers
    assert (
        stream_timeline({"traceEvents": trace["traceEvents"][:2]}, "traced_step_0") == []
    )  # no kernels (CPU)


@pytest.mark.parametrize(
    ("name", "category", "kind"),
    [
        ("ncclKernel_AllReduce_RING_LL_Sum_float", "kernel", "all_reduce"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "kernel", "reduce_scatter"),
        ("ncclDevKernel_SendRecv", "kernel", "communication"),
        ("Memset (Device)", "gpu_memset", "memcpy"),
        ("elementwise_kernel", "kernel", "compute"),
    ],
)
def test_kernel_kind(name: str, category: str, kind: str):
    assert kernel_kind(name, category) == kind


def test_outermost_keeps_what_no_event_of_the_same_thread_contains():
    events = [event("cpu_op", "a", 0, 10), event("cpu_op", "b", 2, 3), event("cpu_op", "c", 10, 1),
              event("cpu_op", "d", 5, 2, tid=2)]  # fmt: skip
    assert [e["name"] for e in outermost(events)] == ["a", "c", "d"]


def test_short_name_drops_return_type_namespace_templates_and_parameters():
    assert short_name("void (anonymous namespace)::softmax_warp<float, 4>(float*, int)") == "softmax_warp"
    assert short_name("aten::mm") == "aten::mm"
    assert short_name("<unnamed>") == "<unnamed>"  # nothing before the first bracket: the name as it is


def test_record_timeline_writes_a_trace_and_returns_the_last_step(tmp_path: Path):
    x = torch.randn(32, 32)
    calls = []

    def step() -> None:
        calls.append(1)
        torch.mm(x, x).relu_()

    path = tmp_path / "traces" / "toy.json"
    rows = record_timeline(step, 3, torch.device("cpu"), path)
    assert len(calls) == 3
    names = [
        a["name"] for a in json.loads(path.read_text())["traceEvents"] if a.get("cat") == "user_annotation"
    ]
    assert {"traced_step_0", "traced_step_1", "traced_step_2"} <= set(names)
    assert [r["name"] for r in rows] == ["aten::mm", "aten::relu_"]  # the last step's outermost operators
    assert {r["lane"] for r in rows} == {"main thread"} and not any(r["communication"] for r in rows)
    # Without a trace path (a peer of the traced rank) the steps run and nothing is written.
    assert record_timeline(step, 2, torch.device("cpu"), None) == [] and len(calls) == 5
