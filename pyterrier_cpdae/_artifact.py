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
import posixpath
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

# Limits of unpacking (as safetensors caps its header and tarfile's "data" filter refuses what a plain folder of
# data files cannot hold): an archive is read as a stream, member by member, and each limit is checked on a member's
# header, before its bytes are written.
#: the most members (files and folders) a package may hold
MAX_MEMBERS = 100_000
#: the most bytes a package without a manifest may unpack to (with one: the sizes its ``contents`` list)
MAX_UNPACKED_BYTES = 64 << 30
#: the most bytes unpacked per byte of archive (lz4 on an index's files gives ~1-5; a bomb of zeros ~250) ...
MAX_RATIO = 100
#: ... checked once more than this many bytes are unpacked (tar headers make a few tiny files look compressible)
RATIO_FLOOR = 16 << 20
#: the most bytes ``from_url`` downloads for one package (archive or all its segments), before anything is unpacked
MAX_DOWNLOAD_BYTES = 64 << 30
#: the most bytes of a package's manifest (``<package>.json``); a larger one is refused unread
MAX_MANIFEST_BYTES = 64 << 20
#: The most bytes an index's metadata file may hold (a larger one is refused unread).
MAX_META_BYTES = 1 << 20

# lock files (.<name>.lock, see _locking.lock_path) and temporaries of atomic writes (.<stem>.<random>.tmp<suffix>)
_TRANSIENT = re.compile(r"^\..+(\.lock|\.tmp(\.[^.]*)?)$")


