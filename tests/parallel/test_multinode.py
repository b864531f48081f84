"""Beyond one machine, simulated: two launchers on this machine, each a "node" of one process, meet at one c10d
rendezvous (as `srun` would start them on two nodes) and train our FSDP to the same parameters as two processes
launched on one node."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from cs336_systems.parallel.launch import first_host, slurm_rendezvous

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.workers.multinode_worker"


def launcher(*flags: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "cs336_systems.parallel.launch",
        "--backend",
        "gloo",
        *flags,
        "--",
        WORKER,
    ]
    # Own session: on failure the whole tree (launcher -> torchrun -> ranks) is killed, no orphan left behind.
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(processes: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output
    return outputs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_fsdp_as_one_node_does(tmp_path: Path):
    one_node = tmp_path / "one_node.pt"
    finish([launcher("--nproc", "2", "--out", str(one_node))])
    two_nodes = tmp_path / "two_nodes.pt"
    rendezvous = ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", uuid.uuid4().hex]
    outputs = finish(
        [launcher("--nnodes", "2", "--nproc", "1", *rendezvous, "--out", str(two_nodes)) for _ in range(2)]
    )
    said = "".join(outputs)
    assert "rank 0 of 2 on node" in said and "rank 1 of 2 on node" in said, said
    assert "on node 0" in said and "on node 1" in said, said
    expected, got = torch.load(one_node), torch.load(two_nodes)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_several_nodes_need_a_rendezvous(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    from cs336_systems.parallel import launch

    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit):
        launch.main(["--nnodes", "2", "--nproc", "1", "--backend", "gloo", "--out", "x.csv", "--", WORKER])
    assert "--nnodes 2 needs --rdzv-endpoint and --rdzv-id, or a SLURM job" in capsys.readouterr().err


def test_the_rendezvous_comes_from_slurm(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", "")  # no scontrol: the node list is read here
    environ = {"SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1", "SLURM_JOB_ID": "123456"}
    assert slurm_rendezvous(environ) == ("gpu07:23456", "123456")
    assert slurm_rendezvous({}) is None
    assert [first_host(s) for s in ("node1", "n[3]", "a-b[001-004],c2")] == ["node1", "n3", "a-b001"]
