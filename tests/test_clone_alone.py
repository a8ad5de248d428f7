"""The suite from a clone alone: no test reads the shared data beside the checkout (../shared)
except through conftest's `shared_data`, which skips naming the path, or under an existence check
of its own; everything else uses the package's assets (megapar/assets)."""

import ast
import functools
import os

import _pytest.outcomes
import pytest
from conftest import ROOT, shared_data

TESTS = os.path.join(ROOT, "tests")
HERE = os.path.basename(__file__)


@functools.cache
def _sources() -> tuple[tuple[str, str], ...]:
    """(name, text) of every test file but conftest.py and this one, read once."""
    out = []
    for name in sorted(os.listdir(TESTS)):
        if name.endswith(".py") and name not in ("conftest.py", HERE):
            with open(os.path.join(TESTS, name)) as f:
                out.append((name, f.read()))
    return tuple(out)


@functools.cache
def _tree(name: str) -> ast.AST:
    """The syntax tree of test file `name`, parsed once for both tests below (only read)."""
    return ast.parse(dict(_sources())[name], os.path.join(TESTS, name))


def _test_files(naming: str = ""):
    """(name, syntax tree) of the test files; with `naming`, of those whose text holds that
    identifier (a file without it holds no name node of it)."""
    for name, text in _sources():
        if naming in text:
            yield name, _tree(name)


def _builds_the_shared_path(node: ast.AST) -> bool:
    """A string that names the shared data's place itself ("shared", "../shared/...")."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    value = node.value.replace("\\", "/")
    return value == "shared" or "../shared" in value or "shared/data" in value


def _checks_or_skips(function: ast.AST) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", "")
            if name in ("exists", "isdir", "isfile", "skip", "shared_data", "_shared"):
                return True
    return False


def test_no_test_builds_the_path_of_the_shared_data_itself():
    found = [f"{name}:{node.lineno}" for name, tree in _test_files()
             for node in ast.walk(tree) if _builds_the_shared_path(node)]
    assert not found, (f"{found}: reach ../shared through conftest.shared_data(...) (it skips "
                       f"where a clone has none) or use megapar/assets")


def test_every_use_of_shared_data_is_checked_or_skipped():
    unchecked = []
    for name, tree in _test_files("SHARED_DATA"):
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.Lambda)):
                continue
            uses = any(isinstance(n, ast.Name) and n.id == "SHARED_DATA"
                       for n in ast.walk(function))
            if uses and not _checks_or_skips(function):
                unchecked.append(f"{name}:{function.lineno}")
    assert not unchecked, (f"{unchecked} read SHARED_DATA without checking it is there: use "
                           f"conftest.shared_data(...), which skips where a clone has none")


def test_shared_data_skips_naming_the_path_where_there_is_none(monkeypatch, tmp_path):
    import conftest

    monkeypatch.setattr(conftest, "SHARED_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(_pytest.outcomes.Skipped) as skipped:
        conftest.shared_data("corpus")
    assert str(tmp_path / "nowhere" / "corpus") in str(skipped.value)
    assert "MEGAPAR_SHARED_DATA" in str(skipped.value)
    (tmp_path / "nowhere" / "corpus").mkdir(parents=True)
    assert conftest.shared_data("corpus") == str(tmp_path / "nowhere" / "corpus")
    assert shared_data is conftest.shared_data
