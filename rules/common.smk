# Shared helpers: config validation, the selected run, job resources, code dependencies, the writeup's inputs.
import csv
import functools
import os
import re
import shlex
from pathlib import Path
from typing import NamedTuple

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate


def _validate_config():
    """Schema validation through Snakemake, reported as one line that names the offending key."""
    try:
        validate(config, "config.schema.yaml")
    except WorkflowError as err:
        cause = err.__cause__ or err.__context__  # the jsonschema ValidationError
        if not hasattr(cause, "absolute_path"):
            raise
        key = ".".join(str(p) for p in cause.absolute_path) or "<top level>"
        raise WorkflowError(f"config.yaml: {key}: {cause.message}") from None
    sizes = config["model_sizes"]
    for run_name, run in config["runs"].items():
        used = [(f"runs.{run_name}.{d}.sizes", s) for d in ("e2e", "mixed_precision", "compile", "profile")
                for s in run[d]["sizes"]]
        used += [(f"runs.{run_name}.e2e.warmup_study.sizes", s) for s in run["e2e"]["warmup_study"]["sizes"]]
        used += [(f"runs.{run_name}.{d}.size", run[d]["size"]) for d in ("memory", "ddp", "sharding")]
        for key, size in used:
            if size not in sizes:
                raise WorkflowError(f"config.yaml: {key}: unknown model size {size!r}; known: {sorted(sizes)}")


def _cuda_available():
    # Importing torch costs a second or two; only `run: auto` needs to know.
    import torch

    return torch.cuda.is_available()


_validate_config()
RUN = config["run"]
if RUN == "auto":
    RUN = "gpu" if _cuda_available() else "cpu"
if RUN not in config["runs"]:
    raise WorkflowError(f"config.yaml: run: unknown run {RUN!r}; known: auto, {', '.join(config['runs'])}")
R = config["runs"][RUN]
RESULTS = f"results/{RUN}"

# Every job imports the package from this checkout and tags its provenance with the run (cluster jobs re-read
# this file, so they set the same).
os.environ.update(
    PYTHONPATH=os.pathsep.join(filter(None, [f"{workflow.basedir}/src", os.environ.get("PYTHONPATH")])),
    CS336_RUN=RUN,
)
# The software of every job, for `--sdm conda` (relative to the rules/*.smk that names it).
ENV = "envs/pipeline.yaml"
# Bash strict mode (Snakemake's default prefix) plus pin_gpus, which gives each GPU job GPUs of its own.
PIN_GPUS = shlex.quote(str(Path(workflow.basedir, "rules", "pin_gpus.sh")))
shell.prefix(f"set -euo pipefail; source {PIN_GPUS}; ")
ALL_SIZES = config["model_sizes"]


wildcard_constraints:
    size="|".join(re.escape(s) for s in config["model_sizes"]),
    warmup=r"\d+",
    context=r"\d+",


# --- Resources: what a job needs, declared by every rule: `gpu`, `threads`, `mem_mb`, `runtime` (minutes). ---
# A single-GPU job holds one GPU on a GPU run; on a CPU run it needs none.
GPU_JOB = 1 if R["device"] == "cuda" else 0


class Needs(NamedTuple):
    mem_mb: int
    runtime: int  # minutes
    threads: int


# By job kind and device: a smoke run needs little; at assignment scale a job holds CUDA contexts, the largest
# models' host-side copies and torch.compile's workers, and sweeps the sizes for an hour or more.
_NEEDS = {
    # no model: accounting formulas, the float accumulation toy, the writeup
    "light": {"cpu": Needs(mem_mb=1000, runtime=10, threads=1),
              "cuda": Needs(mem_mb=4000, runtime=15, threads=1)},
    # one model or kernel benchmark on one device
    "model": {"cpu": Needs(mem_mb=3000, runtime=15, threads=1),
              "cuda": Needs(mem_mb=32000, runtime=90, threads=4)},
    # profiler traces, memory snapshots, torch.compile: more host memory and time
    "heavy": {"cpu": Needs(mem_mb=4000, runtime=20, threads=1),
              "cuda": Needs(mem_mb=64000, runtime=180, threads=8)},
    # one rank of a multi-process job (mem_mb and threads are per rank)
    "rank": {"cpu": Needs(mem_mb=2000, runtime=15, threads=1),
             "cuda": Needs(mem_mb=32000, runtime=60, threads=4)},
}
NEEDS = {kind: by_device[R["device"]] for kind, by_device in _NEEDS.items()}


def gpus_needed(backend, nproc):
    """GPUs a multi-process job holds: one per rank with NCCL, none with gloo (ranks on CPUs)."""
    return nproc if backend == "nccl" else 0


@functools.cache
def gpu_count():
    """GPUs visible to jobs on this machine, as the launcher counts them (CUDA_VISIBLE_DEVICES applies); torch
    is imported only when a rule asks."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def ran_before(csv_path):
    """Whether `csv_path` holds a result that was not skipped for lack of GPUs ("needs ...")."""
    path = Path(csv_path)
    if not path.exists():
        return False
    with path.open(newline="") as rows:
        return not any(
            row.get("status") == "skipped" and row.get("reason", "").startswith("needs ")
            for row in csv.DictReader(rows)
        )


def gpus_ok(needed, csv_path):
    """The `gpus_ok` param of every GPU job: True once a job can get the `needed` GPUs, so a result skipped for
    lack of them ("needs N GPUs, found M") reruns where they exist, without --forceall; a result that did run
    stays True, so a smaller machine never replaces it by a skip. A cluster executor gives each job the GPUs its
    rule requests, whatever the submitting host has."""
    return needed == 0 or workflow.non_local_exec or gpu_count() >= needed or ran_before(csv_path)


# A CUDA run seen from a machine without GPUs (a laptop re-rendering the published GPU writeup, say): its results
# exist that this machine cannot remake, and a checkout gives the code newer file times than the results it made.
# There the code is `ancient` (its times never make a result stale); a missing result still runs and records that
# it needs CUDA. Cluster jobs get GPUs on their nodes, so a cluster run is never view-only.
VIEW_ONLY = R["device"] == "cuda" and not workflow.non_local_exec and gpu_count() == 0


# --- Shell command pieces ---
def code(*modules, view_only=VIEW_ONLY):
    """Source files a rule runs, as inputs, so that editing them makes the rule's results stale (except
    view-only, above)."""
    paths = [f"src/cs336_systems/{m}" for m in modules]
    return [ancient(path) for path in paths] if view_only else paths


def model_flags(size):
    dims = ALL_SIZES[size]
    return (f"--size {size} --d-model {dims['d_model']} --d-ff {dims['d_ff']} --num-layers {dims['num_layers']} "
            f"--num-heads {dims['num_heads']} --vocab-size {config['vocab_size']}")


def listed(values):
    return " ".join(str(v) for v in values)


# Each rules/*.smk appends the final outputs of its deliverables; the writeup depends on all of them.
WRITEUP_INPUTS = []