class PackagedArtifact(pta.Artifact):
    """A PyTerrier artifact whose packages hold only what another machine needs to use it."""

    #: top-level files or folders of the artifact left out of packages (caches rebuilt on first use)
    PACKAGE_EXCLUDE: Tuple[str, ...] = ()
    #: top-level files or folders the artifact is made of: a package without a manifest unpacks only these (any other
    #: member is dropped); ``None``: every member
    PACKAGE_MEMBERS: Optional[Tuple[str, ...]] = None

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
                     expected_sha256: Optional[str] = None, verbose: bool = False, max_members: int = MAX_MEMBERS,
                     max_bytes: int = MAX_UNPACKED_BYTES, max_ratio: float = MAX_RATIO) -> "PackagedArtifact":
        """Unpacks an archive made by :meth:`build_package` into the new folder ``path`` and opens it, offline.

        The archive's SHA-256 is checked against ``expected_sha256`` or, when not given, against the
        ``<package>.json`` that ``build_package`` wrote beside it (if present), *before* anything is unpacked; a
        segmented package (``build_package(max_file_size=...)``: ``<package>.0``, ``<package>.1``, ...) is read from
        its segments. With a ``<package>.json``, only the members its ``contents`` list are unpacked, each at the size
        listed there (a member not listed, or of another size, refuses the package: so unpacking writes at most the
        ``total_size`` it declares). Without one, only the artifact's own files (:attr:`PACKAGE_MEMBERS`) are
        unpacked, other members dropped, and at most ``max_bytes`` (:data:`MAX_UNPACKED_BYTES`) in all. Either way a
        package holds at most ``max_members`` members (:data:`MAX_MEMBERS`), unpacks at most ``max_ratio`` bytes per
        byte of archive once past :data:`RATIO_FLOOR` (:data:`MAX_RATIO`: an archive bomb is refused at its first
        member over the bound, before that member is written), and a member listed twice (which would unpack over
        the first) refuses the package. Caches (:attr:`PACKAGE_EXCLUDE`, e.g. ``faiss/``), lock files and
        temporaries are never unpacked, whatever the archive holds: they are rebuilt from the unpacked files. The
        folder appears only once the whole archive is unpacked and checked: an unpacking stopped by an error or an
        interrupt removes what it wrote; one killed midway leaves a temporary ``.<name>.unpack-<pid>.*.tmp`` beside
        ``path``, which the next ``from_package`` into ``path`` removes.

        Raises:
            FileExistsError: ``path`` exists and is not an empty folder.
            FileNotFoundError: no archive at ``package``.
            ValueError: the archive is corrupt (hash mismatch, not a tar.lz4), holds a member its manifest does not
                list (or at another size), a member twice, more members or bytes than the limits (naming the limit),
                or another kind of artifact.
        """
        from lz4.frame import LZ4FrameFile

        package, path = str(package), Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise FileExistsError(f"{path} already exists; give from_package a new folder")
        info: Any = {}
        if os.path.isfile(f"{package}.json"):
            info = _read_manifest(f"{package}.json")
        if not isinstance(info, dict):
            raise ValueError(f"{package}.json is not a package manifest (a JSON {type(info).__name__})")
        if expected_sha256 is None:
            expected_sha256 = info.get("expected_sha256")
        listed = _manifest_sizes(package, info)
        segments = [f"{package}.{s['idx']}" for s in info.get("segments", [])]
        for p in segments or [package]:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"no package at {p}")
        archive_bytes = sum(os.path.getsize(p) for p in segments or [package])
        limits = _Limits(package, archive_bytes, listed is not None, max_members, max_bytes, max_ratio)

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
                            limits.count(member)
                            if not (member.isfile() or member.isdir()) or member.issparse():
                                continue
                            if not pt.io.path_is_under_base(member.path, str(tmp)) or cls._derived(member.path):
                                continue
                            if listed is None and not cls._own_member(member.path):
                                if verbose:
                                    print(f"dropping {member.path}: not a file of a {cls.__name__}")
                                continue
                            if member.isfile() and listed is not None:
                                rel = Path(member.path).as_posix()
                                if listed.get(rel) != member.size:
                                    why = ("is not listed in its manifest" if rel not in listed else
                                           f"holds {member.size} bytes, its manifest lists {listed[rel]}")
                                    raise ValueError(f"{package} is not the package its manifest {package}.json "
                                                     f"describes: member {rel!r} {why}")
                            if member.isfile():
                                limits.add(member)
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
    def _own_member(cls, rel: str) -> bool:
        """Whether the archive member ``rel`` is one of the artifact's own files (:attr:`PACKAGE_MEMBERS`)."""
        parts = Path(rel).parts
        return cls.PACKAGE_MEMBERS is None or (bool(parts) and parts[0] in cls.PACKAGE_MEMBERS)

    @classmethod
    def from_url(cls, url: str, *, expected_sha256: Optional[str] = None,
                 max_download_bytes: int = MAX_DOWNLOAD_BYTES, **kwargs: Any) -> "PackagedArtifact":
        """PyTerrier's ``Artifact.from_url`` (and so ``from_hf``) for this artifact, bounded: the package (its archive
        or all its segments) is downloaded into a temporary file under PyTerrier's artifact cache, at most
        ``max_download_bytes`` (:data:`MAX_DOWNLOAD_BYTES`; with a manifest, at most what its listed sizes can
        compress to) and its SHA-256 checked, *before* anything is unpacked; it is then unpacked by
        :meth:`from_package` (with its limits) into the cache folder PyTerrier uses for ``url``, and the temporary
        file removed. A download or unpacking that fails or is interrupted leaves nothing behind (the temporaries of
        one killed midway are removed by the next ``from_url`` of the same URL). (PyTerrier's own
        ``pt.Artifact.from_url`` streams the archive into the folder unbounded: call it on this class instead.)

        Raises:
            ValueError: the download exceeds its cap (naming it), or :meth:`from_package` refuses the package.
        """
        from hashlib import sha256
        from urllib.parse import urlparse

        url, headers = _resolve_url(url)
        parsed = urlparse(url)
        if parsed.scheme == "" and os.path.exists(url):
            return cls.load(url, **kwargs)  # a local folder (PyTerrier's behaviour)
        base = Path(pt.io.pyterrier_home()) / "artifacts"
        base.mkdir(parents=True, exist_ok=True)
        path = base / sha256(url.encode()).hexdigest()
        if not path.exists():
            for suffix in (".tar.lz4", ".tar.lz4.json"):  # downloads of processes killed midway
                _remove_dead_unpacks(path, "download", suffix)
            tmp = base / f".{path.name}.download-{os.getpid()}.{secrets.token_hex(4)}.tmp.tar.lz4"
            try:
                info = _download_manifest(url, headers)
                if isinstance(info, dict) and expected_sha256 is not None and info.get("expected_sha256") \
                        and str(info["expected_sha256"]).lower() != expected_sha256.lower():
                    raise ValueError(f"{url}.json lists the SHA-256 {info['expected_sha256']}, not the "
                                     f"expected {expected_sha256}")
                cap = max_download_bytes
                listed = _manifest_sizes(url, info) if isinstance(info, dict) else None
                if listed is not None:  # an lz4 tar of the listed files cannot be larger than this
                    cap = min(cap, _archive_bound(sum(listed.values()), len(listed)))
                parts = ([f"{url}.{i}" for i in range(len(info["segments"]))]
                         if isinstance(info, dict) and info.get("segments") else [url])
                _download(parts, tmp, cap, headers)
                if isinstance(info, dict):
                    manifest = {k: v for k, v in info.items() if k != "segments"}
                    Path(f"{tmp}.json").write_text(json.dumps(manifest), encoding="utf8")
                cls.from_package(tmp, path, expected_sha256=expected_sha256)
                from ._files import write_json_atomic
                write_json_atomic(f"{path}.json", {"url": url})
            finally:
                tmp.unlink(missing_ok=True)
                Path(f"{tmp}.json").unlink(missing_ok=True)
        return cls.load(str(path), **kwargs)

    @classmethod
    def _derived(cls, rel: str) -> bool:
        """Whether the archive member ``rel`` is a cache, lock file or temporary (never unpacked)."""
        parts = Path(rel).parts
        return bool(parts) and (parts[0] in cls.PACKAGE_EXCLUDE or any(_TRANSIENT.match(p) for p in parts))


