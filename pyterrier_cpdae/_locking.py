"""One writer per artifact directory, whatever path reaches it: OS advisory locks held for the whole of a build.

Two locks are taken, both keyed on the artifact's *real* identity rather than on the spelling of its path:

* the lock file ``.<name>.lock`` beside the directory's **resolved** location (symlinks and ``..`` followed:
  ``link -> real/idx``, ``a/../a/idx`` and ``/abs/a/idx`` all lock ``real/.idx.lock``).  It is a sibling, not
  a file inside the directory, so that ``mode="overwrite"`` can delete and recreate the directory while
  holding it and a ``create`` build still sees an empty directory.  While held it records who holds it
  (pid, host, since when), so that a refused writer and a reader meeting an unfinished artifact can say so;
* when the directory already exists, a lock on the directory itself (``flock`` of the directory's file
  descriptor, keyed by the kernel on its device and inode), which also holds across bind mounts and other
  mounts of the same directory.  Where the file system does not support locking a directory (some network
  file systems) this second lock is skipped.

The OS releases both when the process dies, so a killed build never leaves a stale lock behind: the next build
simply takes them.  The recorded holder is only ever shown while its lock is actually held.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator, Optional, Union

__all__ = ["ConcurrentBuildError", "lock_path", "build_lock", "refuse_if_busy", "holder", "describe_holder"]

# a reader's probe (see holder()) holds a shared lock for microseconds: a writer retries this long before refusing
_ACQUIRE_RETRY_S = 0.25


class ConcurrentBuildError(RuntimeError):
    """Raised when another process is already building (or merging into) the same artifact directory."""


def lock_path(path: Union[str, Path]) -> Path:
    """The lock file that guards the artifact directory ``path``: ``.<name>.lock`` beside its resolved location."""
    real = Path(path).expanduser().resolve()
    return real.parent / f".{real.name}.lock"


def describe_holder(info: Optional[dict]) -> str:
    """``"pid 123 on host h since 2024-05-01T10:00:00+00:00"`` for a :func:`holder` record."""
    if not info:
        return "another process (its pid is not recorded: it may hold the directory through another mount)"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since {info.get('since', '?')}"


def holder(path: Union[str, Path]) -> Optional[dict]:
    """Who is building the artifact directory ``path`` right now: ``{"pid", "host", "since", "path"}``, or ``None``.

    Cheap and side-effect free (no file is created): the locks are probed with a shared, non-blocking lock that
    is released at once.  ``{}`` when a lock is held but the holder is not recorded (a lock on the directory
    taken through another mount of it, or a holder still writing its record).
    """
    lock = lock_path(path)
    held = False
    try:
        fd = os.open(str(lock), os.O_RDONLY)
    except OSError:
        fd = None
    if fd is not None:
        try:
            held = _is_held(fd)
            if held:
                return _read_record(fd)
        finally:
            os.close(fd)
    dir_fd = _open_dir(Path(path).expanduser().resolve())
    if dir_fd is not None:
        try:
            if _is_held(dir_fd):
                return {}
        finally:
            os.close(dir_fd)
    return None


def refuse_if_busy(path: Union[str, Path], what: str = "index", activity: str = "built") -> None:
    """Raises the :class:`ConcurrentBuildError` of :func:`build_lock` when another process holds ``path``'s locks.

    A read-only probe (nothing is created), for checks that run before the lock is taken, so that a second
    run is told that the first is running rather than anything its files in progress might suggest.
    """
    info = holder(path)
    if info is not None:
        raise _busy(what, activity, path, Path(path).expanduser().resolve(), info)


@contextlib.contextmanager
def build_lock(path: Union[str, Path], what: str = "index", activity: str = "built") -> Iterator[Path]:
    """Holds the exclusive, non-blocking OS locks of the artifact directory ``path`` for the ``with`` block.

    Raises:
        ConcurrentBuildError: at once (after a fraction of a second, never waiting for a build) when another
            process holds either lock; the message names it: ``the <what> at <path> is being <activity> by pid P
            on host H since T``.
        OSError: the lock file cannot be created (e.g. the parent directory is not writable).
    """
    real = Path(path).expanduser().resolve()
    lock = lock_path(real)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(lock), os.O_RDWR | os.O_CREAT, 0o666)  # the umask applies
    dir_fd = None
    try:
        if not _acquire_retrying(fd):
            raise _busy(what, activity, path, real, _read_record(fd))
        try:
            _write_record(fd, real)
            dir_fd = _open_dir(real)
            if dir_fd is not None and not _lock_dir(dir_fd):
                raise _busy(what, activity, path, real, {})
            yield lock
        finally:
            if dir_fd is not None:
                os.close(dir_fd)  # releases the directory lock
            _clear_record(fd)
            _release(fd)
    finally:
        os.close(fd)


def _busy(what: str, activity: str, path: Union[str, Path], real: Path, info: Optional[dict]) -> ConcurrentBuildError:
    where = f"{path}" if Path(path).absolute() == real else f"{path} (really {real})"
    return ConcurrentBuildError(
        f"the {what} at {where} is being {activity} by {describe_holder(info)} (another process is using it); "
        "wait for it to finish, or use another path")


def _acquire_retrying(fd: int) -> bool:
    deadline = time.monotonic() + _ACQUIRE_RETRY_S
    while True:
        try:
            _acquire(fd)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def _write_record(fd: int, real: Path) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "path": str(real)}
    data = (json.dumps(record) + "\n").encode("utf8")
    try:
        os.ftruncate(fd, _RECORD_OFFSET)
        os.lseek(fd, _RECORD_OFFSET, os.SEEK_SET)
        os.write(fd, data)
    except OSError:  # a full disk must not stop a build for want of a diagnostic
        pass


def _clear_record(fd: int) -> None:
    try:
        os.ftruncate(fd, _RECORD_OFFSET)
    except OSError:
        pass


def _read_record(fd: int) -> Optional[dict]:
    try:
        os.lseek(fd, _RECORD_OFFSET, os.SEEK_SET)
        data = os.read(fd, 4096)
        record = json.loads(data.decode("utf8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


if os.name == "nt":  # pragma: no cover - exercised on Windows only
    import msvcrt

    _RECORD_OFFSET = 1  # byte 0 is the locked byte, which other processes cannot read

    def _acquire(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)

    def _release(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

    def _is_held(fd: int) -> bool:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            os.read(fd, 1)
        except OSError:
            return True
        return False

    def _open_dir(real: Path) -> Optional[int]:
        return None

    def _lock_dir(fd: int) -> bool:
        return True
else:
    import fcntl

    _RECORD_OFFSET = 0

    def _acquire(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _release(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

    def _is_held(fd: int) -> bool:
        """Whether another process holds an exclusive lock on ``fd``'s file (probed with a shared lock)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as ex:
            return ex.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def _open_dir(real: Path) -> Optional[int]:
        try:
            return os.open(str(real), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:  # missing (a build creates it), not a directory, or not readable
            return None

    def _lock_dir(fd: int) -> bool:
        """Locks the directory ``fd``; False when another process holds it, True when locked or unsupported."""
        deadline = time.monotonic() + _ACQUIRE_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as ex:
                if ex.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return True  # this file system cannot lock directories: the lock file alone guards it
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)
