"""Our FSDP (cs336_systems.parallel.fsdp) on CPU/gloo through the real launcher: every case of tests/workers/fsdp_worker.py
asserts on every rank against single-process training, under deterministic algorithms with warnings as errors; one
launch per world size runs all the cases asked of it, and each test reads its own cases' results.
The protocol cases run again with each rank's tensors on a GPU where one is present (still gloo), and over NCCL
where there are two."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.parallel.fsdp import reduce_op_for

WORKER = Path(__file__).parents[1].joinpath("workers", "fsdp_worker.py")


def launch(
    nproc: int, *cases: str, device: str = "cpu", backend: str = "gloo", timeout: float = 300
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = {**os.environ, "FSDP_WORKER_DEVICE": device, "FSDP_WORKER_BACKEND": backend}
    return subprocess.run(
        [*command, str(WORKER), *cases], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


# One launch per world size runs every case the tests below ask of it (the launcher and a Python and torch per rank
# are paid once); the worker reports each case as every rank finishes it, and each test checks its own cases.
CASES_AT = {
    1: ["equality", "frozen"],  # 1: nothing is communicated (fsdp.py's own path)
    2: [
        *("equality", "frozen", "compute_dtype", "prefetch", "transformer", "tied", "anomaly"),
        *("units", "partly_used", "bf16", "meta", "protocol", "protocol_low_precision", "exact_transformer"),
        *("lifetime", "gloo_alone", "exact_averaging", "without_weights"),
    ],
    3: [
        *("equality", "frozen", "units", "partly_used", "bf16", "meta", "protocol", "protocol_low_precision"),
        "without_weights",
        *("exact_transformer", "torch_nn_bf16", "exact_refusals"),
    ],
    4: ["equality", "frozen", "protocol", "protocol_low_precision", "exact_transformer", "exact_averaging"],
}


@pytest.fixture(scope="module")
def launched():
    """world size -> the completed launch of CASES_AT[world size] (launched when a test first asks)."""
    runs: dict[int, subprocess.CompletedProcess] = {}

    def at(world_size: int) -> subprocess.CompletedProcess:
        if world_size not in runs:
            runs[world_size] = launch(world_size, *CASES_AT[world_size], timeout=540)
        return runs[world_size]

    return at


def assert_cases_pass(result: subprocess.CompletedProcess, world_size: int, *cases: str) -> None:
    """Each of `cases` passed on every rank of the launch at `world_size`, and the launch ended cleanly."""
    output = result.stdout + result.stderr
    passed = re.findall(rf"^FSDP case (\S+) OK on {world_size} ranks$", result.stdout, re.M)
    launched_cases = CASES_AT[world_size]
    assert all(case in launched_cases for case in cases), cases
    failed = [case for case in cases if case not in passed]
    if failed:
        stopped_at = launched_cases[len(passed)] if len(passed) < len(launched_cases) else "its end"
        pytest.fail(
            f"{failed} did not pass on {world_size} ranks: the launch of {launched_cases} stopped at "
            f"{stopped_at} (exit status {result.returncode}, cases passed before: {passed}):\n{output}"
        )
    if passed == launched_cases:  # else the failing case's own test shows the failure
        assert result.returncode == 0, output
        assert f"FSDP {' '.join(launched_cases)} OK on {world_size} ranks" in result.stdout, output


def test_a_case_that_did_not_pass_fails_its_own_test_and_names_where_the_launch_stopped():
    """The reading of a shared launch: a case passes only on its own line, and a failed launch fails the tests of
    the cases it did not reach (naming the case it stopped at), while the cases before it still pass."""
    cases = CASES_AT[4]
    lines = [f"FSDP case {case} OK on 4 ranks" for case in cases[:2]]
    stopped = subprocess.CompletedProcess([], 1, "\n".join(lines) + "\n", "AssertionError: deliberate")
    assert_cases_pass(stopped, 4, *cases[:2])
    with pytest.raises(pytest.fail.Exception, match=f"(?s)stopped at {cases[2]} .*deliberate"):
        assert_cases_pass(stopped, 4, cases[3])
    with pytest.raises(pytest.fail.Exception, match="did not pass on 3 ranks"):
        assert_cases_pass(stopped, 3, "equality")  # the lines of another world size do not count
    every = [f"FSDP case {case} OK on 4 ranks" for case in cases]
    torn_down = subprocess.CompletedProcess([], 1, "\n".join(every) + "\n", "at exit: deliberate")
    with pytest.raises(AssertionError, match="at exit: deliberate"):
        assert_cases_pass(torn_down, 4, cases[0])  # every case passed, the launch did not end cleanly


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fp32_training_equals_single_process_training(launched, world_size: int):
    assert_cases_pass(launched(world_size), world_size, "equality", "frozen")


def test_compute_dtype_prefetch_rule_our_transformer_tied_weights_and_anomaly_mode(launched):
    cases = ("compute_dtype", "prefetch", "transformer", "tied", "anomaly")
    assert_cases_pass(launched(2), 2, *cases)


@pytest.mark.parametrize("world_size", [2, 3])
def test_block_units_a_partly_used_unit_and_bf16_weights(launched, world_size: int):
    assert_cases_pass(launched(world_size), world_size, "units", "partly_used", "bf16")


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_unit_whose_backward_reads_no_weights_is_gathered_for_its_forward_only(launched, world_size: int):
    assert_cases_pass(launched(world_size), world_size, "without_weights")


def test_grouped_collectives_hold_their_tensors_until_waited_and_go_alone_on_gloo(launched):
    assert_cases_pass(launched(2), 2, "lifetime", "gloo_alone")


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_model_built_on_the_meta_device_starts_from_the_plain_models_weights(launched, world_size: int):
    assert_cases_pass(launched(world_size), world_size, "meta")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_assignments_protocol_bitwise_in_fp32_and_close_in_fp16_and_bf16(launched, world_size: int):
    assert_cases_pass(
        launched(world_size), world_size, "protocol", "protocol_low_precision", "exact_transformer"
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_exact_mode_divides_its_gradients_where_the_reduce_scatter_would_average(launched, world_size: int):
    assert_cases_pass(launched(world_size), world_size, "exact_averaging")


def test_torch_nn_model_under_bf16_compute_and_what_exact_mode_refuses(launched):
    assert_cases_pass(launched(3), 3, "torch_nn_bf16", "exact_refusals")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_protocol_with_cuda_tensors(world_size: int):
    """The same cases with every rank's model and data on a GPU (ranks share GPUs where there are fewer)."""
    result = launch(world_size, "protocol", "protocol_low_precision", "torch_nn_bf16", device="cuda")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"OK on {world_size} ranks" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_the_protocol_over_nccl():
    """The same cases over NCCL, a GPU per rank, where the reduce-scatter averages (ReduceOp.AVG) instead of
    summing for the shards to be divided after, as on gloo."""
    result = launch(2, "protocol", "protocol_low_precision", "torch_nn_bf16", device="cuda", backend="nccl")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK on 2 ranks" in result.stdout