class _Limits:
    """The bounds of one unpacking (:meth:`PackagedArtifact.from_package`), checked on each member's header before
    its bytes are written."""

    def __init__(self, package: str, archive_bytes: int, manifest: bool, max_members: int, max_bytes: int,
                 max_ratio: float) -> None:
        self.package, self.archive_bytes, self.manifest = package, max(1, archive_bytes), manifest
        self.max_members, self.max_bytes, self.max_ratio = max_members, max_bytes, max_ratio
        self.members, self.total, self.seen = 0, 0, set()

    def count(self, member: tarfile.TarInfo) -> None:
        """Counts every member (whatever is done with it) and refuses one listed twice."""
        self.members += 1
        if self.members > self.max_members:
            raise ValueError(f"{self.package} holds more than {self.max_members} members (the limit of a package, "
                             "max_members); it is not an artifact package")
        rel = posixpath.normpath(Path(member.path).as_posix())
        if not member.isdir():
            if rel in self.seen:
                raise ValueError(f"{self.package} holds the member {rel!r} twice (the second would unpack over the "
                                 "first); it is not an artifact package")
            self.seen.add(rel)

    def add(self, member: tarfile.TarInfo) -> None:
        """Adds a member about to be unpacked, refusing it when it would pass the byte or ratio limits."""
        self.total += member.size
        if not self.manifest and self.total > self.max_bytes:
            raise ValueError(f"{self.package} unpacks to more than {self.max_bytes} bytes (the limit of a package "
                             "without a manifest, max_bytes)")
        if self.total > max(RATIO_FLOOR, self.max_ratio * self.archive_bytes):
            raise ValueError(f"{self.package} unpacks to more than {self.max_ratio:g} times its {self.archive_bytes} "
                             f"bytes (member {member.path!r} reaches {self.total} bytes; limit max_ratio): an archive "
                             "bomb, not an artifact package")


