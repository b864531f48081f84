import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Experiments launched as subprocesses import the package from this checkout even when it is not installed.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(REPO / "src"))


@pytest.fixture(scope="session", autouse=True)
def _smoke_run_in_the_background(request, tmp_path_factory):
    """Where any test of the session needs the pipeline's smoke run (the fixture `smoke_run`), it starts with the
    session, in the background, and runs beside the tests before those that need it."""
    needed = any("smoke_run" in item.fixturenames for item in request.session.items)
    if needed:
        from tests.workflow.test_smoke_pipeline import start_smoke_run

        start_smoke_run(tmp_path_factory)
    yield
    if needed:
        from tests.workflow.test_smoke_pipeline import stop_smoke_run

        stop_smoke_run()


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The repository copy in which the CPU smoke run (`snakemake report/writeup.md --config run=cpu`) has
    completed: tests/workflow/test_smoke_pipeline.py."""
    from tests.workflow.test_smoke_pipeline import completed_smoke_run

    return completed_smoke_run(tmp_path_factory)
