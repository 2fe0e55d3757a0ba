"""Sharing the package's artifacts as PyTerrier packages: what goes into one, and how one is unpacked offline.

:class:`PackagedArtifact` is the base of :class:`~pyterrier_cpdae.dense.DenseIndex` and
:class:`~pyterrier_cpdae.bm25.BM25Index`. PyTerrier's ``build_package`` (and so ``to_hf`` / ``to_zenodo``) packs
every file of the artifact's folder into one ``.tar.lz4`` archive (plus ``<archive>.json``: sizes and SHA-256);
here it packs only a *complete* artifact, and leaves out what is rebuilt on first use or belongs to one machine:
caches (:attr:`PackagedArtifact.PACKAGE_EXCLUDE`, e.g. a DenseIndex's ``faiss/``), lock files ``.<name>.lock``
and temporaries of interrupted atomic writes (``.<stem>.*.tmp<suffix>``). :meth:`PackagedArtifact.from_package`
is the offline counterpart of ``from_url`` / ``from_hf`` for an archive on disk (``from_url`` with a local path
loads the path itself, not the archive's contents).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import tarfile
from pathlib import Path
from typing import IO, Any, Iterator, Optional, Sequence, Tuple, Union

import pyterrier as pt
import pyterrier_alpha as pta

from ._files import current_umask

__all__ = ["PackagedArtifact", "IncompleteIndexError", "read_pt_meta", "META_FILE"]

#: every artifact of this package describes itself in this file, written last
META_FILE = "pt_meta.json"
#: The most bytes an index's metadata file may hold (a larger one is refused unread).
MAX_META_BYTES = 1 << 20

# lock files (.<name>.lock, see _locking.lock_path) and temporaries of atomic writes (.<stem>.<random>.tmp<suffix>)
_TRANSIENT = re.compile(r"^\..+(\.lock|\.tmp(\.[^.]*)?)$")


class PackagedArtifact(pta.Artifact):
    """A PyTerrier artifact whose packages hold only what another machine needs to use it."""

    #: top-level files or folders of the artifact left out of packages (caches rebuilt on first use)
    PACKAGE_EXCLUDE: Tuple[str, ...] = ()

    def built(self) -> bool:  # overridden by each artifact
        raise NotImplementedError

    def package_files(self) -> list[str]:
        """The paths (relative, ``/``-separated) that :meth:`build_package` puts into the archive, in its order.

        Raises:
            ValueError: when the artifact is not completely built.
        """
        return [rel for rel, _ in self._package_files()]

    def _package_files(self) -> Iterator[Tuple[str, Union[str, Any]]]:
        if not self.built():
            raise ValueError(f"{self!r} is not completely built; only a built artifact can be packaged")
        for rel, source in super()._package_files():
            parts = Path(rel).parts
            if parts[0] in self.PACKAGE_EXCLUDE or any(_TRANSIENT.match(p) for p in parts):
                continue
            yield Path(rel).as_posix(), source

    @classmethod
    def from_package(cls, package: Union[str, Path], path: Union[str, Path], *,
                     expected_sha256: Optional[str] = None, verbose: bool = False) -> "PackagedArtifact":
        """Unpacks an archive made by :meth:`build_package` into the new folder ``path`` and opens it, offline.

        The archive's SHA-256 is checked against ``expected_sha256`` or, when not given, against the
        ``<package>.json`` that ``build_package`` wrote beside it (if present), *before* anything is unpacked; a
        segmented package (``build_package(max_file_size=...)``: ``<package>.0``, ``<package>.1``, ...) is read from
        its segments. With a ``<package>.json``, only the members its ``contents`` list are unpacked, each at the size
        listed there (a member not listed, or of another size, refuses the package: so unpacking writes at most the
        ``total_size`` it declares). Caches (:attr:`PACKAGE_EXCLUDE`, e.g. ``faiss/``), lock files and temporaries are
        never unpacked, whatever the archive holds: they are rebuilt from the unpacked files. The folder appears only
        once the whole archive is unpacked and checked; an unpacking killed midway leaves a temporary
        ``.<name>.unpack-<pid>.*.tmp`` beside ``path``, which the next ``from_package`` into ``path`` removes.

        Raises:
            FileExistsError: ``path`` exists and is not an empty folder.
            FileNotFoundError: no archive at ``package``.
            ValueError: the archive is corrupt (hash mismatch, not a tar.lz4), holds a member its manifest does not
                list (or at another size), or holds another kind of artifact.
        """
        from lz4.frame import LZ4FrameFile

        package, path = str(package), Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise FileExistsError(f"{path} already exists; give from_package a new folder")
        info: dict = {}
        if os.path.isfile(f"{package}.json"):
            with open(f"{package}.json", encoding="utf8") as f:
                info = json.load(f)
        if not isinstance(info, dict):
            raise ValueError(f"{package}.json is not a package manifest (a JSON {type(info).__name__})")
        if expected_sha256 is None:
            expected_sha256 = info.get("expected_sha256")
        listed = _manifest_sizes(package, info)
        segments = [f"{package}.{s['idx']}" for s in info.get("segments", [])]
        for p in segments or [package]:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"no package at {p}")

        def raw_archive(stack: contextlib.ExitStack) -> IO[bytes]:
            return (stack.enter_context(pt.io.MultiReader(open(p, "rb") for p in segments)) if segments
                    else stack.enter_context(open(package, "rb")))

        if expected_sha256 is not None:  # the whole archive checked before a byte of it is unpacked
            with contextlib.ExitStack() as stack:
                fin = pt.io.HashReader(raw_archive(stack))
                while fin.read(1 << 20):
                    pass
                if fin.hexdigest() != expected_sha256.lower():
                    raise ValueError(f"{package} is corrupt or not the archive that was packaged: its SHA-256 is "
                                     f"{fin.hexdigest()}, expected {expected_sha256.lower()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_unpacks(path)
        tmp = path.parent / f".{path.name}.unpack-{os.getpid()}.{secrets.token_hex(4)}.tmp"
        tmp.mkdir()
        try:
            with contextlib.ExitStack() as stack:
                try:
                    with tarfile.open(fileobj=LZ4FrameFile(raw_archive(stack)), mode="r|") as tar:
                        for member in tar:
                            if not (member.isfile() or member.isdir()) or member.issparse():
                                continue
                            if not pt.io.path_is_under_base(member.path, str(tmp)) or cls._derived(member.path):
                                continue
                            if member.isfile() and listed is not None:
                                rel = Path(member.path).as_posix()
                                if listed.get(rel) != member.size:
                                    why = ("is not listed in its manifest" if rel not in listed else
                                           f"holds {member.size} bytes, its manifest lists {listed[rel]}")
                                    raise ValueError(f"{package} is not the package its manifest {package}.json "
                                                     f"describes: member {rel!r} {why}")
                            if verbose:
                                print(f"extracting {member.path} [{member.size} bytes]")
                            tar.extract(member, tmp, set_attrs=False)
                except (tarfile.TarError, RuntimeError, EOFError, OSError) as e:
                    raise ValueError(f"{package} is not a readable artifact package ({type(e).__name__}: "
                                     f"{e})") from e
            meta_path = tmp / "pt_meta.json"
            meta = json.loads(meta_path.read_text(encoding="utf8")) if meta_path.is_file() else {}
            kind = (meta.get("type"), meta.get("format")) if isinstance(meta, dict) else (None, None)
            if kind != (cls.ARTIFACT_TYPE, cls.ARTIFACT_FORMAT):
                raise ValueError(f"{package} holds a {kind} artifact, not a {cls.__name__} "
                                 f"{(cls.ARTIFACT_TYPE, cls.ARTIFACT_FORMAT)}; open it with pt.Artifact.from_url")
            os.chmod(tmp, 0o777 & ~current_umask())
            if path.is_dir():
                path.rmdir()  # empty: replaced by the unpacked folder
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cls(path)

    @classmethod
    def _derived(cls, rel: str) -> bool:
        """Whether the archive member ``rel`` is a cache, lock file or temporary (never unpacked)."""
        parts = Path(rel).parts
        return bool(parts) and (parts[0] in cls.PACKAGE_EXCLUDE or any(_TRANSIENT.match(p) for p in parts))


def _manifest_sizes(package: str, info: dict) -> Optional[dict]:
    """``{member path: size}`` from a package manifest's ``contents``, or ``None`` when it has none.

    Raises:
        ValueError: ``contents`` is not a list of ``{"path", "size"}`` objects.
    """
    contents = info.get("contents")
    if contents is None:
        return None
    out = {}
    for entry in contents if isinstance(contents, list) else [None]:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("size"), int)
                and not isinstance(entry.get("size"), bool) and entry["size"] >= 0):
            raise ValueError(f"{package}.json is not a package manifest: its contents must list "
                             f'{{"path", "size"}} objects, got {str(entry)[:80]!r}')
        out[Path(entry["path"]).as_posix()] = entry["size"]
    return out


def _remove_dead_unpacks(path: Path) -> None:
    """Removes the temporaries of :meth:`PackagedArtifact.from_package` into ``path`` left by processes that no
    longer run (killed while unpacking)."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.unpack-(\d+)\.[0-9a-f]+\.tmp$")
    for entry in path.parent.iterdir() if path.parent.is_dir() else ():
        m = pattern.match(entry.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except (PermissionError, OverflowError, OSError):  # alive under another user, or not a pid
            pass


class IncompleteIndexError(FileNotFoundError, RuntimeError):
    """Raised when an index (dense or BM25) that has not been completely built is used: its ``pt_meta.json``,
    written last, is missing.  A ``FileNotFoundError`` and a ``RuntimeError``, so that code written against either
    index's earlier behaviour keeps working."""


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def check_regular(path: Path, what: str) -> os.stat_result:
    """``os.stat`` of ``path`` (following symlinks), refusing anything but a regular file.

    Opening a FIFO for reading blocks until a writer appears (forever), and a device or directory is no index
    file: neither may be handed to a reader that opens by name (npids, FAISS).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``<what>: <path> is a FIFO (named pipe), not a regular file ...``.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what}: {path} is {_file_kind(st.st_mode)}, not a regular file; an index holds only "
                         "regular files — rebuild it with indexer(mode='overwrite')")
    return st


def open_regular(path: Path, what: str) -> IO[bytes]:
    """Opens ``path`` for binary reading only if it is a regular file, without ever blocking.

    The file is opened with ``O_NONBLOCK`` (so a FIFO put in its place cannot hang the open) and checked with
    ``fstat`` on the open descriptor (so it cannot be swapped between the check and the read).

    Raises:
        FileNotFoundError, NotADirectoryError: ``path`` does not exist.
        ValueError: it is not a regular file (see :func:`check_regular`).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what}: {path} is {_file_kind(st.st_mode)}, not a regular file; an index holds only "
                             "regular files — rebuild it with indexer(mode='overwrite')")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_small_file(path: Path, what: str, limit: int = MAX_META_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), refusing one larger than ``limit`` bytes.

    Raises:
        FileNotFoundError, NotADirectoryError: ``path`` does not exist.
        ValueError: not a regular file, or larger than ``limit``.
    """
    with open_regular(path, what) as fin:
        size = os.fstat(fin.fileno()).st_size
        data = fin.read(limit + 1)
    if max(size, len(data)) > limit:
        raise ValueError(f"{what}: {path} is {max(size, len(data))} bytes, more than the {limit} an index's metadata "
                         "can need — it is not this package's file; rebuild the index with indexer(mode='overwrite')")
    return data


def read_pt_meta(path: Path, *, artifact_type: str, artifact_format: str, what: str,
                 required: Sequence[str] = ()) -> Optional[dict]:
    """Reads an artifact's ``pt_meta.json`` and checks its type/format: the one reader of every index of this package.

    Args:
        path: the artifact directory.
        artifact_type / artifact_format: what ``pt_meta.json`` must declare (``ARTIFACT_TYPE``/``ARTIFACT_FORMAT``).
        what: the artifact's class name for error messages (``"DenseIndex"``, ``"BM25Index"``).
        required: fields that must be present.

    Returns:
        The parsed JSON object, or ``None`` when ``pt_meta.json`` does not exist (the artifact is not built).

    Raises:
        ValueError: ``corrupt <what> <path>: pt_meta.json ...`` when it is not a regular file (a FIFO would block the
            reader forever), is larger than ``MAX_META_BYTES``, is not valid UTF-8 JSON, not an object or lacks
            a required field; ``<path> is not a <what>: pt_meta.json describes (type, format), expected (...)`` for
            another kind of artifact.  ``OSError`` (other than a missing file) propagates.
    """
    meta_path = Path(path) / META_FILE
    try:
        data = read_small_file(meta_path, f"corrupt {what} {path}")
    except (FileNotFoundError, NotADirectoryError):  # no artifact there (yet)
        return None
    try:
        text = data.decode("utf8")
    except UnicodeDecodeError as ex:
        raise ValueError(f"corrupt {what} {path}: {META_FILE} is not valid JSON ({ex}); rebuild it with "
                         "indexer(mode='overwrite')") from ex
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as ex:  # RecursionError: absurdly deep nesting
        raise ValueError(f"corrupt {what} {path}: {META_FILE} is not valid JSON ({ex}); rebuild it with "
                         "indexer(mode='overwrite')") from ex
    if not isinstance(meta, dict):
        raise ValueError(f"corrupt {what} {path}: {META_FILE} holds a JSON {type(meta).__name__}, expected an object; "
                         "rebuild it with indexer(mode='overwrite')")
    if (meta.get("type"), meta.get("format")) != (artifact_type, artifact_format):
        raise ValueError(f"{path} is not a {what}: {META_FILE} describes {(meta.get('type'), meta.get('format'))}, "
                         f"expected {(artifact_type, artifact_format)}")
    missing = [k for k in required if k not in meta]
    if missing:
        raise ValueError(f"corrupt {what} {path}: {META_FILE} is missing field(s) {missing}; rebuild it with "
                         "indexer(mode='overwrite')")
    return meta


