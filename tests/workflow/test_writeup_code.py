"""The writeup's code inputs are every module of the package that the report package imports, directly or
transitively, so that editing one re-renders the writeup: rules/report.smk derives them with imported_modules()
(rules/common.smk), which reads the imports from the source."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO
from ..pipeline import copy_pipeline, snakemake

PACKAGE = "src/cs336_systems/"

# Imports every module of cs336_systems.report (as rendering the writeup does) and lists the package's modules that
# Python has loaded then: what the report imports at module level, found by Python rather than by reading source.
IMPORT_THE_REPORT = """
import importlib, pkgutil, sys
import cs336_systems.report as report
for module in pkgutil.walk_packages(report.__path__, "cs336_systems.report."):
    importlib.import_module(module.name)
for name, module in sorted(sys.modules.items()):
    if name.split(".")[0] == "cs336_systems":
        print(module.__file__)
"""


def writeup_code(workdir: Path) -> set[str]:
    """The writeup rule's source inputs as Snakemake plans them, relative to src/cs336_systems: read from its file
    graph (a dot graph whose node for each rule lists its inputs, then its outputs), which the rules' `message:`
    does not hide as it hides a dry run's input lines."""
    result = snakemake(workdir, "--filegraph", "--forceall", "report/cpu/writeup.md", "--config", "run=cpu")
    nodes = re.findall(r"label=<(.*?)>\]\n", result.stdout, re.S)
    writeup = [node for node in nodes if '<font point-size="18">writeup</font>' in node]
    assert len(writeup) == 1, result.stdout[-3000:]
    inputs = writeup[0].split("&#8618; input")[1].split("output &rarr;")[0]
    paths = re.findall(r'<font face="monospace">(.*?)</font>', inputs)
    return {path.removeprefix(PACKAGE) for path in paths if path.startswith(PACKAGE)}


def test_every_module_the_report_imports_is_an_input_of_the_writeup(tmp_path):
    workdir = copy_pipeline(tmp_path)
    path = os.pathsep.join(filter(None, [str(workdir / "src"), os.environ.get("PYTHONPATH")]))
    listing = subprocess.run(
        [sys.executable, "-c", IMPORT_THE_REPORT],
        cwd=workdir,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listing.returncode == 0, listing.stderr[-3000:]
    files = [Path(line) for line in listing.stdout.split()]
    assert all(file.is_relative_to(workdir / PACKAGE) for file in files), files  # this copy's modules
    imported = {file.relative_to(workdir / PACKAGE).as_posix() for file in files}
    # Not only the report package itself: the library modules it builds on (the model, the accounting formulas).
    assert any(not module.startswith("report/") for module in imported), sorted(imported)

    missing = imported - writeup_code(workdir)
    assert not missing, f"imported by the report but not inputs of the writeup: {sorted(missing)}"


def imported_modules():
    """rules/common.smk's imported_modules(), on its own (the rest of common.smk needs a running workflow)."""
    tree = ast.parse((REPO / "rules/common.smk").read_text())
    [function] = [
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "imported_modules"
    ]
    namespace = {"ast": ast, "Path": Path}
    exec(compile(ast.Module([function], type_ignores=[]), "rules/common.smk", "exec"), namespace)
    return namespace["imported_modules"]


def test_the_derivation_follows_imports_inside_functions_submodules_and_relative_imports(tmp_path):
    """Imports Python would not have run by importing the report: one inside a function, of a submodule named
    in `from package import submodule`, whose own imports (relative here) lead further."""
    sources = {
        "__init__.py": "",
        "report/__init__.py": "import os\n\ndef render():\n    from cs336_systems.lib import sub\n",
        "lib/__init__.py": "",
        "lib/sub.py": "from . import helpers\nfrom ..util import thing\n",
        "lib/helpers.py": "import cs336_systems.deep.leaf\n",
        "lib/unused.py": "",
        "util.py": "thing = 1\n",
        "deep/__init__.py": "",
        "deep/leaf.py": "",
        "other.py": "import cs336_systems.lib.unused\n",
    }
    package = tmp_path / "src/cs336_systems"
    for name, source in sources.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(source)
    assert imported_modules()(package, "report") == sorted(set(sources) - {"lib/unused.py", "other.py"})
