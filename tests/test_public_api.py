"""The public API contract's names exist where it says, and the lists of them agree."""

import ast
import importlib
import types
from pathlib import Path

import pytest

import jdist

ROOT = Path(jdist.__file__).parent
SUBPACKAGES = ["checkpoint", "collectives", "ddp", "ddp.hooks", "dp", "launch", "optim", "rpc",
               "sampler", "store", "testing"]


def test_top_level_names():
    for name in ["ReduceOp", "ProcessGroup", "NON_GROUP_MEMBER", "errors", "__version__"]:
        assert hasattr(jdist, name), name


def test_reduce_ops():
    assert [op.name for op in jdist.ReduceOp] == [
        "SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def _type_checking_names(tree: ast.Module) -> dict[str, str]:
    """name -> module of each ``from m import name as name`` under ``if TYPE_CHECKING``."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.unparse(imp)
                for a in imp.names:
                    assert a.asname == a.name, f"{ast.unparse(imp)}: re-export as itself"
                    out[a.name] = imp.module
    return out


def test_top_level_lists_agree():
    """``__all__``, the lazy table and the TYPE_CHECKING block name the same things."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    typed = _type_checking_names(tree)
    lazy = {name: mod for mod, names in jdist._LAZY.items() for name in names}
    assert typed == lazy
    assert set(jdist.__all__) == set(lazy) | {"errors", "__version__"}
    assert len(jdist.__all__) == len(set(jdist.__all__)), "a name listed twice in __all__"
    for name, mod in lazy.items():
        assert name in importlib.import_module(mod).__all__, f"{name} not in {mod}.__all__"
        assert getattr(jdist, name) is getattr(importlib.import_module(mod), name)


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_subpackage_all_matches_its_reexports(package):
    """Each subpackage's ``__all__`` is exactly what its ``__init__`` re-exports."""
    module = importlib.import_module(f"jdist.{package}")
    tree = ast.parse(Path(module.__file__).read_text())
    exported = set(_type_checking_names(tree))
    submodules = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jdist"):
            for a in node.names:
                if a.asname == a.name and not a.name.startswith("_"):
                    is_sub = isinstance(getattr(module, a.name, None), types.ModuleType)
                    (submodules if is_sub else exported).add(a.name)
    listed = set(module.__all__)
    assert len(module.__all__) == len(listed), f"jdist.{package}.__all__ lists a name twice"
    missing = sorted(n for n in listed if not hasattr(module, n))
    assert not missing, f"jdist.{package}.__all__ names missing attributes: {missing}"
    assert exported <= listed, f"re-exported but not in __all__: {sorted(exported - listed)}"
    defined = {t.id for node in tree.body if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name)}
    defined |= {node.name for node in tree.body
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    lazy = set(getattr(module, "_LAZY", ()))  # names loaded on first use by __getattr__
    unexplained = listed - exported - submodules - defined - lazy
    assert not unexplained, f"jdist.{package}.__all__ names nothing its __init__ makes: " \
        f"{sorted(unexplained)}"


def test_store_names_load_without_collectives():
    """``jdist.TCPStore`` is ``jdist.store.TCPStore`` (the JAX-free home)."""
    assert jdist.TCPStore is jdist.store.TCPStore
    assert jdist.collectives.TCPStore is jdist.store.TCPStore
