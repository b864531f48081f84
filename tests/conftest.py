import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Experiments launched as subprocesses import the package from this checkout even when it is not installed.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(REPO / "src"))
