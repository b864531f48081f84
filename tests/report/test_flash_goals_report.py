"""The Hopper tier's goals table on made-up timings whose verdicts are known."""

import json
import re
from pathlib import Path

from cs336_systems.measure.provenance import write_rows
from cs336_systems.report.context import Context
from cs336_systems.report.sections import flash_goals


def timed(path: Path, rows: list[dict], device: str, params: dict | None = None) -> None:
    """Rows as a GPU run writes them, its provenance naming `device`."""
    write_rows(rows, path, params or {})
    sidecar = path.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    meta["provenance"].update(device_name=device, git_commit="abcdef0123456789", git_dirty=None)
    sidecar.write_text(json.dumps(meta))


def cells(shape, ms: dict[str, dict[str, float]]) -> list[dict]:
    batch, heads, seq, d = shape
    return [
        {
            "impl": impl,
            "batch_size": batch,
            "heads": heads,
            "seq_len": seq,
            "d_head": d,
            "causal": True,
            "pass": p,
            "ms": t,
            "status": "ok",
        }  # fmt: skip
        for impl, by_pass in ms.items()
        for p, t in by_pass.items()
    ]


def rows_of(text: str) -> dict[str, list[str]]:
    """The table's rows by goal: [measured on, measured, bound, result]."""
    lines = [line for line in text.splitlines() if line.startswith("| ")][1:]
    return {cols[0]: cols[1:] for cols in ([c.strip() for c in line.split("|")[1:-1]] for line in lines)}


def test_each_goal_is_judged_on_every_gpu_that_measured_its_shape(tmp_path):
    big, small = (1, 32, 32768, 128), (1, 16, 16384, 64)
    ours = {"forward": 9.1, "backward": 20.0, "forward_backward": 29.0}
    cudnn = {"forward": 10.0, "backward": 20.0, "forward_backward": 30.0}
    timed(
        tmp_path / "flash_goals/1x32x32768x128.csv",
        cells(big, {"triton": ours, "sdpa_cudnn": cudnn}),
        "NVIDIA H200",
    )
    timed(
        tmp_path / "flash_goals/1x16x16384x64.csv",
        cells(small, {"triton": {"forward_backward": 4.6}, "sdpa_cudnn": {"forward_backward": 4.5}}),
        "NVIDIA H200",
    )
    # flash_peers on an H100 holds the small shape among others: judged there too, and against 4.5 ms
    peers = cells(small, {"triton": {"forward_backward": 4.4}, "sdpa_cudnn": {"forward_backward": 4.5}})
    peers += cells(
        (4, 16, 4096, 64), {"triton": {"forward_backward": 9.0}, "sdpa_cudnn": {"forward_backward": 1.0}}
    )
    timed(tmp_path / "flash_peers/causal_d64.csv", peers, "NVIDIA H100 80GB HBM3")

    text = flash_goals.render(Context("gpu", tmp_path, tmp_path / "out"))
    rows = rows_of(text)
    assert rows["1×32×32,768×128 forward: ours ≤ 0.92 × cuDNN"] == [
        "H200, abcdef0123",
        "0.910 × (9.100 against 10.000 ms)",
        "≤ 0.92",
        "pass",
    ]
    assert rows["1×32×32,768×128 backward: ours ≤ 0.92 × cuDNN"][-1] == "FAIL"
    assert rows["1×32×32,768×128 forward + backward: ours ≤ 0.92 × cuDNN"][1].startswith("0.967 ×")
    small = re.findall(
        r"^\| 1×16×16,384×64 forward \+ backward: ours ≤ 1 × cuDNN +\| (\w+).*\| (\w+) +\|$", text, re.M
    )
    assert small == [
        ("H200", "FAIL"),
        ("H100", "pass"),
    ]  # one row per GPU: 4.6 against 4.5 ms, 4.4 against 4.5
    h100 = rows["1×16×16,384×64 forward + backward on an H100"]
    assert h100 == ["H100 80GB HBM3, abcdef0123", "4.400 ms", "≤ 4.5 ms", "pass"]
    assert text.count("on an H100") == 1  # the H200's run is not judged against the H100's bound
    assert "Goals met: 3 of 6 pass; not met:" in text


def test_the_spec_grid_goals_take_the_worst_short_cell_per_dtype_and_the_median_of_all(tmp_path):
    grid = []
    for dtype, ratios in (("bfloat16", {128: 1.2, 256: 0.5, 2048: 3.0}), ("float32", {128: 1.4, 256: 0.5})):
        for seq, ratio in ratios.items():
            for impl, ms in (("triton", ratio), ("sdpa", 1.0)):
                grid.append({"impl": impl, "dtype": dtype, "d_head": 64, "seq_len": seq, "pass": "forward_backward",
                             "ms": ms, "status": "ok"})  # fmt: skip
    timed(
        tmp_path / "flash/benchmark.csv",
        grid,
        "NVIDIA H100",
        {"dtypes": ["bfloat16", "float32"], "d_heads": [64]},
    )
    rows = rows_of(flash_goals.render(Context("gpu", tmp_path, tmp_path / "out")))
    bf16 = next(r for g, r in rows.items() if g.startswith("spec grid, bfloat16, d 64, 128–256 tokens"))
    assert bf16[1:] == [
        "worst 1.20 × (128 tokens: 1.200 against 1.000 ms)",
        "≤ 1.3",
        "pass",
    ]  # no passes apart
    fp32 = next(r for g, r in rows.items() if g.startswith("spec grid, float32"))
    assert fp32[-1] == "FAIL"
    median = next(r for g, r in rows.items() if g.startswith("spec grid, all 5 cells"))
    assert median[1:] == ["1.20", "≤ 1", "FAIL"]  # median of 1.2, 0.5, 3.0, 1.4, 0.5


def test_no_timings_no_verdict(tmp_path):
    text = flash_goals.render(Context("cpu", tmp_path, tmp_path / "out"))
    assert text.startswith("_Not judged in this run")
    checks = [
        {"impl": "triton", "pass": p, "interpreted": True, "status": s}
        for p, s in (("forward", "ok"), ("backward", "mismatch"))
    ]
    write_rows(checks, tmp_path / "flash_goals/1x2x64x16.csv", {})
    text = flash_goals.render(Context("cpu", tmp_path, tmp_path / "out"))
    assert text.endswith("checked in the Triton interpreter: 1 of 2 checks pass.")
