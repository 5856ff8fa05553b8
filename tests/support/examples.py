"""The scripts of examples/ imported as modules by the tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(script: str) -> ModuleType:
    """``examples/<script>`` as the module named by its stem, imported once (examples/ is no package)."""
    name = Path(script).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
