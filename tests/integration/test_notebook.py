"""examples/mesh_layouts.ipynb runs top to bottom without error (under 5 minutes)."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).parents[2] / "examples" / "mesh_layouts.ipynb"


@pytest.mark.slow  # 40 s; the notebook's code is viz/analysis, tested in test_viz.py
def test_mesh_layouts_notebook_runs_every_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "simulate_cpu_devices(8)" in code[0].source
    # The kernel is a fresh process running this interpreter (ipykernel's native spec), so
    # it simulates its own 8 devices; any cell error raises CellExecutionError here.
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in code for o in c.get("outputs", []))
    assert "| 2x4 |" in outputs and "decode step 0 B/node" in outputs
    assert sum(1 for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})) >= 5
