"""A script of the repository (a tool, a benchmark, an example: files outside the package)
loaded as a module, for the tests of its functions."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The script at `relative` (to the repository's root), run as a module named by its
    file (``tools/layout_fuzz.py``: ``layout_fuzz``)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
