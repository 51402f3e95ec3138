"""The package's shape: the layers contract has no exceptions, the documented import paths
are plain modules (no ``sys.modules`` rewriting), and the planner is reached from the top."""

import ast
import dataclasses
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
    # The planner is a top-layer function; the config (bottom layer) imports nothing of
    # it. Its old spelling, ZeroPPConfig.auto, is answered by the deprecation table
    # (tests/core/test_public_api.py), which finds zpp.auto_config by name when read.
    assert zpp.auto_config.__module__ == "zeropp_jax.plan.auto"
    imported = set()
    for node in ast.walk(ast.parse((ROOT / "zeropp_jax/core/config.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert not [m for m in imported if m and m.startswith("zeropp_jax.plan")], imported
    assert "auto" not in {f.name for f in dataclasses.fields(zpp.ZeroPPConfig)}


# A technique's settings; outside the transports, the config (with its groups and the
# DeepSpeed reader) and the planner that builds candidate configs, code asks the
# transport plan instead of reading them.
TECHNIQUE_FIELDS = {
    "qwz", "hpz", "qgz", "weight_format", "grad_bits", "qwz_hadamard", "qgz_hadamard",
    "stochastic_rounding", "qgz_error_feedback", "qgz_signs", "hpz_group_size",
    "qgz_pipeline_stages", "qgz_until", "quantize_frozen"}
READERS = {"comm/transports", "core/config.py", "core/settings.py", "core/deepspeed.py",
           "plan/auto.py"}


def _is_config(node: ast.AST) -> bool:
    """``config``, ``cfg``, ``base`` or ``<anything>.config``: a ZeroPPConfig by the
    library's naming."""
    if isinstance(node, ast.Name):
        return node.id in ("config", "cfg", "base")
    return isinstance(node, ast.Attribute) and node.attr == "config"


def test_only_the_transports_and_the_config_read_technique_settings():
    offenders = []
    for path in (ROOT / "zeropp_jax").rglob("*.py"):
        rel = path.relative_to(ROOT / "zeropp_jax").as_posix()
        if any(rel.startswith(r) for r in READERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in TECHNIQUE_FIELDS
                    and _is_config(node.value)):
                offenders.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def test_no_module_level_caches():
    # Caches belong to an owner (the engine's memo, a call's local memo), not to a module:
    # a module-level cache keeps configs, classes and closures alive for the process.
    offenders = []
    for path in (ROOT / "zeropp_jax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                for dec in node.decorator_list:
                    text = ast.unparse(dec)
                    if "lru_cache" in text or text.endswith("cache"):
                        offenders.append(f"{path.name}:{node.lineno} {text}")
    assert not offenders, offenders
