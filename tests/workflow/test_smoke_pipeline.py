"""The CPU smoke run of the whole pipeline, end to end, in a throw-away copy of the repository.

The smoke run happens once per test session (`completed_smoke_run`); test modules that change files work on
their own copy of it (`copy_of_smoke_run`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cs336_systems.report import render

from ..pipeline import announced_jobs, copy_pipeline, snakemake

# The smoke run's own limit, and the pytest-timeout of a test whose setup may build it (with room for the test).
SMOKE_RUN_S = 1500
SMOKE_TIMEOUT_S = SMOKE_RUN_S + 600

# Under pytest-xdist every test that starts from the smoke run goes to one worker, which runs the smoke run once;
# the first to ask for it builds it in its setup, which on a loaded machine may take longer than pytest-timeout's
# default 600 s.
pytestmark = [pytest.mark.xdist_group("smoke_run"), pytest.mark.timeout(SMOKE_TIMEOUT_S)]

_SMOKE: dict[str, Path | subprocess.CompletedProcess] = {}


def completed_smoke_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository copy in which `snakemake report/writeup.md --config run=cpu` has completed (run once)."""
    if "result" not in _SMOKE:
        workdir = copy_pipeline(tmp_path_factory.mktemp("smoke"))
        _SMOKE["result"] = snakemake(workdir, "report/writeup.md", "--config", "run=cpu", timeout=SMOKE_RUN_S)
        _SMOKE["workdir"] = workdir
    result = _SMOKE["result"]
    assert result.returncode == 0, result.stderr[-5000:]
    return _SMOKE["workdir"]


