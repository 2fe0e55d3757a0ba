"""The registry of pre-training objectives: name -> :class:`~pretrain.objectives.base.Objective` subclass. It imports
no part of the toolkit: it imports every module of the ``pretrain.objectives`` package by name (a new file there is
found without editing any other) and those of the ``pretrain.objectives`` entry-point group, which register
themselves (:func:`pretrain.objectives.register_objective`)."""
from __future__ import annotations

import importlib
import logging
import pkgutil

logger = logging.getLogger(__name__)

#: the package whose modules are the built-in objectives, and the entry-point group of the others
PACKAGE = ENTRY_POINT_GROUP = "pretrain.objectives"
_REGISTRY: dict[str, type] = {}  # name -> objective class, in registration order
_FAILED: dict[str, str] = {}  # modules that failed to import -> the error (named when an objective is not found)
_DISCOVERED = False
_NOT_PLUGINS = {"base", "options", "views"}  # modules of the objectives package that hold no objective
#: listing order of the built-in modules in ``--help``: then the package's others alphabetically, then plugins
_BUILTIN_ORDER = ("mlm", "cpdae", "seed", "retromae", "bow")


def unregister_objective(name: str) -> None:
    """Remove ``name`` from the registry (tests)."""
    _REGISTRY.pop(name, None)


def _discover() -> None:
    """Import this package's modules and the entry points (once); a module that fails is logged, not fatal."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    from importlib.metadata import entry_points

    package = importlib.import_module(PACKAGE)  # its __init__ (register_objective); the objectives follow
    found = [m.name for m in pkgutil.iter_modules(package.__path__) if m.name[0] != "_" and m.name not in _NOT_PLUGINS]
    jobs = [(f"{PACKAGE}.{name}", importlib.import_module, ImportError) for name in found]
    jobs += [(ep.value, lambda _, ep=ep: ep.load(), Exception) for ep in entry_points(group=ENTRY_POINT_GROUP)]
    for name, load, errors in jobs:
        try:
            load(name)
        except errors as e:  # a built-in's missing optional dependency, or a broken plugin: the others still load
            _FAILED[name] = f"{type(e).__name__}: {e}"
            logger.warning("objective module %s not loaded: %s", name, e)


def _listing_rank(cls: type) -> tuple[int, int, str]:
    short = cls.__module__[len(PACKAGE) + 1:] if cls.__module__.startswith(PACKAGE + ".") else None
    if short is None:
        return (2, 0, "")
    return (0, _BUILTIN_ORDER.index(short), "") if short in _BUILTIN_ORDER else (1, 0, short)


def available_objectives() -> dict[str, type]:
    """All registered objectives, ``name -> class``, built-in ones first (whichever module was imported first)."""
    _discover()
    return dict(sorted(_REGISTRY.items(), key=lambda kv: _listing_rank(kv[1])))  # stable: a module's keep their order


def objective_class(name: str) -> type:
    """The :class:`Objective` subclass registered as ``name`` (ValueError if there is none)."""
    found = available_objectives()
    if name not in found:
        failed = f" (modules that failed to import: {'; '.join(f'{k}: {v}' for k, v in _FAILED.items())})" if _FAILED else ""
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(found)}{failed}")
    return found[name]
