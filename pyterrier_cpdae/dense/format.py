"""On-disk format helpers of :class:`~pyterrier_cpdae.dense.DenseIndex` (the ``pt_meta.json`` reader, docno and
vector checks and atomic writes it shares with :class:`~pyterrier_cpdae.bm25.BM25Index` live in
:mod:`pyterrier_cpdae._artifact`, :mod:`pyterrier_cpdae._checks` and :mod:`pyterrier_cpdae._files`, re-exported here).

Layout of a built (single) index directory::

    <path>/
      vectors.bin      raw row-major (count, dim) little-endian float32 or float16, no header (for dtype "int8"
                       and "binary": float32, the float copy that rescoring reads)
      codes.bin, calibration.npz
                       dtype "int8" / "binary" only: the scanned codes (:mod:`~pyterrier_cpdae.dense.codes`)
      docnos.npids     docno <-> row lookup (npids)
      pt_meta.json     written LAST: {"type": "dense_index", "format": "cpdae", "package_hint":
                       "pyterrier-cpdae", "layout": "single", "dim", "count", "num_docs", "dtype",
                       "build_id", ...}; ``num_docs`` (= ``count``, the key BM25Index uses too) since 0.1.0;
                       ``build_id`` (random, new at every build's commit; absent in older indexes);
                       ``format_version`` 2 for dtype "int8"/"binary" (with their ``codes`` entry), else 1
      faiss/           cached FAISS structures (built on first use, rebuilt when stale)

While it is being built the directory additionally holds ``_docnos.txt`` (one docno per line, appended
in step with ``vectors.bin``) and ``_build.json`` (the progress record: the number of records, and the
byte lengths of both files, known to be durable on disk).  Both are removed once ``pt_meta.json`` has
been written.  While ``merge_shards()`` runs, ``_merge.json`` records that the merge is under way (and
whether ``shards/`` is to be kept); it is removed last.  A crash can leave these files (and temporaries of
atomic writes) behind: :func:`remove_leftovers` finishes the job once the index is known to be complete.
"""
from __future__ import annotations

import functools
import json
import mmap
import os
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from .._artifact import (MAX_META_BYTES, META_FILE, IncompleteIndexError, check_regular,  # noqa: F401 (re-exported)
                         open_regular, read_pt_meta, read_small_file)
from .._checks import (MAX_NORM, MIN_NORM, as_docno, as_docnos, check_cast_to_zero, check_float16_scale,  # noqa: F401 (re-exported)
                       check_norms, describe_values, stack_vectors)
from .._files import current_umask, fsync_dir, temporary_files, write_json_atomic  # noqa: F401 (re-exported)

VECTORS_FILE = "vectors.bin"
DOCNOS_FILE = "docnos.npids"
BUILD_FILE = "_build.json"
BUILD_DOCNOS_FILE = "_docnos.txt"
MERGE_FILE = "_merge.json"
SHARDS_DIR = "shards"
CODES_FILE = "codes.bin"
CALIBRATION_FILE = "calibration.npz"
FAISS_DIR = "faiss"

ARTIFACT_TYPE = "dense_index"
ARTIFACT_FORMAT = "cpdae"
PACKAGE_HINT = "pyterrier-cpdae"
FORMAT_VERSION = 1
#: the format version of compressed indexes (dtype "int8"/"binary"): readers of version 1 only refuse them
CODES_FORMAT_VERSION = 2
#: the format versions this reader reads
READ_VERSIONS = (FORMAT_VERSION, CODES_FORMAT_VERSION)

#: storage dtype -> dtype of ``vectors.bin`` (compressed indexes keep a float32 copy beside their codes)
DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "int8": np.dtype("<f4"),
          "binary": np.dtype("<f4")}
#: the dtypes whose search scans codes (:mod:`~pyterrier_cpdae.dense.codes`)
COMPRESSED = ("int8", "binary")

#: the largest ``pt_meta.json`` (or ``_merge.json``) read: an index's metadata is a few hundred bytes


def check_dtype(dtype: Any) -> str:
    """Normalises a vector storage dtype to ``"float32"``, ``"float16"``, ``"int8"`` or ``"binary"``.

    Raises:
        ValueError: for any other dtype.
    """
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'float32', 'float16', 'int8' or 'binary', got {dtype!r}")
    return name


