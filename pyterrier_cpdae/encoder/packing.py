"""Deprecated: the unpadded path moved to :mod:`pyterrier_cpdae.encoder.backends.unpadded`; its names read here
still work, with a ``DeprecationWarning``."""
from .._moved import moved_names

__getattr__, __dir__ = moved_names(__name__, "pyterrier_cpdae.encoder.backends.unpadded",
                                   ("PACKED_MODEL_TYPES", "supports_packing", "packed_forward"))
