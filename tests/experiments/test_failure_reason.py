"""failure_reason: the one line of a CLI's log that says why it failed (what the pipeline shows for a failed job)."""

import pytest

from cs336_systems.experiments import failure_reason

TRACEBACK = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/src/cs336_systems/experiments/residuals_benchmark.py", line 44, in parse_args
    model_config(args, heads, "naive")
    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
ValueError: ModelConfig.d_model=64 is not divisible by num_heads=3
"""

# What a job under the launcher leaves: the failing rank's traceback (after cs336_systems.parallel.distributed's
# header), then torchrun's own traceback of the rank's failure.
LAUNCHED = """\
[launch] python -m torch.distributed.run --standalone --nproc-per-node=5 -m cs336_systems.experiments.parallelism_checks
[rank 4] failed:
Traceback (most recent call last):
  File "/src/cs336_systems/parallel/distributed.py", line 102, in distributed
    yield ctx
  File "/src/cs336_systems/parallel/ffn_parallel.py", line 42, in _shard
    return t.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()
           ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~^^^^^^^^^^^^^^^^^^^^^^
IndexError: tuple index out of range

W1126 03:18:24.886000 25879 api.py:1028] Sending process 26180 closing signal SIGTERM
E1126 03:18:25.003000 25879 api.py:1002] failed (exitcode: 1) local_rank: 4 (pid: 26184)
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
cs336_systems.experiments.parallelism_checks FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_03:18:25
============================================================
"""


@pytest.mark.parametrize(
    "log, reason",
    [
        (
            "usage: residuals_benchmark.py [-h] --out OUT\n"
            "residuals_benchmark.py: error: --heads 3: ModelConfig.d_model=64 is not divisible by num_heads=3\n",
            "residuals_benchmark.py: error: --heads 3: ModelConfig.d_model=64 is not divisible by num_heads=3",
        ),
        ("some warning\n" + TRACEBACK, "ValueError: ModelConfig.d_model=64 is not divisible by num_heads=3"),
        (LAUNCHED, "[rank 4] IndexError: tuple index out of range"),
        (  # every rank rejects its flags; torchrun then reports the failure
            "usage: x\nddp_benchmark.py: error: argument --steps: must be >= 1, got 0\n" * 2
            + LAUNCHED[LAUNCHED.index("E1126") :],
            "ddp_benchmark.py: error: argument --steps: must be >= 1, got 0",
        ),
        (  # a chain: the last exception, the one raised
            TRACEBACK
            + "\nThe above exception was the direct cause of the following exception:\n\n"
            + 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
            + "RuntimeError: residuals: no block at 3 heads\n",
            "RuntimeError: residuals: no block at 3 heads",
        ),
        (  # torchrun's per-rank prefixes
            "".join(f"[rank0]: {line}\n" for line in TRACEBACK.splitlines()),
            "ValueError: ModelConfig.d_model=64 is not divisible by num_heads=3",
        ),
        ("[launch] ...\nbash: line 1: srun: command not found\n\n", "bash: line 1: srun: command not found"),
        ("", None),
    ],
    ids=[
        "argparse",
        "traceback",
        "launched",
        "launched-argparse",
        "chained",
        "rank-prefixed",
        "no-traceback",
        "empty",
    ],
)
def test_the_line_that_says_why(log, reason):
    assert failure_reason(log) == reason


def test_only_the_failing_ranks_reason_when_torchrun_alone_failed():
    torchrun_only = LAUNCHED[LAUNCHED.index("E1126") :]
    assert (
        failure_reason(torchrun_only) == "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    )


def test_a_real_argparse_error_is_found(capsys: pytest.CaptureFixture):
    from cs336_systems.experiments import residuals_benchmark

    with pytest.raises(SystemExit):
        residuals_benchmark.parse_args(
            ["--size", "tiny", "--context-length", "8", "--heads", "3", "--out", "x"]
        )
    err = capsys.readouterr().err
    assert failure_reason(err).endswith(
        ": error: --heads 3: ModelConfig.d_model=64 is not divisible by num_heads=3"
    )
