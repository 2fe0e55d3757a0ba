"""The one-line errors of a failed BM25 build (:class:`~pyterrier_cpdae.bm25.index.BM25Indexer`).

Lucene indexes in several threads. When one of them fails (a full disk, an I/O error), Lucene records that first
failure as the writer's "tragedy" and closes the writer; the other threads then fail with
``AlreadyClosedException: this DocumentsWriter is closed``, and whichever thread reports first decides what reaches
Python. :func:`build_error` turns whatever reached Python into one line naming the index folder and the first
failure (the tragedy when there is one), so that the error does not depend on the threads' timing and no raw Java
exception reaches the caller.
"""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Any, Optional

from pyterrier_cpdae._files import disk_full
from pyterrier_cpdae.bm25.jvm import is_java_exception

__all__ = ["LuceneFailure", "NotAllIndexed", "build_error"]


class NotAllIndexed(RuntimeError):
    """Lucene accepted fewer documents than were sent (its reasons are in the Java log)."""


class LuceneFailure(Exception):
    """Lucene's first failure during a build (``_Sink.tragedy`` of :mod:`~pyterrier_cpdae.bm25.index`), carried to :func:`build_error`."""

    def __init__(self, tragedy: Any):
        super().__init__(_java_text(tragedy))
        self.io = _is_io_error(tragedy)


def _java_text(throwable: Any) -> str:
    """``ClassName: message`` of a Java ``Throwable``, on one line."""
    try:
        return _one_line(str(throwable.toString()))
    except Exception:  # pragma: no cover - a Throwable always has toString()
        return _one_line(str(throwable))


def _is_io_error(throwable: Any) -> bool:
    """Whether a Java ``Throwable`` is an ``IOException`` (or wraps one: ``UncheckedIOException``)."""
    try:
        t = throwable
        while t is not None:
            c = t.getClass()
            while c is not None:
                if c.getName() == "java.io.IOException":
                    return True
                c = c.getSuperclass()
            t = t.getCause()
    except Exception:  # pragma: no cover
        pass
    return False


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _java_exception_cause(e: BaseException) -> tuple[str, bool]:
    """(the first cause as ``ClassName: message``, whether it is an I/O error) of a pyjnius ``JavaException``: the
    deepest ``Caused by`` of its Java stack trace, else the exception itself."""
    lines = [str(x) for x in (getattr(e, "stacktrace", None) or [])]
    causes = [x.split("Caused by:", 1)[1].strip() for x in lines if "Caused by:" in x]
    name = str(getattr(e, "classname", None) or "")
    inner = getattr(e, "innermessage", None)
    text = causes[-1] if causes else (f"{name}: {inner}" if name and inner else (name or str(e)))
    cause_name = text.split(":", 1)[0]
    return _one_line(text), "IOException" in cause_name or cause_name.startswith("java.io.")


def build_error(path: Path, e: BaseException) -> Optional[BaseException]:
    """The one-line error that replaces ``e``, a failed build of the BM25 index at ``path`` whose unfinished index
    was removed; None when ``e`` is to be raised as it is (a Python error that already names its problem)."""
    if isinstance(e, LuceneFailure):
        cause, io = str(e), e.io
    elif is_java_exception(e):
        cause, io = _java_exception_cause(e)
    elif disk_full(e):  # Python's own writes (pt_meta.json)
        cause, io = _one_line(str(e)), True
    elif isinstance(e, NotAllIndexed):
        return RuntimeError(f"building the BM25 index at {path} failed: {_one_line(str(e))}; the unfinished index "
                            "was removed")
    else:
        return None
    if disk_full(e) or "No space left on device" in cause:
        return OSError(errno.ENOSPC, f"no space left on {path} while building the BM25 index there ({cause}); the "
                                     "unfinished index was removed; free some space or choose another path", str(path))
    if io:
        return OSError(errno.EIO, f"I/O error while building the BM25 index at {path} ({cause}); the unfinished "
                                  "index was removed", str(path))
    return RuntimeError(f"building the BM25 index at {path} failed in Lucene ({cause}); the unfinished index was "
                        "removed")
