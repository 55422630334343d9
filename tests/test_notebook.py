"""notebooks/quickstart.ipynb runs to its end in a Jupyter kernel of this interpreter (the venv's),
from notebooks/ as Jupyter starts it: the tiny recipe trains and its loss falls, the v6e-8 plan
fits, the run generates text. The kernel has the tests' environment but a notebook user's XLA:
one CPU device and optimised compiles (the 15 steps take a quarter of the time on 8 fake devices,
and run 3-4x slower compiled as the tests compile)."""

import json
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from compile_flags import TEST_COMPILES

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"

# Run after the notebook's own cells, in its kernel: what the test checks, as one JSON line.
CHECK = """
import json, sys
losses = [r["loss"] for r in run.metrics if "loss" in r]
found = {"python": [sys.executable, sys.prefix], "losses": losses, "fits": plan.fits, "text": run.generate("The ", 8)}
print(json.dumps(found))
"""


def test_quickstart_notebook_runs_to_its_end():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "commit it without outputs"
    nb.cells.append(nbformat.v4.new_code_cell(CHECK))
    client = NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    tests = ["--xla_force_host_platform_device_count=8", *TEST_COMPILES.split()]  # conftest.py's
    xla = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag not in tests)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | ({"XLA_FLAGS": xla} if xla else {})
    client.execute(env=env)  # a cell's error raises CellExecutionError
    found = json.loads(nb.cells[-1].outputs[-1]["text"].strip().splitlines()[-1])
    assert found["python"] == [sys.executable, sys.prefix], "the kernel is not this interpreter (the venv's)"
    assert len(found["losses"]) >= 5 and found["losses"][-1] < found["losses"][0] - 1.0, found["losses"]
    assert found["fits"] and found["text"].startswith("The ") and len(found["text"]) > 4
    plan_cell = next(cell for cell in nb.cells if cell.source.startswith("plan = api.plan"))
    assert ": fits" in plan_cell.outputs[-1]["data"]["text/plain"]
    assert any("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))
