"""Bad configuration fails at start, before any job runs, in one line per mistake that names where the value came
from (config.yaml, a --configfile, --config on the command line) and its key: schema violations, unknown sizes,
every constraint between values that a CLI would reject inside its job, YAML syntax errors by line and column. A
job that fails anyway shows the one line of its log that says why."""

import re

import pytest
import yaml

from ..pipeline import copy_pipeline, snakemake

# A line that says what is wrong: where the value came from (a file with line and column for a syntax error), then
# the key and the mistake.
ERROR_LINE = re.compile(r"^(config\.yaml|--configfile \S+|--config \(command line\))(:\d+:\d+)?: .+")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_pipeline(tmp_path_factory.mktemp("pipeline"))


def edited(config_text, edit):
    config = yaml.safe_load(config_text)
    edit(config)
    return yaml.safe_dump(config)


def edit_config(workdir, edit, name="bad.yaml"):
    path = workdir / name
    path.write_text(edited((workdir / "config.yaml").read_text(), edit))
    return path


def error_lines(result):
    output = result.stderr + result.stdout
    lines = [line for line in output.splitlines() if ERROR_LINE.match(line)]
    assert result.returncode != 0, output
    assert lines, output
    return lines


def error_line(result):
    return error_lines(result)[0]


def test_unknown_run_from_the_command_line(workdir):
    line = error_line(snakemake(workdir, "-n", "--config", "run=nope"))
    assert line == "--config (command line): run: unknown run 'nope'; known: auto, cpu, gpu"


def test_unknown_run_from_config_yaml(tmp_path):
    work = copy_pipeline(tmp_path)
    (work / "config.yaml").write_text(
        (work / "config.yaml").read_text().replace("\nrun: auto\n", "\nrun: cpuu\n")
    )
    line = error_line(snakemake(work, "-n"))
    assert line == "config.yaml: run: unknown run 'cpuu'; known: auto, cpu, gpu"


def set_in(*keys_and_value):
    """An edit that sets config[k1][k2]... to the value."""
    *keys, value = keys_and_value

    def edit(config):
        for key in keys[:-1]:
            config = config[key]
        config[keys[-1]] = value

    return edit


def cpu(*keys_and_value):
    return set_in("runs", "cpu", *keys_and_value)