def _archive_bound(total_size: int, members: int) -> int:
    """The most bytes an lz4-compressed tar of ``members`` files of ``total_size`` bytes in all can take: each file
    padded to 512-byte blocks behind a 512-byte header (and its folder's), the tar's end blocks, lz4's worst case
    (incompressible blocks stored with a 4-byte header per 64 KiB, ~0.4%) and frame headers."""
    tar = total_size + 1536 * (members + 1) + 10240
    return tar + tar // 200 + (1 << 16)


def _read_manifest(path: str) -> Any:
    """The parsed ``<package>.json``, refused when larger than :data:`MAX_MANIFEST_BYTES` or not JSON.

    Raises:
        ValueError: naming the file.
    """
    data = read_small_file(Path(path), "package manifest", MAX_MANIFEST_BYTES)
    try:
        return json.loads(data.decode("utf8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not a package manifest: not JSON ({e})") from e


def _resolve_url(url: str) -> Tuple[str, dict]:
    """``url`` through PyTerrier's URL protocol resolvers (``hf:...`` -> ``https://...``), and the headers they add."""
    from urllib.parse import urlparse

    from pyterrier._artifact import UrlResolverResult

    headers: dict = {}
    parsed = urlparse(url)
    resolvers = {ep.name: ep for ep in pt.utils.entry_points("pyterrier.artifact.url_protocol_resolver")}
    while parsed.scheme in resolvers:
        result = resolvers.pop(parsed.scheme).load()(parsed)
        if result is not None:
            if isinstance(result, str):
                result = UrlResolverResult(result)
            elif isinstance(result, tuple):
                result = UrlResolverResult(*result)
            url = result.url
            parsed = urlparse(url)
            headers.update(result.headers)
    return url, headers


def _download_manifest(url: str, headers: dict) -> Any:
    """The package manifest ``<url>.json`` (at most :data:`MAX_MANIFEST_BYTES`), or None when there is none."""
    try:
        with pt.io.open_or_download_stream(f"{url}.json", headers=headers, verbose=False) as fin:
            data = fin.read(MAX_MANIFEST_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"{url}.json is more than {MAX_MANIFEST_BYTES} bytes; it is not a package manifest")
    try:
        return json.loads(data.decode("utf8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{url}.json is not a package manifest: not JSON ({e})") from e


def _download(parts: Sequence[str], out: Path, cap: int, headers: dict) -> None:
    """Downloads ``parts`` (one archive, or its segments in order) into the file ``out``, refusing at once the byte
    past ``cap``."""
    written = 0
    with open(out, "wb") as fout:
        for part in parts:
            with pt.io.open_or_download_stream(part, headers=headers, verbose=False) as fin:
                while True:
                    block = fin.read(min(1 << 20, cap + 1 - written))
                    if not block:
                        break
                    written += len(block)
                    if written > cap:
                        raise ValueError(f"{parts[0]}: the download passed {cap} bytes (the cap of a package, "
                                         "max_download_bytes, or what its manifest's listed sizes can compress to); "
                                         "nothing was unpacked")
                    fout.write(block)


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
        rel = Path(entry["path"]).as_posix()
        if rel in out:
            raise ValueError(f"{package}.json is not a package manifest: it lists {rel!r} twice")
        out[rel] = entry["size"]
    return out


def _remove_dead_unpacks(path: Path, kind: str = "unpack", suffix: str = "") -> None:
    """Removes the temporaries of :meth:`PackagedArtifact.from_package` into ``path`` (``kind="unpack"``; of
    :meth:`~PackagedArtifact.from_url`'s downloads: ``"download"``) left by processes that no longer run (killed while
    unpacking or downloading)."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.{kind}-(\d+)\.[0-9a-f]+\.tmp{re.escape(suffix)}$")
    for entry in path.parent.iterdir() if path.parent.is_dir() else ():
        m = pattern.match(entry.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
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


