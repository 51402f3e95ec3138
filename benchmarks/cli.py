"""What the benchmark scripts share on their command line: where results go.

Results go to ``benchmarks/out/`` (git-ignored) unless ``--out benchmarks/results`` asks to
update the tracked ones, which the docs' tables are rendered from.
"""

from __future__ import annotations

import argparse
import pathlib

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
OUT_HELP = ("directory for the results (default benchmarks/out/, git-ignored; "
            "--out benchmarks/results updates the tracked ones)")


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """``--out DIR``: where the script writes its JSON (and PNG) results."""
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR, help=OUT_HELP)
