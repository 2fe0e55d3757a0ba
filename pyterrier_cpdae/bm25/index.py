"""BM25 over a Lucene index built in-process by Pyserini/Anserini.

:class:`BM25Index` is a PyTerrier artifact: a folder holding a Lucene index (``lucene/``)
and ``pt_meta.json`` (type ``sparse_index``, format ``pyserini_lucene``), so
``pt.Artifact.load(path)`` finds it through the ``pyterrier.artifact`` entry point. The Lucene
index also stores each document's text (stored field ``contents``, as Anserini's
``-storeContents``), which :meth:`BM25Index.text_loader` adds to result frames for re-ranking.

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
    if not index.built():  # a later run (a fresh process) searches the existing index
        index.indexer().index(dataset.get_corpus_iter())
    run = index.bm25(num_results=100)(dataset.get_topics())
    rerank = index.bm25(num_results=100) >> index.text_loader() >> encoder.text_scorer()
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import numpy as np
import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from pyterrier_cpdae._artifact import IncompleteIndexError, PackagedArtifact, read_pt_meta
from pyterrier_cpdae._checks import as_docno
from pyterrier_cpdae._files import temporary_files, write_json_atomic
from pyterrier_cpdae._locking import build_lock, describe_holder, holder
from pyterrier_cpdae.bm25.build_errors import LuceneFailure, NotAllIndexed, build_error
from pyterrier_cpdae.bm25.jvm import autoclass, detach_thread

__all__ = ["BM25Index", "BM25Indexer", "BM25Retriever", "BM25TextLoader"]

_LUCENE_DIR = "lucene"
_META_FILE = "pt_meta.json"
_RESULT_COLUMNS = ["docno", "docid", "score", "rank"]
#: The longest docno, in bytes of UTF-8: Lucene indexes the docno as one term, and refuses a term longer than
#: this (an "immense term" exception from inside the Java indexer)
MAX_DOCNO_BYTES = 32766


class BM25Index(PackagedArtifact):
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
        """The parsed ``pt_meta.json`` (:func:`~pyterrier_cpdae.dense.format.read_pt_meta`), or ``None`` when missing."""
        return read_pt_meta(Path(self.path), artifact_type=self.ARTIFACT_TYPE, artifact_format=self.ARTIFACT_FORMAT,
                            what="BM25Index", required=["num_docs"])

    def built(self) -> bool:
        """Whether the index is complete (a valid ``pt_meta.json`` is written last, after Lucene commits)."""
        try:
            return self._read_meta() is not None
        except ValueError:
            return False

    def metadata(self) -> dict[str, Any]:
        """The parsed ``pt_meta.json`` of the built index (the same as :meth:`meta`).

        Holds, as :meth:`DenseIndex.meta() <pyterrier_cpdae.dense.DenseIndex.meta>` does, ``type``,
        ``format``, ``package_hint`` and ``num_docs`` (the number of documents), plus ``num_empty_skipped``,
        ``stored_fields`` and ``analyzer``.

        Raises:
            IncompleteIndexError: the index is not (completely) built (a ``FileNotFoundError``).
            FileNotFoundError: its Lucene folder is missing.
            ValueError: ``pt_meta.json`` is corrupt.
        """
        meta = self._read_meta()
        if meta is None:
            path = Path(self.path)
            info = holder(path)
            if info is not None:
                raise IncompleteIndexError(f"the BM25 index at {path} is being built by {describe_holder(info)}; "
                                           "wait for that build to finish")
            if path.is_dir() and any(path.iterdir()):
                raise IncompleteIndexError(
                    f"the BM25 index at {path} is incomplete: its build was interrupted or failed ({_META_FILE}, "
                    "written last, is missing); rebuild it with BM25Index(path).indexer(mode='overwrite').index(corpus_iter)")
            raise IncompleteIndexError(
                f"No built BM25 index at {self.path} ({_META_FILE} is missing); build it with "
                "BM25Index(path).indexer().index(corpus_iter)."
            )
        if not self.lucene_path.is_dir():
            raise FileNotFoundError(f"corrupt BM25 index {self.path}: its Lucene folder {_LUCENE_DIR}/ is missing; "
                                    "rebuild it with indexer(mode='overwrite')")
        return meta

    meta = metadata

    def __len__(self) -> int:
        return int(self.metadata()["num_docs"])

    def _require_built(self) -> None:
        self.metadata()

    def has_text(self) -> bool:
        """Whether the index stores the documents' text (what :meth:`text_loader` reads).

        Indexes built with ``store_text=False``, or by versions of this package before text was stored, do not.
        """
        return "contents" in self.metadata().get("stored_fields", [])

    def _fingerprint(self) -> tuple:
        """Identifies one build of the index: ``pt_meta.json`` is replaced (a new file) by every rebuild."""
        st = (Path(self.path) / _META_FILE).stat()
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _open_searcher(self) -> tuple[Any, tuple]:
        """A new Anserini ``SimpleSearcher`` on the built index, and the fingerprint of the build it sees."""
        self._require_built()
        fingerprint = self._fingerprint()
        simple_searcher = autoclass("io.anserini.search.SimpleSearcher")  # Java problems are not index problems
        try:
            searcher = simple_searcher(str(self.lucene_path))
        except Exception as e:  # pyjnius' JavaException
            raise ValueError(f"corrupt BM25 index {self.path}: Lucene cannot open {self.lucene_path} "
                             f"({e}); rebuild it with indexer(mode='overwrite')") from e
        return searcher, fingerprint

    def indexer(self, mode: str = "create", threads: Optional[int] = None, batch_size: int = 2000,
                store_text: bool = True) -> "BM25Indexer":
        """An indexer that builds this index from dicts with ``docno`` and ``text``.

        Args:
            mode: ``"create"`` (fail if the folder exists and is not empty) or ``"overwrite"``
                (replace an existing BM25 index at this path).
            threads: Lucene indexing threads (default: the machine's cores, ``os.cpu_count()``).
            batch_size: documents sent to Java per call (Python prepares the next batch meanwhile).
            store_text: keep each document's text in the index (Lucene stored field ``contents``, as
                Anserini's ``-storeContents``), which :meth:`text_loader` reads.
        """
        return BM25Indexer(self, mode=mode, threads=threads, batch_size=batch_size, store_text=store_text)

    def bm25(self, k1: float = 0.9, b: float = 0.4, num_results: int = 1000, threads: int = 1) -> "BM25Retriever":
        """A BM25 retriever (``qid, query`` → ``qid, query, docno, docid, score, rank``).

        The defaults k1=0.9, b=0.4 are Anserini's.
        """
        return BM25Retriever(self, k1=k1, b=b, num_results=num_results, threads=threads)

    retriever = bm25

    def text_loader(self, fields: Union[str, list[str]] = "*", *, verbose: bool = False) -> "BM25TextLoader":
        """A transformer that adds each document's ``text`` (as it was indexed) for its ``docno``.

        It follows PyTerrier's ``text_loader`` convention (``pt.text.get_text(index)`` works too), so that
        ``index.bm25() >> index.text_loader() >> enc.text_scorer()`` re-ranks BM25's results with an encoder.

        Args:
            fields: ``"*"`` or ``"text"`` (the only stored field).
            verbose: show a progress bar.
        """
        return BM25TextLoader(self, fields, verbose=verbose)

    def __repr__(self) -> str:
        return f"BM25Index({str(self.path)!r})"


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


class BM25Indexer(pt.Indexer):
    """Builds a :class:`BM25Index` from an iterable of dicts (or a DataFrame) with ``docno`` and ``text``.

    Input rules:

    * ``docno`` and ``text`` are required (``ValueError`` naming the document otherwise);
      ``None`` is rejected for either.
    * docnos follow the same rule as :class:`~pyterrier_cpdae.dense.DenseIndex`: strings are kept,
      integers are converted with ``str()`` (so ``7`` and ``"7"`` are the same document), anything else
      (floats, bytes, ...), empty docnos and docnos with line breaks raise ``ValueError``; a repeated docno
      raises ``ValueError``.
    * Java cannot hold every Python string exactly: a NUL character (``"\\x00"``) or a lone surrogate
      (e.g. ``"\\ud800"``) in a docno or a text raises ``ValueError`` naming the document, rather than being
      truncated or replaced silently.
    * A docno longer than :data:`MAX_DOCNO_BYTES` (32766) bytes of UTF-8, Lucene's limit on one term, raises
      ``ValueError`` naming the document and the limit before the document reaches Lucene.
    * A document whose text is empty or whitespace cannot match any query; it is skipped with
      one warning giving the count (Lucene would reject it anyway). A corpus with no document to index
      raises ``ValueError``.

    A failed or interrupted build leaves no index behind that looks built (``pt_meta.json`` is written
    last); one process at a time may build a given path (an OS lock held for the whole build: a second
    writer gets :class:`~pyterrier_cpdae._locking.ConcurrentBuildError` at once).
    """

    def __init__(self, index: BM25Index, mode: str = "create", threads: Optional[int] = None, batch_size: int = 2000,
                 store_text: bool = True):
        if mode not in ("create", "overwrite"):
            raise ValueError(f"mode must be 'create' or 'overwrite', got {mode!r}")
        threads = (os.cpu_count() or 1) if threads is None else threads
        if not _is_int(threads) or not _is_int(batch_size) or threads < 1 or batch_size < 1:
            raise ValueError(f"threads and batch_size must be integers >= 1, got threads={threads!r}, "
                             f"batch_size={batch_size!r}")
        self.index_ref = index
        self.mode = mode
        self.threads = int(threads)
        self.batch_size = int(batch_size)
        self.store_text = bool(store_text)

    def __repr__(self) -> str:
        return (f"BM25Indexer({self.index_ref!r}, mode={self.mode!r}, threads={self.threads}, "
                f"store_text={self.store_text})")

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
        leftovers = temporary_files(path, _META_FILE)  # of a pt_meta.json write interrupted by a crash
        names = {p.name for p in contents} - {p.name for p in leftovers}
        if self.mode == "create":
            if names <= {_LUCENE_DIR} and not (path / _META_FILE).exists():
                raise FileExistsError(f"{path} holds an unfinished BM25 index (an earlier build was interrupted or "
                                      "failed); rebuild it with indexer(mode='overwrite')")
            raise FileExistsError(f"{path} already exists and is not empty; use indexer(mode='overwrite') to replace it")
        # overwrite: only delete what is recognisably (a possibly half-built) BM25 index of ours
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

    def _java_args(self, lucene_path: Path) -> list[str]:
        """Anserini's ``IndexCollection`` options: those of ``python -m pyserini.index.lucene`` for a JsonCollection."""
        args = ["-input", "", "-index", str(lucene_path), "-collection", "JsonCollection", "-threads", str(self.threads)]
        return args + (["-storeContents"] if self.store_text else [])

    def index(self, inp: Union[Iterable[dict], pd.DataFrame]) -> BM25Index:
        """Index the documents; returns the built :class:`BM25Index`.

        Raises:
            ConcurrentBuildError: another process is building the same path.
            ValueError: a document breaks the input rules above (the message names it), or nothing was indexed.
            OSError: ``errno.ENOSPC``, "no space left on <path>", when the disk fills up during the build, or
                ``errno.EIO`` for another I/O error of Lucene's (one line naming the folder and Lucene's first
                failure, whichever indexing thread met it; the unfinished index is removed).
            RuntimeError: another failure inside Lucene (one line, as above); no raw Java exception is raised.
        """
        simple_indexer = autoclass("io.anserini.index.SimpleIndexer")  # sets up Java before touching the folder
        path = Path(self.index_ref.path)
        with build_lock(path, "BM25 index"):
            created = self._prepare_folder()
            lucene_path = path / _LUCENE_DIR
            try:
                num_docs, num_empty = self._build(simple_indexer, lucene_path, inp)
                if num_docs == 0:
                    raise ValueError(f"no documents were indexed into {path} (empty input"
                                     f"{f', or only the {num_empty} with empty text' if num_empty else ''}); "
                                     "a BM25 index needs at least one document with text")
                meta = {
                    "type": BM25Index.ARTIFACT_TYPE,
                    "format": BM25Index.ARTIFACT_FORMAT,
                    "package_hint": BM25Index.ARTIFACT_PACKAGE_HINT,
                    "num_docs": num_docs,
                    "num_empty_skipped": num_empty,
                    "stored_fields": ["contents"] if self.store_text else [],
                    "analyzer": "anserini-default (Lucene standard tokenizer, English stop words, Porter stemmer)",
                }
                # written last: its presence is what built() checks
                write_json_atomic(path / _META_FILE, meta)
            except BaseException as e:
                if created:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    shutil.rmtree(lucene_path, ignore_errors=True)
                    (path / _META_FILE).unlink(missing_ok=True)
                error = build_error(path, e)
                if error is None:
                    raise
                raise error from e
            if num_empty:
                warnings.warn(f"{num_empty} document(s) with empty text were not indexed (they cannot match any "
                              "query)", stacklevel=2)
        return self.index_ref

    def _open_sink(self, simple_indexer: Any, lucene_path: Path) -> "_Sink":
        """Anserini's ``SimpleIndexer`` on ``lucene_path``, wrapped in the fastest way this JVM has to feed it."""
        writer = simple_indexer(self._java_args(lucene_path))
        helper = _blob_indexer_class()
        if helper is None:
            return _JsonSink(writer)
        return _BlobSink(writer, helper(writer, self.threads))

    def _build(self, simple_indexer: Any, lucene_path: Path, inp: Union[Iterable[dict], pd.DataFrame]) -> tuple[int, int]:
        """Feeds the documents to Anserini in batches; returns (documents indexed, empty documents skipped).

        Java indexes with ``threads`` threads while this thread checks and encodes the next batch (pyjnius
        releases the GIL during Java calls).
        """
        return self._feed(self._open_sink(simple_indexer, lucene_path), inp)

    def _feed(self, sink: "_Sink", inp: Union[Iterable[dict], pd.DataFrame]) -> tuple[int, int]:
        """Checks the documents and sends them to ``sink`` in batches of ``batch_size`` (see :meth:`_build`)."""
        seen: set[str] = set()
        num_empty = 0
        batch: list[str] = []  # docno, text, docno, text, ...
        positions: list[int] = []  # input position of each document of the batch
        try:
            for i, doc in enumerate(self._records(inp)):
                docno = text = None
                if type(doc) is dict:
                    docno, text = doc.get("docno"), doc.get("text")
                # the common case is checked here; anything else gets _checked_document's full checks and errors.
                # Texts are checked for NUL characters and lone surrogates a batch at a time (_batch_bytes)
                if not (type(docno) is str and type(text) is str and docno and docno.isascii() and docno.isprintable()):
                    docno, text = _checked_document(i, doc)
                if len(docno) > MAX_DOCNO_BYTES // 4:  # shorter ones fit whatever their characters (<= 4 bytes each)
                    _check_docno_length(i, docno)
                if docno in seen:
                    raise ValueError(f"duplicate docno {docno!r} (document #{i}); docnos must be unique")
                seen.add(docno)
                head = text[:1]
                if not (head > " " and not head.isspace()) and (not text.strip() or not text.strip(_JAVA_WHITESPACE)):
                    _check_text(i, docno, text)
                    num_empty += 1
                    continue
                batch.append(docno)
                batch.append(text)
                positions.append(i)
                if len(positions) >= self.batch_size:
                    sink.send(batch, positions)
                    batch, positions = [], []
            if batch:
                sink.send(batch, positions)
            num_docs = sink.finish()
            sink.close()  # commits
        except BaseException as e:
            # Lucene keeps the first failure of any of its threads (its "tragedy"), which closes the writer: the
            # error that reached this thread may be a later one (another thread's "this DocumentsWriter is closed")
            tragedy = sink.tragedy() if isinstance(e, Exception) else None
            try:
                sink.abort()
            except Exception:  # pragma: no cover - best effort; the caller removes the folder
                pass
            if tragedy is not None:
                raise LuceneFailure(tragedy) from e
            raise
        return num_docs, num_empty


class _Sink:
    """The Java end of a build: takes batches of checked documents (:meth:`send`), may index them in the
    background, reports the count (:meth:`finish`) and commits (:meth:`close`); after a failure, :meth:`abort`."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.num_sent = 0  # documents sent

    def send(self, batch: list[str], positions: list[int]) -> None:
        """Starts indexing one batch: ``[docno, text, docno, text, ...]`` of the input documents at ``positions``.

        Raises:
            ValueError: a text of the batch holds a NUL character or a lone surrogate (naming the document).
        """
        raise NotImplementedError

    def finish(self) -> int:
        """Waits for every batch sent; returns the number of documents indexed (all of them, or RuntimeError)."""
        raise NotImplementedError

    def close(self) -> None:
        """Commits the index and closes the writer (after :meth:`finish`)."""
        self.writer.close()

    def abort(self) -> None:
        """Stops after a failure (no batch runs any more) and closes the writer; the caller removes the index."""
        self.writer.close()

    def tragedy(self) -> Optional[Any]:
        """The first failure of Lucene's writer (a Java ``Throwable``, whichever thread met it), or None."""
        try:
            return self.writer.writer.getTragicException()  # SimpleIndexer's IndexWriter (pyjnius reaches it)
        except Exception:  # another Anserini version: no such field; the error that reached Python is named
            return None

    def _check_added(self, added: int, refused: Optional[str] = None) -> int:
        if added != self.num_sent:
            first = f"; the first refused docno is {refused!r}" if refused else ""
            raise NotAllIndexed(f"Lucene indexed {added} of the {self.num_sent} documents sent{first} (see the Java "
                               "log above)")
        return added


def _batch_bytes(batch: list[str], positions: list[int]) -> bytes:
    """The batch as UTF-8, fields separated by NUL; a ValueError naming the first document whose text holds a NUL
    character or a lone surrogate (which Java cannot hold as they are).

    One join, count and encode of the whole batch check every text at C speed; only a failing batch is searched
    document by document.
    """
    joined = "\x00".join(batch)
    try:
        if joined.count("\x00") == len(batch) - 1:
            return joined.encode("utf-8")
    except UnicodeEncodeError:
        pass
    for k, position in enumerate(positions):
        _check_text(position, batch[2 * k], batch[2 * k + 1])
    raise AssertionError("unreachable: a batch failed its check but none of its documents did")  # pragma: no cover


class _BlobSink(_Sink):
    """Sends each batch as one UTF-8 ``byte[]`` (:func:`_batch_bytes`) to the package's Java helper
    ``pyterrier_cpdae.BlobIndexer`` (:mod:`pyterrier_cpdae.bm25.java`): no JSON on either side; ``addBlob`` queues the
    batch and returns, so ``threads`` Java threads index without waiting for Python; at the end they write their
    in-memory buffers as segments all at once."""

    def __init__(self, writer: Any, helper: Any):
        super().__init__(writer)
        self.helper = helper

    def send(self, batch: list[str], positions: list[int]) -> None:
        self.helper.addBlob(_batch_bytes(batch, positions), len(positions))
        self.num_sent += len(positions)

    def finish(self) -> int:
        return self._check_added(int(self.helper.finish()), self.helper.firstRefused())

    def close(self) -> None:
        self.helper.close()
        super().close()

    def abort(self) -> None:
        self.helper.close()  # drops what is still queued
        super().abort()


class _JsonSink(_Sink):
    """Sends each batch as JSON strings to Anserini's ``SimpleIndexer.addRawDocuments`` (the fallback when the JVM
    was started without the package's helper jar, e.g. by Pyserini); one Python thread waits in that call while
    the caller prepares the next batch."""

    def __init__(self, writer: Any):
        super().__init__(writer)
        self.added = 0
        self.pending: Optional[concurrent.futures.Future] = None
        self.feeder = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bm25-feeder")

    def send(self, batch: list[str], positions: list[int]) -> None:
        _batch_bytes(batch, positions)  # the same checks
        docs = [json.dumps({"id": batch[k], "contents": batch[k + 1]}) for k in range(0, len(batch), 2)]
        self._wait()
        self.pending = self.feeder.submit(self.writer.addRawDocuments, docs)
        self.num_sent += len(positions)

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.added += int(pending.result())

    def _stop_feeder(self) -> None:
        self.feeder.submit(detach_thread).result()
        self.feeder.shutdown()

    def finish(self) -> int:
        self._wait()
        return self._check_added(self.added)

    def close(self) -> None:
        self._stop_feeder()
        super().close()

    def abort(self) -> None:
        if self.pending is not None:
            concurrent.futures.wait([self.pending])  # never close the writer under a running batch
        self._stop_feeder()
        super().abort()


_warned_no_helper = False


def _helper_class(name: str) -> Optional[Any]:
    """The Java class ``pyterrier_cpdae.<name>`` of the package's helper jar (:mod:`pyterrier_cpdae.bm25.java`), or None
    (with one warning per process) when the running JVM was started without that jar."""
    global _warned_no_helper
    try:
        return autoclass(f"pyterrier_cpdae.{name}")
    except Exception as e:  # pyjnius' JavaException: the JVM was started without our jar on its class path
        if not _warned_no_helper:
            _warned_no_helper = True
            warnings.warn(f"the Java VM was started without pyterrier-cpdae's helper jar ({e}; e.g. Pyserini started "
                          "Java before pyterrier_cpdae did), so BM25 takes Anserini's slower paths (JSON documents "
                          "when indexing, one Java call per hit when searching); let pyterrier_cpdae start Java "
                          "first for the fast ones", stacklevel=4)
        return None


def _blob_indexer_class() -> Optional[Any]:
    """``pyterrier_cpdae.BlobIndexer`` (see :func:`_helper_class`)."""
    return _helper_class("BlobIndexer")


def _flat_hits_class() -> Optional[Any]:
    """``pyterrier_cpdae.FlatHits`` (see :func:`_helper_class`)."""
    return _helper_class("FlatHits")


# what Java's String.trim() removes (Anserini rejects a document whose text trims to nothing)
_JAVA_WHITESPACE = "".join(map(chr, range(33)))


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _java_safe(value: str) -> Optional[str]:
    """Why ``value`` cannot cross into Java unchanged (None when it can)."""
    if "\x00" in value:
        return "contains a NUL character ('\\x00'), which Java would truncate"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"contains a lone surrogate {value[e.start]!r} at position {e.start} (not valid Unicode text; "
                    "decode the source with errors='replace' or fix it)")
    return None


