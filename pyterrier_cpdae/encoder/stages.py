"""The PyTerrier stages made by :class:`~pyterrier_cpdae.encoder.cpdae.CPDAE`'s factories: ``query_encoder()`` and
``doc_encoder()`` (add ``query_vec`` / ``doc_vec``), ``text_scorer()`` (scores query-document rows), and the
encoder as the first stage of an indexing pipeline; and how ``enc >> index`` tells a dense index which encoder
makes its vectors (:func:`_with_producer`)."""
from __future__ import annotations

import json
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from .._checks import stack_vectors
from .._producers import PRODUCER_SUFFIX, describe_producer, frame_producer, query_differences
from .batching import check_texts, chunked, dedup, read_ahead
from .policy import ASYNC_DEVICES, STREAM_WINDOWS


# ``CPDAE`` in the annotations below is :class:`~pyterrier_cpdae.encoder.cpdae.CPDAE` (not imported: cpdae.py imports
# this module)

def _with_producer(right: Any, encoder: "CPDAE") -> Any:
    """``right``, told that ``encoder`` makes its vectors when it records or checks them (``with_producer``: a
    :class:`~pyterrier_cpdae.dense.DenseIndexer` records them, a retriever or scorer of a dense index checks them
    against the index's); the encoder does not import the index."""
    attach = getattr(right, "with_producer", None)
    if callable(attach):
        return attach(encoder)
    if isinstance(right, pt.Compose) and right._transformers:  # enc >> (retriever % k), enc >> (retriever >> rr)
        first = _with_producer(right._transformers[0], encoder)
        if first is not right._transformers[0]:
            return pt.Compose(first, *right._transformers[1:])
    return right


def stage_for(encoder: "CPDAE", inp: pd.DataFrame) -> pt.Transformer:
    """The stage of ``encoder`` that a frame with the columns of ``inp`` calls for: a query and a document column
    (``query`` or ``query_vec`` with ``text`` or ``doc_vec``) are scored (``text_scorer()``); ``query`` alone gets
    ``query_vec`` (``query_encoder()``); ``text`` alone gets ``doc_vec`` (``doc_encoder()``).

    Raises:
        ValueError: PyTerrier's, naming the columns each mode needs, for a frame of none of them."""
    with pta.validate.any(inp) as v:
        for q in ("query", "query_vec"):
            for d in ("text", "doc_vec"):
                v.columns(includes=[q, d], mode="scorer")
        v.columns(includes=["query"], mode="query_encoder")
        v.columns(includes=["text"], mode="doc_encoder")
    return {"scorer": encoder.text_scorer, "query_encoder": encoder.query_encoder,
            "doc_encoder": encoder.doc_encoder}[v.mode]()


class _Stage(pt.Transformer):
    """Base of the transformers made by :class:`CPDAE`'s factories (equal when their encoders are equal)."""

    name = ""

    def __init__(self, encoder: CPDAE):
        super().__init__()
        self.encoder = encoder

    @property
    def batch_size(self) -> int:
        """Read by PyTerrier's ``Compose.index`` to size the chunks it hands this stage: whole sorting windows, so
        that ``enc >> indexer`` sorts texts by length over the same windows as ``encode_docs`` (chunks of
        ``max(100, batch_size)`` texts would cap the window at 100 and pad each batch to the longest of ~100
        unsorted texts); on :data:`ASYNC_DEVICES` :data:`STREAM_WINDOWS` windows at once, so that the next window is
        tokenized while the device encodes this one."""
        enc = self.encoder
        return enc.batch_size * enc.sort_window * (STREAM_WINDOWS if enc.device.type in ASYNC_DEVICES else 1)

    def __eq__(self, other: Any) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.encoder == other.encoder

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.encoder))

    def __repr__(self) -> str:
        return f"{self.encoder!r}.{self.name}()"

    def subtransformers(self) -> Dict[str, Any]:
        return {}  # the encoder is a model holder here, not a pipeline stage


