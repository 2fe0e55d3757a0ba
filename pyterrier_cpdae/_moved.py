"""Module-level ``__getattr__``/``__dir__`` for a module whose names moved: reading one warns (``DeprecationWarning``)
and returns the object from its new module."""
from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable


def moved_names(module: str, moved_to: str, names: tuple[str, ...]) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """``(__getattr__, __dir__)`` for ``module``, whose ``names`` now live in ``moved_to``."""
    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} moved to {moved_to}.{name}; import it from there", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(moved_to), name)

    def __dir__() -> list:
        return sorted(names)

    return __getattr__, __dir__
