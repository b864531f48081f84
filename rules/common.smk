# The helpers every rules/*.smk shares (included after rules/config.smk, before any rules): what a job needs, what
# every job's command shares, the launch of multi-process jobs, the code a job runs, and the writeup's inputs.
import ast
import csv
import functools
import shlex
from pathlib import Path
from typing import NamedTuple

# ---- What a job needs: `gpu`, `mem_mb`, `runtime` (minutes) as resources, `threads` beside them, through `job()`
# or `ranks()`; and whether the GPUs are there.

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


def rank_threads(nproc, nodes=1):
    """A CPU thread budget per rank (NEEDS["rank"].threads), for the ranks of one node of `nproc` ranks over
    `nodes` nodes (each a value or a function of the wildcards)."""
    return lambda w: int(setting_of(nproc, w)) // int(setting_of(nodes, w)) * NEEDS["rank"].threads


def per_world_size(table):
    """A function of the wildcards: the entry of `table` (keyed by world size) for the `world_size` wildcard."""
    return lambda w: table[int(w.world_size)]


# ---- What every job's command shares: strict bash with GPU pinning, the software environment, list flags, and
# the launch of a multi-process job.

# The software of every job, for `--sdm conda` (relative to the rules/*.smk that names it).
ENV = "envs/pipeline.yaml"
# Bash strict mode (Snakemake's default prefix) plus pin_gpus, which gives each GPU job GPUs of its own.
PIN_GPUS = shlex.quote(str(Path(workflow.basedir, "rules", "pin_gpus.sh")))
shell.prefix(f"set -euo pipefail; source {PIN_GPUS}; ")


def attention_shape_args(shape):
    """An attention shape BxHxNxD (batch, heads, sequence, head dim) as flash_benchmark's arguments."""
    batch, heads, seq, d_head = (int(x) for x in shape.split("x"))
    return f"--heads {heads} --tokens {batch * seq} --seq-lens {seq} --d-heads {d_head}"


def listed(values):
    return " ".join(str(v) for v in values)


def launched(nproc, backend, csv, also=None, nodes=1):
    """The params of a job of `nproc` processes on `backend` over `nodes` nodes (values, or functions of the
    wildcards) whose table is `csv`: `launcher`, the command that starts cs336_systems.parallel.launch (launcher()); `nproc`,
    the processes per node; `gpus`, what pin_gpus must hold (the `gpu` resource says the same, but Snakemake
    lowers it to the profile's limit, `--resources gpu=1`, and an NCCL job alone on a 2-GPU box should still get
    both); `gpus_ok` reruns a result skipped for lack of them; `also` is another output that gets the launcher's
    skipped row (a pattern of the same wildcards as `csv`)."""
    per_node = lambda w: int(setting_of(nproc, w)) // int(setting_of(nodes, w))
    gpus = lambda w: gpus_needed(setting_of(backend, w), per_node(w))
    return dict(
        launcher=lambda w: launcher(int(setting_of(nodes, w)), gpus(w)),
        nproc=per_node,
        backend=lambda w: setting_of(backend, w),
        gpus=gpus,
        gpus_ok=lambda w: gpus_ok(gpus(w), csv.format(**w)),
        also=(lambda w: f"--also {also.format(**w)}") if also else "",
    )


def launcher(nodes, gpus_per_node):
    """cs336_systems.parallel.launch on this machine, or on each of `nodes` nodes of a SLURM job: one srun task per node
    in a job step beside the one Snakemake's jobstep executor runs the rule in (--overlap), with the node's GPUs;
    the launchers meet at the rendezvous cs336_systems.parallel.launch derives from the job's environment. Outside a SLURM
    job the command stops at once, saying why."""
    if nodes == 1:
        return "python -m cs336_systems.parallel.launch"
    gpus = f" --gpus-per-node={gpus_per_node}" if gpus_per_node else ""
    return (f"{{ [ -n \"${{SLURM_JOB_ID:-}}\" ] || {{ echo 'a job on {nodes} nodes runs in a SLURM job "
            f"(snakemake --profile profiles/slurm)' >&2; exit 1; }}; }}; "
            f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --overlap --kill-on-bad-exit=1{gpus} "
            f"python -m cs336_systems.parallel.launch --nnodes {nodes}")