def remove_leftovers(path: Path) -> list:
    """Finishes what a build or merge killed after its commit left behind; returns the names it removed.

    Only acts when ``pt_meta.json`` is complete and valid (``read_meta``), i.e. the commit happened: then the
    progress record and docno text of the build (``_build.json``, ``_docnos.txt``), temporaries of
    interrupted atomic writes, and the state of an interrupted ``merge_shards()`` (``_merge.json``: before
    its commit the stray merged files, after it ``shards/`` unless it was to be kept) are removed.  The
    caller must hold the build lock of ``path`` (another process could be starting a build there).
    """
    import shutil

    try:
        meta = read_meta(path)
    except ValueError:
        return []
    if meta is None:
        return []
    removed = []

    def remove(p: Path) -> None:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        else:
            return
        removed.append(p.name)

    merge = path / MERGE_FILE
    if merge.exists():
        try:
            keep = bool(json.loads(read_small_file(merge, "merge record").decode("utf8")).get("keep_shards"))
        except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
            keep = True  # unreadable: never delete shards on a guess
        if meta.get("layout") == "sharded":  # killed before the merged pt_meta.json: the view is still valid
            for name in (VECTORS_FILE, DOCNOS_FILE, CODES_FILE, CALIBRATION_FILE):
                remove(path / name)
        elif not keep:
            remove(path / SHARDS_DIR)
    if meta.get("layout") == "single":
        for name in (BUILD_FILE, BUILD_DOCNOS_FILE):
            remove(path / name)
    for name in (META_FILE, BUILD_FILE, MERGE_FILE):
        for p in temporary_files(path, name):
            remove(p)
    remove(merge)
    if removed:
        fsync_dir(path)
    return removed


def shard_dirs(path: Path) -> list:
    """The shard directories ``<path>/shards/<i>`` (not the shards' lock files ``shards/.<i>.lock``)."""
    shards = path / SHARDS_DIR
    if not shards.is_dir():
        return []
    return sorted((p for p in shards.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def has_leftovers(path: Path) -> bool:
    """Whether :func:`remove_leftovers` may have something to do in ``path`` (cheap: no file is read)."""
    return any((path / name).exists() for name in (BUILD_FILE, BUILD_DOCNOS_FILE, MERGE_FILE)) or any(
        temporary_files(path, name) for name in (META_FILE, BUILD_FILE, MERGE_FILE))


def read_meta(path: Path) -> Optional[dict]:
    """Reads and checks a dense index's ``pt_meta.json`` (:func:`read_pt_meta`); returns None when it does not exist.

    ``num_docs`` is set from ``count`` for indexes written before it was stored.

    Raises:
        ValueError: when the file is not valid JSON, describes another artifact type/format or has invalid fields.
    """
    meta = read_pt_meta(path, artifact_type=ARTIFACT_TYPE, artifact_format=ARTIFACT_FORMAT, what="DenseIndex",
                        required=["dim", "count", "dtype"])
    if meta is None:
        return None
    meta_path = Path(path) / META_FILE
    version = meta.get("format_version", FORMAT_VERSION)  # (indexes written before it was recorded: version 1)
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise ValueError(f"{path} is a DenseIndex of format_version {version!r} ({meta_path}); this pyterrier-cpdae "
                         f"reads format_version {', '.join(map(str, READ_VERSIONS))} only: open it with the "
                         "pyterrier-cpdae that wrote it, or rebuild it with indexer(mode='overwrite')")
    layout = meta.get("layout", "single")
    if layout == "sharded" and "num_shards" not in meta:
        raise ValueError(f"corrupt {meta_path}: missing field(s) ['num_shards']")
    if layout not in ("single", "sharded"):
        raise ValueError(f"corrupt {meta_path}: unknown layout {layout!r}")
    for key, low in (("dim", 1), ("count", 0), ("num_shards", 1)):
        value = meta.get(key, low)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"corrupt {meta_path}: {key}={value!r} (must be an integer >= {low})")
    if meta.setdefault("num_docs", meta["count"]) != meta["count"]:
        raise ValueError(f"corrupt {meta_path}: num_docs={meta['num_docs']!r} differs from count={meta['count']!r}")
    check_dtype(meta["dtype"])
    if (meta["dtype"] in COMPRESSED) != (version == CODES_FORMAT_VERSION):
        raise ValueError(f"corrupt {meta_path}: dtype={meta['dtype']!r} with format_version {version!r}")
    return meta


def base_meta(*, dim: int, count: int, dtype: str, **extra: Any) -> dict:
    """The ``pt_meta.json`` contents of an index.

    ``build_id`` is a fresh random id unless given: every build, rebuild or merge commits a new one, which is how
    retrievers that keep files or FAISS structures open notice that the index was rebuilt (never by sampling
    its content).
    """
    meta = {
        "build_id": uuid.uuid4().hex,
        "type": ARTIFACT_TYPE,
        "format": ARTIFACT_FORMAT,
        "package_hint": PACKAGE_HINT,
        "format_version": CODES_FORMAT_VERSION if dtype in COMPRESSED else FORMAT_VERSION,
        "dim": int(dim),
        "count": int(count),
        "num_docs": int(count),
        "dtype": dtype,
    }
    meta.update(extra)
    return meta


def open_vectors(path: Path, meta: dict) -> np.memmap:
    """Memory-maps ``vectors.bin`` after checking that its size matches ``pt_meta.json``.

    Raises:
        FileNotFoundError: when the file is missing.
        ValueError: when the file is not a regular file (opened without blocking), truncated or too long.
    """
    vec_path = path / VECTORS_FILE
    try:
        fin = open_regular(vec_path, f"corrupt dense index {path}")
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"corrupt dense index {path}: {VECTORS_FILE} is missing") from None
    with fin:
        dtype = DTYPES[meta["dtype"]]
        expected = int(meta["count"]) * int(meta["dim"]) * dtype.itemsize
        actual = os.fstat(fin.fileno()).st_size
        if actual != expected:
            raise ValueError(f"corrupt dense index {path}: {VECTORS_FILE} has {actual} bytes but pt_meta.json "
                             f"(count={meta['count']}, dim={meta['dim']}, dtype={meta['dtype']}) needs {expected} "
                             "bytes (truncated or partially written?)")
        if expected == 0:
            return np.zeros((0, int(meta["dim"])), dtype=dtype)  # type: ignore[return-value]
        return np.memmap(fin, dtype=dtype, mode="r", shape=(int(meta["count"]), int(meta["dim"])))