class _VecAdder(_Stage):
    """Adds ``out_column`` computed from the text ``in_column``; streams dict records window by window."""

    in_column = ""
    out_column = ""
    id_column = ""
    length_option = ""  # the encoder option that holds these texts' maximum length
    unique = False  # repeated texts encoded once

    def _encode(self, texts: List[str]) -> np.ndarray:
        return self.encoder._encode(texts, getattr(self.encoder, self.length_option), unique=self.unique)

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pta.validate.columns(inp, includes=[self.in_column])
        if len(inp) == 0:
            return inp.assign(**{self.out_column: pd.Series([], index=inp.index, dtype=object),
                                 self.stamp_column: pd.Series([], index=inp.index, dtype=object)})
        ids = inp[self.id_column].tolist() if self.id_column in inp.columns else None
        texts = check_texts(inp[self.in_column].tolist(), self.in_column, ids, self.id_column)
        vecs = list(self._encode(texts))
        # each row says which encoder made its vector (a column travels with the row through merge, concat, records,
        # pickling: _producers.py): a dense index checks it wherever the vectors meet it
        return inp.assign(**{self.out_column: vecs, self.stamp_column: self.stamp()})

    @property
    def stamp_column(self) -> str:
        """The column beside ``out_column`` that names the producer of its vectors (``query_vec_producer``)."""
        return self.out_column + PRODUCER_SUFFIX

    def stamp(self) -> str:
        """The stamp of every row this stage encodes: the canonical JSON of the encoder's ``producer()`` (taken now:
        the weights key follows in-place edits of the weights), with ``max_length`` the length these texts were cut
        at (``query_max_length`` for queries: it changes query vectors, not which index they may search)."""
        producer = self.encoder.producer()
        producer["max_length"] = int(getattr(self.encoder, self.length_option))  # these vectors' length (queries')
        return json.dumps(producer, sort_keys=True, separators=(",", ":"))

    def transform_iter(self, inp: Iterable[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        """Records window by window.  On :data:`ASYNC_DEVICES` the next window is read from ``inp``, checked and
        tokenized in a background thread while the device encodes this one (:func:`.batching.read_ahead`); an
        error in a record is raised after the records of the windows before it have been yielded, as without."""
        enc = self.encoder
        max_length = getattr(enc, self.length_option)

        def numbered(chunks: Iterable[List[Dict[str, Any]]]) -> Iterator[Tuple[int, List[Dict[str, Any]]]]:
            offset = 0
            for chunk in chunks:
                yield offset, chunk
                offset += len(chunk)

        def prepared(item: Tuple[int, List[Dict[str, Any]]]) -> Tuple[List[Dict[str, Any]], Any, Optional[np.ndarray]]:
            offset, chunk = item
            missing = next((i for i, r in enumerate(chunk) if self.in_column not in r), None)
            if missing is not None:
                raise ValueError(f"{self.name} needs a {self.in_column!r} field, but record {offset + missing} has "
                                 f"keys {sorted(chunk[missing])}")
            ids = [r.get(self.id_column) for r in chunk]
            texts = check_texts([r[self.in_column] for r in chunk], self.in_column, ids, self.id_column, offset)
            texts, inverse = dedup(texts) if self.unique else (texts, None)
            return chunk, enc._tokenize(texts, max_length), inverse

        windows = map(prepared, numbered(chunked(inp, enc.batch_size * enc.sort_window)))
        for chunk, tokenized, inverse in read_ahead(windows, enabled=enc.device.type in ASYNC_DEVICES):
            vecs = enc._encode_tokenized([tokenized], len(tokenized[0]), max_length)
            if inverse is not None:
                vecs = vecs[inverse]
            stamp = self.stamp()  # per window: weights edited between windows make other vectors
            for rec, vec in zip(chunk, vecs):
                out = dict(rec)
                out[self.out_column] = vec
                out[self.stamp_column] = stamp
                yield out


class _QueryEncoder(_VecAdder):
    name = "query_encoder"
    in_column, out_column, id_column = "query", "query_vec", "qid"
    length_option, unique = "query_max_length", True

    def __rshift__(self, right: Any) -> pt.Transformer:
        return super().__rshift__(_with_producer(right, self.encoder))


class _DocEncoder(_VecAdder):
    name = "doc_encoder"
    in_column, out_column, id_column = "text", "doc_vec", "docno"
    length_option = "doc_max_length"

    def __rshift__(self, right: Any) -> pt.Transformer:
        return super().__rshift__(_with_producer(right, self.encoder))


class _ByColumns(_Stage):
    """The encoder itself (each input encoded as its columns say, :meth:`CPDAE.transform`) as the first stage of
    ``enc >> indexer``: it reports the sorting window as its ``batch_size``, so that PyTerrier feeds it chunks of
    whole windows."""

    def __repr__(self) -> str:
        return repr(self.encoder)

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        return self.encoder.transform(inp)

    def transform_iter(self, inp: Iterable[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        return self.encoder.transform_iter(inp)


class _TextScorer(_Stage):
    name = "text_scorer"

    def _vectors(self, inp: pd.DataFrame, vec_col: str, text_col: str, id_col: str, max_length: int) -> np.ndarray:
        """The ``(n, dim)`` vectors of ``vec_col``, or encoded from ``text_col``; all checked finite, so that every
        score is a number (a NaN row is named by its ``qid``/``docno``, or its row number without one)."""
        enc = self.encoder
        ids, id_name = (inp[id_col].tolist(), id_col) if id_col in inp.columns else (list(range(len(inp))), "row")
        if vec_col in inp.columns:
            self._check_producer(inp, vec_col, id_col)
            return stack_vectors(inp[vec_col].tolist(), ids, enc.dim, what=vec_col, id_name=id_name)
        texts = check_texts(inp[text_col].tolist(), text_col, *((ids, id_col) if id_name == id_col else ()))
        vecs = enc._encode(texts, max_length, unique=True)  # queries repeat per row; documents across queries
        if not np.isfinite(vecs).all():  # e.g. an fp16 overflow inside the model
            stack_vectors(list(vecs), ids, enc.dim, what=f"{vec_col} encoded from {text_col!r}", id_name=id_name)
        return vecs

    def _check_producer(self, inp: pd.DataFrame, vec_col: str, id_col: str) -> None:
        """Refuses given vectors that another encoder made (their stamp column, :mod:`pyterrier_cpdae._producers`):
        this encoder's query and document vectors scored against them would rank at random. Rows without a stamp
        (vectors from user code) are scored as given."""
        same = lambda a, b: not query_differences(a, b)  # noqa: E731 (the index's rule for query vectors)
        given = frame_producer(inp, vec_col, id_col, same)
        own = self.encoder.producer()
        differ = query_differences(own, given) if given else []
        if differ:
            raise ValueError(f"text_scorer: the {vec_col} column was encoded by {describe_producer(given)}, not by "
                             f"this encoder ({describe_producer(own)}; they differ in {', '.join(differ)}): scores "
                             f"of vectors from two encoders mean nothing. Drop {vec_col} to encode the "
                             f"{'queries' if vec_col == 'query_vec' else 'documents'} with this encoder")

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        with pta.validate.any(inp) as v:
            for q in ("query", "query_vec"):
                for d in ("text", "doc_vec"):
                    v.columns(includes=["qid", q, d])
        if len(inp) == 0:
            out = inp.assign(score=pd.Series([], index=inp.index, dtype=np.float64))
            return pt.model.add_ranks(out)
        enc = self.encoder
        q = self._vectors(inp, "query_vec", "query", "qid", enc.query_max_length)
        d = self._vectors(inp, "doc_vec", "text", "docno", enc.doc_max_length)
        scores = np.einsum("ij,ij->i", q, d).astype(np.float64)
        return pt.model.add_ranks(inp.assign(score=scores))