BAD_VALUES = [
    # the schema
    (cpu("e2e", "steps", -3), "runs.cpu.e2e.steps: -3 is less than the minimum of 2"),
    (set_in("runs", "gpu", "e2e", "batch_size", "four"), "runs.gpu.e2e.batch_size: 'four' is not of type"),
    (cpu("flash", "d_heads", [300]), "runs.cpu.flash.d_heads.0: 300 is greater than the maximum of 256"),
    (cpu("extra", 1), "runs.cpu: Additional properties are not allowed ('extra'"),
    (
        set_in("model_sizes", {"tiny": {"d_model": 64}}),
        "<top level>: Additional properties are not allowed ('model_sizes'",
    ),
    # the train_step CLI measures each depth once
    (
        cpu("train_step", "num_layers", [1, 1]),
        "runs.cpu.train_step.num_layers: [1, 1] has non-unique elements",
    ),
    (
        cpu("train_step", "sharded", "num_layers", [2, 2]),
        "runs.cpu.train_step.sharded.num_layers: [2, 2] has non-unique elements",
    ),
    # sizes by name
    (cpu("e2e", "sizes", ["huge"]), "runs.cpu.e2e.sizes: unknown model size 'huge'"),
    (cpu("ddp", "size", "huge"), "runs.cpu.ddp.size: unknown model size 'huge'"),
    (cpu("residuals", "size", "huge"), "runs.cpu.residuals.size: unknown model size 'huge'"),
    (
        cpu("checkpointing", "depths", "size", "huge"),
        "runs.cpu.checkpointing.depths.size: unknown model size 'huge'",
    ),
    # heads against the width they split (the residuals CLI's --heads, the train_step CLIs' --num-heads)
    (
        cpu("residuals", "heads", [3, 4]),
        "runs.cpu.residuals.heads: 3 does not divide d_model 64 of size tiny",
    ),
    (
        cpu("residuals", "heads", [64]),
        "runs.cpu.residuals.heads: 64 heads split d_model 64 of size tiny into head dim 1, and RoPE needs an even "
        "head dim",
    ),
    (
        set_in("runs", "gpu", "residuals", "heads", [16, 24]),
        "runs.gpu.residuals.heads: 24 does not divide d_model 2560 of size 2.7B",
    ),
    (
        cpu("train_step", "num_heads", 5),
        "runs.cpu.train_step.num_heads: 5 does not divide d_model 64 (runs.cpu.train_step.d_model)",
    ),
    (
        set_in("runs", "gpu", "train_step", "check", "num_heads", 256),
        "runs.gpu.train_step.check.num_heads: 256 heads split d_model 256 (runs.gpu.train_step.check.d_model) into "
        "head dim 1, and RoPE needs an even head dim",
    ),
    # checkpoint policies against the depth they run at
    (
        cpu("checkpointing", "depths", "policies", ["none", "every:3"]),
        "runs.cpu.checkpointing.depths.policies: every:3 groups more blocks than depth 2 "
        "(runs.cpu.checkpointing.depths.depths); every:K takes K from 1 to the depth",
    ),
    (
        cpu("checkpointing", "policies", "policies", ["every:1", "every:4"]),
        "runs.cpu.checkpointing.policies.policies: every:4 groups more blocks than the 2 layers of size tiny; "
        "every:K takes K from 1 to the depth",
    ),
    # the short-sequence goal compares ours with SDPA in flash_host's table
    (
        cpu("flash_host", "impls", ["triton", "sdpa_cudnn"]),
        "runs.cpu.flash_host.impls: ['triton', 'sdpa_cudnn'] lacks sdpa: the writeup judges the short-sequence goal "
        "on ours (triton) against sdpa",
    ),
    # world sizes against nodes, and one FSDP job per world size
    (
        cpu("fsdp", "jobs", [{"world_size": 2, "nodes": 3, "variants": ["ours"]}]),
        "runs.cpu.fsdp.jobs.0.nodes: world_size 2 is not a multiple of nodes 3",
    ),
    (
        cpu(
            "fsdp", "jobs", [{"world_size": 2, "variants": ["ours"]}, {"world_size": 2, "variants": ["ddp"]}]
        ),
        "runs.cpu.fsdp.jobs.1.world_size: 2 again (jobs.0 has it): one job per world size",
    ),
    # the §8 checks shard fixed FFN shapes over each world size
    (
        set_in("parallelism", "check_world_sizes", [2, 5]),
        "parallelism.check_world_sizes: 5 does not divide every dimension of the FFNs the check shards",
    ),
]


@pytest.mark.parametrize(
    "edit, expected", BAD_VALUES, ids=[expected.split(":")[0] for _, expected in BAD_VALUES]
)
def test_bad_values_name_the_key_and_the_file(workdir, edit, expected):
    bad = edit_config(workdir, edit)
    line = error_line(snakemake(workdir, "-n", "--configfile", str(bad), "--config", "run=cpu"))
    assert line.startswith(f"--configfile bad.yaml: {expected}"), line


def test_every_mistake_gets_its_line(workdir):
    def two_mistakes(config):
        cpu("residuals", "heads", [3])(config)
        cpu("train_step", "num_heads", 5)(config)

    bad = edit_config(workdir, two_mistakes)
    lines = error_lines(snakemake(workdir, "-n", "--configfile", str(bad), "--config", "run=cpu"))
    assert [line.split(":")[1].strip() for line in lines] == [
        "runs.cpu.residuals.heads",
        "runs.cpu.train_step.num_heads",
    ]


def test_the_file_that_set_the_value_is_named(tmp_path):
    """config.yaml, or the --configfile that overrides part of it; the rest still comes from config.yaml."""
    work = copy_pipeline(tmp_path)
    config = work / "config.yaml"
    config.write_text(edited(config.read_text(), cpu("residuals", "heads", [3, 4])))
    line = error_line(snakemake(work, "-n", "--config", "run=cpu"))
    assert line == "config.yaml: runs.cpu.residuals.heads: 3 does not divide d_model 64 of size tiny"

    (work / "part.yaml").write_text("runs:\n  cpu:\n    train_step: {num_heads: 5}\n")
    lines = error_lines(snakemake(work, "-n", "--configfile", "part.yaml", "--config", "run=cpu"))
    assert lines == [
        "config.yaml: runs.cpu.residuals.heads: 3 does not divide d_model 64 of size tiny",
        "--configfile part.yaml: runs.cpu.train_step.num_heads: 5 does not divide d_model 64 "
        "(runs.cpu.train_step.d_model)",
    ]


