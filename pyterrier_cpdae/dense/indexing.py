"""The writers of a dense index: the streaming, crash-resumable :class:`DenseIndexer` behind
:meth:`DenseIndex.indexer`, and merging (:func:`merge_indexes`, :func:`merge_shards`).

They depend on the file format (:mod:`~pyterrier_cpdae.dense.format`) and the store
(:mod:`~pyterrier_cpdae.dense.store`, which reads and checks what they
wrote), never on :class:`~pyterrier_cpdae.dense.DenseIndex` itself: they are given the index (any
artifact with a ``path``) and return it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from .._locking import build_lock
from . import codes as qcodes
from . import format as io
# iter_batches: re-exported (the indexer's input batches, dense/inputs.py)
from .inputs import DOC_STAMP, iter_batches, iter_stamped_batches, peek_producer  # noqa: F401
from .store import (DenseStore, check_producer, check_producers, check_shard_metas, check_shard_set,
                    check_vectors_producer)

MODES = ("create", "overwrite", "resume")
# files/directories an index directory may hold; ``overwrite`` deletes only these (never arbitrary content)
_OWNED = [io.META_FILE, io.VECTORS_FILE, io.DOCNOS_FILE, io.BUILD_FILE, io.BUILD_DOCNOS_FILE, io.MERGE_FILE,
          io.FAISS_DIR, *qcodes.FILES]


def shard_from_env() -> Tuple[Optional[int], Optional[int]]:
    """``(rank, world_size)`` from torchrun's environment (``RANK``/``WORLD_SIZE``), or ``(None, None)``."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        return int(os.environ.get("RANK", "0")), world
    return None, None


def remove_index_files(target: Path, *, shards: bool) -> None:
    """Deletes the files a dense index owns in ``target`` (never other content), and ``shards/`` when ``shards``.

    The caller holds the build lock of ``target``.
    """
    if not target.exists():
        return
    for name in _OWNED:
        p = target / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    for name in (io.META_FILE, io.BUILD_FILE, io.MERGE_FILE):  # temporaries of interrupted atomic writes
        for p in io.temporary_files(target, name):
            p.unlink()
    if shards and (target / io.SHARDS_DIR).exists():
        shutil.rmtree(target / io.SHARDS_DIR)


def shard_iter(docs: Iterable[Any], shard: int, num_shards: int) -> Iterator[Any]:
    """Yields the records of ``docs`` that belong to ``shard`` (record ``i`` goes to shard ``i % num_shards``)."""
    for i, doc in enumerate(docs):
        if i % num_shards == shard:
            yield doc


