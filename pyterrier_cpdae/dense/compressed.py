"""What the store does with a compressed index (dtype ``"int8"``/``"binary"``): opens its codes as search parts and
sends a search to :mod:`~pyterrier_cpdae.dense.int8` (exact) or :mod:`~pyterrier_cpdae.dense.binary` (approximate).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np

from . import binary as binary_search
from . import format as io
from . import int8 as int8_search
from .codes import CodePart, Codes


def open_code_parts(path: Path, meta: dict, parts: list) -> List[CodePart]:
    """The codes of the index at ``path`` as parts ``(Codes, offset, stride)`` matching its vector ``parts``.

    Raises:
        ValueError: the index is not compressed, or its codes are missing, truncated or do not match their
            fingerprint."""
    if meta["dtype"] not in io.COMPRESSED:
        raise ValueError(f"{path} stores dtype={meta['dtype']!r}: it has no codes")
    if meta.get("layout") == "sharded":
        dirs = [Path(path) / io.SHARDS_DIR / str(s) for s in range(int(meta["num_shards"]))]
    else:
        dirs = [Path(path)]
    for vectors, _, _ in parts:  # the float copy is read only to rescore, row by row
        io.advise_random(vectors)
    return [(Codes(d, io.read_meta(d)), offset, stride) for d, (_, offset, stride) in zip(dirs, parts)]


def search(path: Path, meta: dict, parts: List[CodePart], vectors_of: Callable[[np.ndarray], np.ndarray],
           queries: np.ndarray, k: int, backend: str, kwargs: dict,
           prefetch: Optional[Callable[[np.ndarray], object]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The search of a compressed index: exact for int8, approximate for binary, on the CPU whatever the backend. The
    scan's products are int8 through ``torch._int_mm`` (the faster, measured: ``experiments/results/bench_int8.md``)
    unless ``scan="numpy"`` (float32 BLAS products of the widened codes; the default where torch cannot be imported);
    both give the same results. The options of the float kernels that do not apply here (``device``, ``resident``,
    ``pinned``, ``precision``) are ignored, ``chunk_size`` is the scan's ``block_size``. ``prefetch`` (the store's, :func:`.format.prefetch_ids`)
    is called with the ids of the rows each round of rescoring reads, before they are read.

    Raises:
        ValueError: an unknown backend, or ``rescore_multiplier`` for an int8 index (whose search is exact)."""
    if backend not in ("numpy", "torch"):
        raise ValueError(f"backend must be 'auto', 'numpy' or 'torch', got {backend!r}")
    scan = kwargs.get("scan")
    if meta["dtype"] == "binary":  # the Hamming scans of binary.SCANS (checked there), FAISS's popcount by default
        scan = binary_search.DEFAULT_SCAN if scan is None else scan
    elif scan is None:
        try:
            import torch  # noqa: F401
            scan = "torch"
        except ImportError:  # pragma: no cover (a dependency)
            scan = "numpy"
    if meta["dtype"] != "binary" and scan not in ("numpy", "torch"):
        raise ValueError(f"scan must be 'numpy' or 'torch', got {scan!r}")
    options = {"backend": scan}
    for name in ("block_size", "query_batch_size", "threads"):
        if kwargs.get(name) is not None:
            options[name] = kwargs[name]
    if kwargs.get("chunk_size") is not None:
        options["block_size"] = kwargs["chunk_size"]
    multiplier = kwargs.get("rescore_multiplier")
    if multiplier is not None and meta["dtype"] != "binary":
        raise ValueError(f"rescore_multiplier applies to dtype='binary' indexes only; {path} stores "
                         f"dtype={meta['dtype']!r}, whose search is exact")
    if meta["dtype"] == "int8":
        return int8_search.search(parts, queries, k, vectors_of, stats=kwargs.get("stats"), prefetch=prefetch,
                                  **options)
    if multiplier is not None:
        options["rescore_multiplier"] = multiplier
    return binary_search.search(parts, queries, k, vectors_of, prefetch=prefetch, **options)
