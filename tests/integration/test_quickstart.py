"""examples/quickstart.py runs as the README says, trains, and holds the README's snippet."""

from __future__ import annotations

import math
import pathlib
import re
import subprocess
import sys

from helpers import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "quickstart.py"


def _normalize(line: str) -> str:
    return " ".join(line.split())


def test_quickstart_runs_and_the_loss_falls():
    # Its own process: it simulates its 8 CPU devices itself, before JAX starts.
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss (\S+)$", proc.stdout, re.M)]
    assert len(losses) >= 5, proc.stdout
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < 0.5 * losses[0], losses
    assert "consolidate(): " in proc.stdout


def test_readme_use_it_snippet_is_in_quickstart():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Use it\n", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("\n```", 1)[0]
    program = {_normalize(line) for line in SCRIPT.read_text().splitlines()}
    missing = [line for line in snippet.splitlines()
               if line.strip() and not line.startswith("import ")
               and _normalize(line) not in program]
    assert not missing, f"README lines not in examples/quickstart.py: {missing}"
