"""The main job's script (``experiments/main.py``) loaded as a module, for the tests that call its ``main``."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

MAIN = Path(__file__).resolve().parents[2] / "experiments" / "main.py"


def load_main(name: str) -> ModuleType:
    """A fresh module of ``experiments/main.py`` named ``name`` (each test file its own name, so their loads stay
    apart)."""
    spec = importlib.util.spec_from_file_location(name, MAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
