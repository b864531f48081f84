"""Nsight Compute's raw page as tidy rows (cs336_systems.measure.ncu), and the flash_ncu CLI where it cannot profile.

tests/data/ncu_raw_page.csv is a column subset of a real raw page (`ncu --import ... --csv --page raw
--print-units base`, ncu 2025.3 on an H200) of flash_ncu's workload at 1x4x2048x64: four unit markers, our
forward, our three backward kernels, cuDNN's forward and its three backward kernels."""

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # ncu.py and flash_ncu import triton: let the interpreter be chosen first (see test_flash_attention.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cs336_systems.experiments import flash_ncu  # noqa: E402
from cs336_systems.measure import ncu  # noqa: E402

PAGE = (Path(__file__).parents[1] / "data" / "ncu_raw_page.csv").read_text()
# The page was recorded where only the portable tier ran (the units of a GPU without the Hopper tier).
UNITS = [u for u in flash_ncu.UNITS if u["impl"] != "triton_hopper"]


def test_kernels_are_in_launch_order_without_the_units_row():
    kernels = ncu.kernels(PAGE)
    assert [int(k["ID"]) for k in kernels] == list(range(12))
    assert kernels[1]["Kernel Name"] == "flash_fwd_kernel"
    assert kernels[1]["gpu__time_duration.sum"] == "37,504"  # ns, with a thousands separator


def test_each_kernel_is_credited_to_the_unit_its_marker_opened():
    rows = ncu.credit_to_units(ncu.kernels(PAGE), UNITS)
    assert [(r["impl"], r["pass"], r["kernel"][:26]) for r in rows] == [
        ("triton_portable", "forward", "flash_fwd_kernel"),
        ("triton_portable", "backward", "flash_bwd_preprocess_kerne"),
        ("triton_portable", "backward", "flash_bwd_dkdv_kernel"),
        ("triton_portable", "backward", "flash_bwd_dq_kernel"),
        ("sdpa_cudnn", "forward", "cudnn_generated_fort_nativ"),
        ("sdpa_cudnn", "backward", "void cudnn::compute_dot_do"),
        ("sdpa_cudnn", "backward", "cudnn_generated_fort_nativ"),
        ("sdpa_cudnn", "backward", "void cudnn::convert_dq_to_"),
    ]


def test_kernel_columns_read_base_units_and_rank_stalls():
    forward = ncu.credit_to_units(ncu.kernels(PAGE), UNITS)[0]
    assert forward["duration_ms"] == pytest.approx(0.037504)
    assert forward["tensor_ops"] == 2_214_592_512
    assert forward["tensor_pipe_pct"] == pytest.approx(13.14)
    assert (forward["registers_per_thread"], forward["block_size"], forward["grid_size"]) == (125, 128, 128)
    assert forward["bound"] == "compute"  # SM 7.55 % of peak against memory 6.71 %
    assert (forward["stall_1"], forward["stall_1_cycles"]) == ("long_scoreboard", 2.93)
    assert forward["stall_2_cycles"] <= forward["stall_1_cycles"]


def test_one_unit_can_span_kernels_of_another_library():
    """cuDNN's backward is three kernels here (dO.O, the fused pass, dQ to 16 bits): all credited to it."""
    rows = ncu.credit_to_units(ncu.kernels(PAGE), UNITS)
    backward = [r for r in rows if r["impl"] == "sdpa_cudnn" and r["pass"] == "backward"]
    assert len(backward) == 3 and sum(r["tensor_ops"] > 0 for r in backward) == 1


def test_markers_that_do_not_match_the_units_are_an_error():
    kernels = ncu.kernels(PAGE)
    with pytest.raises(ValueError, match="found 4 unit markers among the profiled kernels, expected 3"):
        ncu.credit_to_units(kernels, UNITS[:3])
    with pytest.raises(ValueError, match="'flash_fwd_kernel' was profiled before the first unit marker"):
        ncu.credit_to_units(kernels[1:] + kernels[:1], UNITS)


@pytest.mark.parametrize(("text", "value"), [("1,234.5", 1234.5), ("0", 0.0), ("n/a", None), ("", None)])
def test_number(text, value):
    assert ncu.number(text) == value


def test_requested_metrics_keep_what_the_gpu_offers():
    assert ncu.requested_metrics(None) == list(ncu.METRICS.values())
    assert ncu.requested_metrics({"gpu__time_duration", "launch__block_size"}) == [
        "gpu__time_duration.sum",
        "launch__block_size",
    ]


def test_command_profiles_only_the_started_ranges_into_the_report(tmp_path):
    cmd = ncu.command(tmp_path / "r.ncu-rep", ["python", "-m", "x"], ["gpu__time_duration.sum"])
    assert cmd[:3] == ["ncu", "--profile-from-start", "off"]
    assert cmd[cmd.index("--export") + 1] == str(tmp_path / "r.ncu-rep")
    assert cmd[cmd.index("--metrics") + 1] == "gpu__time_duration.sum"
    assert cmd[-3:] == ["python", "-m", "x"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shapes", "1x16x16384"], "is not BxHxNxD"),
        (["--shapes", "1x16x16384x320"], "head dim 320 is not supported"),
        (["--shapes", "0x16x16384x64"], "is not BxHxNxD"),
        ([], "give exactly one of --shapes"),
        (["--shapes", "1x2x128x16", "--workload", "1x2x128x16"], "give exactly one of --shapes"),
    ],
)
def test_bad_shapes_fail_at_parse_time_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        flash_ncu.parse_args([*argv, "--out", "x.csv"])
    assert message in capsys.readouterr().err


def test_without_cuda_or_ncu_every_row_says_why(monkeypatch):
    args = flash_ncu.parse_args(["--shapes", "1x2x128x16", "2x4x256x64", "--out", "x.csv"])
    monkeypatch.setattr(flash_ncu.torch.cuda, "is_available", lambda: False)
    rows = flash_ncu.run(args)
    assert len(rows) == 2 * len(flash_ncu.UNITS) and {r["reason"] for r in rows} == {"needs CUDA"}
    assert {(r["batch_size"], r["heads"], r["seq_len"], r["d_head"]) for r in rows} == {
        (1, 2, 128, 16),
        (2, 4, 256, 64),
    }
    monkeypatch.setattr(flash_ncu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash_ncu.shutil, "which", lambda name: None)
    assert {r["reason"] for r in flash_ncu.run(args)} == {"needs Nsight Compute (ncu on the PATH)"}
