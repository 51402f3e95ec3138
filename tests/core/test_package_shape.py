"""The package's shape: the layers contract has no exceptions, the documented import paths
are plain modules (no ``sys.modules`` rewriting), and the planner is reached from the top."""

import ast
import pathlib
import tomllib

import zeropp_jax as zpp

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_contracts_ignore_nothing():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    assert contracts, "pyproject.toml lost its import-linter contracts"
    for contract in contracts:
        assert not contract.get("ignore_imports"), contract["name"]


def test_no_module_rewrites_sys_modules():
    offenders = []
    for path in (ROOT / "zeropp_jax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(
                    node.value, ast.Name) and node.value.id == "sys":
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


def test_core_config_does_not_reach_the_planner():
    # The planner is a top-layer function; the config (bottom layer) knows nothing of it.
    assert zpp.auto_config.__module__ == "zeropp_jax.plan.auto"
    assert not hasattr(zpp.ZeroPPConfig, "auto")
