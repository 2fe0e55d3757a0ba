"""Deprecated: the unpadded path moved to :mod:`pyterrier_cpdae.encoder.backends.unpadded`; its names read here
still work, with a ``DeprecationWarning``."""
from __future__ import annotations

import warnings
from typing import Any

_MOVED_TO = "pyterrier_cpdae.encoder.backends.unpadded"
_NAMES = ("PACKED_MODEL_TYPES", "supports_packing", "packed_forward")


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    warnings.warn(f"{__name__}.{name} moved to {_MOVED_TO}.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(_MOVED_TO), name)


def __dir__() -> list:
    return sorted(_NAMES)
