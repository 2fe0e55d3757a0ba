"""Deprecated: the OpenVINO backend moved to :mod:`pyterrier_cpdae.encoder.backends.openvino`; its names read here
still work, with a ``DeprecationWarning``."""
from .._moved import moved_names

__getattr__, __dir__ = moved_names(__name__, "pyterrier_cpdae.encoder.backends.openvino",
                                   ("openvino_available", "compile_encoder", "CompiledEncoder"))
