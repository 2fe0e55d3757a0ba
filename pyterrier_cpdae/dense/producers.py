"""Deprecated: the producer records and stamps moved to :mod:`pyterrier_cpdae._producers` (shared by the dense index
and the encoder's text scorer); its names read here still work, with a ``DeprecationWarning``."""
from .._moved import moved_names

__getattr__, __dir__ = moved_names(__name__, "pyterrier_cpdae._producers", (
    "PRODUCER_SUFFIX", "QUERY_PRODUCER_KEYS", "DEFAULT_PRODUCER_ADVICE", "producer_column", "stamp", "parse_stamp",
    "frame_producer", "check_vectors_producer", "check_producer", "check_query_producer", "query_differences",
    "same_document_producer", "describe_producer", "check_producers"))
