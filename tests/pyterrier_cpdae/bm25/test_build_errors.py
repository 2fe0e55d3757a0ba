"""A BM25 build that fails inside Lucene stops with one line naming the index folder and Lucene's first failure,
whichever of its indexing threads met it; no raw Java exception reaches the caller, and nothing is left behind.

A full disk is simulated with a 1 MB tmpfs (root only: skipped elsewhere). Lucene closes its writer when one
thread's write fails (its "tragedy"); the other threads then get ``AlreadyClosedException: this DocumentsWriter
is closed``, which used to reach Python when such a thread reported first.
"""
from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest

from pyterrier_cpdae.bm25 import BM25Index
from pyterrier_cpdae.bm25 import index as bm25_index
from tests.helpers.tiny_sets import random_word_docs as _docs  # 3,000: ~5 MB, more than a 1 MB disk holds indexed


@pytest.fixture
def full_disk(tmp_path: Path, tmpfs) -> Path:
    """A 1 MB tmpfs, unmounted at the end."""
    return tmpfs(tmp_path / "full", "size=1m")


def _left(folder: Path) -> list[str]:
    """What a failed build left in ``folder`` (its OS lock file aside)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def _assert_one_line_enospc(error: BaseException, path: Path) -> None:
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, repr(error)
    text = str(error)
    assert "\n" not in text and f"no space left on {path} while building the BM25 index" in text
    assert "No space left on device" in text  # Lucene's first failure, named
    assert "AlreadyClosed" not in text and "JavaException" not in text and "DocumentsWriter" not in text


def test_a_full_disk_gives_the_same_one_line_error_twenty_times(full_disk: Path) -> None:
    """Twenty builds on a full disk, with one to eight indexing threads (so that the threads race to report):
    every one stops with the ENOSPC line naming its folder, and leaves nothing in it."""
    docs = _docs()
    for k in range(20):
        path = full_disk / f"idx{k}"
        with pytest.raises(Exception) as info:
            BM25Index(path).indexer(threads=1 + k % 8).index(docs)
        _assert_one_line_enospc(info.value, path)
        assert not path.exists() and _left(full_disk) == [], f"build {k} left {_left(full_disk)}"
        assert not BM25Index(path).built()


def _raise_as_a_later_thread(monkeypatch: pytest.MonkeyPatch, classname: str, message: str,
                             always: bool = False) -> None:
    """Makes every failure of the Java side reach Python as the raw pyjnius exception ``classname: message``
    with no cause, as when a thread that found the writer already closed reports before the one that failed
    (``always``: the end of the build fails so too, whatever happened)."""
    import jnius  # the JVM is running: BM25Index's indexer started it

    def wrap(method):
        def call(self, *args):
            try:
                out = method(self, *args)
            except Exception:
                out = None
            else:
                if not (always and method.__name__ == "finish"):
                    return out
            raise jnius.JavaException(f"JVM exception occurred: {message}", classname, message, [])
        return call

    for name in ("send", "finish"):
        monkeypatch.setattr(bm25_index._BlobSink, name, wrap(getattr(bm25_index._BlobSink, name)))
        monkeypatch.setattr(bm25_index._JsonSink, name, wrap(getattr(bm25_index._JsonSink, name)))


def test_a_closed_writer_reported_first_still_names_the_full_disk(full_disk: Path, monkeypatch) -> None:
    from pyterrier_cpdae.bm25.jvm import autoclass

    autoclass("java.lang.String")  # starts Java so that jnius can be imported by the patch
    _raise_as_a_later_thread(monkeypatch, "org.apache.lucene.store.AlreadyClosedException",
                             "this DocumentsWriter is closed")
    path = full_disk / "idx"
    with pytest.raises(Exception) as info:
        BM25Index(path).indexer(threads=2).index(_docs())
    _assert_one_line_enospc(info.value, path)
    assert not path.exists() and _left(full_disk) == []


def test_another_java_failure_is_one_line_naming_the_folder(tmp_path: Path, monkeypatch) -> None:
    """A Java failure that is not Lucene's tragedy (here: any Java error on a healthy disk) is one RuntimeError
    line naming the folder and the Java class and message; the unfinished index is removed."""
    from pyterrier_cpdae.bm25.jvm import autoclass

    autoclass("java.lang.String")
    _raise_as_a_later_thread(monkeypatch, "java.lang.IllegalStateException", "something broke", always=True)
    path = tmp_path / "idx"
    with pytest.raises(RuntimeError) as info:
        BM25Index(path).indexer(threads=2).index(_docs(50))
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"building the BM25 index at {path} failed in Lucene")
    assert "java.lang.IllegalStateException: something broke" in text
    assert not path.exists()
