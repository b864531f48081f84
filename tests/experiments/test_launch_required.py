"""A CLI that runs as ranks, started without the launcher, says in one line how to start it and exits with status
2, without a traceback."""

import importlib
import os
import subprocess
import sys

import pytest

from cs336_systems.parallel.distributed import _LAUNCHER_VARIABLES

HOW = "python -m cs336_systems.parallel.launch --nproc N --backend gloo|nccl --out X.csv -- "

# CLI -> its required flags
LAUNCHED = {
    "allreduce_benchmark": ["--backend", "gloo"],
    "ddp_benchmark": ["--size", "tiny"],
    "fsdp_benchmark": ["--size", "tiny"],
    "naive_ddp_check": [],
    "parallelism_checks": ["--backend", "gloo"],
    "ring_allreduce_timing": ["--backend", "gloo"],
    "sharding_benchmark": ["--size", "tiny"],
    "train_step_benchmark": ["--num-layers", "1", "--stacks", "ours_fsdp"],  # a sharded stack
}


@pytest.fixture
def not_launched(monkeypatch):
    for name in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", LAUNCHED)
def test_without_the_launcher_one_line_says_how_to_start_it(name, not_launched, tmp_path, capsys):
    module = importlib.import_module(f"cs336_systems.experiments.{name}")
    with pytest.raises(SystemExit) as stopped:
        module.main([*LAUNCHED[name], "--out", str(tmp_path / "x.csv")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert f"{HOW}cs336_systems.experiments.{name} [flags]" in last, err
    assert ": error: " in last and "Traceback" not in err
    assert not (tmp_path / "x.csv").exists()


def test_flag_errors_come_first(not_launched, tmp_path, capsys):
    from cs336_systems.experiments import ddp_benchmark

    with pytest.raises(SystemExit):
        ddp_benchmark.main(["--size", "tiny", "--steps", "0", "--out", str(tmp_path / "x.csv")])
    assert "argument --steps: must be >= 1, got 0" in capsys.readouterr().err


def test_run_as_a_module_it_prints_only_that_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cs336_systems.experiments.ddp_benchmark",
            "--size",
            "xl",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "ddp_benchmark.py: error: runs as the ranks of a process group: start it with "
        f"{HOW}cs336_systems.experiments.ddp_benchmark [flags]"
    ]
