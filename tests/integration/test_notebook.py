"""examples/mesh_layouts.ipynb is generated from examples/mesh_layouts_notebook.py, and runs.

The script is the one source: ``examples/make_notebook.py`` writes the notebook from it. The
first test pins that the committed notebook is exactly what the generator makes (so the two
cannot drift apart); its cells are then the script's, in the script's order, so running the
script top to bottom in one process runs every cell of the notebook as a kernel would. The
second test runs the script (a plain Python process, not a Jupyter kernel through nbclient).
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import nbformat
import pytest

from helpers import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NOTEBOOK = EXAMPLES / "mesh_layouts.ipynb"
SCRIPT = EXAMPLES / "mesh_layouts_notebook.py"
REGENERATE = ".venv/bin/python examples/make_notebook.py"


def _generator():
    spec = importlib.util.spec_from_file_location("make_notebook", EXAMPLES / "make_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notebook_is_generated_from_the_script():
    make_notebook = _generator()
    assert make_notebook.NOTEBOOKS[SCRIPT.name] == NOTEBOOK.name
    expected = make_notebook.render(SCRIPT)
    assert make_notebook.render(SCRIPT) == expected  # deterministic
    assert NOTEBOOK.read_text(encoding="utf-8") == expected, (
        f"examples/{NOTEBOOK.name} is not what examples/{SCRIPT.name} generates (edited by "
        f"hand, or the script was edited without regenerating). Put the change in the script, "
        f"then regenerate the notebook: {REGENERATE}")
    # A valid notebook, in the exact form nbformat (and so Jupyter) writes it.
    nb = nbformat.reads(expected, as_version=4)
    nbformat.validate(nb)
    assert nbformat.writes(nb) + "\n" == expected
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert "simulate_cpu_devices(8)" in code[0].source


# Runs the script as ``python examples/mesh_layouts_notebook.py`` would, with matplotlib's
# non-interactive backend and plt.show() counting (then closing) the figures it would show.
RUNNER = """
import runpy, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
shown = []
def show(*args, **kwargs):
    shown.extend(plt.get_fignums())
    plt.close("all")
plt.show = show
runpy.run_path(sys.argv[1], run_name="__main__")
print(f"figures shown: {len(shown)}")
"""


@pytest.mark.slow  # ~30 s; the notebook's code is viz/analysis, tested in test_viz.py
def test_mesh_layouts_script_runs_every_cell():
    # A fresh process: it simulates its own 8 devices (the first cell).
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(SCRIPT)], cwd=EXAMPLES,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 devices" in proc.stdout
    assert "| 2x4 |" in proc.stdout and "decode step 0 B/node" in proc.stdout, proc.stdout
    assert "figures shown: 5" in proc.stdout, proc.stdout  # 4 layouts' overviews, the bars