class DenseIndexer(pt.Indexer):
    """Streams ``docno``/``doc_vec`` records into a :class:`DenseIndex` (see :meth:`DenseIndex.indexer`)."""

    def __init__(self, index: pta.Artifact, *, mode: str = "create", dtype: Optional[str] = None,
                 shard: Optional[int] = None, num_shards: Optional[int] = None, presharded: bool = False,
                 batch_size: int = 1024, checkpoint_every: int = 65536, verbose: bool = False,
                 producer: Any = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if dtype is not None:
            dtype = io.check_dtype(dtype)
        if (shard is None) != (num_shards is None):
            raise ValueError("pass both shard= and num_shards= (or neither)")
        if shard is None:
            shard, num_shards = shard_from_env()
        if num_shards is not None and num_shards == 1:
            shard = num_shards = None
        if num_shards is not None:
            if num_shards < 1 or not 0 <= shard < num_shards:
                raise ValueError(f"need 0 <= shard < num_shards, got shard={shard}, num_shards={num_shards}")
        if checkpoint_every < 1 or batch_size < 1:
            raise ValueError("checkpoint_every and batch_size must be >= 1")
        self.index_obj = index
        self.mode = mode
        self.dtype = dtype
        self.shard = shard
        self.num_shards = num_shards
        self.presharded = presharded
        self.batch_size = batch_size
        self.checkpoint_every = checkpoint_every
        self.verbose = verbose
        if producer is not None and not callable(getattr(producer, "producer", None)):
            producer = check_producer(producer)
        self.producer = producer

    def with_producer(self, source: Any) -> "DenseIndexer":
        """This indexer, told what makes the vectors fed to it (called by ``enc >> indexer`` for a CPDAE encoder);
        an explicit ``producer=`` wins."""
        if self.producer is not None:
            return self
        import copy
        other = copy.copy(self)
        other.producer = source
        return other

    def resolved_producer(self) -> Optional[dict]:
        """The producer recorded in the index (:func:`check_producer`), or ``None`` when not known."""
        source = self.producer
        if source is not None and callable(getattr(source, "producer", None)):
            return check_producer(source.producer())
        return source

    def __repr__(self) -> str:
        extra = f", shard={self.shard}, num_shards={self.num_shards}" if self.num_shards else ""
        return f"DenseIndexer({str(self.index_obj.path)!r}, mode={self.mode!r}, dtype={self.dtype!r}{extra})"

    def index_inputs(self) -> List[List[str]]:
        """The record fields :meth:`index` needs (PyTerrier's indexer inspection)."""
        return [["docno", "doc_vec"]]

    @property
    def target(self) -> Path:
        """The directory this indexer writes (``<path>/shards/<i>`` when sharded)."""
        base = Path(self.index_obj.path)
        return base / io.SHARDS_DIR / str(self.shard) if self.num_shards else base

    # -- preparing the directory -------------------------------------------------------------------------
    def _prepare(self) -> Optional[dict]:
        """Checks/cleans the target directory for ``mode``; returns the progress record to resume from.

        Called with the build lock of the target held.
        """
        target = self.target
        base = Path(self.index_obj.path)
        if self.mode != "overwrite":
            io.remove_leftovers(target)  # of a build or merge killed after its commit
        if self.num_shards and (base / io.META_FILE).exists():
            meta = io.read_meta(base)
            if meta.get("layout") != "sharded" and self.mode != "overwrite":
                raise FileExistsError(f"{base} already holds a built (unsharded) dense index; use mode='overwrite'")
        target_meta = io.read_meta(target) if self.mode != "overwrite" else None
        if (not self.num_shards and io.shard_dirs(base) and self.mode != "overwrite"
                and (target_meta is None or target_meta.get("layout") == "sharded")):
            raise FileExistsError(f"{base} holds a sharded dense index ({io.SHARDS_DIR}/); merge it with "
                                  "DenseIndex.merge_shards() or use mode='overwrite'")
        state = None
        if self.mode == "create":
            if target.exists() and any(target.iterdir()):
                what = "a built dense index" if (target / io.META_FILE).exists() else (
                    "a partially built dense index" if (target / io.BUILD_FILE).exists() else "files")
                raise FileExistsError(f"{target} already exists and holds {what}; use mode='overwrite' to replace it"
                                      + (" or mode='resume' to continue it" if (target / io.BUILD_FILE).exists() else ""))
        elif self.mode == "overwrite":
            remove_index_files(target, shards=not self.num_shards)
            if self.num_shards and (base / io.META_FILE).exists():
                (base / io.META_FILE).unlink()  # the top-level (sharded or single) index is no longer valid
        elif self.mode == "resume":
            if target_meta is not None:
                return {"complete": True}
            if (target / io.BUILD_FILE).exists():
                state = self._load_state()
            elif target.exists():
                for name in (io.META_FILE, io.BUILD_FILE):  # an interrupted first write of the progress record
                    for p in io.temporary_files(target, name):
                        p.unlink()
                foreign = sorted(p.name for p in target.iterdir())
                if foreign:
                    raise FileExistsError(
                        f"cannot resume {target}: it holds no progress record ({io.BUILD_FILE}) but is not empty "
                        f"({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}); resume continues only a "
                        "build this indexer started. Use mode='overwrite' to replace this index's files, or an "
                        "empty directory")
        self._created = [d for d in (target, *target.parents) if not d.exists()]
        target.mkdir(parents=True, exist_ok=True)
        return state

    def _discard_empty_build(self) -> None:
        """Removes the files (and directories) of a build that this call started and that holds no record."""
        target = self.target
        for name in (io.VECTORS_FILE, io.BUILD_DOCNOS_FILE, io.BUILD_FILE):
            (target / name).unlink(missing_ok=True)
        for p in io.temporary_files(target, io.BUILD_FILE):
            p.unlink(missing_ok=True)
        for d in getattr(self, "_created", []):
            try:
                d.rmdir()  # only when empty
            except OSError:
                break

    def _load_state(self) -> dict:
        import json
        target = self.target
        try:
            with open(target / io.BUILD_FILE, encoding="utf8") as fin:
                state = json.load(fin)
            for key in ("count", "vec_bytes", "docno_bytes", "dtype"):
                state[key]
        except (ValueError, KeyError, TypeError) as ex:
            raise ValueError(f"cannot resume {target}: corrupt progress record {io.BUILD_FILE} ({ex}); "
                             "rebuild with mode='overwrite'") from ex
        if self.dtype is not None and state["dtype"] != self.dtype:
            raise ValueError(f"cannot resume {target}: it was started with dtype={state['dtype']!r}, not {self.dtype!r}")
        if state.get("num_shards") != self.num_shards or state.get("shard") != self.shard:
            raise ValueError(f"cannot resume {target}: it was started with shard={state.get('shard')}, "
                             f"num_shards={state.get('num_shards')}, not shard={self.shard}, num_shards={self.num_shards}")
        for name, key in ((io.VECTORS_FILE, "vec_bytes"), (io.BUILD_DOCNOS_FILE, "docno_bytes")):
            p = target / name
            if not p.exists() and state[key] == 0:  # killed right after the first progress record
                p.touch()
            size = p.stat().st_size if p.exists() else -1
            if size < state[key]:
                raise ValueError(f"cannot resume {target}: {name} has {max(size, 0)} bytes but the progress record "
                                 f"says {state[key]} bytes are durable; rebuild with mode='overwrite'")
            with open(p, "r+b") as f:  # drop any partially written tail, consistently in both files
                f.truncate(state[key])
                os.fsync(f.fileno())
        return state

    def _save_state(self, state: dict, vec_file, docno_file) -> None:
        vec_file.flush()
        docno_file.flush()
        os.fsync(vec_file.fileno())
        os.fsync(docno_file.fileno())
        io.write_json_atomic(self.target / io.BUILD_FILE, state)

    # -- indexing ----------------------------------------------------------------------------------------
    def index(self, inp: Any) -> pta.Artifact:
        """Indexes ``inp`` (iterable of dicts or DataFrames with ``docno`` and ``doc_vec``, or a DataFrame).

        The whole build holds the build lock of its directory: a second process building into the same path
        gets :class:`~pyterrier_cpdae._locking.ConcurrentBuildError` at once.

        Returns:
            The :class:`DenseIndex` this indexer was made by (for a shard: the top-level index, which is a searchable
            sharded view once every shard is built).
        """
        with build_lock(self.target, "dense index"):
            return self._index_locked(inp)

    def _index_locked(self, inp: Any) -> pta.Artifact:
        state = self._prepare()
        if state is not None and state.get("complete"):
            if self.num_shards and not (Path(self.index_obj.path) / io.META_FILE).exists():
                # a kill between a shard's commit and the top-level pt_meta.json: write it now if all are built
                write_sharded_meta_if_complete(Path(self.index_obj.path), self.num_shards)
            warnings.warn(f"{self.target} is already completely built; mode='resume' has nothing to do")
            return self.index_obj
        target = self.target
        fresh = state is None
        producer = self.resolved_producer()
        if producer is None:  # vectors stamped by their encoder (a frame or records made by it): their producer
            inp, producer = peek_producer(inp)
        if not fresh and state.get("producer") is not None and producer is not None:
            # a resume continues the vectors of the producer that started the build (without a recorded producer on
            # either side, the sampled prefix check of _PrefixCheck still compares the vectors)
            check_producers(target, [("the interrupted build", state.get("producer")), ("this resume", producer)],
                            advice="resume with the encoder that started the build, or rebuild with mode='overwrite'")
        if self.num_shards and self.mode != "overwrite":
            # refused before encoding anything, naming the shard already built by another encoder (an overwrite may
            # be the first of a rebuild of every shard with a new encoder: its siblings are checked at the view)
            base = Path(self.index_obj.path)
            built = [(f"shard {d.name}", io.read_meta(d)) for d in io.shard_dirs(base) if d != target]
            check_producers(base, [(x, m.get("producer")) for x, m in built if m is not None and
                                   m.get("num_shards") == self.num_shards] + [(f"shard {self.shard}", producer)])
        if fresh:
            state = {"format_version": io.FORMAT_VERSION, "dim": None, "dtype": self.dtype or "float32",
                     "count": 0, "vec_bytes": 0, "docno_bytes": 0, "shard": self.shard,
                     "num_shards": self.num_shards, "presharded": self.presharded}
            if producer is not None:
                state["producer"] = producer
            # the progress record comes first: from now on the directory is a resumable build of this indexer
            io.write_json_atomic(target / io.BUILD_FILE, state)
        try:
            self._write(inp, state, fresh)
        except Exception:
            if fresh and state["count"] == 0:
                self._discard_empty_build()  # nothing was indexed: leave nothing behind
            raise
        self._finalise(state)
        return self.index_obj

    def _write(self, inp: Any, state: dict, fresh: bool) -> None:
        """Appends the input's records (after the ``state["count"]`` already indexed ones) to the data files."""
        target = self.target
        store_dtype = io.DTYPES[state["dtype"]]
        skip = int(state["count"])
        stored_prefix = io.iter_text_docnos(target / io.BUILD_DOCNOS_FILE, limit=skip) if skip else iter(())
        prefix_check = _PrefixCheck(target, state, skip) if skip else None

        with open(target / io.VECTORS_FILE, "wb" if fresh else "ab") as vec_file, \
                open(target / io.BUILD_DOCNOS_FILE, "wb" if fresh else "ab") as docno_file:
            position = 0  # position in the (unfiltered) input
            seen = 0  # records of this shard seen (including the skipped prefix)
            since_checkpoint = 0
            # what this shard was given: every shard of a round-robin split must see the same input (see
            # check_shard_inputs); a resume reads the whole input again, so this covers it all
            input_digest = hashlib.sha256()
            shard_digests = [hashlib.sha256() for _ in range(self.num_shards or 0)] if not self.presharded else []
            for raw_docnos, raw_vecs, stamps in iter_stamped_batches(inp, self.batch_size):
                if stamps is not None:  # every stamped row must come from the index's producer
                    check_vectors_producer(target, state.get("producer") or {"name": "vectors without a stamp"},
                                           pd.DataFrame({"docno": raw_docnos, DOC_STAMP: stamps}), "doc_vec", "docno")
                records = range(position, position + len(raw_docnos))
                if self.num_shards:
                    input_digest.update(_docno_bytes(raw_docnos))
                    for s, digest in enumerate(shard_digests):  # the part of the input each shard keeps
                        digest.update(_docno_bytes(raw_docnos[(s - position) % self.num_shards::self.num_shards]))
                position += len(raw_docnos)
                if self.num_shards and not self.presharded:
                    keep = [i for i, r in enumerate(records) if r % self.num_shards == self.shard]
                    records = [records[i] for i in keep]
                    raw_docnos = [raw_docnos[i] for i in keep]
                    raw_vecs = [raw_vecs[i] for i in keep]
                if not raw_docnos:
                    continue
                docnos = io.as_docnos(raw_docnos, records)
                if seen < skip:  # the already indexed prefix: verify docnos and (a sample of) vectors, do not write
                    n_skip = min(skip - seen, len(docnos))
                    for i in range(n_skip):
                        stored = next(stored_prefix, None)
                        if stored != docnos[i]:
                            raise ValueError(
                                f"cannot resume {target}: record {seen + i} of the input has docno {docnos[i]!r} but "
                                f"the index holds {stored!r} there; resume needs the same input in the same order")
                    prefix_check.check(seen, docnos[:n_skip], raw_vecs[:n_skip])
                    seen += n_skip
                    docnos, raw_vecs = docnos[n_skip:], raw_vecs[n_skip:]
                    if not docnos:
                        continue
                vecs = io.stack_vectors(raw_vecs, docnos, state["dim"])
                if state["dim"] is None:
                    state["dim"] = int(vecs.shape[1])
                with np.errstate(over="ignore"):
                    stored_vecs = vecs.astype(store_dtype, copy=False)
                if store_dtype != np.float32 and not np.isfinite(stored_vecs).all():
                    bad = [docnos[i] for i in np.nonzero(~np.isfinite(stored_vecs).all(axis=1))[0][:5]]
                    raise ValueError(f"doc_vec of docno(s) {bad} overflow(s) {state['dtype']}")
                if store_dtype != np.float32:
                    io.check_float16_scale(vecs, stored_vecs, docnos)
                text = ("\n".join(docnos) + "\n").encode("utf8")  # encoded before anything of the batch is written
                vec_file.write(stored_vecs.tobytes())
                docno_file.write(text)
                seen += len(docnos)
                state["count"] += len(docnos)
                state["vec_bytes"] += stored_vecs.nbytes
                state["docno_bytes"] += len(text)
                since_checkpoint += len(docnos)
                if since_checkpoint >= self.checkpoint_every:
                    self._save_state(state, vec_file, docno_file)
                    since_checkpoint = 0
            if seen < skip:
                raise ValueError(f"cannot resume {target}: the input has only {seen} documents but {skip} are already "
                                 "indexed; resume needs the same input in the same order")
            if state["count"] == 0:
                raise ValueError(f"no documents were indexed into {target} (empty input"
                                 f"{' for this shard' if self.num_shards else ''})")
            self._save_state(state, vec_file, docno_file)
            if self.num_shards:
                self._input = {"presharded": self.presharded, "records": position,
                               "docnos_sha256": input_digest.hexdigest()}
                if not self.presharded:
                    self._input["shard_docnos_sha256"] = [d.hexdigest() for d in shard_digests]

    def _finalise(self, state: dict) -> None:
        target = self.target
        io.build_docno_lookup(io.iter_text_docnos(target / io.BUILD_DOCNOS_FILE), target / io.DOCNOS_FILE)
        extra = {"layout": "single"}
        if state.get("producer") is not None:
            extra["producer"] = state["producer"]
        if self.num_shards:
            extra.update(shard=self.shard, num_shards=self.num_shards, input=self._input)
        if state["dtype"] in io.COMPRESSED:  # the codes of every vector, calibrated on them all (codes.py)
            extra["codes"] = qcodes.write_codes(target, state["dtype"], int(state["count"]), int(state["dim"]))
        io.write_json_atomic(target / io.META_FILE,
                             io.base_meta(dim=state["dim"], count=state["count"], dtype=state["dtype"], **extra))
        io.remove_leftovers(target)  # _docnos.txt and _build.json (a crash before this is finished on resume/open)
        if self.num_shards:
            write_sharded_meta_if_complete(Path(self.index_obj.path), self.num_shards,
                                           replacing=self.mode == "overwrite")


class _PrefixCheck:
    """On resume, compares a sample of the re-fed prefix's vectors with the stored ones.

    With an encoder in front of the indexer the skipped prefix is encoded again anyway, so a resume with
    another model of the same dimension would silently mix two models' vectors.  Records ``0..31`` and then
    about 256 records spread over the prefix are compared; a record matches when the cosine of the two vectors
    is at least ``MIN_COSINE`` and their norms differ by at most ``NORM_TOLERANCE`` (relative).  Both bounds are
    far looser than bf16/fp16 rounding or the batch-dependent noise of mixed-precision encoding (cosine > 0.999)
    and far tighter than the agreement of two different models (typically cosine < 0.9).
    """

    MIN_COSINE = 0.99
    NORM_TOLERANCE = 0.05

    def __init__(self, target: Path, state: dict, skip: int):
        self.target = target
        self.dtype = io.DTYPES[state["dtype"]]
        self.stored = np.memmap(target / io.VECTORS_FILE, dtype=self.dtype, mode="r", shape=(skip, int(state["dim"])))
        self.dim = int(state["dim"])
        self.stride = max(1, skip // 256)

    def check(self, first: int, docnos: List[str], raw_vecs: List[Any]) -> None:
        rows = [first + i for i in range(len(docnos)) if first + i < 32 or (first + i) % self.stride == 0]
        if not rows:
            return
        picked = [r - first for r in rows]
        fed = io.stack_vectors([raw_vecs[i] for i in picked], [docnos[i] for i in picked], self.dim)
        with np.errstate(over="ignore"):
            fed = fed.astype(self.dtype).astype(np.float32)
        stored = np.asarray(self.stored[rows], dtype=np.float32)
        fed_norm, stored_norm = np.linalg.norm(fed, axis=1), np.linalg.norm(stored, axis=1)
        scale = np.maximum(fed_norm, stored_norm)
        tiny = scale < 1e-12
        cosine = np.where(tiny, 1.0, (fed * stored).sum(axis=1) / np.maximum(fed_norm * stored_norm, 1e-30))
        norms_ok = np.abs(fed_norm - stored_norm) <= self.NORM_TOLERANCE * scale
        bad = np.nonzero((cosine < self.MIN_COSINE) | ~norms_ok)[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"cannot resume {self.target}: the vector fed for record {rows[i]} (docno {docnos[picked[i]]!r}) differs "
                f"from the stored one (cosine {cosine[i]:.4f}, norms {fed_norm[i]:.4g} vs {stored_norm[i]:.4g}); "
                "the build was started with another encoder (or other encoder settings). Resume with the encoder "
                "that started it, or rebuild with mode='overwrite'")


def write_sharded_meta_if_complete(base: Path, num_shards: int, *, replacing: bool = False) -> bool:
    """Writes the top-level ``pt_meta.json`` of a sharded index once all ``num_shards`` shards are built.

    Each shard process calls this after finishing its shard; the content is deterministic, so concurrent
    writers (atomic renames) are harmless, and the last finisher always sees every shard complete.

    Args:
        replacing: the caller has just overwritten its shard (``mode="overwrite"``), perhaps the first of a rebuild
            of every shard with another encoder: siblings of another producer then leave the view unwritten with a
            warning naming them (the rebuild of the last of them writes it), instead of an error.

    Raises:
        ValueError: when the shards disagree on dim/dtype/num_shards, on the producer of their vectors (unless
            ``replacing``) or their sizes do not match the round-robin split.
    """
    metas = []
    for s in range(num_shards):
        shard_dir = base / io.SHARDS_DIR / str(s)
        meta = io.read_meta(shard_dir) if shard_dir.exists() else None
        if meta is None:
            return False
        metas.append(meta)
    check_shard_inputs(base, metas)
    check_shard_metas(base, metas)
    try:
        check_producers(base, [(f"shard {s}", m.get("producer")) for s, m in enumerate(metas)])
    except ValueError as e:
        if not replacing:
            raise
        warnings.warn(f"the sharded view of {base} is not written (not searchable) until its shards come from one "
                      f"producer: {e}")
        return False
    # the view's build id follows from its shards' (deterministic, as the comment above needs): a rebuilt shard
    # gives the view a new one
    build_id = hashlib.sha256(" ".join(str(m.get("build_id")) for m in metas).encode()).hexdigest()[:32]
    extra = {"producer": metas[0]["producer"]} if metas[0].get("producer") is not None else {}
    io.write_json_atomic(base / io.META_FILE, io.base_meta(
        dim=metas[0]["dim"], count=sum(m["count"] for m in metas), dtype=metas[0]["dtype"],
        layout="sharded", num_shards=num_shards, build_id=build_id, **extra))
    return True


def _docno_bytes(docnos: Sequence[Any]) -> bytes:
    """The docnos as fingerprinted by :func:`check_shard_inputs` (one ``str()`` per line)."""
    return "".join(f"{d}\n" for d in docnos).encode("utf8", "surrogatepass")


def check_shard_inputs(base: Path, metas: Optional[List[dict]] = None) -> None:
    """Refuses shards of ``base`` that were not given the parts of one input.

    Without ``presharded=True`` a shard keeps every ``n``-th record of *its* input, so shards fed different parts
    of a corpus index ``1/n`` of each part and silently drop the rest.  Each shard's ``pt_meta.json`` records
    what it was given (``input``: the number of records and a SHA-256 of their docnos before striding; without
    ``presharded`` also the SHA-256 of the part each shard keeps).  Shards built without ``presharded`` must
    have been given the same input, and a ``presharded`` shard's records must be its part of that input
    (:meth:`DenseIndex.shard_iter`).  Shards that are all ``presharded``, or built before this was recorded,
    are not checked.

    Args:
        metas: the shards' metadata in shard order (default: read from the built shards under ``base``).

    Raises:
        ValueError: naming the shards that disagree and saying to pass ``presharded=True``.
    """
    if metas is None:
        metas = [m for m in (io.read_meta(d) for d in io.shard_dirs(base)) if m is not None]
    inputs = [(m.get("shard", s), m.get("input")) for s, m in enumerate(metas)]
    inputs = [(s, i) for s, i in inputs if isinstance(i, dict)]
    strided = [(s, i) for s, i in inputs if not i.get("presharded")]
    if not strided:
        return
    advice = ("if each process was given its own part of the corpus, rebuild every shard with "
              "indexer(shard=i, num_shards=n, presharded=True, mode='overwrite') (then each shard indexes all it "
              "is given); otherwise feed every shard the same input")

    def show(s: int, i: dict) -> str:
        return f"shard {s}: {i.get('records')} records (docnos sha256 {str(i.get('docnos_sha256'))[:12]})"

    if len({(i.get("records"), i.get("docnos_sha256")) for _, i in strided}) > 1:
        raise ValueError(f"the shards of {base} were given different inputs ({'; '.join(show(*x) for x in strided)}): "
                         "without presharded=True each shard keeps only every num_shards-th record of its input, "
                         f"so most of each input was dropped; {advice}")
    parts = strided[0][1].get("shard_docnos_sha256") or []
    for s, i in inputs:
        if i.get("presharded") and (s >= len(parts) or parts[s] != i.get("docnos_sha256")):
            raise ValueError(f"the shards of {base} were given different inputs: shard {s} (presharded=True) was given "
                             f"{i.get('records')} records that are not its part of the input of shard(s) "
                             f"{[x for x, _ in strided]} (built without presharded=True, which keep every "
                             f"num_shards-th record of {strided[0][1].get('records')} records); {advice}")


# -- merging --------------------------------------------------------------------------------------------------
def merge_indexes(sources: Sequence[Path], target: Path, *, mode: str = "create", block_size: int = 65536) -> None:
    """Concatenates the built single indexes ``sources`` (in order) into a new index at ``target``.

    See :meth:`DenseIndex.merge`.  The destination's build lock is held throughout.

    Raises:
        ValueError: the sources differ in dim/dtype, share docnos or include a sharded view (``target`` is left
            unbuilt), or ``target`` is one of the sources or contains one.
    """
    if not sources:
        raise ValueError("merge needs at least one source index")
    if mode not in ("create", "overwrite"):
        raise ValueError(f"mode must be 'create' or 'overwrite', got {mode!r}")
    target = Path(target)
    resolved = target.resolve()
    for src_path in sources:
        src = Path(src_path).resolve()
        if src == resolved or resolved in src.parents:
            raise ValueError(f"cannot merge into {target}: it {'is' if src == resolved else 'contains'} the "
                             f"source index {src_path} (which mode={mode!r} would destroy before it is read); "
                             "merge into another path")
    stores = [DenseStore(p) for p in sources]
    with build_lock(target, "dense index"):
        metas = [s.open()[0] for s in stores]
        for s, m in zip(stores, metas):
            if m.get("layout") == "sharded":
                raise ValueError(f"{s.path} is a sharded view; use its merge_shards()")
            if (m["dim"], m["dtype"]) != (metas[0]["dim"], metas[0]["dtype"]):
                raise ValueError(f"cannot merge {s.path} (dim={m['dim']}, dtype={m['dtype']}) with "
                                 f"{stores[0].path} (dim={metas[0]['dim']}, dtype={metas[0]['dtype']})")
        check_producers(target, [(f"source index {s.path}", m.get("producer")) for s, m in zip(stores, metas)],
                        what="cannot merge into")
        if target.exists() and any(target.iterdir()):
            if mode == "create":
                raise FileExistsError(f"{target} already exists; use mode='overwrite' to replace it")
            remove_index_files(target, shards=True)
        target.mkdir(parents=True, exist_ok=True)
        io.write_json_atomic(target / io.MERGE_FILE, {"sources": [str(s.path) for s in stores], "keep_shards": True})

        def vector_blocks():
            for s in stores:
                vecs = s.vectors()
                for start in range(0, len(vecs), block_size):
                    yield np.asarray(vecs[start:start + block_size])

        def docnos():
            for s in stores:
                yield from s.docnos().fwd

        _write_merged(target, vector_blocks(), docnos(), metas[0], sum(int(m["count"]) for m in metas))
        io.remove_leftovers(target)


def merge_shards(store: DenseStore, *, keep_shards: bool = False, block_size: int = 65536) -> None:
    """Merges the sharded view of ``store`` in place into a single index; see :meth:`DenseIndex.merge_shards`.

    Raises:
        ValueError: the directory is not a sharded view (and no interrupted merge was being finished), or its
            shards were given different inputs without ``presharded=True`` (:func:`check_shard_inputs`).
    """
    target = store.path
    with build_lock(target, "dense index"):
        finished = (target / io.MERGE_FILE).exists()
        io.remove_leftovers(target)  # of a merge killed before or after its commit
        check_shard_set(target)  # a missing, unfinished or duplicated shard is named (before the view is opened)
        check_shard_inputs(target)  # before the view is opened: it names the cause, not a missing pt_meta.json
        store.invalidate()
        meta, parts, lookups = store.open()
        if meta.get("layout") != "sharded":
            if finished:  # an interrupted merge_shards() had committed; its cleanup is now complete
                return
            raise ValueError(f"{target} is not a sharded view (nothing to merge)")
        n = len(parts)
        total = int(meta["count"])
        rows = max(1, block_size // n)
        shard_metas = [io.read_meta(target / io.SHARDS_DIR / str(s)) for s in range(n)]
        check_producers(target, [(f"shard {s}", m.get("producer")) for s, m in enumerate(shard_metas)])

        def vector_blocks():
            for start in range(0, len(parts[0][0]), rows):
                # shard sizes differ by at most one (round-robin), the short shards being the last ones, so
                # row i of shard s lands at merged row i * n + s
                blocks = [np.asarray(p[0][start:start + rows]) for p in parts]
                merged = np.empty((sum(len(b) for b in blocks), blocks[0].shape[1]), dtype=blocks[0].dtype)
                for s, b in enumerate(blocks):
                    merged[s::n] = b
                yield merged

        def docnos():
            for start in range(0, len(lookups[0]), rows):
                chunk = [lk.fwd.lookup(np.arange(start, min(start + rows, len(lk)))) for lk in lookups]
                for i in range(len(chunk[0])):
                    for s in range(n):
                        if i < len(chunk[s]):
                            yield str(chunk[s][i])

        single = {k: v for k, v in meta.items() if k not in ("layout", "num_shards")}
        io.write_json_atomic(target / io.MERGE_FILE, {"keep_shards": bool(keep_shards)})
        for name in (io.VECTORS_FILE, io.DOCNOS_FILE):
            (target / name).unlink(missing_ok=True)
        _write_merged(target, vector_blocks(), docnos(), single, total)
        store.invalidate()
        for lookup in lookups:
            lookup.close()
        io.remove_leftovers(target)  # shards/ (unless kept), then _merge.json


def _write_merged(target: Path, vector_blocks: Iterator[np.ndarray], docnos: Iterator[str], meta: dict,
                  total: int) -> None:
    """Writes vectors + docno lookup of a merged index, then (last) its pt_meta.json."""
    written = 0
    with open(target / io.VECTORS_FILE, "wb") as fout:
        for block in vector_blocks:
            fout.write(np.ascontiguousarray(block).tobytes())
            written += len(block)
        fout.flush()
        os.fsync(fout.fileno())
    if written != total:
        raise ValueError(f"merge wrote {written} vectors but expected {total}")
    io.build_docno_lookup(docnos, target / io.DOCNOS_FILE)
    extra = {"producer": meta["producer"]} if meta.get("producer") is not None else {}
    if meta["dtype"] in io.COMPRESSED:  # calibrated again on the merged vectors
        extra["codes"] = qcodes.write_codes(target, meta["dtype"], total, int(meta["dim"]))
    out_meta = io.base_meta(dim=meta["dim"], count=total, dtype=meta["dtype"], layout="single", **extra)
    io.write_json_atomic(target / io.META_FILE, out_meta)
