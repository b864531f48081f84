"""profiles/slurm through snakemake-executor-plugin-slurm, against stand-in SLURM commands.

The stand-ins (sbatch, squeue, sacct, scancel, srun, sinfo, sacctmgr) are one small Python script written into
tmp_path/bin. They answer exactly what the plugin asks (read from its source):
`sbatch --parsable ... --wrap=CMD` prints the job id; `sacct -X --parsable2 --noheader --format=JobIdRaw,State --name RUN` and `squeue
--format=%i|%T --name RUN` print `id|STATE` lines; `sacctmgr` lists the account the profile names; `sinfo` the
partitions. sbatch records its full argument list and runs the job script (which starts Snakemake's jobstep
executor, which calls srun) to completion before it answers, so at most the plugin's two submission threads run
jobs at once on this 2-core machine.

The CPU run goes through the profile with a subset of its jobs stale (one rule of every resource kind, the
writeup among them); the GPU run's jobs are only submitted (the stand-in fails them) to check their GPU requests.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import REPO
from ..pipeline import SNAKEMAKE, announced_jobs, copy_pipeline
from .test_smoke_pipeline import SMOKE_TIMEOUT_S, copy_of_smoke_run, job_counts

FAKE_SLURM = r'''
import fcntl, json, os, subprocess, sys
from pathlib import Path

STATE = Path(os.environ["FAKE_SLURM_DIR"])
command, args = Path(sys.argv[0]).name, sys.argv[1:]


def locked_append(name, line):
    with open(STATE / name, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line + "\n")


def option(flag, default=None):
    """The value of `flag VALUE` or `flag=VALUE` in args."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return default


def jobs():
    return [json.loads(p.read_text()) for p in sorted((STATE / "jobs").glob("*.json"))]


def set_state(job):
    (STATE / "jobs" / f"{job['id']}.json").write_text(json.dumps(job))


locked_append("calls.jsonl", json.dumps({"command": command, "args": args}))
if command == "sbatch":
    with open(STATE / "next_id", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        job_id = str(int(f.read() or 1000) + 1)
        f.seek(0)
        f.truncate()
        f.write(job_id)
    job = {"id": job_id, "name": option("--job-name"), "state": "RUNNING"}
    set_state(job)
    if os.environ.get("FAKE_SLURM_FAIL"):
        job["state"] = "FAILED"
    else:
        env = dict(os.environ, SLURM_JOB_ID=job_id, SLURM_JOB_NAME=job["name"])
        if option("--gpus"):
            env["SLURM_GPUS"] = option("--gpus")
        log = Path(option("--output").replace("%j", job_id))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            done = subprocess.run(["/bin/sh", "-c", option("--wrap")], cwd=option("-D"), env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
        job["state"] = "COMPLETED" if done.returncode == 0 else "FAILED"
    set_state(job)
    print(job_id)
elif command in ("sacct", "squeue"):
    if command == "sacct" and option("-j"):  # the failure reason of a job step
        sys.exit(0)
    for job in jobs():
        if job["name"] == option("--name"):
            print(f"{job['id']}|{job['state']}")
elif command == "scancel":
    for job in jobs():
        if job["id"] in args:
            set_state({**job, "state": "CANCELLED"})
elif command == "srun":  # srun [options] COMMAND...: run COMMAND here, once per task (--ntasks), as on nodes
    argv = args[next(i for i, arg in enumerate(args) if not arg.startswith("-")):]
    tasks = int(option("--ntasks", option("-n", "1")))
    os.environ["SLURM_JOB_NODELIST"] = "localhost"  # a step's tasks see the job's nodes (the jobstep plugin drops it)
    if tasks == 1:
        os.execvp(argv[0], argv)
    started = [subprocess.Popen(argv, env=dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i)))
               for i in range(tasks)]
    sys.exit(max(task.wait() for task in started))
elif command == "sinfo":
    print("PARTITION\ncpu*\ngpu")
