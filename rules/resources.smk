# What a job needs, declared by every rule through `job()`: `gpu`, `mem_mb`, `runtime` (minutes) as resources, `threads` beside them; and whether the GPUs are there.
import csv
import functools
from pathlib import Path
from typing import NamedTuple

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


def job(kind, gpu=0):
    """The resources of one process of `kind` (NEEDS) holding `gpu` GPUs: `resources: **job("model", GPU_JOB)`."""
    return dict(gpu=gpu, mem_mb=NEEDS[kind].mem_mb, runtime=NEEDS[kind].runtime)


def setting_of(setting, wildcards):
    """A rule's setting given as a value or as a function of the wildcards (the all-reduce's world size)."""
    return setting(wildcards) if callable(setting) else setting


def ranks(nproc, backend, nodes=1):
    """The resources of a job of `nproc` processes on `backend` over `nodes` nodes, each a value or a function of
    the wildcards: `resources: **ranks(2, "nccl")`. One GPU per rank with NCCL, none with gloo (ranks on CPUs);
    NEEDS["rank"] memory per rank of a node. On several nodes (SLURM) the GPUs are asked per node (`gres`, sbatch
    --gres), not as the job's total (`gpu`, --gpus, which SLURM may spread unevenly over the nodes)."""
    count = lambda w: int(setting_of(nodes, w))
    per_node = lambda w: int(setting_of(nproc, w)) // count(w)
    gpus = lambda w: gpus_needed(setting_of(backend, w), per_node(w))
    return dict(
        gpu=lambda w: gpus(w) if count(w) == 1 else 0,
        nodes=count,
        gres=lambda w: f"gpu:{gpus(w)}" if count(w) > 1 and gpus(w) else "",
        mem_mb=lambda w: per_node(w) * NEEDS["rank"].mem_mb,
        runtime=NEEDS["rank"].runtime,
    )
