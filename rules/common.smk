# Shared helpers: config validation, the selected run, code dependencies, and the writeup's inputs.
import functools
import os
import re
from pathlib import Path
import shutil
import subprocess

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

# Every job imports the package from this checkout and tags its provenance with the run.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [f"{workflow.basedir}/src", os.environ.get("PYTHONPATH")]))
os.environ["CS336_RUN"] = RUN
PY = "python -m cs336_systems.experiments"
# A single-GPU job holds one GPU (so `--resources gpu=N` runs N of them at once); on a CPU run it needs none.
GPU_JOB = 1 if R["device"] == "cuda" else 0
ALL_SIZES = config["model_sizes"]


wildcard_constraints:
    size="|".join(re.escape(s) for s in config["model_sizes"]),
    warmup=r"\d+",


@functools.cache
def gpu_count():
    """GPUs visible to jobs, as the launcher counts them (CUDA_VISIBLE_DEVICES applies); torch is imported only
    when a rule asks."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def code(*modules):
    """Source files a rule runs, as inputs, so that editing them makes the rule's results stale."""
    return [f"src/cs336_systems/{m}" for m in modules]


def model_flags(size):
    dims = ALL_SIZES[size]
    return (f"--size {size} --d-model {dims['d_model']} --d-ff {dims['d_ff']} --num-layers {dims['num_layers']} "
            f"--num-heads {dims['num_heads']} --vocab-size {config['vocab_size']}")


def listed(values):
    return " ".join(str(v) for v in values)


# Each rules/*.smk appends the final outputs of its deliverables; the writeup depends on all of them.
WRITEUP_INPUTS = []
