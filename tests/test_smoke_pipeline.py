"""The CPU smoke run of the whole pipeline, end to end, in a throw-away copy of the repository."""

import re

import pytest

from .pipeline import copy_pipeline, snakemake


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    workdir = copy_pipeline(tmp_path_factory.mktemp("smoke"))
    result = snakemake(workdir, "report/writeup.md", "--config", "run=cpu", timeout=1500)
    assert result.returncode == 0, result.stderr[-5000:]
    return workdir


def test_writeup_has_every_section_and_its_figures(smoke):
    writeup = (smoke / "report/writeup.md").read_text()
    assert writeup == (smoke / "report/cpu/writeup.md").read_text().replace("](figures/", "](cpu/figures/")
    for heading in (
        "1.1.3 End-to-end",
        "1.1.4 Profiling",
        "1.2.1 PyTorch attention",
        "1.3.2–1.3.4 FlashAttention-2",
        "2.1.3 All-reduce",
        "3 Optimizer state sharding",
    ):
        assert f"## {heading}" in writeup
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", writeup)
    assert figures, "the writeup has no figures"
    for link in figures:
        assert (smoke / "report" / link).is_file(), link
    assert "| tiny" in writeup  # the e2e table


def test_second_run_has_nothing_to_do(smoke):
    result = snakemake(smoke, "report/writeup.md", "--config", "run=cpu")
    assert result.returncode == 0, result.stderr
    assert "Nothing to be done" in result.stdout + result.stderr


def test_changing_one_size_reruns_only_its_jobs(smoke):
    config = smoke / "config.yaml"
    original = config.read_text()
    config.write_text(original.replace("tiny:   {d_model: 64,", "tiny:   {d_model: 96,"))
    try:
        dry = snakemake(smoke, "-n", "report/writeup.md", "--config", "run=cpu")
    finally:
        config.write_text(original)
    assert dry.returncode == 0, dry.stderr
    assert "e2e_benchmark" in dry.stdout and "writeup" in dry.stdout
