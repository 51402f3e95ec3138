"""Writes the example notebooks from their scripts, the one source of each.

    .venv/bin/python examples/make_notebook.py           # regenerate every notebook
    .venv/bin/python examples/make_notebook.py --check   # exit 1 if one is out of date

A script is plain Python in the "percent" cell format (the subset jupytext and VS Code read):

    # %%                 starts a code cell; its lines are copied as they are
    # %% [markdown]      starts a markdown cell; every line is "#" or "# " + markdown

Lines before the first ``# %%`` (the script's docstring) are not part of the notebook; blank
lines at the start and end of a cell are dropped. The notebook has no outputs, fixed cell ids
(``cell-00``, ``cell-01``, ...) and fixed metadata, and is written as nbformat writes it
(one-space indent, sorted keys), so the same script always gives the same bytes and
regenerating an unchanged notebook leaves ``git status`` clean. Standard library only.
"""

from __future__ import annotations

import json
import pathlib
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent
NOTEBOOKS = {  # script -> the notebook written from it, both in examples/
    "mesh_layouts_notebook.py": "mesh_layouts.ipynb",
}
METADATA = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}}
CODE, MARKDOWN = "# %%", "# %% [markdown]"


def cells(text: str) -> list[tuple[str, str]]:
    """``(cell_type, source)`` for each cell of a percent-format script's text."""
    found: list[tuple[str, list[str]]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("# %%"):
            if line.rstrip() not in (CODE, MARKDOWN):
                raise ValueError(f"line {number}: a cell starts with exactly {CODE!r} or "
                                 f"{MARKDOWN!r}, not {line!r}")
            found.append(("markdown" if line.rstrip() == MARKDOWN else "code", []))
        elif not found:
            continue  # the script's header, before the first cell
        elif found[-1][0] == "markdown":
            if line != "#" and not line.startswith("# "):
                if line.strip():
                    raise ValueError(f"line {number}: a markdown cell's lines are '#' or "
                                     f"'# ' + text, not {line!r}")
                line = "#"  # a blank line: the cells' separator, dropped below if trailing
            found[-1][1].append(line[2:])
        else:
            found[-1][1].append(line)
    out = []
    for cell_type, lines in found:
        while lines and not lines[0].strip():
            lines.pop(0)
        while lines and not lines[-1].strip():
            lines.pop()
        if not lines:
            raise ValueError(f"an empty {cell_type} cell (cell {len(out)})")
        out.append((cell_type, "\n".join(lines)))
    if not out:
        raise ValueError(f"no cells: a cell starts with a {CODE!r} line")
    return out


def notebook(text: str) -> dict:
    """The nbformat 4.5 notebook (as JSON data) of a percent-format script's text."""
    nb_cells = []
    for index, (cell_type, source) in enumerate(cells(text)):
        lines = source.splitlines(keepends=True)  # nbformat's on-disk form of a source
        cell = {"cell_type": cell_type, "id": f"cell-{index:02d}", "metadata": {},
                "source": lines}
        if cell_type == "code":
            cell.update(execution_count=None, outputs=[])
        nb_cells.append(cell)
    return {"cells": nb_cells, "metadata": METADATA, "nbformat": 4, "nbformat_minor": 5}


def render(script: pathlib.Path) -> str:
    """The notebook file's text for ``script``, formatted as ``nbformat.write`` does."""
    nb = notebook(script.read_text(encoding="utf-8"))
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print(__doc__.strip().splitlines()[0], "\nusage: make_notebook.py [--check]",
              file=sys.stderr)
        return 2
    stale = 0
    for script_name, notebook_name in NOTEBOOKS.items():
        script, out = EXAMPLES / script_name, EXAMPLES / notebook_name
        text = render(script)
        current = out.read_text(encoding="utf-8") if out.exists() else None
        if current == text:
            print(f"{out.name} is up to date with {script.name}")
        elif check:
            stale += 1
            print(f"{out.name} differs from what {script.name} generates; regenerate it with "
                  f"`.venv/bin/python examples/make_notebook.py`", file=sys.stderr)
        else:
            with out.open("w", encoding="utf-8", newline="\n") as f:
                f.write(text)
            print(f"wrote {out.name} from {script.name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
