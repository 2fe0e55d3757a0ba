"""Value checks that every wing shares: integer options (and the default of a thread-count option), docnos, and
vectors in a ``doc_vec``/``query_vec`` column.

The encoder (:mod:`pyterrier_cpdae.encoder`), the dense index (:mod:`pyterrier_cpdae.dense`), the BM25 index
(:mod:`pyterrier_cpdae.bm25`) and the dataset readers (:mod:`pyterrier_cpdae.datasets`) use these, so they live
here rather than inside one wing.  numpy only.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["check_int", "default_num_threads", "as_docno", "as_docnos", "stack_vectors", "check_norms", "describe_values", "MAX_NORM"]


def check_int(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as an ``int``, refusing non-integers (floats, bools, strings, None) and values below ``minimum``.

    Raises:
        ValueError: naming the option, the value and what is allowed.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def default_num_threads() -> int:
    """The cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` elsewhere): the default of
    a thread-count option."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def as_docno(value: Any) -> str:
    """Converts one docno to the stored ``str`` form.

    Strings are kept as they are; Python/numpy integers are converted with ``str(int(x))``; anything
    else (floats, bytes, None, ...) is rejected so that ``5`` and ``5.0`` can never silently become
    different docnos.

    Raises:
        ValueError: for empty docnos, docnos containing a line break or a NUL character (npids cannot store
            them exactly), docnos that are not valid Unicode (lone surrogates such as ``"\\ud800"``), or
            unsupported types.
    """
    if isinstance(value, str):
        docno = value
    elif isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        docno = str(int(value))
    else:
        raise ValueError(f"docno must be a str (or an int, converted with str()), got {type(value).__name__}: {value!r}")
    if not docno:
        raise ValueError("empty docno")
    if "\n" in docno or "\r" in docno:
        raise ValueError(f"docno {docno!r} contains a line break")
    if "\x00" in docno:
        raise ValueError(f"docno {docno!r} contains a NUL character")
    try:
        docno.encode("utf8")
    except UnicodeEncodeError as ex:
        raise ValueError(f"docno {docno!r} is not valid Unicode (a lone surrogate at position {ex.start}; "
                         "was it decoded with errors='surrogateescape'?)") from None
    return docno


def as_docnos(values: Sequence[Any], records: Sequence[int]) -> list:
    """:func:`as_docno` of a batch, naming the failing record by its position in the input (``records``).

    Raises:
        ValueError: ``record <i> of the input: <reason>``.
    """
    out = []
    for value, record in zip(values, records):
        try:
            out.append(as_docno(value))
        except ValueError as ex:
            raise ValueError(f"record {record} of the input: {ex}") from None
    return out


def stack_vectors(vecs: Sequence[Any], docnos: Sequence[str], dim: Optional[int], what: str = "doc_vec",
                  id_name: str = "docno") -> np.ndarray:
    """Stacks per-record vectors into a float32 (n, dim) array, checking shapes and finiteness.

    Args:
        vecs: the vectors (arrays, lists or torch tensors).
        docnos: the identifier of each record, named in error messages.
        dim: the expected dimension (``None``: that of the first vector).
        what: the column name, for error messages.
        id_name: the identifier name (``"docno"`` or ``"qid"``), for error messages.

    Raises:
        ValueError: naming the record whose vector is missing, not 1-d, empty, of the wrong dimension or not
            finite.
    """
    arrays = []
    for docno, v in zip(docnos, vecs):
        if v is None:
            raise ValueError(f"{what} of {id_name} {docno!r} is missing (None)")
        if hasattr(v, "detach"):  # a torch tensor; numpy has no bfloat16
            v = v.detach().cpu()
            v = (v.float() if str(v.dtype) == "torch.bfloat16" else v).numpy()
        a = np.asarray(v)
        if a.dtype.kind not in "biuf":
            raise ValueError(f"{what} of {id_name} {docno!r} must hold real numbers, got {describe_values(a)}; "
                             "nothing is coerced (a cast would drop imaginary parts or parse strings)")
        if a.ndim != 1:
            raise ValueError(f"{what} of {id_name} {docno!r} must be a 1-d vector, got shape {a.shape}")
        if a.shape[0] == 0:
            raise ValueError(f"{what} of {id_name} {docno!r} is empty (dimension 0); vectors need at least one "
                             "component")
        if dim is None:
            dim = a.shape[0]
        if a.shape[0] != dim:
            raise ValueError(f"{what} of {id_name} {docno!r} has dimension {a.shape[0]}, expected {dim} "
                             "(the dimension of the index / first batch)")
        arrays.append(a)
    if not arrays:
        return np.zeros((0, dim or 0), dtype=np.float32)
    with np.errstate(over="ignore"):  # float64 values beyond float32's range become inf: refused just below
        out = np.stack(arrays).astype(np.float32, copy=False)
    finite = np.isfinite(out).all(axis=1)
    if not finite.all():
        bad = [docnos[i] for i in np.nonzero(~finite)[0][:5]]
        raise ValueError(f"{what} contains NaN or infinite values for {id_name}(s) {bad} (values beyond float32's "
                         "range count as infinite)")
    check_norms(out, what, lambda rows: [docnos[i] for i in rows], id_name)
    return out


#: the largest Euclidean norm of a stored or query vector: the inner product of two such vectors is at most
#: ``MAX_NORM ** 2 = 2 ** 126`` in magnitude (Cauchy-Schwarz, also for every partial sum), below float32's
#: largest value (about ``2 ** 128``), so no score can overflow to infinity
MAX_NORM = 2.0 ** 63


def check_norms(vectors: np.ndarray, what: str, names: Any, id_name: str) -> None:
    """Refuses float32 rows whose norm exceeds :data:`MAX_NORM` (their scores could overflow float32).

    Cheap: only rows whose largest component times ``sqrt(dim)`` exceeds the bound get their norm computed
    (in float64, where squaring cannot overflow).

    Args:
        vectors: finite float32 ``(n, dim)``.
        what / id_name: named in the message (``"doc_vec"``/``"docno"``, ``"query_vec"``/``"qid"``).
        names: maps row numbers to their identifiers (for the message).

    Raises:
        ValueError: naming up to 5 rows and their norms.
    """
    if not vectors.size:
        return
    suspect = np.nonzero(np.abs(vectors).max(axis=1) * np.sqrt(vectors.shape[1]) > MAX_NORM)[0]
    if not len(suspect):
        return
    norms = np.linalg.norm(vectors[suspect].astype(np.float64), axis=1)
    bad = suspect[norms > MAX_NORM]
    if len(bad):
        shown = ", ".join(f"{n!r} (norm {v:.3g})" for n, v in zip(names(bad[:5]), norms[norms > MAX_NORM][:5]))
        raise ValueError(f"{what} of {id_name}(s) {shown} exceed(s) the largest norm {MAX_NORM:.3g} (2**63): "
                         "inner products with such vectors can overflow float32 to infinity; rescale or normalise "
                         "the vectors")


def describe_values(a: np.ndarray) -> str:
    """What an array that holds no real numbers holds, for error messages (``"complex numbers (dtype ...)"``)."""
    kind = {"c": "complex numbers", "U": "strings", "S": "bytes", "O": "non-numeric Python objects",
            "M": "dates", "m": "time spans", "V": "structured values"}.get(a.dtype.kind, "non-numeric values")
    return f"{kind} (dtype {a.dtype})"
