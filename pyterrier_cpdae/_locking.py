"""One writer per artifact directory: an OS advisory lock held for the whole of a build.

The lock is a sibling file ``.<name>.lock`` beside the artifact directory (not inside it, so that
``mode="overwrite"`` can delete and recreate the directory while holding it, and so that a
``create`` build still sees an empty directory).  The OS releases the lock when the process dies, so a
killed build never leaves a stale lock behind: the next build simply takes it.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Union


class ConcurrentBuildError(RuntimeError):
    """Raised when another process is already building (or merging into) the same artifact directory."""


def lock_path(path: Union[str, Path]) -> Path:
    """The lock file that guards the artifact directory ``path``."""
    path = Path(path).absolute()
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def build_lock(path: Union[str, Path], what: str = "index") -> Iterator[Path]:
    """Holds an exclusive, non-blocking OS lock on the artifact directory ``path`` for the ``with`` block.

    Raises :class:`ConcurrentBuildError` at once (it never waits) when another process holds it.
    """
    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(lock), os.O_RDWR | os.O_CREAT, 0o666)  # the umask applies
    try:
        try:
            _acquire(fd)
        except OSError:
            raise ConcurrentBuildError(
                f"another process is building the {what} at {Path(path).absolute()} (it holds the lock {lock}); "
                f"wait for it to finish, or build into another path") from None
        try:
            yield lock
        finally:
            _release(fd)
    finally:
        os.close(fd)


if os.name == "nt":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _acquire(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)

    def _release(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _acquire(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _release(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