def advise_random(vectors: np.ndarray) -> None:
    """``madvise(MADV_RANDOM)`` on a memory-mapped vector file that is read row by row (a compressed index's float
    copy, read only to rescore): the kernel then reads each row's pages, not its readahead window around them (at
    8.8M x 768, 265 GiB read for 24 queries' rescoring without it, 29x slower: bench_int8_msmarco_scale.md)."""
    mapping = getattr(vectors, "_mmap", None)
    if mapping is not None and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)


#: rows of a prefetch whose residency is sampled first (:func:`prefetch_rows`)
PREFETCH_SAMPLE = 64


def prefetch_rows(vectors: np.ndarray, rows: np.ndarray) -> int:
    """Asks the kernel to read the pages of ``rows`` of a memory-mapped vector file ahead of their use
    (``madvise(MADV_WILLNEED)`` over each run of pages, adjacent rows' pages merged): the reads are queued together
    and the storage serves them in parallel, where reading the rows one by one waits for one page fault after another
    (at 8.8M x 768, a search from a cold page cache 1.7-1.9x faster: ``bench_int8_msmarco_scale.md``). Only a hint:
    what is read stays the file's. Skipped (0) when ``vectors`` is not a memmap, or when a sample of
    ``PREFETCH_SAMPLE`` of the rows is in the page cache already (each advice costs about a microsecond, more than it
    saves when the file is cached). Returns the number of page runs advised."""
    mapping = getattr(vectors, "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_WILLNEED") or vectors.ndim != 2 or not len(rows) \
            or not vectors.flags.c_contiguous:
        return 0
    rows = np.asarray(rows, dtype=np.int64)
    if _resident(vectors, rows[np.linspace(0, len(rows) - 1, min(len(rows), PREFETCH_SAMPLE)).astype(np.int64)]):
        return 0
    rows = np.unique(rows)
    row_bytes = vectors.strides[0]
    base = int(getattr(vectors, "offset", 0)) % mmap.ALLOCATIONGRANULARITY  # row 0's place in the mapping
    page = mmap.PAGESIZE
    first = (base + rows * row_bytes) // page * page
    last = -(-(base + (rows + 1) * row_bytes) // page) * page  # (the end of each row's last page)
    new = np.concatenate([[True], first[1:] > last[:-1]])  # a row whose pages start a run (rows ascending)
    starts = first[new]
    ends = last[np.concatenate([np.flatnonzero(new)[1:] - 1, [len(rows) - 1]])]  # (each run's last row)
    for a, b in zip(starts.tolist(), ends.tolist()):
        try:
            _advise(mapping, a, b - a)
        except (OSError, ValueError):  # (a hint the system refuses: the rows are read as they come)
            return 0
    return len(starts)


def prefetch_ids(parts: list, ids: np.ndarray) -> int:
    """:func:`prefetch_rows` of the stored vectors of global document ids over an index's search parts ``(vectors,
    offset, stride)`` (a sharded view's parts hold ids ``row * stride + offset``): the reads a rescoring is about to
    make. Returns the number of page runs advised."""
    ids = np.asarray(ids, dtype=np.int64)
    return sum(prefetch_rows(vectors, (ids[ids % stride == offset] - offset) // stride)
               for vectors, offset, stride in parts)


def _advise(mapping: mmap.mmap, start: int, length: int) -> None:
    mapping.madvise(mmap.MADV_WILLNEED, start, length)


def _resident(vectors: np.ndarray, rows: np.ndarray) -> bool:
    """Whether the first page of each of ``rows`` of the memmap ``vectors`` is in memory (``mincore``); False where
    it cannot be asked."""
    import ctypes

    mincore = _mincore()
    if mincore is None:
        return False
    page = mmap.PAGESIZE
    flag = (ctypes.c_ubyte * 1)()
    for row in rows.tolist():
        address = (vectors.ctypes.data + row * vectors.strides[0]) // page * page
        if mincore(ctypes.c_void_p(address), ctypes.c_size_t(page), flag) != 0 or not flag[0] & 1:
            return False
    return True


@functools.lru_cache(maxsize=None)
def _mincore():
    """libc's ``mincore`` (looked up once: finding the library runs a program), or None where there is none."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).mincore
    except (OSError, AttributeError):
        return None


def open_docnos(path: Path, meta: dict):
    """Opens ``docnos.npids`` after checking its count.

    The hash inverse (docno -> row) is the last block of the file and its size follows from its header, so
    checking its length detects a truncated file wherever it was cut (npids itself opens one and fails only
    on lookup).

    Raises:
        FileNotFoundError: when the file is missing.
        ValueError: when it cannot be read, is truncated, or holds a different number of docnos.
    """
    import npids

    docno_path = path / DOCNOS_FILE
    try:
        check_regular(docno_path, f"corrupt dense index {path}")  # npids opens by name: a FIFO would block it
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"corrupt dense index {path}: {DOCNOS_FILE} is missing") from None
    try:
        lookup = npids.Lookup(docno_path)
    except Exception as ex:  # npids raises various low-level errors on corrupt files
        raise ValueError(f"corrupt dense index {path}: cannot read {DOCNOS_FILE} ({type(ex).__name__}: {ex})") from ex
    if len(lookup) != int(meta["count"]):
        lookup.close()
        raise ValueError(f"corrupt dense index {path}: {DOCNOS_FILE} holds {len(lookup)} docnos, "
                         f"pt_meta.json says count={meta['count']}")
    inv = getattr(lookup.inv, "codec", None)
    complete = (inv is not None and hasattr(inv, "hash_bits")
                and len(inv.hash_offsets) == (1 << inv.hash_bits) + 1 and len(inv.dids) == len(lookup))
    if not complete:
        lookup.close()
        raise ValueError(f"corrupt dense index {path}: {DOCNOS_FILE} ({docno_path.stat().st_size} bytes) is "
                         "truncated (its docno -> row table is incomplete); rebuild the index with "
                         "indexer(mode='overwrite')")
    return lookup


def iter_text_docnos(path: Path, limit: Optional[int] = None) -> Iterator[str]:
    """Yields docnos from a ``_docnos.txt`` file (one per line), at most ``limit`` of them."""
    with open(path, "rb") as fin:
        for i, line in enumerate(fin):
            if limit is not None and i >= limit:
                return
            yield line.rstrip(b"\n").decode("utf8")


def build_docno_lookup(docnos: Iterator[str], out_path: Path) -> None:
    """Builds an npids lookup at ``out_path`` (streaming) and checks that the docnos are unique.

    Uniqueness is checked without holding a Python set of all docnos: every stored docno is looked up
    in the npids inverse index (a hash table of 4-byte row ids) and must map back to its own row.

    Raises:
        ValueError: naming (up to 10) duplicate docnos; ``out_path`` is removed in that case.
    """
    if out_path.exists():
        out_path.unlink()
    try:
        _write_forward(docnos, out_path)
        _write_hash_inverse(out_path)
        duplicates = find_duplicate_docnos(out_path)
    except ZeroDivisionError as e:  # npids cannot read back a full block (256) of one repeated docno
        out_path.unlink(missing_ok=True)
        raise ValueError("duplicate docnos: a block of 256 consecutive records repeats one docno (each docno may "
                         "be indexed once); the index was left unbuilt") from e
    except BaseException:
        out_path.unlink(missing_ok=True)
        raise
    if duplicates:
        out_path.unlink(missing_ok=True)
        raise ValueError(f"duplicate docnos: {duplicates[:10]}{' ...' if len(duplicates) > 10 else ''} "
                         "(each docno may be indexed once); the index was left unbuilt")
    with open(out_path, "rb+") as fout:
        os.fsync(fout.fileno())


def _write_forward(docnos: Iterator[str], out_path: Path) -> None:
    """Writes npids' forward lookup (row -> docno) of ``docnos``, streaming.

    npids 0.1.3 stores a block of docnos that are all equal (a one-document index, or a last block of one
    docno) as fixed-width strings of width 0 after their common prefix, and then cannot open the file
    (``ZeroDivisionError``). Shortening that prefix by one byte gives the block a width of 1.
    """
    import npids

    with npids.Lookup.builder(out_path, build_inv=False) as builder:
        for docno in docnos:
            builder.add(docno)
        pending = builder.seeds  # the docnos of the block that close() will commit (None once committed)
        fixed = builder.seeded_formats.get("fixedbytes") if pending else None
        if fixed is not None and fixed.size() == 0 and fixed.prefix:
            fixed.prefix = fixed.prefix[:-1]


def _write_hash_inverse(lookup_path: Path) -> None:
    """Appends npids' hash inverse (docno -> row) to a forward-only npids lookup.

    For docnos that form integer sequences (``"1"``..``"11429"`` in Vaswani, ``"d001"``..``"d160"``) npids
    chooses an arithmetic inverse codec whose 0.1.3 version is wrong: it range-checks a number before
    subtracting the sequence's start, so the last ``start`` docnos are not found (Vaswani's last document
    would be reported as a duplicate, and could never be scored), and it accepts differently padded numbers
    (``"7"`` for ``"007"``). The hash inverse compares whole docnos, so it is exact for every docno scheme.
    """
    import npids
    from npids.codecs import inv as inv_codecs
    from npids.utils import FileManager

    with npids.Lookup(lookup_path) as lookup, FileManager(lookup_path, "a") as writer:
        inv_codecs["hash"].build(lookup.fwd, writer)


def find_duplicate_docnos(lookup_path: Path, block: int = 65536, limit: int = 10) -> list:
    """Returns up to ``limit`` docnos of the npids lookup that occur more than once."""
    import npids

    found: list = []
    with npids.Lookup(lookup_path) as lookup:
        n = len(lookup)
        for start in range(0, n, block):
            ids = np.arange(start, min(start + block, n))
            docnos = lookup.fwd.lookup(ids, as_bytes=True)
            back = np.asarray(lookup.inv.lookup(docnos))
            bad = np.nonzero(back != ids)[0]
            for b in bad:
                d = docnos[b].decode("utf8")
                if d not in found:
                    found.append(d)
                if len(found) >= limit:
                    return found
    return found