def test_the_reduce_scatter_averages_only_where_the_backend_can_and_the_average_is_asked():
    assert reduce_op_for("nccl", 2.0, 2) == dist.ReduceOp.AVG
    assert reduce_op_for("gloo", 2.0, 2) == dist.ReduceOp.SUM  # gloo has no AVG: divided after
    assert reduce_op_for("nccl", 1.0, 2) == dist.ReduceOp.SUM  # gradient_divide_factor=1: a sum is asked


def logits_gradient(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str, divisor: int = 1
) -> torch.Tensor:
    logits = logits.detach().requires_grad_(True)
    (nn.functional.cross_entropy(logits, labels, reduction=reduction) / divisor).backward()
    return logits.grad


@pytest.mark.parametrize("world_size", [2, 3, 4, 6, 8])
def test_a_per_rank_mean_loss_shares_the_whole_mean_exactly_only_at_a_power_of_two(world_size: int):
    """Why exact mode meets the protocol's per-rank mean bitwise at 2 and 4 ranks but not at 3: before any layer
    of ours runs, each rank's loss gradient carries fl(1/n) for its n sequences and the average then divides by
    the world size, where one process uses fl(1/N). Dividing by a power of two only shifts the exponent, so the
    two agree to the bit; dividing by 3 rounds once more, and no FSDP can recover the single process's bits. A
    loss normalised by the whole batch (its sum / N on every rank, the gradients summed) agrees at any size."""
    torch.manual_seed(0)
    n = 5
    logits, labels = torch.randn(n * world_size, 100), torch.randint(0, 100, (n * world_size,))
    whole = logits_gradient(logits, labels, "mean")
    ranks = [slice(r * n, (r + 1) * n) for r in range(world_size)]
    per_rank_mean = torch.cat([logits_gradient(logits[r], labels[r], "mean") / world_size for r in ranks])
    summed = torch.cat([logits_gradient(logits[r], labels[r], "sum", n * world_size) for r in ranks])
    assert torch.equal(summed, whole)
    power_of_two = world_size & (world_size - 1) == 0
    assert torch.equal(per_rank_mean, whole) == power_of_two
