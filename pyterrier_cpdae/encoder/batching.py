"""Input checking, de-duplication and length-sorted batching for :class:`~pyterrier_cpdae.encoder.CPDAE`.

These helpers are model-agnostic (numpy only).  :func:`check_int` also checks the integer options (``k``,
``num_results``, batch sizes) of the retrievers and search kernels.  The encoder tokenises a *window* of texts in one fast-tokenizer
call, sorts the window by token count, cuts it into batches (of ``batch_size`` texts, or by a token budget:
:func:`token_budget_batches`) padded only to their own longest sequence and writes each batch's vectors back to
the rows they came from.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._checks import check_int  # noqa: F401 (re-exported: the encoder's option checks)


def _describe_row(i: int, ids: Optional[Sequence[Any]], id_name: Optional[str], first_row: int = 0) -> str:
    if ids is not None and id_name and ids[i] is not None:
        return f"row {first_row + i} ({id_name}={ids[i]!r})"
    return f"row {first_row + i}"


def check_texts(values: Iterable[Any], column: str, ids: Optional[Sequence[Any]] = None,
                id_name: Optional[str] = None, first_row: int = 0) -> List[str]:
    """Checks that every value is a valid Unicode string and returns them as a list.

    Empty strings are allowed (they encode as ``[CLS] [SEP]``).

    Args:
        values: the texts (a list, a DataFrame column, any iterable of strings; not a single string).
        column: the column name, used in error messages.
        ids: optional row identifiers (``qid``/``docno``) used in error messages.
        id_name: the name of the identifier column.
        first_row: the row number of ``values[0]`` in the whole input (for streamed windows).

    Raises:
        ValueError: a value is missing (``None`` or NaN), or holds a lone surrogate (not encodable as UTF-8,
            which the tokenizer cannot take).
        TypeError: ``values`` is a single string/bytes or not iterable, or a value is not a string.
    """
    if isinstance(values, (str, bytes)):
        raise TypeError(f"expected a list of {column!r} strings, got a single {type(values).__name__} {values!r:.60}; "
                        "wrap it in a list")
    try:
        texts = values if isinstance(values, list) else list(values)
    except TypeError:
        raise TypeError(f"expected a list of {column!r} strings, got {type(values).__name__} {values!r:.60}") from None
    if not all(isinstance(t, str) for t in texts):  # fast path: one C-level pass
        for i, t in enumerate(texts):
            if isinstance(t, str):
                continue
            where = _describe_row(i, ids, id_name, first_row)
            if t is None or (isinstance(t, float) and math.isnan(t)):
                raise ValueError(f"{column!r} is missing (None/NaN) at {where}; fill it (e.g. with '') or drop the "
                                 "row before encoding")
            raise TypeError(f"{column!r} must hold strings, but {where} holds {type(t).__name__} {t!r}")
    for i, t in enumerate(texts):
        if t.isascii():  # O(1) in CPython: only non-ASCII texts are checked
            continue
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as ex:
            where = _describe_row(i, ids, id_name, first_row)
            raise ValueError(f"{column!r} at {where} is not valid Unicode: it holds the lone surrogate "
                             f"{t[ex.start]!r} at character {ex.start} (text decoded with errors='surrogateescape' "
                             "or cut inside a surrogate pair?); repair it, e.g. "
                             "text.encode('utf-8', 'replace').decode('utf-8')") from None
    return texts


def dedup(texts: Sequence[str]) -> Tuple[List[str], np.ndarray]:
    """Unique texts in first-seen order and, for each input text, the index of its unique text.

    ``[uniq[i] for i in inverse] == list(texts)``.
    """
    index: dict = {}
    inverse = np.fromiter((index.setdefault(t, len(index)) for t in texts), dtype=np.int64, count=len(texts))
    return list(index), inverse


def chunked(items: Iterable[Any], size: int) -> Iterator[List[Any]]:
    """Consecutive lists of ``size`` items (the last may be shorter); streams any iterable."""
    if isinstance(items, (list, tuple)):
        for s in range(0, len(items), size):
            yield list(items[s:s + size])
        return
    chunk: List[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def length_sorted_batches(lengths: np.ndarray, batch_size: int) -> List[np.ndarray]:
    """Splits row indices into batches of rows of similar length, longest first.

    Sorting longest-first makes the first batch the most memory-hungry one, so an out-of-memory error shows up
    at once; ties keep input order (stable sort), which keeps the output deterministic.
    """
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]


def token_budget_batches(lengths: np.ndarray, max_tokens: int, padded: bool = True) -> List[np.ndarray]:
    """Splits row indices into batches of rows of similar length holding at most ``max_tokens`` tokens, longest
    first (as in text-embeddings-inference's ``max_batch_tokens``).

    The rows are sorted by length, longest first (ties in input order, as :func:`length_sorted_batches`), and cut
    greedily: a batch takes rows while its size stays within the budget, where the size of a ``padded`` batch is
    ``rows x its longest row`` (what a padded forward pass computes on; the longest row is its first) and that of
    a packed batch (``padded=False``) the sum of its rows' lengths.  So batches of short texts hold many rows and
    batches of long texts few, for the same work per batch.  A row longer than the budget forms a batch of its
    own (the caller refuses budgets below the maximum length).

    Example: lengths ``[10, 3, 7, 3]``, budget 20, padded -> ``[[0, 2], [1, 3]]`` (2 x 10 = 20, then 2 x 3 = 6).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    ordered = lengths[order]
    cumulative = np.cumsum(ordered)
    batches: List[np.ndarray] = []
    start, n = 0, len(order)
    while start < n:
        if padded:
            end = start + max(1, max_tokens // max(int(ordered[start]), 1))
        else:
            before = int(cumulative[start - 1]) if start else 0
            end = max(start + 1, int(np.searchsorted(cumulative, before + max_tokens, side="right")))
        batches.append(order[start:min(end, n)])
        start = min(end, n)
    return batches


def cut_batches(lengths: np.ndarray, budget: Optional[int], batch_size: int, packed: bool = False) -> List[np.ndarray]:
    """A window's rows cut into length-sorted batches: by the token ``budget`` (real tokens when ``packed``, else
    rows x longest: :func:`token_budget_batches`), or with no budget by ``batch_size`` texts
    (:func:`length_sorted_batches`)."""
    if budget is None:
        return length_sorted_batches(lengths, batch_size)
    return token_budget_batches(lengths, budget, padded=not packed)


def pad(seqs: Sequence[Sequence[int]], lengths: np.ndarray, pad_id: int) -> Tuple[np.ndarray, np.ndarray]:
    """Right-pads token id sequences to the longest one of the batch (not to a fixed max length).

    Returns:
        ``(input_ids, attention_mask)``, both int64 ``(B, max(lengths))``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    width = int(lengths.max()) if len(lengths) else 0
    mask = np.arange(width)[None, :] < lengths[:, None]
    ids = np.full(mask.shape, pad_id, dtype=np.int64)
    ids[mask] = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    return ids, mask.astype(np.int64)


_END = object()


def read_ahead(items: Iterable[Any], enabled: bool = True) -> Iterator[Any]:
    """Yields ``items`` in order, computing the next one in a background thread while the caller works on the
    current one (``enabled``; else plainly).  The encoder tokenizes its next window this way while the device
    encodes the current one (Hugging Face's fast tokenizers release the GIL while they split a batch).  An
    exception raised while computing an item is raised here, at that item; closing the generator early waits for
    the one item in flight and computes no further one."""
    it = iter(items)
    if not enabled:
        yield from it
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpdae-read-ahead") as worker:
        pending = worker.submit(next, it, _END)
        while True:
            item = pending.result()
            if item is _END:
                return
            pending = worker.submit(next, it, _END)
            yield item
