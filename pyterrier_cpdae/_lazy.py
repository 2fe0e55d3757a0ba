"""Lazy public names of a package: the ``__getattr__``/``__dir__`` pair (PEP 562) that the package's ``__init__``
and the wings' ``__init__`` (``encoder``, ``bm25``) share, so that importing a package starts nothing (no JVM, no
torch model code) until one of its names is used."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose names ``exports`` maps to the modules that define them;
    a name is imported on first use and then cached in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
