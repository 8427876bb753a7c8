"""The bench scripts as modules for the tests: bench/ is a folder of scripts, not a package."""

import importlib.util
import sys
from types import ModuleType

from tests.distributed import ROOT


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` run afresh as the module ``<name>_bench``, registered in
    ``sys.modules`` (dataclasses and pickle look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