def train_step_options(settings, compile):
    """The train_step CLI's flags for the settings that differ by device (do_bench's times on CUDA, steps
    elsewhere), and --no-compile unless `compile`."""
    flags = [f"--{key.replace('_', '-')} {settings[key]}" for key in ("warmup_ms", "rep_ms", "steps")
             if key in settings]
    return " ".join(flags + ([] if compile else ["--no-compile"]))


# ---- The code a job runs, as its inputs (paths relative to src/cs336_systems).

# What every experiment CLI imports (cs336_systems.cli and what it builds on). Not sizes.py: a rule that builds a
# model has its size's row of that table as a param (model_dims), so editing one size reruns that size's jobs only.
CLI_CODE = ("cli.py", "model/transformer.py", "measure/timing.py", "measure/provenance.py")
# The Transformer workload: the model, its batch and its training step.
MODEL_CODE = ("training/workload.py",)
# Our FlashAttention: the operator, the tier that runs (flash_tiers imports the Hopper tier by name) and each tier.
FLASH_KERNEL_CODE = ("kernels/flash_attention.py", "kernels/flash_tiers.py", "kernels/flash_triton.py",
                     "kernels/flash_replay.py", "kernels/flash_replay.cpp",
                     "kernels/triton_interpreter.py", "kernels/hopper/__init__.py", "kernels/hopper/flash_attention.py",
                     "kernels/hopper/_kernels.py")


def code(*modules, view_only=VIEW_ONLY):
    """Source files a rule runs, as inputs, so that editing them makes the rule's results stale (except
    view-only, above). An experiment CLI (experiments/...) also runs CLI_CODE."""
    if any(m.startswith("experiments/") for m in modules):
        modules = (*modules, *CLI_CODE)
    paths = [f"src/cs336_systems/{m}" for m in dict.fromkeys(modules)]
    return [ancient(path) for path in paths] if view_only else paths


def imported_modules(package, *folders):
    """Every module of `package` (a folder of src/) under `folders`, and every module of the package that those
    import, directly or transitively, at module level or inside a function: paths relative to `package`. Read from
    the source (ast), never imported, so that parsing the Snakefile stays fast and torch-free."""

    def files(name):  # a module's file, or a package's __init__.py
        base = package.parent.joinpath(*name.split("."))
        return [path for path in (base / "__init__.py", base.with_suffix(".py")) if path.is_file()]

    todo = [path for folder in folders for path in (package / folder).rglob("*.py")]
    found = set()
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found.add(path)
        here = path.relative_to(package.parent).parent.parts  # the package that `path` is in
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from x import y`: y is a name of x or its submodule x.y
                x = [*here[: len(here) + 1 - node.level], node.module] if node.level else [node.module]
                names = [".".join(filter(None, [*x, alias.name])) for alias in node.names]
            else:
                continue
            for name in names:  # importing a.b.c runs a, a.b and a.b.c
                parts = name.split(".")
                if parts[0] == package.name:
                    todo += [file for i in range(len(parts)) for file in files(".".join(parts[: i + 1]))]
    return sorted(path.relative_to(package).as_posix() for path in found)


def model_dims(size=None):
    """The `model` param of a job that builds the Transformer: the dimensions of `size` (default: the `size`
    wildcard) from cs336_systems.model.sizes; the command passes only the name."""
    return (lambda w: MODEL_SIZES[w.size]) if size is None else MODEL_SIZES[size]


# Each rules/*.smk appends the final outputs of its deliverables; the writeup depends on all of them.
WRITEUP_INPUTS = []
