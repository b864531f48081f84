# What every job's command shares: strict bash with GPU pinning, the software environment, the code a rule runs
# (its inputs), list flags, and the writeup's inputs that each rules/*.smk appends to.
import shlex

# The software of every job, for `--sdm conda` (relative to the rules/*.smk that names it).
ENV = "envs/pipeline.yaml"
# Bash strict mode (Snakemake's default prefix) plus pin_gpus, which gives each GPU job GPUs of its own.
PIN_GPUS = shlex.quote(str(Path(workflow.basedir, "rules", "pin_gpus.sh")))
shell.prefix(f"set -euo pipefail; source {PIN_GPUS}; ")


# What every experiment CLI imports (cs336_systems.cli and what it builds on). Not sizes.py: a rule that builds a
# model has its size's row of that table as a param (model_dims), so editing one size reruns that size's jobs only.
CLI_CODE = ("cli.py", "model/transformer.py", "measure/timing.py", "measure/provenance.py")
# The Transformer workload: the model, its batch and its training step.
MODEL_CODE = ("training/workload.py",)


def code(*modules, view_only=VIEW_ONLY):
    """Source files a rule runs, as inputs, so that editing them makes the rule's results stale (except
    view-only, above). An experiment CLI (experiments/...) also runs CLI_CODE."""
    if any(m.startswith("experiments/") for m in modules):
        modules = (*modules, *CLI_CODE)
    paths = [f"src/cs336_systems/{m}" for m in dict.fromkeys(modules)]
    return [ancient(path) for path in paths] if view_only else paths


def model_dims(size=None):
    """The `model` param of a rule that builds the Transformer: the dimensions of `size` (default: the `size`
    wildcard) from cs336_systems.model.sizes; the command passes only the name."""
    return (lambda w: MODEL_SIZES[w.size]) if size is None else MODEL_SIZES[size]


def listed(values):
    return " ".join(str(v) for v in values)


# Each rules/*.smk appends the final outputs of its deliverables; the writeup depends on all of them.
WRITEUP_INPUTS = []
