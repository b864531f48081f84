"""cs336_systems.measure.cuda_memory: a snapshot's active-memory timeline and largest allocations (a synthetic snapshot),
reading a dumped one, the counters off CUDA, and (on CUDA) the peaks split at the optimizer step."""

import pickle

import pytest
import torch

from cs336_systems.measure import cuda_memory

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


SYNTHETIC_SNAPSHOT = {
    # 1000 bytes were live before recording; at the end 1000 + 300 + 50 are.
    "segments": [{"device": 0, "blocks": [
        {"size": 1000, "state": "active_allocated"}, {"size": 300, "state": "active_allocated"},
        {"size": 50, "state": "active_allocated"}, {"size": 100, "state": "inactive"},
    ]}],
    "device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 4096, "frames": []},
        {"action": "alloc", "addr": 1, "size": 100, "frames": [_frame("/x/torch/nn/functional.py", 1, "linear")]},
        {"action": "alloc", "addr": 2, "size": 300, "frames": [
            _frame("/x/torch/nn/modules/linear.py", 125, "forward"),
            _frame("/x/src/cs336_systems/model/transformer.py", 150, "forward"),
            _frame("/x/src/cs336_systems/training/workload.py", 70, "loss"),
        ]},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 3, "size": 50, "frames": []},
    ]],
}  # fmt: skip


def test_active_timeline_and_largest_allocations_from_a_snapshot(tmp_path):
    timeline = cuda_memory.active_timeline(SYNTHETIC_SNAPSHOT, 0)
    assert timeline == [1000, 1100, 1400, 1300, 1350]
    top = cuda_memory.largest_allocations(SYNTHETIC_SNAPSHOT, top=2)
    assert [r["size_bytes"] for r in top] == [300, 100]
    assert top[0]["origin"] == "transformer.py:150 forward"
    assert top[0]["stack"] == "transformer.py:150 forward <- workload.py:70 loss"
    assert top[1]["origin"] is None
    png = tmp_path / "timeline.png"
    cuda_memory.plot_timeline(timeline, "synthetic", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="device_traces"):
        cuda_memory.active_timeline(SYNTHETIC_SNAPSHOT, 3)


def test_a_dumped_snapshot_is_read_into_its_peak_its_largest_allocations_and_a_plot(tmp_path):
    path = tmp_path / "memory_x.pickle"
    path.write_bytes(pickle.dumps(SYNTHETIC_SNAPSHOT))
    peak_mib, largest = cuda_memory.read_snapshot(path, torch.device("cpu"), "synthetic", top=1)
    assert peak_mib == 1400 / 2**20
    assert [row["size_bytes"] for row in largest] == [300]
    assert (tmp_path / "memory_x_timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_counters_read_none_off_cuda():
    cpu = torch.device("cpu")
    assert cuda_memory.allocated_mib(cpu) is None and cuda_memory.allocated_mib(cpu, peak=True) is None
    assert cuda_memory.device_index(cpu) == 0
    cuda_memory.reset_peak(cpu)  # a no-op, not an error


@needs_cuda
def test_recorded_peaks_split_a_train_step_at_the_optimizer_step(tmp_path):
    device = torch.device("cuda")
    weight = torch.nn.Parameter(torch.randn(1024, 1024, device=device))
    optimizer = torch.optim.AdamW([weight])

    def step():
        optimizer.zero_grad(set_to_none=True)
        (torch.randn(4096, 1024, device=device) @ weight).square().sum().backward()
        optimizer.step()

    step()  # AdamW's state exists before recording
    snapshot = tmp_path / "step.pickle"
    peaks = cuda_memory.recorded_peaks(step, 2, device, snapshot, optimizer)
    assert snapshot.exists()
    assert (
        peaks["peak_allocated_mib"] >= peaks["start_allocated_mib"] >= 4 * 4
    )  # weight + 2 Adam moments + grad
    assert peaks["peak_allocated_mib"] == max(
        peaks["forward_backward_peak_mib"], peaks["optimizer_step_peak_mib"]
    )
    # The forward/backward holds the (4096 x 1024) activation: 16 MiB more than the optimizer step needs.
    assert peaks["forward_backward_peak_mib"] > peaks["optimizer_step_peak_mib"]
    assert not optimizer._optimizer_step_pre_hooks  # the hooks are removed afterwards
