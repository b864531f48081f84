"""experiments/gpu_tests.py: the kernels' tests as rows, and the pass/fail table the writeup shows beside the
timings."""

import json

import pandas as pd
import pytest

from cs336_systems.experiments import gpu_tests
from cs336_systems.report.context import Context
from cs336_systems.report.sections import flash_peers, fsdp

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.kernels.test_flash_hopper" name="test_a[bf16]" time="0.5"/>
<testcase classname="tests.kernels.test_flash_hopper" name="test_b" time="0.25">
  <failure message="AssertionError: relative errors above 0.03: {'dQ': 0.5}&#10;second line">trace</failure>
</testcase>
<testcase classname="tests.kernels.test_flash_hopper" name="test_c" time="0.0">
  <skipped type="pytest.skip" message="needs a CUDA GPU of capability (9, 0)">skip</skipped>
</testcase>
</testsuite></testsuites>"""


def test_junit_rows_keep_each_outcome_and_the_first_line_of_its_message():
    rows = gpu_tests.junit_rows(JUNIT, "tests/kernels/test_flash_hopper.py")
    assert [(r["test"].split("::")[1], r["outcome"]) for r in rows] == [
        ("test_a[bf16]", "passed"),
        ("test_b", "failed"),
        ("test_c", "skipped"),
    ]
    assert rows[1]["message"] == "AssertionError: relative errors above 0.03: {'dQ': 0.5}"
    assert rows[0]["seconds"] == 0.5


def test_without_cuda_every_file_is_a_skipped_row(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_tests.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "kernels.csv"
    gpu_tests.main(["--tests", __file__, "--out", str(out)])
    frame = pd.read_csv(out)
    assert list(frame["status"]) == ["skipped"] and list(frame["reason"]) == ["needs CUDA"]


def test_a_marker_runs_only_the_tests_it_selects(tmp_path):
    tests = tmp_path / "test_marked.py"
    tests.write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_on_gpu():\n    pass\n\ndef test_anywhere():\n    pass\n"
    )
    assert [r["test"].split("::")[1] for r in gpu_tests.run_file(str(tests), 120, "gpu")] == ["test_on_gpu"]
    assert len(gpu_tests.run_file(str(tests), 120)) == 2


def test_a_missing_test_file_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        gpu_tests.parse_args(["--tests", "tests/no_such_test.py", "--out", "x.csv"])
    assert "--tests: no such file: tests/no_such_test.py" in capsys.readouterr().err


def test_the_writeup_names_each_failure_and_counts_the_rest(tmp_path):
    results = tmp_path / "results"
    (results / "gpu_tests").mkdir(parents=True)
    rows = [{**r, "status": "ok"} for r in gpu_tests.junit_rows(JUNIT, "tests/kernels/test_flash_hopper.py")]
    pd.DataFrame(rows).to_csv(results / "gpu_tests/kernels.csv", index=False)
    provenance = {
        "device_name": "NVIDIA H200",
        "device_count": 1,
        "torch": "2.11",
        "git_commit": "abc",
        "timestamp": "t",
    }
    (results / "gpu_tests/kernels.json").write_text(json.dumps({"provenance": provenance, "params": {}}))
    text = flash_peers.gpu_tests(Context("gpu", results, tmp_path))
    assert "| tests/kernels/test_flash_hopper.py |" in text
    assert "**1 failed**: `tests.kernels.test_flash_hopper::test_b`" in text
    assert "1 skipped: needs a CUDA GPU of capability (9, 0)" in text


def test_the_writeup_names_timings_from_other_commits(tmp_path):
    results = tmp_path / "results"
    for deliverable, commit in (("gpu_tests", "new"), ("flash_peers", "old"), ("flash_peers", "new")):
        (results / deliverable).mkdir(parents=True, exist_ok=True)
        name = f"{deliverable}/{commit}"
        row = {"test": "t", "file": "f", "outcome": "passed", "message": "", "status": "ok"}
        pd.DataFrame([row]).to_csv(results / f"{name}.csv", index=False)
        provenance = {"device_name": "NVIDIA H100", "device_count": 1, "torch": "2.11", "git_commit": commit,
                      "timestamp": "t"}  # fmt: skip
        params = {"causal": False, "d_heads": [64]} if deliverable == "flash_peers" else {}
        (results / f"{name}.json").write_text(json.dumps({"provenance": provenance, "params": params}))
    text = flash_peers.gpu_tests(Context("gpu", results, tmp_path))
    assert (
        "All 1 tests that ran passed. Timings below measured at another commit than the one tested here (each "
        "times the kernels of its own commit): not causal d 64 at old." in text
    )
    (results / "flash_peers/old.csv").unlink()
    assert "Timings below" not in flash_peers.gpu_tests(Context("gpu", results, tmp_path))
    # the goal shapes' timings count too, named by shape; a table checked in the interpreter times nothing
    (results / "flash_goals").mkdir()
    shape = {"batch_size": 1, "heads": 32, "seq_len": 32768, "d_head": 128, "impl": "triton", "ms": 1.0}
    for name, commit, extra in (("1x32x32768x128", "later", {}), ("1x2x64x16", "cpu", {"interpreted": True})):
        pd.DataFrame([{**shape, **extra}]).to_csv(results / f"flash_goals/{name}.csv", index=False)
        provenance = {"device_name": "NVIDIA H200", "device_count": 1, "torch": "2.11", "git_commit": commit,
                      "timestamp": "t"}  # fmt: skip
        (results / f"flash_goals/{name}.json").write_text(
            json.dumps({"provenance": provenance, "params": {}})
        )
    assert (
        "Timings below measured at another commit than the one tested here (each times the kernels of its own "
        "commit): the goal shape 1×32×32,768×128 at later."
        in flash_peers.gpu_tests(Context("gpu", results, tmp_path))
    )


def test_the_fsdp_section_shows_its_gpu_tests_and_why_one_was_skipped(tmp_path):
    results = tmp_path / "results"
    (results / "fsdp_gpu_tests").mkdir(parents=True)
    rows = [
        {"file": "tests/parallel/test_fsdp.py", "test": "t::test_the_protocol_with_cuda_tensors[2]",
         "outcome": "passed", "message": "", "status": "ok"},
        {"file": "tests/parallel/test_fsdp.py", "test": "t::test_the_protocol_over_nccl", "outcome": "skipped",
         "message": "needs 2 GPUs", "status": "ok"},
    ]  # fmt: skip
    pd.DataFrame(rows).to_csv(results / "fsdp_gpu_tests/tests.csv", index=False)
    provenance = {"device_name": "NVIDIA H200", "device_count": 1, "torch": "2.11", "git_commit": "abc",
                  "timestamp": "t"}  # fmt: skip
    (results / "fsdp_gpu_tests/tests.json").write_text(json.dumps({"provenance": provenance, "params": {}}))
    text = fsdp.gpu_tests(Context("gpu", results, tmp_path))
    assert "| tests/parallel/test_fsdp.py |        1 |         1 |" in text
    assert "All 1 tests that ran passed. 1 skipped: needs 2 GPUs." in text
    assert "has no results" in fsdp.gpu_tests(Context("gpu", tmp_path / "elsewhere", tmp_path))
