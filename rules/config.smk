# The configuration: config.yaml read (a YAML syntax error named by its line and column), merged with any
# --configfile and --config, validated (the schema, the model sizes against the library's table, then every
# constraint between values that a CLI would otherwise reject inside its job), the selected run, and the environment
# every job inherits. A mistake stops Snakemake here, before any job starts (so before it deletes an earlier result),
# one line per mistake naming where the value came from (config.yaml, a --configfile or --config) and its key.
# Last, what the Snakefile's onerror shows: one line per failed job, why it failed, from its log.
import ast
import os
import re
import sys
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.utils import validate

sys.path.insert(0, str(Path(workflow.basedir, "src")))  # this checkout's package, for its size table
from cs336_systems.experiments import failure_reason  # noqa: E402  (torch-free)
from cs336_systems.model.sizes import MODEL_SIZES  # noqa: E402  (torch-free)


def _read_yaml(path):
    """The YAML file at `path`, or a one-line WorkflowError at the line and column of its syntax error (Snakemake's
    own parse of the file says only that it is not valid JSON or YAML)."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        context = error.context if error.problem else None
        if context and error.context_mark and error.context_mark.line != mark.line:
            context += f" that starts at line {error.context_mark.line + 1}, column {error.context_mark.column + 1}"
        place = f"{path}:{mark.line + 1}:{mark.column + 1}"
        raise WorkflowError(
            f"{place}: YAML syntax error: {error.problem or error.context}" + (f" ({context})" if context else "")
        ) from None
    except yaml.YAMLError as error:
        raise WorkflowError(f"{path}: YAML syntax error: {' '.join(str(error).split())}") from None


# Read here first, so that a syntax error names its place; then Snakemake reads it (and the command line's config).
CONFIG_YAML = _read_yaml("config.yaml") if Path("config.yaml").exists() else None


configfile: "config.yaml"


def _config_sources():
    """(label, config) of every source of the merged config, in the order Snakemake applies them (a later one's
    value wins): config.yaml, each --configfile, --config."""
    settings = workflow.config_settings
    sources = [] if getattr(settings, "replace_workflow_config", False) else [("config.yaml", CONFIG_YAML or {})]
    sources += [(f"--configfile {os.path.relpath(path)}", _read_yaml(path) or {}) for path in settings.configfiles]
    return sources + [("--config (command line)", dict(settings.config))]


def _holds(tree, path):
    for key in path:
        if isinstance(tree, dict) and key in tree:
            tree = tree[key]
        elif isinstance(tree, list) and isinstance(key, int) and 0 <= key < len(tree):
            tree = tree[key]
        else:
            return False
    return True


def _source_of(path):
    """Which source set the value at `path` (a list of keys): the last one applied that holds it, or, for a key
    that none holds (a required key missing), the last that holds the nearest key above it."""
    sources = _config_sources()
    for depth in range(len(path), 0, -1):
        for label, tree in reversed(sources):
            if _holds(tree, path[:depth]):
                return label
    return "config.yaml"


def _key(path):
    return ".".join(str(key) for key in path) or "<top level>"


def _schema_problem():
    """The first schema violation as (key path, message, path of the value to blame), or None."""
    try:
        validate(config, "config.schema.yaml")
    except WorkflowError as err:
        cause = err.__cause__ or err.__context__  # the jsonschema ValidationError
        if not hasattr(cause, "absolute_path"):
            raise
        path = list(cause.absolute_path)
        blamed = path
        if cause.validator == "additionalProperties" and isinstance(cause.instance, dict):
            known = cause.schema.get("properties", {})
            blamed = path + [key for key in cause.instance if key not in known][:1]
        return path, cause.message, blamed
    return None


def _heads_problem(heads, d_model, whose):
    """Why `heads` attention heads cannot split d_model (`whose`: where it is from) as ModelConfig requires, or
    None."""
    if d_model % heads:
        return f"{heads} does not divide d_model {d_model} {whose}"
    if d_model // heads % 2:
        return (f"{heads} heads split d_model {d_model} {whose} into head dim {d_model // heads}, and RoPE needs an "
                "even head dim")
    return None


def _strategy_check_shapes():
    """FFN_SHAPES of cs336_systems.bench.strategy_checks, the FFNs that parallelism_checks shards over its ranks,
    read from the source (importing it would import torch)."""
    source = Path(workflow.basedir, "src/cs336_systems/bench/strategy_checks.py")
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FFN_SHAPES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise WorkflowError(f"{source}: no FFN_SHAPES, which the config's parallelism.check_world_sizes must divide")


def _run_problems(name, run):
    """(key path, message) of every value of run `name` that its CLI would reject against another value."""
    at = ["runs", name]
    problems, sizes = [], []
    for deliverable in ("e2e", "mixed_precision", "compile", "profile"):
        sizes += [([*at, deliverable, "sizes"], size) for size in run[deliverable]["sizes"]]
    sizes += [([*at, "e2e", "warmup_study", "sizes"], size) for size in run["e2e"]["warmup_study"]["sizes"]]
    sizes += [([*at, d, "size"], run[d]["size"]) for d in ("memory", "ddp", "sharding", "fsdp", "residuals")]
    sizes += [([*at, "checkpointing", study, "size"], run["checkpointing"][study]["size"])
              for study in ("policies", "depths")]
    for path, size in sizes:
        if size not in MODEL_SIZES:
            problems.append((path, f"unknown model size {size!r}; known: {list(MODEL_SIZES)}"))

    # Heads against the width they split (the residuals CLI's --heads, the train_step CLIs' --num-heads).
    residuals = run["residuals"]
    if residuals["size"] in MODEL_SIZES:
        d_model = MODEL_SIZES[residuals["size"]]["d_model"]
        for heads in residuals["heads"]:
            if problem := _heads_problem(heads, d_model, f"of size {residuals['size']}"):
                problems.append(([*at, "residuals", "heads"], problem))
    train_step = run["train_step"]
    for keys, dims in ((["train_step"], train_step), (["train_step", "check"], train_step.get("check"))):
        whose = f"({_key([*at, *keys, 'd_model'])})"
        if dims and (problem := _heads_problem(dims["num_heads"], dims["d_model"], whose)):
            problems.append(([*at, *keys, "num_heads"], problem))

    # Checkpoint policies against the depth they run at: every:K takes K from 1 to the number of layers.
    for study, settings in run["checkpointing"].items():
        if settings["size"] not in MODEL_SIZES:
            continue
        if study == "depths":
            depths = [(depth, f"depth {depth} ({_key([*at, 'checkpointing', study, 'depths'])})")
                      for depth in settings["depths"]]
        else:  # the policies job runs at the size's own depth
            layers = MODEL_SIZES[settings["size"]]["num_layers"]
            depths = [(layers, f"the {layers} layers of size {settings['size']}")]
        for policy in settings.get("policies", []):
            kind, _, k = policy.partition(":")
            for depth, said in depths:
                if kind == "every" and int(k) > depth:
                    problems.append(([*at, "checkpointing", study, "policies"],
                                     f"{policy} groups more blocks than {said}; every:K takes K from 1 to the depth"))

    # flash_host: the short-sequence goal is ours' wall time per call against SDPA's, in the same table.
    if missing := [impl for impl in ("triton", "sdpa") if impl not in run["flash_host"]["impls"]]:
        problems.append(([*at, "flash_host", "impls"],
                         f"{run['flash_host']['impls']} lacks {', '.join(missing)}: the writeup judges the "
                         "short-sequence goal on ours (triton) against sdpa"))

    # FSDP: one job per world size, its ranks spread evenly over its nodes.
    first_job = {}
    for i, job in enumerate(run["fsdp"]["jobs"]):
        n, nodes = job["world_size"], job.get("nodes", 1)
        if n in first_job:
            problems.append(([*at, "fsdp", "jobs", i, "world_size"],
                             f"{n} again (jobs.{first_job[n]} has it): one job per world size"))
        first_job.setdefault(n, i)
        if n % nodes:
            problems.append(([*at, "fsdp", "jobs", i, "nodes"],
                             f"world_size {n} is not a multiple of nodes {nodes}"))
    return problems


def _config_problems():
    """(key path, message) of every value that the CLIs would reject against another value, in every run."""
    problems = [problem for name, run in config["runs"].items() for problem in _run_problems(name, run)]
    shapes = _strategy_check_shapes()
    checked = [(["parallelism", "check_world_sizes"], n) for n in config["parallelism"]["check_world_sizes"]]
    checked += [(["runs", name, "parallelism_world_sizes", "checks"], n) for name, run in config["runs"].items()
                for n in run.get("parallelism_world_sizes", {}).get("checks", [])]
    for path, n in checked:
        if any(dim % n for shape in shapes for dim in shape):
            problems.append((path,
                             f"{n} does not divide every dimension of the FFNs the check shards "
                             f"{', '.join('x'.join(map(str, s)) for s in shapes)} (B x D x D_FF, "
                             f"cs336_systems.bench.strategy_checks.FFN_SHAPES)"))
    return problems


def _validate_config():
    """Schema validation through Snakemake, then the constraints between values; one line per mistake, naming
    where its value came from and its key."""
    if problem := _schema_problem():
        path, message, blamed = problem
        raise WorkflowError(f"{_source_of(blamed)}: {_key(path)}: {message}")
    if problems := _config_problems():
        raise WorkflowError("\n".join(f"{_source_of(path)}: {_key(path)}: {message}" for path, message in problems))


def _cuda_available():
    # Importing torch costs a second or two; only `run: auto` needs to know.
    import torch

    return torch.cuda.is_available()


_validate_config()
RUN = config["run"]
if RUN == "auto":
    RUN = "gpu" if _cuda_available() else "cpu"
if RUN not in config["runs"]:
    chose = "" if RUN == config["run"] else " (what run: auto chose)"
    known = ", ".join(["auto", *config["runs"]])
    raise WorkflowError(f"{_source_of(['run'])}: run: unknown run {RUN!r}{chose}; known: {known}")
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


def log_failed_jobs():
    """For the Snakefile's onerror: one line per job that failed, with why (the one line of its log that says so,
    cs336_systems.experiments.failure_reason) and where its log is. Snakemake shows each failed job's command and
    log path, but not what the log says."""
    failed = getattr(getattr(workflow, "scheduler", None), "failed", ())
    jobs = [one for job in failed for one in (job.jobs if job.is_group() else [job])]
    for job in sorted(jobs, key=lambda job: (job.rule.name, sorted(job.wildcards_dict.items()))):
        wildcards = ", ".join(f"{key}={value}" for key, value in job.wildcards_dict.items())
        name = f"{job.rule.name} ({wildcards})" if wildcards else job.rule.name
        logs = [Path(log) for log in job.log]
        reasons = [failure_reason(log.read_text(errors="replace")) for log in logs if log.is_file()]
        reason = next((r for r in reasons if r), "its log says nothing" if logs else "it has no log")
        logger.error(f"{name} failed: {reason}" + (f" (log: {', '.join(map(str, logs))})" if logs else ""))
