"""Sharing artifacts: ``build_package`` / ``from_package`` round-trip a DenseIndex and a BM25Index offline, leaving
caches, lock files and temporaries out of the archive; PyTerrier's own ``from_url`` (what ``from_hf`` calls)
unpacks the same archive from a loopback HTTP server."""
from __future__ import annotations

import functools
import http.server
import tarfile
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest
from lz4.frame import LZ4FrameFile

from pyterrier_cpdae.bm25 import BM25Index
from pyterrier_cpdae.dense import DenseIndex
from pyterrier_cpdae.datasets import load_dataset

DIM = 8


def _dense(path: Path, n: int = 50) -> tuple[DenseIndex, pd.DataFrame]:
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    index = DenseIndex(path)
    index.indexer().index([{"docno": f"d{i}", "doc_vec": vecs[i]} for i in range(n)])
    q = rng.standard_normal((4, DIM)).astype(np.float32)
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(4)], "query": "x", "query_vec": list(q)})
    return index, topics


def _archive_names(package: str) -> list[str]:
    with open(package, "rb") as f, tarfile.open(fileobj=LZ4FrameFile(f), mode="r|") as tar:
        return [m.name for m in tar if m.isfile()]


def _files_under(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_dense_index_round_trip_leaves_faiss_cache_and_locks_out(tmp_path):
    index, topics = _dense(tmp_path / "idx")
    before = index.faiss_flat_retriever(num_results=10)(topics)  # writes faiss/ (a cache)
    exact = index.retriever(num_results=10)(topics)
    assert any((tmp_path / "idx" / "faiss").iterdir())
    (tmp_path / "idx" / "shards").mkdir()
    (tmp_path / "idx" / "shards" / ".0.lock").write_text("")  # lock files of a (past) build ...
    (tmp_path / "idx" / ".pt_meta.abc123.tmp.json").write_text("{")  # ... and an interrupted atomic write
    package = index.build_package(str(tmp_path / "idx.tar.lz4"), verbose=False)
    names = _archive_names(package)
    assert sorted(names) == ["docnos.npids", "pt_meta.json", "vectors.bin"], names
    assert index.package_files() == names

    copy = DenseIndex.from_package(package, tmp_path / "elsewhere" / "copy")
    assert isinstance(copy, DenseIndex) and copy.path == tmp_path / "elsewhere" / "copy"
    original = _files_under(tmp_path / "idx")
    assert _files_under(copy.path) == {k: original[k] for k in names}  # byte-identical files
    pd.testing.assert_frame_equal(copy.retriever(num_results=10)(topics).drop(columns="query_vec"),
                                  exact.drop(columns="query_vec"))
    pd.testing.assert_frame_equal(copy.faiss_flat_retriever(num_results=10)(topics).drop(columns="query_vec"),
                                  before.drop(columns="query_vec"))
    assert pt.Artifact.load(str(copy.path)).__class__ is DenseIndex  # the entry point finds it


def test_from_package_checks_hash_kind_and_target(tmp_path):
    index, _ = _dense(tmp_path / "idx", n=5)
    package = index.build_package(str(tmp_path / "idx.tar.lz4"), verbose=False)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(FileExistsError, match="taken"):
        DenseIndex.from_package(package, tmp_path / "taken")
    assert (tmp_path / "taken" / "x").read_text() == "mine"
    with pytest.raises(ValueError, match=r"not a BM25Index"):
        BM25Index.from_package(package, tmp_path / "wrong-kind")
    assert not (tmp_path / "wrong-kind").exists()
    data = bytearray(Path(package).read_bytes())
    data[-9] ^= 0xFF  # one flipped byte near the end (after every file: only the hash can tell)
    bad = tmp_path / "bad.tar.lz4"
    bad.write_bytes(bytes(data))
    (tmp_path / "bad.tar.lz4.json").write_bytes(Path(package + ".json").read_bytes())
    with pytest.raises(ValueError, match="bad.tar.lz4"):
        DenseIndex.from_package(bad, tmp_path / "from-bad")
    assert not (tmp_path / "from-bad").exists()
    with pytest.raises(ValueError, match="not completely built"):
        DenseIndex(tmp_path / "nothing").build_package(str(tmp_path / "n.tar.lz4"), verbose=False)


def test_segmented_package_round_trip(tmp_path):
    index, topics = _dense(tmp_path / "idx", n=6000)  # 192 kB of vectors: several lz4 blocks
    package = index.build_package(str(tmp_path / "idx.tar.lz4"), max_file_size=32768, verbose=False)
    assert Path(package + ".1").is_file()  # really segmented
    copy = DenseIndex.from_package(package, tmp_path / "copy")
    pd.testing.assert_frame_equal(copy.retriever(num_results=5)(topics), index.retriever(num_results=5)(topics))


def test_pyterrier_from_url_unpacks_our_package(tmp_path, monkeypatch):
    """``to_hf`` uploads exactly build_package's archive and ``from_hf`` is ``from_url`` on it: served here from
    127.0.0.1 (no network), PyTerrier's own download code unpacks it into a working index."""
    index, topics = _dense(tmp_path / "idx", n=20)
    index.faiss_flat_retriever(num_results=5)(topics)
    served = tmp_path / "served"
    served.mkdir()
    index.build_package(str(served / "idx.tar.lz4"), verbose=False)
    monkeypatch.setenv("PYTERRIER_HOME", str(tmp_path / "pt_home"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        copy = pt.Artifact.from_url(f"http://127.0.0.1:{server.server_address[1]}/idx.tar.lz4")
    finally:
        server.shutdown()
        server.server_close()
    assert isinstance(copy, DenseIndex)
    assert not (Path(copy.path) / "faiss").exists()
    pd.testing.assert_frame_equal(copy.retriever(num_results=5)(topics), index.retriever(num_results=5)(topics))


def test_bm25_index_round_trip(tmp_path):
    ds = load_dataset("sample")
    index = BM25Index(tmp_path / "bm25")
    index.indexer().index(ds.get_corpus_iter())
    topics = ds.get_topics()
    before = index.bm25(num_results=10)(topics)
    package = index.build_package(str(tmp_path / "bm25.tar.lz4"), verbose=False)
    names = _archive_names(package)
    assert "pt_meta.json" in names and all(n == "pt_meta.json" or n.startswith("lucene/") for n in names)
    copy = BM25Index.from_package(package, tmp_path / "copy")
    after = copy.bm25(num_results=10)(topics)
    pd.testing.assert_frame_equal(after, before)
    some = before.head(3)
    assert copy.text_loader()(some)["text"].tolist() == index.text_loader()(some)["text"].tolist()
