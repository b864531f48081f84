"""Bad configuration fails at start, in one line that names the key, before any job runs."""

import pytest
import yaml

from ..pipeline import copy_pipeline, snakemake


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_pipeline(tmp_path_factory.mktemp("pipeline"))


def edit_config(workdir, edit):
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    edit(config)
    path = workdir / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def error_line(result):
    lines = [line for line in (result.stderr + result.stdout).splitlines() if "config.yaml:" in line]
    assert result.returncode != 0, result.stdout + result.stderr
    assert lines, result.stdout + result.stderr
    return lines[0]


def test_unknown_run(workdir):
    line = error_line(snakemake(workdir, "-n", "--config", "run=nope"))
    assert "run: unknown run 'nope'" in line and "cpu" in line and "gpu" in line


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda c: c["runs"]["cpu"]["e2e"].update(steps=-3),
            "runs.cpu.e2e.steps: -3 is less than the minimum of 2",
        ),
        (
            lambda c: c["runs"]["gpu"]["e2e"].update(batch_size="four"),
            "runs.gpu.e2e.batch_size: 'four' is not of type",
        ),
        (
            lambda c: c["runs"]["cpu"]["e2e"].update(sizes=["huge"]),
            "runs.cpu.e2e.sizes: unknown model size 'huge'",
        ),
        (
            lambda c: c["runs"]["cpu"]["ddp"].update(size="huge"),
            "runs.cpu.ddp.size: unknown model size 'huge'",
        ),
        (
            lambda c: c.update(model_sizes={"tiny": {"d_model": 64}}),
            "<top level>: Additional properties are not allowed ('model_sizes'",
        ),
        (
            lambda c: c["runs"]["cpu"]["flash"].update(d_heads=[300]),
            "runs.cpu.flash.d_heads.0: 300 is greater than the maximum of 256",
        ),
        (
            lambda c: c["runs"]["cpu"].update(extra=1),
            "runs.cpu: Additional properties are not allowed ('extra'",
        ),
    ],
)
def test_bad_values_name_the_key(workdir, edit, expected):
    bad = edit_config(workdir, edit)
    line = error_line(snakemake(workdir, "-n", "--configfile", str(bad), "--config", "run=cpu"))
    assert expected in line


def test_dry_run_of_the_whole_dag(workdir):
    for run in ("cpu", "gpu"):
        result = snakemake(workdir, "-n", "report/writeup.md", "--config", f"run={run}")
        assert result.returncode == 0, result.stderr
        assert f"results/{run}/e2e/" in result.stdout and "writeup" in result.stdout
    gpu = snakemake(workdir, "-n", "report/writeup.md", "--config", "run=gpu").stdout
    for size in ("small", "medium", "large", "xl", "2.7B"):
        assert f"results/gpu/e2e/{size}.csv" in gpu