def _checked_document(i: int, doc: Any) -> tuple[str, str]:
    """(docno, text) of input document #i, or a ValueError/TypeError naming it."""
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
        raise ValueError(f"document #{i} ({docno!r}): text must be a str, got {type(text).__name__}")
    return docno, text  # docnos: as_docno refuses NUL and lone surrogates; texts: _batch_bytes or _check_text


def _check_docno_length(i: int, docno: str) -> None:
    """A ValueError naming input document #i if its docno is longer than Lucene can index (:data:`MAX_DOCNO_BYTES`
    bytes of UTF-8), before it reaches Lucene."""
    size = len(docno.encode("utf-8"))  # lone surrogates were refused by as_docno
    if size > MAX_DOCNO_BYTES:
        raise ValueError(f"document #{i} (docno {docno[:40]!r}..., {len(docno)} characters): the docno is {size} bytes "
                         f"in UTF-8, longer than Lucene's limit of {MAX_DOCNO_BYTES} bytes for one term (the docno is "
                         "indexed as one term); shorten the docnos (e.g. a hash of the long ones)")


def _check_text(i: int, docno: str, text: str) -> None:
    """A ValueError naming input document #i if its text holds what Java cannot (a NUL, a lone surrogate)."""
    problem = _java_safe(text)
    if problem:
        raise ValueError(f"document #{i} ({docno!r}): text {problem}")


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
