"""The public API is a checked-in list (``public_api.txt``): the package root's names and
those of each documented short path (``zeropp_jax.checkpoint``, ...). A removal or rename
shows here and is made on purpose, with the old spelling in ``zeropp_jax/_deprecations.py``,
where it keeps working for a release and warns."""

import importlib
import pathlib
import re
import types
import warnings

import pytest

import zeropp_jax as zpp
from zeropp_jax import _deprecations

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAYERS = {"core", "quant", "comm", "units", "train", "parallel", "inference", "measure", "plan"}


def _listed() -> dict[str, set[str]]:
    out = {}
    for line in (HERE / "public_api.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            module, names = line.split(":", 1)
            out[module] = set(names.split())
    return out


def _own_public_names(module: types.ModuleType) -> set[str]:
    """The public names a module binds, its submodules left out."""
    return {n for n, v in vars(module).items() if not n.startswith("_")
            and not (isinstance(v, types.ModuleType) and v.__name__.startswith("zeropp_jax."))}


def test_the_public_api_is_the_checked_in_list():
    listed = _listed()
    assert set(listed) == {"zeropp_jax", *_deprecations.SHORT_PATHS}, sorted(listed)
    modules = {"zeropp_jax": zpp, **{p: importlib.import_module(p)
                                     for p in _deprecations.SHORT_PATHS}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the public spelling never warns
        for path, module in modules.items():
            assert set(module.__all__) == listed[path], (
                f"{path}.__all__ differs from tests/core/public_api.txt: added "
                f"{sorted(set(module.__all__) - listed[path])}, removed "
                f"{sorted(listed[path] - set(module.__all__))}")
            for name in module.__all__:
                getattr(module, name)
            # Nothing beside the listed names (an import a star would pass on).
            assert _own_public_names(module) - set(module.__all__) == set(), path
    # The root's submodules: the layer folders, the short paths and, once imported, the
    # old root modules (which warn).
    submodules = {n for n, v in vars(zpp).items() if isinstance(v, types.ModuleType)
                  and v.__name__.startswith("zeropp_jax.") and not n.startswith("_")}
    allowed = LAYERS | {p.split(".")[1] for p in _deprecations.SHORT_PATHS} | {
        m.split(".")[1] for m in _deprecations.MOVED if m.count(".") == 1}
    assert submodules <= allowed, sorted(submodules - allowed)
    public_dir = {n for n in dir(zpp) if not n.startswith("_")} - submodules
    assert public_dir == set(zpp.__all__) - {p.split(".")[1] for p in _deprecations.SHORT_PATHS}


def test_every_old_spelling_warns_names_the_new_one_and_still_works():
    for old, entry in _deprecations.MOVED.items():
        new = _deprecations.resolve(entry.new)
        if old == "zeropp_jax.ZeroPPConfig.auto":
            for owner in (zpp.ZeroPPConfig, zpp.ZeroPPConfig.zero3()):
                with pytest.warns(DeprecationWarning, match=re.escape(entry.new)) as record:
                    assert owner.auto is zpp.auto_config
                assert record[0].filename == __file__  # the user's line, not the library's
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(old)
        # Imported again (as a fresh process would): the import warns and gives the names.
        with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is deprecated")):
            importlib.reload(module)
        assert getattr(zpp, old.split(".")[1]) is module
        shared = {n for n in _own_public_names(module)} & set(dir(new))
        assert shared, f"{old} gives none of {entry.new}'s names"
        for name in shared:
            assert getattr(module, name) is getattr(new, name), (old, name)
    # What the table says of each old module: the names users reached through it.
    assert zpp.losses.token_mean is zpp.token_mean
    assert zpp.qgz.qgz_reduce_scatter is zpp.collectives.qgz_reduce_scatter
    assert zpp.wrap.auto_units is importlib.import_module("zeropp_jax.units.wrap").auto_units


def test_a_short_path_forwards_its_home_modules_other_names_with_a_warning():
    home = importlib.import_module("zeropp_jax.train.checkpoint")
    with pytest.warns(DeprecationWarning, match="import it from zeropp_jax.train.checkpoint"):
        assert zpp.checkpoint.FORMAT is home.FORMAT
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        zpp.checkpoint.nothing_here  # noqa: B018


def test_the_api_reference_names_only_what_exists():
    # docs/reference.md's ``::: target`` blocks and their ``members:`` lists.
    text = (ROOT / "docs" / "reference.md").read_text()
    checked = 0
    for block in re.split(r"\n(?=::: )", text):
        if not block.startswith("::: "):
            continue
        target = block.split()[1]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            obj = _deprecations.resolve(target)
            for member in re.findall(r"^\s+- (\w+)\s*$", block, re.M):
                assert hasattr(obj, member), f"reference.md: {target}.{member} does not exist"
                checked += 1
    assert checked > 20, checked
    # The short paths the reference names are the table's.
    named = set(re.findall(r"`(zeropp_jax\.\w+)`", text.split("## ", 1)[0]))
    assert named == set(_deprecations.SHORT_PATHS), sorted(named ^ set(_deprecations.SHORT_PATHS))