elif command == "sacctmgr":
    print("testaccount")
'''
COMMANDS = ("sbatch", "squeue", "sacct", "scancel", "srun", "sinfo", "sacctmgr")
PLACEHOLDERS = {"YOUR_ACCOUNT": "testaccount", "YOUR_CPU_PARTITION": "cpu", "YOUR_GPU_PARTITION": "gpu"}


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """(profile dir, environment, state dir) for running Snakemake against the stand-in SLURM."""
    root = tmp_path_factory.mktemp("slurm")
    bin_dir, state = root / "bin", root / "state"
    (state / "jobs").mkdir(parents=True)
    bin_dir.mkdir()
    for name in COMMANDS:
        script = bin_dir / name
        script.write_text(f"#!{sys.executable}\n{FAKE_SLURM}")
        script.chmod(0o755)
    # The profile as a user would use it: the repository's, with its placeholders filled in.
    profile = root / "profile"
    profile.mkdir()
    text = (REPO / "profiles/slurm/config.yaml").read_text()
    for placeholder, value in PLACEHOLDERS.items():
        assert placeholder in text, placeholder
        text = text.replace(placeholder, value)
    (profile / "config.yaml").write_text(text)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_DIR=str(state))
    assert shutil.which("sbatch", path=env["PATH"]) == str(bin_dir / "sbatch")
    return profile, env, state


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, stand_in):
    """(workdir, profile dir, environment, state dir): the stand-in SLURM on a copy of the pipeline (no results)."""
    return copy_pipeline(tmp_path_factory.mktemp("slurm_pipeline")), *stand_in


@pytest.fixture(scope="module")
def smoke_cluster(tmp_path_factory, stand_in):
    """The same on a copy of the completed smoke run."""
    return copy_of_smoke_run(tmp_path_factory, "slurm_run"), *stand_in


def run_profile(cluster, *args: str, fail_jobs: bool = False) -> subprocess.CompletedProcess:
    workdir, profile, env, _ = cluster
    if fail_jobs:
        env = dict(env, FAKE_SLURM_FAIL="1")
    # Poll every second instead of the profile's 40 s: the stand-ins answer at once.
    cmd = [
        *SNAKEMAKE,
        "--profile",
        str(profile),
        "--slurm-init-seconds-before-status-checks",
        "1",
        "--seconds-between-status-checks",
        "1",
        "--max-status-checks-per-second",
        "10",
        *args,
    ]
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)


def plan(cluster, *args: str) -> dict[tuple[str, str], dict[str, str]]:
    """The jobs that a dry run through the profile lists: (rule, wildcards) -> resources and threads as
    Snakemake evaluated them from the rules. (A dry run caps threads at --cores; a node has more than we ask.)"""
    dry = run_profile(cluster, "-n", "--cores", "64", *args)
    assert dry.returncode == 0, dry.stderr[-3000:]
    return planned_jobs(dry.stdout + dry.stderr)


def planned_jobs(output: str) -> dict[tuple[str, str], dict[str, str]]:
    """(rule, wildcards) -> resources (and threads), as strings, of every job that a dry run lists."""
    planned = {}
    for job in announced_jobs(output):
        # A rule's comment on SLURM is rule_<name>[_wildcards_<values joined by _>].
        key = "_".join(str(value) for value in job["wildcards"].values())
        needs = {name: str(value) for name, value in job["resources"].items()}
        needs["threads"] = str(job["threads"])
        planned[(job["rule_name"], key)] = needs
    return planned


def submissions(state: Path) -> dict[tuple[str, str], list[str]]:
    """(rule, wildcards) -> sbatch arguments, from the stand-in's record."""
    found = {}
    for line in (state / "calls.jsonl").read_text().splitlines():
        call = json.loads(line)
        if call["command"] != "sbatch":
            continue
        comment = call["args"][call["args"].index("--comment") + 1]
        rule, _, wildcards = comment.removeprefix("rule_").partition("_wildcards_")
        found[(rule, wildcards)] = call["args"]
    return found


def assert_submitted_as_declared(args: list[str], needs: dict[str, str]) -> None:
    """The sbatch flags of one job against the resources Snakemake evaluated for its rule."""
    line = shlex.join(arg for arg in args if not arg.startswith("--wrap="))  # not the job script's own flags
    assert f"--mem {needs['mem_mb']}" in line and f"-t {needs['runtime']}" in line, line
    assert f"--cpus-per-task={needs['threads']}" in line, line
    assert f"-A {needs['slurm_account']}" in line and f"-p {needs['slurm_partition']}" in line, line
    gpus = int(needs["gpu"])
    assert (f"--gpus={gpus}" in line) == (gpus > 0) and ("--gpus" in line) == (gpus > 0), line


# One job of every resource kind (rules/common.smk: model, heavy, multi-process; the writeup is light) and its
# result.
REDONE = {
    "mixed_precision_autocast_dtypes": "results/cpu/mixed_precision/autocast_dtypes.csv",
    "memory_profile": "results/cpu/memory/peaks.csv",
    "allreduce_benchmark": "results/cpu/allreduce/gloo_n2.csv",
}


# Under pytest-xdist every test that starts from the smoke run goes to one worker, which runs the smoke run once.
@pytest.mark.xdist_group("smoke_run")
@pytest.mark.timeout(SMOKE_TIMEOUT_S)
def test_cpu_run_through_the_profile_submits_every_job_as_its_rule_declares(smoke_cluster):
    """Those results deleted and asked for again, with the writeup (which then reruns too)."""
    cluster = smoke_cluster
    workdir, _, _, state = cluster
    (state / "calls.jsonl").unlink(missing_ok=True)  # another test's submissions (a shared stand-in)
    for result in REDONE.values():
        (workdir / result).unlink()
    writeup = workdir / "report/cpu/writeup.md"
    before = writeup.stat().st_mtime_ns

    result = run_profile(cluster, *REDONE.values(), "report/writeup.md", "--config", "run=cpu")
    assert result.returncode == 0, result.stderr[-5000:]
    # The jobs as Snakemake announced them, with their resources and threads evaluated from the rules (as a dry
    # run lists them, but with threads uncapped by --cores: a node has more than we ask).
    planned = planned_jobs(result.stdout + result.stderr)
    assert {rule for rule, _ in planned} == {*REDONE, "writeup"}
    submitted = submissions(state)
    assert set(submitted) == set(planned)
    for job, needs in planned.items():
        assert needs["slurm_partition"] == ("cpu" if job[0] == "writeup" else "gpu")
        assert_submitted_as_declared(submitted[job], needs)
    assert "--parsable" in submitted[("writeup", "")]
    # Multi-process jobs ask for a CPU per rank; every job ran on the "node" through srun.
    assert planned[("allreduce_benchmark", "gloo_2")]["threads"] == "2"
    sruns = [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]
    assert sum(call["command"] == "srun" for call in sruns) == len(planned)

    assert writeup.stat().st_mtime_ns > before
    assert (workdir / "report/writeup.md").read_text().startswith("# CS336")
    assert all((workdir / result).exists() for result in REDONE.values())
    # Snakemake recorded the cluster jobs like local ones: nothing is stale afterwards.
    again = run_profile(cluster, "-n", "report/writeup.md", "--config", "run=cpu")
    assert again.returncode == 0 and job_counts(again.stdout + again.stderr) == {}, again.stderr[-3000:]


def test_gpu_run_requests_the_gpus_each_rule_needs(cluster):
    """The GPU preset's jobs, submitted only: one GPU for a single-GPU rule, one per rank for NCCL."""
    workdir, _, _, state = cluster
    (state / "calls.jsonl").unlink(missing_ok=True)
    targets = [
        "results/gpu/communication_accounting/xxl.csv",
        "results/gpu/e2e_warmup/small_w0.csv",
        "results/gpu/memory/peaks.csv",
        "results/gpu/naive_ddp/check.csv",
    ]
    planned = plan(cluster, *targets)
    assert {rule for rule, _ in planned} == {
        "communication_accounting",
        "e2e_warmup_study",
        "memory_profile",
        "naive_ddp_check",
    }

    result = run_profile(cluster, "--restart-times", "0", *targets, fail_jobs=True)
    assert result.returncode != 0  # the stand-in fails every job, after recording it
    submitted = submissions(state)
    assert set(submitted) == set(planned)
    for job, needs in planned.items():
        assert_submitted_as_declared(submitted[job], needs)
    gpus = {rule: needs["gpu"] for (rule, _), needs in planned.items()}
    assert gpus == {
        "communication_accounting": "0",
        "e2e_warmup_study": "1",
        "memory_profile": "1",
        "naive_ddp_check": "2",
    }
    assert not list((workdir / "results/gpu").rglob("*.csv"))


def test_every_job_that_needs_a_gpu_goes_to_the_gpu_partition(cluster):
    """The whole GPU run, planned through the profile: a GPU rule missing from its set-resources would go to the
    CPU partition with a request for GPUs."""
    planned = plan(cluster, "report/writeup.md", "--forceall", "--config", "run=gpu")
    assert ("train_step_cold", "ours") in planned  # (the whole run, not a part)
    misplaced = sorted(
        {
            rule
            for (rule, _), needs in planned.items()
            if int(needs["gpu"]) > 0 and needs["slurm_partition"] != "gpu"
        }
    )
    assert not misplaced, f"add to profiles/slurm/config.yaml set-resources: {misplaced}"


def test_fsdp_on_two_nodes_runs_one_launcher_per_node(cluster):
    """An FSDP job of world size 2 on 2 nodes: sbatch asks for the nodes, and an srun task per node starts a
    launcher; the two meet at the rendezvous derived from the job and train as one job of two ranks."""
    workdir, _, _, state = cluster
    (state / "calls.jsonl").unlink(missing_ok=True)
    (workdir / "two_nodes.yaml").write_text(
        "runs:\n  cpu:\n    fsdp:\n      jobs: [{world_size: 2, nodes: 2, variants: [ours, single]}]\n"
    )
    target = "results/cpu/fsdp/n2.csv"
    args = [target, "--config", "run=cpu", "--configfile", "two_nodes.yaml"]
    planned = plan(cluster, *args)
    assert set(planned) == {("fsdp_benchmark", "2")}
    needs = planned[("fsdp_benchmark", "2")]
    assert (needs["nodes"], needs["gpu"], needs["threads"]) == ("2", "0", "1"), needs

    result = run_profile(cluster, *args)
    assert result.returncode == 0, result.stderr[-5000:]
    sbatch = submissions(state)[("fsdp_benchmark", "2")]
    assert "--nodes=2" in sbatch and not any(arg.startswith("--gpus") for arg in sbatch), sbatch
    calls = [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]
    per_node = [
        call["args"] for call in calls if call["command"] == "srun" and "--ntasks-per-node=1" in call["args"]
    ]
    assert len(per_node) == 1 and "--nodes=2" in per_node[0] and "--nnodes" in per_node[0], per_node
    rows = list(csv.DictReader((workdir / target).open()))
    assert {(row["variant"], row["world_size"], row["status"]) for row in rows} >= {("ours", "2", "ok")}, rows
    # the configuration refuses what it cannot run, before any job
    (workdir / "three.yaml").write_text(
        "runs:\n  cpu:\n    fsdp:\n      jobs: [{world_size: 3, nodes: 2, variants: [ours]}]\n"
    )
    bad = run_profile(cluster, "-n", target, "--config", "run=cpu", "--configfile", "three.yaml")
    said = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "world_size 3 is not a multiple of nodes 2" in said, said[-2000:]
