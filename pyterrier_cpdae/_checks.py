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

__all__ = ["check_int", "default_num_threads", "as_docno", "as_docnos", "stack_vectors", "check_norms",
           "describe_values", "MAX_NORM", "MIN_NORM", "check_cast_to_zero", "check_float16_scale"]


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
    names = lambda rows: [docnos[i] for i in rows]  # noqa: E731
    check_norms(out, what, names, id_name)
    if any(a.dtype != np.float32 for a in arrays):
        check_cast_to_zero(np.stack(arrays), out, what, names, id_name)
    return out


def check_cast_to_zero(source: np.ndarray, cast: np.ndarray, what: str, names: Any, id_name: str) -> None:
    """Refuses rows that are not zero in ``source`` (e.g. float64) but are in ``cast`` (float32 or float16): they were
    too small for that dtype (below :data:`MIN_NORM`, :func:`check_norms`), not a vector of zeros.

    Raises:
        ValueError: naming up to 5 rows."""
    lost = np.nonzero(~cast.any(axis=1) & source.any(axis=1))[0]
    if len(lost):
        raise ValueError(f"{what} of {id_name}(s) {names(lost[:5])} are not zero but become zero in {cast.dtype}: "
                         f"their norm is far below the smallest norm {MIN_NORM:.3g} (2**-63) of a vector that is not "
                         "zero, so their inner products underflow; rescale or normalise the vectors")


#: the largest Euclidean norm of a stored or query vector: the inner product of two such vectors is at most
#: ``MAX_NORM ** 2 = 2 ** 126`` in magnitude (Cauchy-Schwarz, also for every partial sum), below float32's
#: largest value (about ``2 ** 128``), so no score can overflow to infinity
MAX_NORM = 2.0 ** 63


#: the smallest Euclidean norm of a stored or query vector that is not zero: the mirror of :data:`MAX_NORM`. Two
#: vectors whose norms lie in ``[2**-63, 2**63]`` have ``|q| |d|`` in ``[2**-126, 2**126]``, float32's normal range,
#: so the scale of their scores is representable; below it even two parallel vectors score a subnormal number or zero
#: (a norm of 1e-23 against another of 1e-23 scores 1e-46, which float32 rounds to 0), and the absolute error of a
#: score that underflows (up to ``2**-126`` per product and per partial sum, more where the hardware flushes subnormals
#: to zero) is no longer bounded by the float32 rounding bound the exact search's tie rule is proved with
#: (``tol = (dim + 2) 2**-24 |q| M``, docs/dense_index.md): such vectors tie or order by rounding noise. A vector of
#: zeros scores exactly 0 against everything and is kept.
MIN_NORM = 2.0 ** -63


def check_norms(vectors: np.ndarray, what: str, names: Any, id_name: str) -> None:
    """Refuses float32 rows whose norm exceeds :data:`MAX_NORM` (their scores could overflow float32) or, not zero,
    lies below :data:`MIN_NORM` (their scores underflow).

    Cheap: only rows whose largest component times ``sqrt(dim)`` exceeds the upper bound, or whose largest component
    is below the lower one, get their norm computed (in float64, where squaring neither overflows nor underflows).

    Args:
        vectors: finite float32 ``(n, dim)``.
        what / id_name: named in the message (``"doc_vec"``/``"docno"``, ``"query_vec"``/``"qid"``).
        names: maps row numbers to their identifiers (for the message).

    Raises:
        ValueError: naming up to 5 rows and their norms.
    """
    if not vectors.size:
        return
    largest = np.abs(vectors).max(axis=1)
    for high, suspect in ((True, np.nonzero(largest * np.sqrt(vectors.shape[1]) > MAX_NORM)[0]),
                          (False, np.nonzero((largest < MIN_NORM) & (largest > 0))[0])):
        if not len(suspect):
            continue
        norms = np.linalg.norm(vectors[suspect].astype(np.float64), axis=1)
        out = norms > MAX_NORM if high else norms < MIN_NORM
        bad = suspect[out]
        if not len(bad):
            continue
        shown = ", ".join(f"{n!r} (norm {v:.3g})" for n, v in zip(names(bad[:5]), norms[out][:5]))
        if high:
            raise ValueError(f"{what} of {id_name}(s) {shown} exceed(s) the largest norm {MAX_NORM:.3g} (2**63): "
                             "inner products with such vectors can overflow float32 to infinity; rescale or "
                             "normalise the vectors")
        raise ValueError(f"{what} of {id_name}(s) {shown} fall(s) below the smallest norm {MIN_NORM:.3g} (2**-63) of "
                         "a vector that is not zero: its inner products underflow float32 (to subnormal numbers or "
                         "zero), so they would rank by rounding noise; rescale or normalise the vectors")


#: the relative error (``|stored - v| / |v|``) float16 storage may cause: its unit roundoff is 2**-11, so rounding in
#: its normal range stays eight times inside; a vector that errs more lies (partly) below float16's normal range
#: (2**-14), where its components keep fewer bits, or become zero
FLOAT16_TOLERANCE = 2.0 ** -8


def check_float16_scale(vectors: np.ndarray, stored: np.ndarray, names: Sequence[str]) -> None:
    """Refuses float32 rows (not zero) whose float16 copy ``stored`` is off by more than :data:`FLOAT16_TOLERANCE` of
    their norm: too small for float16 (its subnormals, or zero), their stored scores would underflow.

    Raises:
        ValueError: naming up to 5 docnos, their norms and their relative error in float16."""
    v = vectors.astype(np.float64)
    norm = np.linalg.norm(v, axis=1)
    err = np.linalg.norm(stored.astype(np.float64) - v, axis=1)
    bad = np.nonzero(err > FLOAT16_TOLERANCE * norm)[0]
    if len(bad):
        shown = ", ".join(f"{names[i]!r} (norm {norm[i]:.3g}, off by {err[i] / norm[i]:.2g} of it in float16)"
                          for i in bad[:5])
        raise ValueError(f"doc_vec of docno(s) {shown} is too small for float16 storage (below its normal range, "
                         "about 6.1e-05 per component): its stored scores would underflow; index in float32 or "
                         "rescale the vectors")


def describe_values(a: np.ndarray) -> str:
    """What an array that holds no real numbers holds, for error messages (``"complex numbers (dtype ...)"``)."""
    kind = {"c": "complex numbers", "U": "strings", "S": "bytes", "O": "non-numeric Python objects",
            "M": "dates", "m": "time spans", "V": "structured values"}.get(a.dtype.kind, "non-numeric values")
    return f"{kind} (dtype {a.dtype})"
