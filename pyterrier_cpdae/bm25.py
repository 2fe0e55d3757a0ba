"""BM25 over a Lucene index built in-process by Pyserini/Anserini.

:class:`BM25Index` is a PyTerrier artifact: a folder holding a Lucene index (``lucene/``)
and ``pt_meta.json`` (type ``sparse_index``, format ``pyserini_lucene``), so
``pt.Artifact.load(path)`` finds it through the ``pyterrier.artifact`` entry point.

Indexing and search go through Anserini's ``SimpleIndexer`` / ``SimpleSearcher`` Java classes
(the classes behind ``pyserini.index.lucene.LuceneIndexer`` and
``pyserini.search.lucene.LuceneSearcher``), called directly via pyjnius: importing
``pyserini.search.lucene`` also imports Pyserini's neural encoders (transformers, ...) and
takes ~10 s, while the Java classes are all BM25 needs. Text analysis is Anserini's
default: Lucene's standard tokenizer, lower-casing, English stop words and Porter stemming,
for documents and queries alike. Queries are analysed as bags of words (no Lucene query
syntax), so any string is a valid query.

Example::

    index = BM25Index("vaswani.bm25")
    index.indexer().index(dataset.get_corpus_iter())
    run = index.bm25(num_results=100)(dataset.get_topics())
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from pyterrier_cpdae._index_io import as_docno, temporary_files, write_json_atomic
from pyterrier_cpdae._java import autoclass

__all__ = ["BM25Index", "BM25Indexer", "BM25Retriever"]

_LUCENE_DIR = "lucene"
_META_FILE = "pt_meta.json"
_RESULT_COLUMNS = ["docno", "docid", "score", "rank"]


class BM25Index(pta.Artifact):
    """A Lucene index for BM25 retrieval, built and searched with Pyserini/Anserini.

    Args:
        path: folder of the index (created by :meth:`indexer`).
    """

    ARTIFACT_TYPE = "sparse_index"
    ARTIFACT_FORMAT = "pyserini_lucene"
    ARTIFACT_PACKAGE_HINT = "pyterrier-cpdae"

    def __init__(self, path: Union[str, Path]):
        super().__init__(path)

    @property
    def lucene_path(self) -> Path:
        """Folder of the Lucene index inside the artifact."""
        return Path(self.path) / _LUCENE_DIR

    def _read_meta(self) -> Optional[dict[str, Any]]:
        """The parsed ``pt_meta.json``, or ``None`` when it does not exist.

        Raises:
            ValueError: when it is not valid JSON, or describes another kind of artifact.
        """
        meta_path = Path(self.path) / _META_FILE
        if not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"corrupt BM25 index {self.path}: {_META_FILE} is not valid JSON ({e}); rebuild it with "
                             "indexer(mode='overwrite')") from e
        if not isinstance(meta, dict) or (meta.get("type"), meta.get("format")) != (self.ARTIFACT_TYPE,
                                                                                   self.ARTIFACT_FORMAT):
            found = (meta.get("type"), meta.get("format")) if isinstance(meta, dict) else type(meta).__name__
            raise ValueError(f"{self.path} is not a BM25Index: {_META_FILE} describes {found}, expected "
                             f"{(self.ARTIFACT_TYPE, self.ARTIFACT_FORMAT)}")
        return meta

    def built(self) -> bool:
        """Whether the index is complete (a valid ``pt_meta.json`` is written last, after Lucene commits)."""
        try:
            return self._read_meta() is not None
        except ValueError:
            return False

    def metadata(self) -> dict[str, Any]:
        """Contents of ``pt_meta.json`` (type, format, number of documents, ...).

        Raises:
            FileNotFoundError: the index is not (completely) built, or its Lucene folder is missing.
            ValueError: ``pt_meta.json`` is corrupt.
        """
        meta = self._read_meta()
        if meta is None:
            raise FileNotFoundError(
                f"No built BM25 index at {self.path} ({_META_FILE} is missing); build it with "
                "BM25Index(path).indexer().index(corpus_iter)."
            )
        if not self.lucene_path.is_dir():
            raise FileNotFoundError(f"corrupt BM25 index {self.path}: its Lucene folder {_LUCENE_DIR}/ is missing; "
                                    "rebuild it with indexer(mode='overwrite')")
        return meta

    def __len__(self) -> int:
        return int(self.metadata()["num_docs"])

    def _require_built(self) -> None:
        self.metadata()

    def indexer(self, mode: str = "create", threads: int = 1, batch_size: int = 1000) -> "BM25Indexer":
        """An indexer that builds this index from dicts with ``docno`` and ``text``.

        Args:
            mode: ``"create"`` (fail if the folder exists and is not empty) or ``"overwrite"``
                (replace an existing BM25 index at this path).
            threads: Lucene indexing threads.
            batch_size: documents sent to Java per call.
        """
        return BM25Indexer(self, mode=mode, threads=threads, batch_size=batch_size)

    def bm25(self, k1: float = 0.9, b: float = 0.4, num_results: int = 1000, threads: int = 1) -> "BM25Retriever":
        """A BM25 retriever (``qid, query`` → ``qid, query, docno, docid, score, rank``).

        The defaults k1=0.9, b=0.4 are Anserini's.
        """
        return BM25Retriever(self, k1=k1, b=b, num_results=num_results, threads=threads)

    retriever = bm25

    def __repr__(self) -> str:
        return f"BM25Index({str(self.path)!r})"


class BM25Indexer(pt.Indexer):
    """Builds a :class:`BM25Index` from an iterable of dicts (or a DataFrame) with ``docno`` and ``text``.

    Input rules:

    * ``docno`` and ``text`` are required (``ValueError`` naming the document otherwise);
      ``None`` is rejected for either.
    * docnos follow the same rule as :class:`~pyterrier_cpdae.dense_index.DenseIndex`: strings are kept,
      integers are converted with ``str()`` (so ``7`` and ``"7"`` are the same document), anything else
      (floats, bytes, ...), empty docnos and docnos with line breaks raise ``ValueError``; a repeated docno
      raises ``ValueError``. A failed build leaves no index behind.
    * A document whose text is empty or whitespace cannot match any query; it is skipped with
      one warning giving the count (Lucene would reject it anyway).
    """

    def __init__(self, index: BM25Index, mode: str = "create", threads: int = 1, batch_size: int = 1000):
        if mode not in ("create", "overwrite"):
            raise ValueError(f"mode must be 'create' or 'overwrite', got {mode!r}")
        if threads < 1 or batch_size < 1:
            raise ValueError("threads and batch_size must be >= 1")
        self.index_ref = index
        self.mode = mode
        self.threads = threads
        self.batch_size = batch_size

    def __repr__(self) -> str:
        return f"BM25Indexer({self.index_ref!r}, mode={self.mode!r}, threads={self.threads})"

    def index_inputs(self) -> list[list[str]]:
        return [["docno", "text"]]

    def _prepare_folder(self) -> bool:
        """Make the target folder ready; returns whether we created it."""
        path = Path(self.index_ref.path)
        if not path.exists():
            path.mkdir(parents=True)
            return True
        if not path.is_dir():
            raise NotADirectoryError(f"{path} exists and is not a folder")
        contents = list(path.iterdir())
        if not contents:
            return False
        if self.mode == "create":
            raise FileExistsError(f"{path} already exists and is not empty; use indexer(mode='overwrite') to replace it")
        # overwrite: only delete what is recognisably (a possibly half-built) BM25 index of ours
        leftovers = temporary_files(path, _META_FILE)  # of a pt_meta.json write interrupted by a crash
        names = {p.name for p in contents} - {p.name for p in leftovers}
        meta_ok = True
        if _META_FILE in names:
            try:
                meta = json.loads((path / _META_FILE).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                meta = None  # a corrupt pt_meta.json beside lucene/: a damaged BM25Index, which may be replaced
            # another artifact's metadata is never ours to delete
            meta_ok = not isinstance(meta, dict) or meta.get("format") == BM25Index.ARTIFACT_FORMAT
        if not names <= {_META_FILE, _LUCENE_DIR} or not meta_ok:
            raise FileExistsError(f"{path} holds something other than a BM25Index ({sorted(names)}); refusing to overwrite it")
        (path / _META_FILE).unlink(missing_ok=True)  # unbuilt from now on
        for p in leftovers:
            p.unlink()
        shutil.rmtree(path / _LUCENE_DIR, ignore_errors=True)
        return False

    @staticmethod
    def _records(inp: Union[Iterable[dict], pd.DataFrame]) -> Iterator[dict]:
        if isinstance(inp, pd.DataFrame):
            return (row for row in inp.to_dict(orient="records"))
        return iter(inp)

    def index(self, inp: Union[Iterable[dict], pd.DataFrame]) -> BM25Index:
        """Index the documents; returns the built :class:`BM25Index`."""
        simple_indexer = autoclass("io.anserini.index.SimpleIndexer")  # sets up Java before touching the folder
        path = Path(self.index_ref.path)
        created = self._prepare_folder()
        lucene_path = path / _LUCENE_DIR
        writer = simple_indexer(str(lucene_path), False, int(self.threads))
        seen: set[str] = set()
        num_docs = num_empty = 0
        batch: list[str] = []
        closed = False
        try:
            for i, doc in enumerate(self._records(inp)):
                if not isinstance(doc, dict):
                    raise TypeError(f"document #{i}: expected a dict with 'docno' and 'text', got {type(doc).__name__}")
                missing = [c for c in ("docno", "text") if doc.get(c) is None]
                if missing:
                    raise ValueError(f"document #{i} (docno={doc.get('docno')!r}) has no {' / '.join(missing)} "
                                     f"(keys: {sorted(doc)})")
                try:
                    docno = as_docno(doc["docno"])
                except ValueError as e:
                    raise ValueError(f"document #{i}: {e}") from None
                text = doc["text"]
                if not isinstance(text, str):
                    raise ValueError(f"document {docno!r}: text must be a str, got {type(text).__name__}")
                if docno in seen:
                    raise ValueError(f"duplicate docno {docno!r} (document #{i}); docnos must be unique")
                seen.add(docno)
                if not text.strip():
                    num_empty += 1
                    continue
                batch.append(json.dumps({"id": docno, "contents": text}))
                if len(batch) >= self.batch_size:
                    num_docs += self._add(writer, batch)
                    batch = []
            if batch:
                num_docs += self._add(writer, batch)
            writer.close()
            closed = True
        except BaseException:
            if not closed:
                try:
                    writer.close()
                except Exception:  # pragma: no cover - best effort cleanup
                    pass
            if created:
                shutil.rmtree(path, ignore_errors=True)
            else:
                shutil.rmtree(lucene_path, ignore_errors=True)
            raise
        if num_empty:
            warnings.warn(f"{num_empty} document(s) with empty text were not indexed (they cannot match any query)",
                          stacklevel=2)
        meta = {
            "type": BM25Index.ARTIFACT_TYPE,
            "format": BM25Index.ARTIFACT_FORMAT,
            "package_hint": BM25Index.ARTIFACT_PACKAGE_HINT,
            "num_docs": num_docs,
            "num_empty_skipped": num_empty,
            "analyzer": "anserini-default (Lucene standard tokenizer, English stop words, Porter stemmer)",
        }
        # written last: its presence is what built() checks
        write_json_atomic(path / _META_FILE, meta)
        return self.index_ref

    @staticmethod
    def _add(writer: Any, batch: list[str]) -> int:
        added = int(writer.addRawDocuments(batch))
        if added != len(batch):
            raise RuntimeError(f"Lucene indexed {added} of {len(batch)} documents in a batch")
        return added


class BM25Retriever(pt.Transformer):
    """BM25 retrieval from a :class:`BM25Index` (``qid, query`` → ranked documents).

    Output: the input columns, then ``docno``, ``docid`` (Lucene's internal id), ``score``
    and ``rank`` (from 0), at most ``num_results`` rows per query, sorted by score. Scores are
    Lucene BM25 as Anserini reports them: rounded to 4 decimals, ties broken by docno (each later
    tied score lowered by 1e-6). Queries are bags of words, so punctuation or Lucene operators in
    them are harmless; a query with no indexable term gets no results.
    """

    def __init__(self, index: BM25Index, k1: float = 0.9, b: float = 0.4, num_results: int = 1000, threads: int = 1):
        if num_results < 1 or threads < 1:
            raise ValueError("num_results and threads must be >= 1")
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"need k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.index = index
        self.k1 = float(k1)
        self.b = float(b)
        self.num_results = int(num_results)
        self.threads = int(threads)
        self._searcher: Optional[Any] = None

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

    def searcher(self) -> Any:
        """Anserini's ``SimpleSearcher`` for this index, with this retriever's BM25 parameters."""
        if self._searcher is None:
            self.index._require_built()
            simple_searcher = autoclass("io.anserini.search.SimpleSearcher")  # Java problems are not index problems
            try:
                searcher = simple_searcher(str(self.index.lucene_path))
            except Exception as e:  # pyjnius' JavaException
                raise ValueError(f"corrupt BM25 index {self.index.path}: Lucene cannot open {self.index.lucene_path} "
                                 f"({e}); rebuild it with indexer(mode='overwrite')") from e
            searcher.set_bm25(self.k1, self.b)
            self._searcher = searcher
        return self._searcher

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
        out = builder.to_df(merge_on_index=inp)
        if not len(out):
            out = out.astype({"docno": str, "docid": "int64", "score": "float64", "rank": "int64"})
        return out
