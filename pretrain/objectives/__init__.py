"""Registry of pre-training objectives (``--objective NAME``).

Each entry maps a name to ``"module:Class"``; classes are imported lazily so that a
missing optional dependency of one objective does not break the others.
"""
from __future__ import annotations

import importlib
from typing import Any

from .base import Objective

OBJECTIVES: dict[str, str] = {
    "mlm": "pretrain.objectives.mlm:MLMObjective",
    "cpdae": "pretrain.objectives.cpdae:CPDAEObjective",
    "cpdae_r": "pretrain.objectives.cpdae:CPDAERObjective",
    "cpdae_nocl": "pretrain.objectives.cpdae:CPDAENoCLObjective",
    "cpdae_idfrec": "pretrain.objectives.cpdae:CPDAEIDFRecObjective",
    "seed": "pretrain.objectives.seed:SEEDObjective",
    "retromae": "pretrain.objectives.retromae:RetroMAEObjective",
    "bow": "pretrain.objectives.bow:BoWObjective",
}


def objective_class(name: str) -> type[Objective]:
    """The :class:`Objective` subclass registered as ``name``.

    Raises:
        ValueError: if ``name`` is not a registered objective.
    """
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    module, cls = OBJECTIVES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_objective(name: str, mlm_model: Any, tokenizer: Any, config: Any, **extra: Any) -> Objective:
    """Instantiate objective ``name`` (``extra`` carries e.g. ``idf=`` for ``cpdae_idfrec``)."""
    return objective_class(name)(mlm_model, tokenizer, config, **extra)


__all__ = ["OBJECTIVES", "Objective", "build_objective", "objective_class"]
