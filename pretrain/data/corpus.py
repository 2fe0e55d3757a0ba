"""Pre-training corpora: streaming readers, block packing, a tokenized on-disk cache and IDF.

Typical use (what ``python -m pretrain`` does)::

    from pretrain.data.corpus import TokenCache, idf_weights
    cache = TokenCache.build_or_load("wiki:../shared/data/enwiki-sample", tokenizer,
                                     max_length=512, cache_dir="runs/.token_cache")
    cache[0]          # token ids of the first block (no special tokens, <= 510 ids)
    idf = idf_weights(cache)   # (|V|,) float tensor for --objective cpdae_idfrec

**Packing.** Each document is split into sentences (:func:`split_sentences`) and the
sentences are packed greedily, in order, into blocks of at most ``max_length - 2`` token
ids (room is left for ``[CLS]`` and ``[SEP]``). A sentence that does not fit in the current
block starts a new one; a single sentence longer than a block is cut. Different documents
are never merged into one block: the reconstruction target of CPDAE ("which words occur in
this text") must describe one text, so a short document stays a short block. Concatenating
a document's blocks gives exactly its tokenization.

**Cache.** Token ids of all blocks are stored back to back in one flat ``uint16`` file
(``uint32`` when the vocabulary has more than 65,536 entries) with an ``int64`` offsets
array, a per-token document-frequency array and ``meta.json``. The cache directory name is
a hash of everything that determines the content (spec, corpus file sizes, mtimes and hashes of every byte,
fields, max_docs, max_length, the tokenizer's vocabulary and normalisation -- not its name or
path), so another tokenizer or block length builds another cache. A cache is built in a temporary directory
and renamed into place when complete; concurrent processes (e.g. DDP ranks starting
together) serialise on a lock file, so one builds and the others wait and then load it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from pyterrier_cpdae._checks import default_num_threads

from .blocks import (_encode_batches, _batched, block_lengths, encode_batch, fast_backend,  # noqa: F401
                     pack_sentences, pack_texts, split_sentences, token_dtype)  # (re-exported)
from .inputs import corpus_fingerprints, input_changes, tokenizer_fingerprint  # noqa: F401 (re-exported)
from .readers import Fields, corpus_files, iter_texts, parse_fields, resolve_spec  # noqa: F401
from .token_stats import idf_weights, token_prior_logits  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

#: Bumped whenever the cache layout or packing changes (part of the cache key).
CACHE_FORMAT_VERSION = 3  # 2: meta.json holds the data files' checksums and the corpus files' fingerprints;
# 3: df.npy's checksum too, and corpus fingerprints that read every byte


#: The data files of a cache whose blake2b checksums ``meta.json`` records and every open checks.
CHECKED_FILES = ("tokens.bin", "offsets.bin", "df.npy")


def _corpus_fingerprint(spec: str) -> str:
    """A hash of (path, size, mtime, hash of every byte) of each local corpus file
    (:func:`pretrain.data.inputs.file_fingerprint`), so an edited corpus gets a new cache."""

    h = hashlib.sha256()
    for p, fp in corpus_fingerprints(spec).items():
        h.update(f"{p}\0{fp['size']}\0{fp['mtime_ns']}\0{fp['sha256']}\n".encode())
    return h.hexdigest()[:16]


def _file_checksum(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


class TokenCache(torch.utils.data.Dataset):
    """A tokenized, block-packed corpus on disk (map-style dataset of token-id lists).

    Build or reuse one with :meth:`build_or_load`; open an existing directory with
    ``TokenCache(path)``.

    Files in the cache directory:

    * ``tokens.bin``: all blocks' token ids back to back (``uint16``/``uint32``, see :func:`token_dtype`);
    * ``offsets.bin``: ``int64`` array of ``len(cache) + 1`` start offsets into ``tokens.bin``;
    * ``df.npy``: ``int64`` (|V|,) number of blocks containing each token id;
    * ``meta.json``: the build key (spec, fields, max_docs, max_length, tokenizer), counts, the blake2b checksums of
      ``tokens.bin``, ``offsets.bin`` and ``df.npy`` and the fingerprints of the corpus files it was built from.

    Opening a cache checks every file (:meth:`_check_files`): file sizes, offsets strictly increasing from 0 to the
    token count (no empty block), every id below the vocabulary size, the three checksums, and ``meta.json``'s key
    against the directory's name (the name is the key's hash); a cache that fails is reported as damaged, and
    :meth:`build_or_load` rebuilds it with a warning.

    Args:
        path: A complete cache directory.
    """

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"no token cache at {self.path} (meta.json missing)")
        try:
            with open(meta_path) as f:
                self.meta: dict[str, Any] = json.load(f)
            self.dtype = np.dtype(self.meta["dtype"])
            num_tokens, num_blocks = int(self.meta["num_tokens"]), int(self.meta["num_blocks"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(self._damaged(meta_path, f"{type(e).__name__}: {e}")) from e
        if not self.meta.get("complete"):
            raise ValueError(f"token cache at {self.path} is incomplete")
        self._tokens: Optional[np.ndarray] = None
        self._offsets: Optional[np.ndarray] = None
        self._check_files(num_tokens, num_blocks)

    def _damaged(self, path: Path, problem: str) -> str:
        return (f"token cache file {path} is truncated or corrupt ({problem}); delete the cache directory {self.path} "
                "and run again to rebuild it (TokenCache.build_or_load, used by python -m pretrain, rebuilds it "
                "automatically)")

    def _check_files(self, num_tokens: int, num_blocks: int) -> None:
        """The data files against ``meta.json``: their sizes, the offsets (from 0 to the token count, strictly
        increasing: no empty block), every token id below the vocabulary size, and the checksums of
        ``tokens.bin`` and ``offsets.bin`` recorded at build time (a rewritten id or offset). Vectorised numpy
        passes over the memory-mapped files, about a second per GB."""
        for name, want in (("tokens.bin", num_tokens * self.dtype.itemsize), ("offsets.bin", (num_blocks + 1) * 8)):
            path = self.path / name
            size = path.stat().st_size if path.is_file() else None
            if size != want:
                raise ValueError(self._damaged(path, "missing" if size is None else f"{size} bytes, {want} expected"))
        off = self.offsets
        if int(off[0]) != 0 or int(off[-1]) != num_tokens:
            raise ValueError(self._damaged(self.path / "offsets.bin",
                                           f"offsets run from {int(off[0])} to {int(off[-1])}, not 0 to {num_tokens}"))
        lengths = np.diff(off)
        bad = np.flatnonzero(lengths <= 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(self._damaged(self.path / "offsets.bin",
                                           f"block {i} is {'empty' if lengths[i] == 0 else 'of negative length'} "
                                           f"(offsets {int(off[i])} -> {int(off[i + 1])}); {bad.size} such block(s)"))
        vocab_size = int(self.meta["vocab_size"])
        top = int(self.tokens.max())
        if top >= vocab_size:
            at = int(np.argmax(self.tokens >= vocab_size))
            raise ValueError(self._damaged(self.path / "tokens.bin", f"token id {top} (first bad one at position {at}) "
                                           f"is outside the vocabulary of {vocab_size}"))
        for name, want in (self.meta.get("checksum") or {}).items():
            if name not in CHECKED_FILES:
                continue
            got = _file_checksum(self.path / name) if (self.path / name).is_file() else "missing"
            if got != want:
                raise ValueError(self._damaged(self.path / name, f"its content changed since the cache was built "
                                               f"(blake2b {got}, {want} recorded)"))
        if set(self.meta.get("checksum") or {}) != set(CHECKED_FILES):
            raise ValueError(self._damaged(self.path / "meta.json", f"it records checksums of "
                                           f"{sorted(self.meta.get('checksum') or {})}, not of {list(CHECKED_FILES)}"))
        key = self.meta.get("key")
        try:
            named = self._path_of_key(key, self.path.parent).name
        except (KeyError, TypeError, AttributeError, ValueError):
            named = None
        if named != self.path.name:
            raise ValueError(self._damaged(self.path / "meta.json", "its key does not hash to the directory's name"))
        df_path = self.path / "df.npy"
        try:
            df = np.load(df_path, mmap_mode="r")
            if df.shape != (int(self.meta["vocab_size"]),):
                raise ValueError(f"shape {df.shape}, ({self.meta['vocab_size']},) expected")
        except (OSError, ValueError, EOFError) as e:
            raise ValueError(self._damaged(df_path, str(e))) from e

    # memmaps are reopened lazily (also after pickling into DataLoader workers)
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = None
        state["_offsets"] = None
        return state

    def _open(self) -> None:
        n_tokens = self.meta["num_tokens"]
        # np.memmap refuses empty files; a cache always holds >= 1 block with >= 1 token
        self._tokens = np.memmap(self.path / "tokens.bin", dtype=self.dtype, mode="r", shape=(n_tokens,))
        self._offsets = np.memmap(self.path / "offsets.bin", dtype=np.int64, mode="r",
                                  shape=(self.meta["num_blocks"] + 1,))

    @property
    def offsets(self) -> np.ndarray:
        """``int64`` start offsets of the blocks (length ``len(self) + 1``)."""
        if self._offsets is None:
            self._open()
        return self._offsets

    @property
    def tokens(self) -> np.ndarray:
        """The flat token-id memmap."""
        if self._tokens is None:
            self._open()
        return self._tokens

    def __len__(self) -> int:
        return int(self.meta["num_blocks"])

    def __getitem__(self, i: int) -> list[int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"block index {i} out of range for a cache of {n} blocks")
        i %= n
        off = self.offsets
        return self.tokens[int(off[i]):int(off[i + 1])].tolist()

    def lengths(self) -> np.ndarray:
        """Number of token ids of every block (``int64``, length ``len(self)``)."""
        return np.diff(np.asarray(self.offsets))

    @property
    def num_texts(self) -> int:
        """Number of texts (blocks) the model trains on -- the ``N`` of :func:`idf_weights`."""
        return len(self)

    @property
    def num_documents(self) -> int:
        """Number of source documents that produced at least one block."""
        return int(self.meta["num_documents"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def max_length(self) -> int:
        return int(self.meta["key"]["max_length"])

    def document_frequency(self) -> np.ndarray:
        """``int64`` (|V|,) array: in how many blocks each token id occurs (computed at build time)."""
        return np.load(self.path / "df.npy")

    def __repr__(self) -> str:
        return (f"TokenCache({str(self.path)!r}, blocks={len(self)}, documents={self.num_documents}, "
                f"tokens={self.meta['num_tokens']}, max_length={self.max_length})")

    # ------------------------------------------------------------------ building

    @staticmethod
    def cache_key(spec: str, tokenizer: Any, max_length: int, fields: Fields = None, max_docs: int = -1) -> dict[str, Any]:
        """Everything that determines a cache's content (its hash names the cache directory)."""
        kind, loc = resolve_spec(spec)
        return {
            "format": CACHE_FORMAT_VERSION,
            "spec": f"{kind}:{loc}",
            "corpus_fingerprint": _corpus_fingerprint(spec),
            "fields": parse_fields(fields),
            "max_docs": int(max_docs),
            "max_length": int(max_length),
            "tokenizer": str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)),
            "tokenizer_hash": tokenizer_fingerprint(tokenizer),
            "vocab_size": len(tokenizer),
        }

    @classmethod
    def cache_path(cls, spec: str, tokenizer: Any, max_length: int, cache_dir: Union[str, os.PathLike],
                   fields: Fields = None, max_docs: int = -1) -> Path:
        """The directory :meth:`build_or_load` uses for these arguments."""
        return cls._path_of_key(cls.cache_key(spec, tokenizer, max_length, fields, max_docs), cache_dir)

    @staticmethod
    def _path_of_key(key: dict[str, Any], cache_dir: Union[str, os.PathLike]) -> Path:
        max_length = key["max_length"]
        # the tokenizer's name is informative only: the same tokenizer saved elsewhere reuses the cache
        hashed = {k: v for k, v in key.items() if k != "tokenizer"}
        digest = hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:20]
        kind = key["spec"].split(":", 1)[0]
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(key["spec"].split(":", 1)[1]).name)[:40] or kind
        return Path(cache_dir) / f"{kind}-{stem}-L{max_length}-{digest}"

    @classmethod
    def build_or_load(cls, spec: str, tokenizer: Any, max_length: int, cache_dir: Union[str, os.PathLike],
                      fields: Fields = None, max_docs: int = -1, *, batch_docs: int = 64,
                      progress: Optional[bool] = None, lock_timeout: float = -1,
                      num_threads: Optional[int] = None) -> "TokenCache":
        """Load the cache for these arguments, building it first if it does not exist yet.

        Safe to call from several processes at once: they serialise on
        ``<cache>.lock`` (an OS file lock, released even if the holder crashes); the first
        builds, the others find the complete cache and load it. A build writes into a
        temporary directory renamed into place only when complete, so an interrupted build
        never leaves a cache that looks complete (its leftovers are removed by the next build).

        Args:
            spec: Corpus spec (see :func:`pretrain.data.readers.iter_texts`).
            tokenizer: A Hugging Face tokenizer (fast ones tokenize much faster).
            max_length: Block length in tokens *including* the two special tokens (>= 3).
            cache_dir: Directory holding caches (created if needed).
            fields: Text fields (see :func:`~pretrain.data.readers.iter_texts`).
            max_docs: Read at most this many documents (-1: all).
            batch_docs: Documents tokenized per tokenizer call and per task of a tokenizing thread (bounds
                memory while building; the files do not depend on it).
            progress: Show a tqdm progress bar (default: only on the process that builds,
                and only on local rank 0).
            lock_timeout: Seconds to wait for another process's build (-1: forever).
            num_threads: Threads that tokenize and pack (None: the cores this process may use,
                ``os.sched_getaffinity``); used with fast (Rust) tokenizers, whose batch calls release the GIL.
                The files are byte-identical for every value: the calling thread reads the corpus and
                writes the batches in order. ``TOKENIZERS_PARALLELISM=false`` keeps each tokenizer call on
                one core (otherwise the tokenizer may also spread a call over its own Rust threads).

        Raises:
            ValueError: on a bad ``max_length`` or a corpus without text (see :func:`iter_texts`).
            TimeoutError: if ``lock_timeout`` passes while another process builds.
        """
        from filelock import FileLock, Timeout

        if not isinstance(max_length, int) or max_length < 3:
            raise ValueError(f"max_length must be an integer >= 3 (two special tokens + content), got {max_length!r}")
        key = cls.cache_key(spec, tokenizer, max_length, fields, max_docs)  # hashes the vocabulary: once
        path = cls._path_of_key(key, cache_dir)
        cache = cls._load_valid(path)
        if cache is not None:
            return cache
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock")
        t0 = time.time()
        try:
            with lock.acquire(timeout=lock_timeout, poll_interval=0.5):
                cache = cls._load_valid(path)
                if cache is not None:
                    logger.info("token cache built by another process at %s (waited %.0fs)", path, time.time() - t0)
                    return cache
                for stale in path.parent.glob(path.name + ".tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                if path.exists():  # not complete or damaged (e.g. an older layout, a truncated file): rebuild
                    shutil.rmtree(path)
                cls._log_changed_inputs(path, key, spec)
                tmp = path.parent / f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                tmp.mkdir()
                try:
                    if progress is None:
                        progress = os.environ.get("LOCAL_RANK", "0") == "0"
                    cls._build(tmp, key, spec, tokenizer, max_length, fields, max_docs, batch_docs, progress,
                               default_num_threads() if num_threads is None else num_threads)
                    os.replace(tmp, path)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
        except Timeout as e:
            raise TimeoutError(f"waited {lock_timeout}s for another process building the token cache {path}") from e
        return cls(path)

    @staticmethod
    def _log_changed_inputs(path: Path, key: dict[str, Any], spec: str) -> None:
        """Before a build: when a cache of the same corpus spec and settings exists beside ``path``, log what
        changed since it was built (a corpus file, the tokenizer) -- the reason a new cache is built."""

        same = {k: key[k] for k in ("format", "spec", "fields", "max_docs", "max_length")}
        current = None
        for meta_path in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*/meta.json"):
            if meta_path.parent == path:
                continue
            try:
                meta = json.loads(meta_path.read_text())
                old = meta["key"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if {k: old.get(k) for k in same} != same:
                continue
            if current is None:
                current = {"corpus_files": corpus_fingerprints(spec),
                           "tokenizer": {"hash": key["tokenizer_hash"], "vocab_size": key["vocab_size"]}}
            previous = {"corpus_files": meta.get("corpus_files", current["corpus_files"]),
                        "tokenizer": {"hash": old.get("tokenizer_hash"), "vocab_size": old.get("vocab_size")}}
            changes = input_changes(previous, current) or ["the corpus files changed (size, time or content)"]
            logger.warning("token cache %s was built from other inputs (%s); building a new cache at %s",
                           meta_path.parent, "; ".join(changes), path)

    @classmethod
    def _load_valid(cls, path: Path) -> Optional["TokenCache"]:
        """The cache at ``path`` if it is complete and its files pass the size checks, else None (logged)."""
        if not cls._complete(path):
            return None
        try:
            return cls(path)
        except (OSError, ValueError) as e:
            logger.warning("%s; rebuilding it", e)
            return None

    @staticmethod
    def _complete(path: Path) -> bool:
        try:
            with open(path / "meta.json") as f:
                return bool(json.load(f).get("complete"))
        except (OSError, ValueError):
            return False

    @staticmethod
    def _build(out: Path, key: dict[str, Any], spec: str, tokenizer: Any, max_length: int, fields: Fields,
               max_docs: int, batch_docs: int, progress: bool, num_threads: int = 1) -> None:
        from tqdm.auto import tqdm

        vocab_size = len(tokenizer)
        dtype = token_dtype(vocab_size)
        df = np.zeros(vocab_size, dtype=np.int64)
        n_docs = n_blocks = n_tokens = 0
        t0 = time.time()
        bar = tqdm(desc=f"tokenizing {spec}", unit=" docs", disable=not progress, delay=2,  # none for a small corpus
                   total=max_docs if max_docs > 0 else None)
        batches = _batched(iter_texts(spec, fields=fields, max_docs=max_docs), batch_docs)
        htok, hoff = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
        with open(out / "tokens.bin", "wb") as ftok, open(out / "offsets.bin", "wb") as foff:
            foff.write(np.zeros(1, dtype=np.int64).tobytes())
            hoff.update(np.zeros(1, dtype=np.int64).tobytes())
            for n_texts, (docs, encoded) in _encode_batches(batches, tokenizer, max_length, num_threads):
                n_docs += docs
                bar.update(n_texts)
                if encoded is None:
                    continue
                tokens, lens, ids, counts = encoded
                tok_bytes, off_bytes = tokens.tobytes(), (n_tokens + np.cumsum(lens)).tobytes()
                ftok.write(tok_bytes)
                foff.write(off_bytes)
                htok.update(tok_bytes)
                hoff.update(off_bytes)
                df[ids] += counts
                n_blocks += len(lens)
                n_tokens += int(tokens.size)
        bar.close()
        if n_blocks == 0:
            raise ValueError(f"corpus {spec!r} holds no text that the tokenizer turns into tokens")
        np.save(out / "df.npy", df)
        meta = {"key": key, "dtype": dtype.name, "vocab_size": vocab_size, "num_documents": n_docs,
                "num_blocks": n_blocks, "num_tokens": n_tokens, "build_seconds": round(time.time() - t0, 2),
                "checksum": {"tokens.bin": htok.hexdigest(), "offsets.bin": hoff.hexdigest(),
                             "df.npy": _file_checksum(out / "df.npy")},
                "corpus_files": _corpus_files_record(spec),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "complete": True}
        with open(out / "meta.json", "w") as f:
            json.dump(meta, f, indent=2)
        logger.info("token cache: %d documents -> %d blocks, %d tokens in %.1fs (%d thread%s)", n_docs, n_blocks,
                    n_tokens, time.time() - t0, num_threads, "" if num_threads == 1 else "s")


def _corpus_files_record(spec: str) -> dict[str, Any]:
    return corpus_fingerprints(spec)


class IndexedTexts(torch.utils.data.Dataset):
    """A token cache as the Trainer's dataset: item ``i`` is ``{"input_ids": block i, "idx": i}`` (the collators draw
    every example's masks from its ``idx``)."""

    def __init__(self, cache: TokenCache):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.cache[i], "idx": int(i)}


__all__ = ["TokenCache", "IndexedTexts", "encode_batch", "default_num_threads", "block_lengths", "fast_backend", "idf_weights", "token_prior_logits", "iter_texts", "split_sentences", "pack_sentences", "pack_texts",
           "token_dtype", "tokenizer_fingerprint"]
