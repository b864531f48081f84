"""`snakemake --lint` finds nothing: helpers live in rules/common.smk (no functions beside rules), every rule that
runs has a log."""

import pytest

from ..pipeline import copy_pipeline, snakemake


@pytest.mark.parametrize("run", ["cpu", "gpu"])
def test_lint_reports_nothing(tmp_path, run):
    result = snakemake(copy_pipeline(tmp_path), "--lint", "--config", f"run={run}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "Lints for" not in output, output[-5000:]
    assert "your workflow is in a good condition" in output, output[-5000:]
