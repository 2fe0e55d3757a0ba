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
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import pandas as pd
import pyterrier as pt

from pyterrier_cpdae._artifact import IncompleteIndexError, PackagedArtifact, read_pt_meta
from pyterrier_cpdae._checks import as_docno
from pyterrier_cpdae._files import temporary_files, write_json_atomic
from pyterrier_cpdae._locking import build_lock, describe_holder, holder
from pyterrier_cpdae.bm25.build_errors import LuceneFailure, NotAllIndexed, build_error
from pyterrier_cpdae.bm25.jvm import _blob_indexer_class, autoclass, detach_thread
from pyterrier_cpdae.bm25.retrieval import BM25Retriever, BM25TextLoader, _is_int

__all__ = ["BM25Index", "BM25Indexer", "BM25Retriever", "BM25TextLoader"]

_LUCENE_DIR = "lucene"
_META_FILE = "pt_meta.json"
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
    PACKAGE_MEMBERS = ("pt_meta.json", _LUCENE_DIR)

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


# what Java's String.trim() removes (Anserini rejects a document whose text trims to nothing)
_JAVA_WHITESPACE = "".join(map(chr, range(33)))


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


