"""The registry of pre-training objectives: name -> :class:`~pretrain.objectives.base.Objective` subclass.

It sits below :mod:`pretrain.arguments` and :mod:`pretrain.objectives`: the parser composes a run's options from the
objective's ``Options`` looked up here, and the objectives register themselves here
(:func:`pretrain.objectives.register_objective`).  Neither imports the other through it: the registry finds the
objectives the way it finds third-party ones, as plugins: it imports every module of the ``pretrain.objectives``
package by name (so a new file there is found without editing any other file) and the modules of the
``pretrain.objectives`` entry-point group of installed packages.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
from typing import Any

logger = logging.getLogger(__name__)

#: the package whose modules are the built-in objectives
PACKAGE = "pretrain.objectives"
#: name -> objective class, in registration order.
_REGISTRY: dict[str, type] = {}
#: modules that failed to import: module name -> error text (named when an objective is not found).
_FAILED: dict[str, str] = {}
_DISCOVERED = False
ENTRY_POINT_GROUP = "pretrain.objectives"
#: modules of the objectives package that hold no objective.
_NOT_PLUGINS = {"base", "options", "views"}
#: listing order of the built-in modules in ``--help`` (other modules follow, alphabetically).
_BUILTIN_ORDER = ("mlm", "cpdae", "seed", "retromae", "bow")


def unregister_objective(name: str) -> None:
    """Remove ``name`` from the registry (tests)."""
    _REGISTRY.pop(name, None)


def _discover() -> None:
    """Import this package's modules and the ``pretrain.objectives`` entry points (once)."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    package = importlib.import_module(PACKAGE)  # its __init__ (register_objective); the objectives follow
    order = {n: i for i, n in enumerate(_BUILTIN_ORDER)}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: (order.get(i.name, len(order)), i.name)):
        if info.name.startswith("_") or info.name in _NOT_PLUGINS:
            continue
        module = f"{PACKAGE}.{info.name}"
        try:
            importlib.import_module(module)
        except ImportError as e:  # a missing optional dependency of one objective must not break the others
            _FAILED[module] = f"{type(e).__name__}: {e}"
            logger.warning("objective module %s not loaded: %s", module, e)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001 - a broken third-party plugin is reported, not fatal
            _FAILED[ep.value] = f"{type(e).__name__}: {e}"
            logger.warning("objective plugin %s (%s) not loaded: %s", ep.name, ep.value, e)


def _listing_rank(cls: type) -> tuple[int, int, str]:
    """Listing position of an objective's module: the built-ins in ``_BUILTIN_ORDER``, then this
    package's other modules alphabetically, then plugins from elsewhere (in registration order)."""
    mod = cls.__module__
    short = mod[len(PACKAGE) + 1:] if mod.startswith(PACKAGE + ".") else None
    if short is None:
        return (2, 0, "")
    return (0, _BUILTIN_ORDER.index(short), "") if short in _BUILTIN_ORDER else (1, 0, short)


def available_objectives() -> dict[str, type]:
    """All registered objectives, ``name -> class`` (built-in ones first; the order does not depend on
    which objective module was imported first)."""
    _discover()
    return dict(sorted(_REGISTRY.items(), key=lambda kv: _listing_rank(kv[1])))  # stable: a module's classes keep their order


def objective_class(name: str) -> type:
    """The :class:`Objective` subclass registered as ``name``.

    Raises:
        ValueError: if ``name`` is not a registered objective.
    """
    found = available_objectives()
    if name not in found:
        failed = f" (modules that failed to import: {'; '.join(f'{k}: {v}' for k, v in _FAILED.items())})" if _FAILED else ""
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(found)}{failed}")
    return found[name]
