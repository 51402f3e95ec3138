"""Counts the redesign's targets in the library's source (``zeropp_jax/``), read as text and
ASTs (nothing is imported or run):

    python tools/redesign_metrics.py

* functions with a parameter named ``config`` or ``cfg`` (that take the whole config), and
  how many of them are the transports' resolution (``comm/transports/``);
* functions with both a ``nodes`` and a ``local`` parameter;
* call sites of ``plan_of(`` (its definition, docstrings and strings left out);
* ``apply_units``' named parameters;
* lines that mention ``feedback`` outside ``comm/``.
"""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1] / "zeropp_jax"


def _params(fn: ast.AST) -> list[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def _code_calls(src: str, name: str) -> int:
    """``name(`` as code (not inside a string or a comment)."""
    toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    return sum(1 for a, b in zip(toks, toks[1:])
               if a.type == tokenize.NAME and a.string == name and b.string == "("
               and not (toks[toks.index(a) - 1].string == "def"))


def main() -> None:
    config_fns, transport_fns, node_local, plan_of, feedback = [], 0, [], 0, 0
    apply_params = None
    for path in sorted(ROOT.rglob("*.py")):
        src = path.read_text()
        rel = path.relative_to(ROOT.parent).as_posix()
        plan_of += _code_calls(src, "plan_of")
        if not rel.startswith("zeropp_jax/comm/"):
            feedback += sum("feedback" in line.lower() for line in src.splitlines())
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = _params(node)
            if {"config", "cfg"} & set(names):
                config_fns.append(f"{rel}:{node.name}")
                transport_fns += rel.startswith("zeropp_jax/comm/transports/")
            if "nodes" in names and "local" in names:
                node_local.append(f"{rel}:{node.name}")
            if node.name == "apply_units":
                apply_params = len(names)
    print(f"functions taking the whole config: {len(config_fns)} "
          f"({transport_fns} of them the transports' resolution)")
    print(f"functions taking nodes and local: {len(node_local)}")
    for name in node_local:
        print(f"  {name}")
    print(f"plan_of( call sites: {plan_of}")
    print(f"apply_units named parameters: {apply_params}")
    print(f"lines mentioning feedback outside comm/: {feedback}")


if __name__ == "__main__":
    main()
