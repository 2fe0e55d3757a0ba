"""Searching a :class:`~pyterrier_cpdae.bm25.index.BM25Index`: :class:`BM25Retriever` (BM25 rankings through
Anserini's ``SimpleSearcher``) and :class:`BM25TextLoader` (the stored text of ranked documents), each keeping one
searcher that is reopened when the index has been rebuilt."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from pyterrier_cpdae._checks import as_docno
from pyterrier_cpdae.bm25.jvm import _flat_hits_class, autoclass

__all__ = ["BM25Retriever", "BM25TextLoader"]

# ``BM25Index`` in the annotations below is :class:`~pyterrier_cpdae.bm25.index.BM25Index` (not imported: index.py
# imports this module)

_RESULT_COLUMNS = ["docno", "docid", "score", "rank"]


class _OpensSearcher:
    """Keeps one ``SimpleSearcher`` on ``self.index`` and reopens it when the index has been rebuilt since."""

    index: BM25Index
    _searcher: Optional[Any] = None
    _fingerprint: Optional[tuple] = None

    def _configure(self, searcher: Any) -> None:
        """Sets up a freshly opened searcher."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickles without the Java searcher (pyjnius objects cannot be pickled); it is reopened on first use."""
        state = self.__dict__.copy()
        state.pop("_searcher", None)
        state.pop("_fingerprint", None)
        return state

    def searcher(self) -> Any:
        """Anserini's ``SimpleSearcher`` for the current build of the index (reopened after a rebuild)."""
        self.index._require_built()
        if self._searcher is None or self._fingerprint != self.index._fingerprint():
            old = self._searcher
            searcher, self._fingerprint = self.index._open_searcher()
            self._configure(searcher)
            self._searcher = searcher
            if old is not None:
                try:
                    old.close()
                except Exception:  # pragma: no cover - the old reader is dropped either way
                    pass
        return self._searcher


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class BM25Retriever(_OpensSearcher, pt.Transformer):
    """BM25 retrieval from a :class:`BM25Index` (``qid, query`` → ranked documents).

    Output: the input columns, then ``docno``, ``docid`` (Lucene's internal id), ``score``
    and ``rank`` (from 0), at most ``num_results`` rows per query, sorted by score. Scores are
    Lucene BM25 as Anserini reports them: rounded to 4 decimals, ties broken by docno (each later
    tied score lowered by 1e-6). Queries are bags of words, so punctuation or Lucene operators in
    them are harmless; a query with no indexable term gets no results.
    """

    def __init__(self, index: BM25Index, k1: float = 0.9, b: float = 0.4, num_results: int = 1000, threads: int = 1):
        if not _is_int(num_results) or not _is_int(threads) or num_results < 1 or threads < 1:
            raise ValueError(f"num_results and threads must be integers >= 1, got num_results={num_results!r}, "
                             f"threads={threads!r}")
        try:
            ok = math.isfinite(k1) and math.isfinite(b) and k1 >= 0 and 0 <= b <= 1  # NaN fails every comparison
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"BM25 needs finite k1 >= 0 and 0 <= b <= 1, got k1={k1!r}, b={b!r}")
        self.index = index
        self.k1 = float(k1)
        self.b = float(b)
        self.num_results = int(num_results)
        self.threads = int(threads)

    def _key(self) -> tuple:
        return (str(Path(self.index.path).resolve()), self.k1, self.b, self.num_results)

    def __repr__(self) -> str:
        return (f"{self.index!r}.bm25(k1={self.k1}, b={self.b}, num_results={self.num_results}, "
                f"threads={self.threads})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BM25Retriever) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("BM25Retriever",) + self._key())

    def fuse_rank_cutoff(self, k: int) -> Optional["BM25Retriever"]:
        """``bm25 % k`` with ``k < num_results`` becomes a BM25 retriever asking Lucene for only ``k`` results."""
        if k < self.num_results:
            return BM25Retriever(self.index, k1=self.k1, b=self.b, num_results=k, threads=self.threads)
        return None

    def _configure(self, searcher: Any) -> None:
        searcher.set_bm25(self.k1, self.b)

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pta.validate.query_frame(inp, extra_columns=["query"])
        clash = [c for c in _RESULT_COLUMNS if c in inp.columns]
        if clash:
            raise ValueError(f"BM25 retrieval expects a query frame, but the input already has {clash}; "
                             "drop those columns (e.g. with pt.apply.generic) before retrieving")
        builder = pta.DataFrameBuilder(["docno", "docid", "score", "rank"])
        if len(inp):
            queries = []
            for qid, query in zip(inp["qid"], inp["query"]):
                if not isinstance(query, str):
                    raise ValueError(f"query for qid {qid!r} must be a str, got {query!r}")
                queries.append(query)
            searcher = self.searcher()
            flat_hits = _flat_hits_class()
            if flat_hits is not None:  # the same batch_search, its hits copied into four arrays in Java
                hits = flat_hits.search(searcher, queries, self.num_results, self.threads)
                counts = np.asarray(hits.counts, dtype=np.int64)
                starts = np.repeat(np.cumsum(counts) - counts, counts)
                # lists, not arrays: DataFrameBuilder would broadcast an array of one hit as a single value
                # (pyjnius already hands the Java arrays over as lists); no hits at all (e.g. only blank
                # queries): nothing to add — pyjnius' empty arrays would not make columns
                if counts.sum():
                    builder.extend({
                        "_index": np.repeat(np.arange(len(queries)), counts).tolist(),
                        "docno": hits.docnos,
                        "docid": hits.docids,
                        "score": hits.scores,
                        "rank": (np.arange(len(starts), dtype=np.int64) - starts).tolist(),
                    })
            else:
                self._per_hit(searcher, queries, builder)
        out = builder.to_df(merge_on_index=inp)
        if not len(out):
            out = out.astype({"docno": str, "docid": "int64", "score": "float64", "rank": "int64"})
        return out


    def _per_hit(self, searcher: Any, queries: list[str], builder: "pta.DataFrameBuilder") -> None:
        """Anserini's batch_search with its hits read one Java call per field (when the helper jar is missing)."""
        array_list = autoclass("java.util.ArrayList")
        jqueries, jkeys = array_list(), array_list()
        for i, q in enumerate(queries):
            jqueries.add(q)
            jkeys.add(str(i))  # positional keys: the input may repeat a qid
        hits = searcher.batch_search(jqueries, jkeys, self.num_results, self.threads)
        for i in range(len(queries)):
            found = hits.get(str(i))
            n = len(found) if found is not None else 0
            if n == 0:
                continue
            builder.extend({
                "_index": i,
                "docno": [h.docid for h in found],
                "docid": [int(h.lucene_docid) for h in found],
                "score": [float(h.score) for h in found],
                "rank": list(range(n)),
            })


class BM25TextLoader(_OpensSearcher, pt.Transformer):
    """Adds ``text`` (the text stored at indexing) for each ``docno`` of the input: PyTerrier's text loader.

    A docno that is not in the index (including documents skipped for having empty text) raises
    ``ValueError`` naming it. An existing ``text`` column is replaced.
    """

    schematic = {"label": "TextLoader"}

    def __init__(self, index: BM25Index, fields: Union[str, list[str]] = "*", *, verbose: bool = False):
        wanted = ["text"] if fields == "*" else [fields] if isinstance(fields, str) else list(fields)
        if wanted != ["text"]:
            raise ValueError(f"a BM25Index stores one text field, 'text'; cannot load {wanted}")
        self.index = index
        self.verbose = verbose
        if index.built():
            self._require_text()

    def __repr__(self) -> str:
        return f"{self.index!r}.text_loader()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BM25TextLoader) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("BM25TextLoader", self._key()))

    def _key(self) -> str:
        return str(Path(self.index.path).resolve())

    def _require_text(self) -> None:
        if not self.index.has_text():
            raise ValueError(f"the BM25 index {self.index.path} does not store the documents' text (it was built with "
                             "store_text=False, or by an earlier version of pyterrier-cpdae); rebuild it with "
                             "indexer(mode='overwrite'), or load the text from the corpus (e.g. pt.text.get_text(dataset))")

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pta.validate.columns(inp, includes=["docno"])
        self._require_text()
        searcher = self.searcher()
        texts: dict[str, str] = {}
        docnos = []
        for i, value in enumerate(inp["docno"]):
            try:
                docnos.append(as_docno(value))
            except ValueError as e:
                raise ValueError(f"row {i}: {e}") from None
        unique = list(dict.fromkeys(docnos))
        array_list = autoclass("java.util.ArrayList")
        chunk = 10_000
        with pt.tqdm(total=len(unique), desc="loading text", unit="doc", disable=not self.verbose) as progress:
            for start in range(0, len(unique), chunk):
                jdocnos = array_list()
                for docno in unique[start:start + chunk]:
                    jdocnos.add(docno)
                found = searcher.batch_get_docs(jdocnos, os.cpu_count() or 1)  # looked up in parallel, in Java
                for docno in unique[start:start + chunk]:
                    doc = found.get(docno)
                    if doc is not None:
                        texts[docno] = doc.get("contents")
                progress.update(len(jdocnos))
        missing = [d for d in unique if d not in texts]
        if missing:
            raise ValueError(f"{len(missing)} docno(s) of the input are not in the BM25 index {self.index.path}, "
                             f"e.g. {missing[:5]} (documents with empty text are not indexed)")
        return inp.drop(columns=["text"], errors="ignore").assign(text=[texts[d] for d in docnos])

    def fuse_rank_cutoff(self, k: int) -> pt.Transformer:
        """``loader % k`` cuts the ranking before loading text (and so fuses into the retriever before it)."""
        return pt.RankCutoff(k) >> self
