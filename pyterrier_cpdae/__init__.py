"""pyterrier-cpdae: PyTerrier transformers for CPDAE-style dense retrieval.

Public API::

    from pyterrier_cpdae import CPDAE, DenseIndex, BM25Index, load_dataset

Names are imported lazily, so that e.g. using the dense index does not start Java.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CPDAE": "pyterrier_cpdae.encoder",
    "DenseIndex": "pyterrier_cpdae.dense",
    "BM25Index": "pyterrier_cpdae.bm25",
    "load_dataset": "pyterrier_cpdae.datasets",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pyterrier_cpdae' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