def test_a_config_mistake_deletes_no_earlier_result(tmp_path):
    """Stopped before any job starts, Snakemake removes nothing, not even what it was asked to redo."""
    work = copy_pipeline(tmp_path)
    earlier = work / "results/cpu/residuals/residuals.csv"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("module,status\nblock,ok\n")
    bad = edit_config(work, cpu("residuals", "heads", [3, 4]))
    result = snakemake(
        work,
        str(earlier.relative_to(work)),
        "--forcerun",
        "residuals",
        "--configfile",
        str(bad),
        "--config",
        "run=cpu",
    )
    assert error_line(result).startswith("--configfile bad.yaml: runs.cpu.residuals.heads: 3 does not divide")
    assert earlier.read_text() == "module,status\nblock,ok\n"


@pytest.mark.parametrize(
    "broken, fixed, expected",
    [
        # an unclosed flow sequence: found where the next key starts, and said where the sequence began
        (
            "      batch_size: 4\n",
            "      batch_size: [4\n",
            "expected ',' or ']', but got ':' (while parsing a flow",
        ),
        # a tab in the indentation
        ("    device: cpu\n", "\tdevice: cpu\n", "found character '\\t' that cannot start any token"),
    ],
    ids=["unclosed-list", "tab"],
)
def test_a_yaml_syntax_error_names_its_line_and_column(tmp_path, broken, fixed, expected):
    work = copy_pipeline(tmp_path)
    config = work / "config.yaml"
    text = config.read_text()
    line_number = text[: text.index(broken)].count("\n") + 1  # the broken line, 1-based
    config.write_text(text.replace(broken, fixed, 1))
    line = error_line(snakemake(work, "-n", "--config", "run=cpu"))
    assert re.match(r"config\.yaml:(\d+):(\d+): YAML syntax error: ", line), line
    assert expected in line
    reported = int(line.split(":")[1])
    assert reported in (line_number, line_number + 1), (
        line_number,
        line,
    )  # the line, or where the next begins
    if reported != line_number:
        assert f"line {line_number}," in line  # then the construct's start is named too


def test_dry_run_of_the_whole_dag(workdir):
    for run in ("cpu", "gpu"):
        result = snakemake(workdir, "-n", "report/writeup.md", "--config", f"run={run}")
        assert result.returncode == 0, result.stderr
        assert f"results/{run}/e2e/" in result.stdout and "writeup" in result.stdout
    gpu = snakemake(workdir, "-n", "report/writeup.md", "--config", "run=gpu").stdout
    for size in ("small", "medium", "large", "xl", "2.7B"):
        assert f"results/gpu/e2e/{size}.csv" in gpu


ACCOUNTING = "src/cs336_systems/experiments/communication_accounting_analysis.py"
ACCOUNTING_LOG = "results/cpu/logs/communication_accounting/xxl.log"


@pytest.mark.parametrize(
    "old, new, reason",
    [
        (  # an exception: its last line
            "def run(args: argparse.Namespace) -> list[dict]:\n",
            "def run(args: argparse.Namespace) -> list[dict]:\n    raise ValueError('made up for the test')\n",
            "ValueError: made up for the test",
        ),
        (  # a flag error: argparse's error line
            "    return p.parse_args(argv)\n",
            "    p.error('--x 16: made up for the test')\n",
            "communication_accounting_analysis.py: error: --x 16: made up for the test",
        ),
    ],
    ids=["exception", "argparse"],
)
def test_a_failed_job_shows_why_in_one_line(tmp_path, old, new, reason):
    work = copy_pipeline(tmp_path)
    cli = work / ACCOUNTING
    assert old in cli.read_text()
    cli.write_text(cli.read_text().replace(old, new, 1))
    result = snakemake(work, "results/cpu/communication_accounting/xxl.csv", "--config", "run=cpu")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    said = [line for line in output.splitlines() if line.startswith("communication_accounting failed:")]
    assert said == [f"communication_accounting failed: {reason} (log: {ACCOUNTING_LOG})"], output[-3000:]