def copy_of_smoke_run(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A private copy of the completed smoke run, with Snakemake's metadata and every file's mtime, so that
    Snakemake sees the same up-to-date state there."""
    dest = tmp_path_factory.mktemp(name) / "repo"
    shutil.copytree(
        completed_smoke_run(tmp_path_factory), dest, symlinks=True, ignore=shutil.ignore_patterns("locks")
    )
    return dest


def job_counts(output: str) -> dict[str, int]:
    """Rule name -> job count from the "Job stats" table that `snakemake` (also -n) prints; {} when none."""
    match = re.search(r"Job stats:\njob\s+count\n[-\s]+\n(.*?)\ntotal\s+\d+", output, re.S)
    if not match:
        return {}
    return {name: int(count) for name, count in (line.split() for line in match.group(1).splitlines())}


# The writeup's sections in which our Triton kernels run on a CPU too, in the interpreter: a "needs CUDA" there is a
# part that gave up where the interpreter could have run.
INTERPRETED_SECTIONS = (
    "1.3.2–1.3.4 FlashAttention-2",
    "FlashAttention-2 against PyTorch's fastest attention",
    "3.1 Autograd residuals",
    "9 The leaderboard's training step",
)
NAN_VALUE = re.compile(r"(?<![A-Za-z])[+−-]?nan(?![A-Za-z])", re.IGNORECASE)
CUDA_CALL = re.compile(r"torch\.cuda\.|cuda\.synchronize")


def cpu_writeup_problems(writeup: str) -> list[str]:
    """What a CPU run's writeup must not say: `nan` as a value, a CUDA call as what was done, and "needs CUDA" in a
    section whose kernels the Triton interpreter runs."""
    problems = []
    for number, line in enumerate(writeup.splitlines(), start=1):
        if NAN_VALUE.search(line):
            problems.append(f"line {number}, nan as a value: {line[:300]}")
        if CUDA_CALL.search(line):
            problems.append(f"line {number}, a CUDA call in a CPU run: {line[:300]}")
    for section in writeup.split("\n## ")[1:]:
        heading = section.splitlines()[0]
        if heading.startswith(INTERPRETED_SECTIONS) and "needs CUDA" in section:
            problems.append(f"§{heading}: 'needs CUDA' where the Triton interpreter runs our kernels")
    return problems


def test_the_cpu_writeup_check_finds_each_problem():
    writeup = "\n".join(
        [
            "# title",
            "## 1.1.3 End-to-end benchmarking",
            "fp32, `torch.cuda.synchronize()` after every step; a nanosecond, financial, NaNo.",
            "| ours | 1.0 | nan |",
            "activations and temporaries +nan GiB",
            "## 1.1.6 Memory profiling",
            "Not measured in this run: needs CUDA.",
            "## 1.3.2–1.3.4 FlashAttention-2",
            "Not measured in this run: needs CUDA.",
        ]
    )
    problems = cpu_writeup_problems(writeup)
    assert [p.split(",")[0].split(":")[0] for p in problems] == [
        "line 3",
        "line 4",
        "line 5",
        "§1.3.2–1.3.4 FlashAttention-2",
    ]
    assert problems[0].startswith("line 3, a CUDA call")  # its words with "nan" in them are no values


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return completed_smoke_run(tmp_path_factory)


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
        "7 Fully-sharded data parallel",
    ):
        assert f"## {heading}" in writeup
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", writeup)
    assert figures, "the writeup has no figures"
    for link in figures:
        assert (smoke / "report" / link).is_file(), link
    assert "| tiny" in writeup  # the e2e table


def test_console_shows_a_line_per_job_and_where_the_writeup_is(smoke):
    """Issue 41: each job is one line on the console (its message: the section and the file it writes), not a rule
    block with every input; at the end, where the writeup and the HTML report are."""
    console = _SMOKE["result"].stdout + _SMOKE["result"].stderr
    jobs = announced_jobs(console)
    assert len(jobs) > 30 and all(job["rule_msg"] for job in jobs), [
        j["rule_name"] for j in jobs if not j["rule_msg"]
    ]
    job_lines = re.findall(r"^Job \d+: (.*) -> results/cpu/", console, re.M)
    assert len(job_lines) == len(jobs) - 1  # the writeup's message names report/, not results/
    assert not re.search(r"^\s+input: ", console, re.M)
    assert "The writeup of run cpu: report/cpu/writeup.md" in console
    assert "snakemake --report report/report.html" in console


def test_cpu_writeup_says_what_the_cpu_did(smoke, tmp_path):
    """Issue 41: rendered from the smoke run, the CPU writeup shows no `nan`, names no CUDA call as what it did, and
    shows what the interpreter can (our kernels' correctness) where it would otherwise say "needs CUDA"."""
    writeup = render("cpu", smoke / "results/cpu", tmp_path)
    assert cpu_writeup_problems(writeup) == []
    assert "Triton interpreter, CPU: correctness only, no timings." in writeup
    assert "are judged on a GPU" in writeup and "goal (one GPU)" not in writeup  # §9: no goal table on a CPU


def test_second_run_has_nothing_to_do(smoke):
    result = snakemake(smoke, "report/writeup.md", "--config", "run=cpu")
    assert result.returncode == 0, result.stderr
    assert "Nothing to be done" in result.stdout + result.stderr


def test_changing_one_size_reruns_only_its_jobs(smoke):
    sizes = smoke / "src/cs336_systems/model/sizes.py"  # the one table of model sizes
    original = sizes.read_text()
    sizes.write_text(original.replace('"tiny": {"d_model": 64,', '"tiny": {"d_model": 96,'))
    try:
        dry = snakemake(smoke, "-n", "report/writeup.md", "--config", "run=cpu")
    finally:
        sizes.write_text(original)
    assert dry.returncode == 0, dry.stderr
    # Every job that builds the tiny model, and nothing that does not (attention, flash, all-reduce, ...).
    assert set(job_counts(dry.stdout + dry.stderr)) == {
        "e2e_benchmark",
        "e2e_warmup_study",
        "profile_model",
        "mixed_precision_e2e",
        "memory_profile",
        "compile_e2e",
        "ddp_benchmark",
        "sharding_benchmark",
        "fsdp_benchmark",
        "residuals",
        "checkpointing_policies",
        "checkpointing_depths",
        "writeup",
    }


def test_html_report_has_every_figure_and_table_captioned(smoke):
    result = snakemake(smoke, "--report", "report/report.html", "--config", "run=cpu")
    assert result.returncode == 0, result.stderr[-5000:]
    html = (smoke / "report/report.html").read_text()
    figures = sorted(p.name for p in (smoke / "report/cpu/figures").glob("*.png"))
    tables = sorted(str(p.relative_to(smoke)) for p in (smoke / "results/cpu").rglob("*.csv"))
    assert figures and tables
    # Self-contained: each file is embedded as a data URI next to its path and caption.
    for path in [f"report/cpu/figures/{name}" for name in figures] + tables + ["report/cpu/writeup.md"]:
        assert f'"{path}": {{"name"' in html, path
    for name in figures:
        assert f"data:image/png;charset=utf8;filename={name};base64," in html, name
    # Captions come from rules/report/*.rst, rendered to HTML per file.
    assert "all-reduce time and bandwidth per tensor size" in html  # figure.rst, for allreduce_cpu.png
    # e2e.rst, with the job's wildcards filled in and rendered from rst
    assert 'end-to-end benchmark of the <tt class=\\"docutils literal\\">tiny</tt> model' in html
    assert html.count('"caption": ""') == 0, "a file of the report has no caption"
