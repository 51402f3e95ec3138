"""What the benchmark scripts share on their command line and in their output: the
simulated mesh, where results go, and how they are written.

Results go to ``benchmarks/out/`` (git-ignored) unless ``--out benchmarks/results`` asks to
update the tracked ones, which the docs' tables are rendered from.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
OUT_HELP = ("directory for the results (default benchmarks/out/, git-ignored; "
            "--out benchmarks/results updates the tracked ones)")


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """``--out DIR``: where the script writes its JSON (and PNG) results."""
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR, help=OUT_HELP)


def add_convergence_run_arguments(p: argparse.ArgumentParser) -> None:
    """The training run of the convergence studies (examples/train_gpt.py's flags, the
    convergence study's defaults: a 3.3M GPT on a 2x2 mesh, 400 steps)."""
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=16)


def mesh_parser(description: str | None, *, local: int = 4,
                local_help: str | None = None) -> argparse.ArgumentParser:
    """The parser of a benchmark on a simulated ``(node, local)`` mesh: ``--nodes`` (default
    2), ``--local`` (default ``local``) and ``--out``; the script adds its own options."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=local, help=local_help)
    add_out_argument(p)
    return p


def simulate_mesh_devices(args: argparse.Namespace) -> None:
    """``--nodes`` x ``--local`` simulated CPU devices; call it first, before JAX touches
    its backend."""
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.nodes * args.local)


def timed_gpt_parser(description: str | None) -> argparse.ArgumentParser:
    """The parser of a benchmark timing variants of the example GPT in interleaved rounds
    (``common.timed_rounds``): the mesh (``--nodes``, ``--local``, default 2 x 2), the
    model (``--layers``, ``--d-model``, ``--heads``, ``--seq-len``, ``--batch``), the rounds
    (``--rounds``, ``--steps-per-round``) and ``--out``."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps-per-round", type=int, default=3)
    add_out_argument(p)
    return p


def cpu_name() -> str:
    """This machine's CPU model (``/proc/cpuinfo``), for a result's JSON."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def write_json(out: pathlib.Path, name: str, results: Any) -> pathlib.Path:
    """Writes ``results`` to ``out/name`` (creating ``out``), says so, returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return path


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` drawing to files only (the Agg backend), or None, with a note,
    when matplotlib is not installed (``pip install matplotlib``, or the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install matplotlib)")
        return None
    return plt
