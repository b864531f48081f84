# The configuration: config.yaml validated (schema, then the model sizes against the library's table), the selected
# run, and the environment every job inherits.
import os
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

sys.path.insert(0, str(Path(workflow.basedir, "src")))  # this checkout's package, for its size table
from cs336_systems.model.sizes import MODEL_SIZES  # noqa: E402  (torch-free)


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
    for run_name, run in config["runs"].items():
        used = [(f"runs.{run_name}.{d}.sizes", s) for d in ("e2e", "mixed_precision", "compile", "profile")
                for s in run[d]["sizes"]]
        used += [(f"runs.{run_name}.e2e.warmup_study.sizes", s) for s in run["e2e"]["warmup_study"]["sizes"]]
        used += [(f"runs.{run_name}.{d}.size", run[d]["size"]) for d in ("memory", "ddp", "sharding", "fsdp")]
        for key, size in used:
            if size not in MODEL_SIZES:
                raise WorkflowError(f"config.yaml: {key}: unknown model size {size!r}; known: {list(MODEL_SIZES)}")


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


wildcard_constraints:
    size="|".join(re.escape(s) for s in MODEL_SIZES),
    warmup=r"\d+",
    context=r"\d+",
