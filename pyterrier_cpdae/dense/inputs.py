"""What a dense index's indexer accepts: a DataFrame, or an iterable of dicts and/or DataFrames with ``docno`` and
``doc_vec``, cut into batches (:func:`iter_batches`), with the producer stamp of each batch's rows
(:func:`iter_stamped_batches`, the ``doc_vec_producer`` column an encoder adds) and the producer stamped on the input's
first rows (:func:`peek_producer`, what the indexer records when the pipeline does not say).
"""
from __future__ import annotations

import itertools
from typing import Any, Iterator, List, Optional, Tuple

import pandas as pd

from .._producers import frame_producer, producer_column, same_document_producer

__all__ = ["DOC_STAMP", "iter_batches", "iter_stamped_batches", "peek_producer"]


def iter_batches(inp: Any, batch_size: int) -> Iterator[Tuple[List[Any], List[Any]]]:
    """Normalises indexer input into batches of ``(raw_docnos, raw_vectors)``.

    Accepts a DataFrame, or an iterable of dicts (what ``pt.Transformer >> Indexer`` feeds: pyterrier
    1.1's ``Compose.index`` yields the records of each transformed batch one dict at a time) and/or
    DataFrames.

    Raises:
        ValueError: when a record/frame lacks the ``docno`` or ``doc_vec`` column.
        TypeError: for other record types.
    """
    for docnos, vecs, _ in iter_stamped_batches(inp, batch_size):
        yield docnos, vecs


#: the stamp column of document vectors (:mod:`~pyterrier_cpdae._producers`)
DOC_STAMP = producer_column("doc_vec")


def iter_stamped_batches(inp: Any, batch_size: int) -> Iterator[Tuple[List[Any], List[Any], Optional[List[Any]]]]:
    """:func:`iter_batches` with each batch's producer stamps (the ``doc_vec_producer`` of its rows; ``None`` for a
    batch where no row has one)."""
    def check_frame(df: pd.DataFrame) -> None:
        missing = [c for c in ("docno", "doc_vec") if c not in df.columns]
        if missing:
            raise ValueError(f"DenseIndex indexer input is missing column(s) {missing}; found columns "
                             f"{list(df.columns)} (did you forget the encoder, e.g. `enc >> index.indexer()`?)")

    def frame_batches(df: pd.DataFrame):
        check_frame(df)
        for s in range(0, len(df), batch_size):
            part = df.iloc[s:s + batch_size]
            yield list(part["docno"]), list(part["doc_vec"]), list(part[DOC_STAMP]) if DOC_STAMP in df.columns \
                else None

    if isinstance(inp, pd.DataFrame):
        yield from frame_batches(inp)
        return
    docnos: List[Any] = []
    vecs: List[Any] = []
    stamps: List[Any] = []

    def batch():
        return docnos, vecs, (stamps if any(x is not None for x in stamps) else None)
    for rec in inp:
        if isinstance(rec, pd.DataFrame):
            if docnos:
                yield batch()
                docnos, vecs, stamps = [], [], []
            yield from frame_batches(rec)
            continue
        if not isinstance(rec, dict):
            raise TypeError(f"DenseIndex indexer expects dicts or DataFrames with docno and doc_vec, got "
                            f"{type(rec).__name__}")
        if "docno" not in rec or "doc_vec" not in rec:
            missing = [c for c in ("docno", "doc_vec") if c not in rec]
            raise ValueError(f"DenseIndex indexer input is missing column(s) {missing}; record has keys "
                             f"{sorted(rec)} (did you forget the encoder, e.g. `enc >> index.indexer()`?)")
        docnos.append(rec["docno"])
        vecs.append(rec["doc_vec"])
        stamps.append(rec.get(DOC_STAMP))
        if len(docnos) >= batch_size:
            yield batch()
            docnos, vecs, stamps = [], [], []
    if docnos:
        yield batch()


def peek_producer(inp: Any) -> Tuple[Any, Optional[dict]]:
    """``(inp, producer)``: the producer stamped on the first record (or on all rows of a DataFrame) of the indexer's
    input, and the input to read instead of ``inp`` (an iterator's first record is put back).

    Raises:
        ValueError: a DataFrame whose rows come from more than one producer."""
    if isinstance(inp, pd.DataFrame):
        return inp, frame_producer(inp, "doc_vec", "docno", same=same_document_producer)
    it = iter(inp)
    try:
        first = next(it)
    except StopIteration:
        return [], None
    rest = itertools.chain([first], it)
    if isinstance(first, pd.DataFrame):
        return rest, frame_producer(first, "doc_vec", "docno", same=same_document_producer)
    if isinstance(first, dict) and first.get(DOC_STAMP) is not None:
        return rest, frame_producer([first], "doc_vec", "docno")
    return rest, None
