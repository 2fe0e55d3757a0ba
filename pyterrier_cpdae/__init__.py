"""pyterrier-cpdae: PyTerrier transformers for CPDAE-style dense retrieval.

Public API::

    from pyterrier_cpdae import CPDAE, DenseIndex, BM25Index, load_dataset

Names are imported lazily, so that e.g. using the dense index does not start Java.
"""
from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "CPDAE": "pyterrier_cpdae.encoder",
    "DenseIndex": "pyterrier_cpdae.dense",
    "BM25Index": "pyterrier_cpdae.bm25",
    "load_dataset": "pyterrier_cpdae.datasets",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports('pyterrier_cpdae', _EXPORTS, globals())
